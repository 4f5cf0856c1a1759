import sys

print("before")
sys.exit(3)
