"""Deep recursion: the limit is Python's, and the RecursionError reads as Python writes it."""
import sys

print(sys.getrecursionlimit())


def depth(n):
    return depth(n + 1)


try:
    depth(0)
except RecursionError as exc:
    print("caught:", exc)
sys.setrecursionlimit(5000)


def count(n):
    return 0 if n == 0 else 1 + count(n - 1)


print(count(4000))
