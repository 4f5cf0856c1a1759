import sys

print("out")
sys.exit("fatal: something went wrong")
