import sys

print(repr(sys.stdin.read()))
try:
    input()
except EOFError as exc:
    print("EOFError", exc)
