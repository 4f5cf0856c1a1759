# | head -n 1 with the handler Python's documentation suggests: exit 0, no traceback.
# pipe: head -n 1
# piped-only
# expect-exit: 0
# expect-stdout: "line 0\n"
import os
import sys

try:
    for i in range(1_000_000):
        print(f"line {i}")
    sys.stdout.flush()
except BrokenPipeError:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)
