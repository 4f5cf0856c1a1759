import atexit
import sys

atexit.register(print, "atexit ran")
atexit.register(lambda: print("first of the handlers", file=sys.stderr))
print("body")
sys.exit(4)
