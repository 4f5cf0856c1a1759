# stdin redirected from a file: seekable, its size known, read in binary.
# stdin-file: input.bin
# expect-stdout: "size 6 fileno 0\n"
import hashlib
import os
import sys

print("size", os.fstat(sys.stdin.fileno()).st_size, "fileno", sys.stdin.fileno())
data = sys.stdin.buffer.read()
print(hashlib.sha256(data).hexdigest()[:16], sys.stdin.buffer.seek(0), len(sys.stdin.buffer.read()))
