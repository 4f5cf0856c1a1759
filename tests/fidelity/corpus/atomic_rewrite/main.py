# A file rewritten atomically: a temporary file in the same directory, then os.replace.
# expect-stdout: "version 2\n"
import os
import tempfile

with open("state.txt", "w") as f:
    f.write("version 1\n")
fd, tmp = tempfile.mkstemp(dir=".", prefix=".state-")
with os.fdopen(fd, "w") as f:
    f.write("version 2\n")
os.replace(tmp, "state.txt")
print(open("state.txt").read(), end="")
print(sorted(os.listdir(".")))
