# | head -n 3 with nothing handled: python's BrokenPipeError traceback and exit status.
# pipe: head -n 3
# piped-only
# expect-exit: 1
# expect-stderr: "BrokenPipeError"
for i in range(1_000_000):
    print("row", i)
