"""A child's output, still in the pipe when the script kills itself, reaches the terminal."""
import os
import signal
import subprocess
import sys

print("parent", flush=True)
subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
               check=True)
os.kill(os.getpid(), signal.SIGKILL)
