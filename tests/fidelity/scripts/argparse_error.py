"""argparse refusing its arguments: usage on stderr, exit status 2."""
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("count", type=int)
parser.parse_args()
