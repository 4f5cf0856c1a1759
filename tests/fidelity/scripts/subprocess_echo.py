"""A child process writing to the same stdout and stderr, in order with the script's own prints."""
import subprocess
import sys

print("parent first", flush=True)
subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
               check=True)
print("parent last")
print(subprocess.run(["echo", "captured"], capture_output=True, text=True).stdout.strip())
