import sys

name = input("name? ")
print(f"hello {name}")
print(repr(sys.stdin.read()))
