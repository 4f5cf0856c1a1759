# os._exit: flushed output stays, atexit does not run, the status is the script's.
# expect-exit: 7
# expect-stdout: "flushed\n"
import atexit
import os
import sys

atexit.register(print, "never")
print("flushed")
sys.stdout.flush()
print("lost in the buffer")
os._exit(7)
