# A forked child that ends with sys.exit() ends; the parent reads its status.
# expect-stdout: "child exited 3\n"
import os
import sys

pid = os.fork()
if pid == 0:
    sys.exit(3)
_, status = os.waitpid(pid, 0)
print("child exited", os.waitstatus_to_exitcode(status))
