# The directory holds what the project holds: no ./files, nothing of a sandbox's.
# expect-stdout: "['data.txt', 'main.py']\n"
import glob
import os
import subprocess

print(sorted(os.listdir(".")))
print(sorted(glob.glob("*")))
print(subprocess.run(["ls", "-A"], capture_output=True, text=True).stdout, end="")
