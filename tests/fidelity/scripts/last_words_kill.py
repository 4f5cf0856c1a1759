import os
import signal

print("bye", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
