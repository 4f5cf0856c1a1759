"""The usual main guard, __file__ and __name__, and a module-level docstring."""
import os
import sys


def main() -> int:
    print(__name__, os.path.basename(__file__), __doc__.split(":")[0])
    print(sys.argv[0] == __file__ or os.path.abspath(sys.argv[0]) == os.path.abspath(__file__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
