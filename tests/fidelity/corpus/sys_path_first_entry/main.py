# sys.path[0] is the script's directory; argv and __file__ are python's.
# expect-stdout: "first is the script's directory: True\n"
import os
import sys

print("first is the script's directory:", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("entries:", len(sys.path))
print("argv:", sys.argv, "file:", __file__)
