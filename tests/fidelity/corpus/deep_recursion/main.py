# A recursion 2,990 deep under a limit of 3,000: legal, as under python.
# expect-stdout: "2990\n"
import sys

sys.setrecursionlimit(3000)


def depth(n):
    return n if n == 0 else 1 + depth(n - 1)


print(depth(2990))
try:
    depth(3100)
except RecursionError as exc:
    print("RecursionError:", exc)
