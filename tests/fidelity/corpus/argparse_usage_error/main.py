# The script's own argparse error: its usage and exit status 2.
# args: --count many
# expect-exit: 2
# expect-stderr: "error: argument --count: invalid int value: 'many'"
import argparse

parser = argparse.ArgumentParser(prog="report")
parser.add_argument("--count", type=int, default=1)
print(parser.parse_args())
