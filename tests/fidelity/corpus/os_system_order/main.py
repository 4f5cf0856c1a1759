# os.system's child writes to the real fd 1, before python's buffered lines on a pipe.
# expect-stdout: "from the child\n"
import os
import subprocess

print("before")
os.system("echo from the child")
subprocess.run(["echo", "from subprocess"])
print("after")
