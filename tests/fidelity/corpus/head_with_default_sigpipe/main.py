# | head -n 2 with SIGPIPE restored to its default: the script dies of it, 141.
# pipe: head -n 2
# piped-only
# expect-exit: 141
# expect-stdout: "0\n1\n"
import signal

signal.signal(signal.SIGPIPE, signal.SIG_DFL)
for i in range(1_000_000):
    print(i)
