import warnings

print("before")
warnings.warn("careful", stacklevel=1)
print("after")
