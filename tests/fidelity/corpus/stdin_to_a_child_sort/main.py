# A child process reads the script's stdin: fd 0 is the real one.
# stdin: 'pear\napple\nfig\n'
# expect-stdout: 'apple\nfig\npear\n'
import subprocess
import sys

sys.stdout.flush()
subprocess.run(["sort"], check=True)
