# A forked child that falls off the end of the script runs the rest, as the parent does.
# expect-stdout: "child: the end\nparent: child ended 0\nparent: the end\n"
import os
import sys

pid = os.fork()
if pid:
    _, status = os.waitpid(pid, 0)
    print("parent: child ended", os.waitstatus_to_exitcode(status))
who = "child" if pid == 0 else "parent"
print(f"{who}: the end")
sys.stdout.flush()
