# sys.stdout is a TextIOWrapper: reconfigure works, the bytes follow the new encoding.
# expect-stdout: b'caf\xe9\n'
# piped-only
import sys

print(type(sys.stdout).__name__, sys.stdout.encoding, sys.stdout.errors, file=sys.stderr)
sys.stdout.reconfigure(encoding="latin-1")
print("café")
