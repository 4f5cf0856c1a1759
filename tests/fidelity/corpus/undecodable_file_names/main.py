# A file name that is not UTF-8: os.listdir gives surrogates, printing them is python's.
# expect-stdout: "name\udcff.txt"
# piped-only
import os
import sys

with open(b"name\xff.txt", "wb") as f:
    f.write(b"x")
print(sys.stdout.errors, file=sys.stderr)
for name in sorted(os.listdir(".")):
    print(name)
