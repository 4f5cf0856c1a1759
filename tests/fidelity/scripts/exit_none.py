import sys

print("done")
sys.exit(None)
