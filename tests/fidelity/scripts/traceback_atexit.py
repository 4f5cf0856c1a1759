import atexit
import sys

atexit.register(lambda: print("cleanup", file=sys.stderr))


def divide(a, b):
    return a / b


print("start")
divide(1, 0)
