import sys


def main() -> int:
    print("main ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
