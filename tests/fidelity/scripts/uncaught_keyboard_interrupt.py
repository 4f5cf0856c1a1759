# An uncaught KeyboardInterrupt: its traceback on stderr, and the process ends as if by
# SIGINT (a shell sees 130).
import os
import signal

print("before", flush=True)
os.kill(os.getpid(), signal.SIGINT)
print("never")
