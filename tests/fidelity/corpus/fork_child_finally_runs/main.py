# A forked child that exits inside try/finally runs its finally block and ends with its code.
# expect-stdout: "child finally\nparent saw 7\n"
import os
import sys

pid = os.fork()
if pid == 0:
    try:
        sys.exit(7)
    finally:
        print("child finally", flush=True)
_, status = os.waitpid(pid, 0)
print("parent saw", os.waitstatus_to_exitcode(status))
