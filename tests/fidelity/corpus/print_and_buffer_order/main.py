# print() and sys.stdout.buffer.write() mixed: the order follows python's buffering.
# expect-stdout: "b"
import sys

print("a")
sys.stdout.buffer.write(b"b\n")
print("c")
sys.stdout.flush()
sys.stdout.buffer.write(b"d\n")
