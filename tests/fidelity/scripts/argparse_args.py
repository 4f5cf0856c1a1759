"""argparse with positional and optional arguments, and --help's program name."""
import argparse

parser = argparse.ArgumentParser(description="sum numbers")
parser.add_argument("numbers", nargs="+", type=int)
parser.add_argument("--scale", type=float, default=1.0)
parser.add_argument("-v", "--verbose", action="store_true")
args = parser.parse_args()
print(parser.prog, sum(args.numbers) * args.scale, args.verbose)
parser.print_usage()
