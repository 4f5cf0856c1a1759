# What the streams are: the same answers as python's, piped or at a terminal.
# expect-stdout: "stdin False\n"
import os
import shutil
import sys

print("stdin", sys.stdin.isatty())
print("stdout", sys.stdout.isatty(), "stderr", sys.stderr.isatty(), "fd1", os.isatty(1))
print(shutil.get_terminal_size((80, 24)), sys.stdout.line_buffering)
