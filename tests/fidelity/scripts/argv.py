import os
import sys

print(sys.argv[1:])
print(os.path.basename(sys.argv[0]), __name__)
print(__file__ == os.path.abspath(sys.argv[0]))
