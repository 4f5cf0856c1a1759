"""Several megabytes on stdout, lines and one long line, then a line on stderr."""
import sys

for i in range(100_000):
    print(f"line {i:06d} " + "x" * 40)
print("y" * 1_000_000)
print("done", file=sys.stderr)
