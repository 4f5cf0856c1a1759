# sys.excepthook replaced: it reports the uncaught exception; exit status 1.
# expect-exit: 1
# expect-stderr: "hook: ValueError('bad input')\n"
import sys


def hook(kind, value, tb):
    print(f"hook: {value!r}", file=sys.stderr)


sys.excepthook = hook
raise ValueError("bad input")
