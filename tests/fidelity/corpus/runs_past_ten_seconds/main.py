# No deadline unless one is asked for: a script that takes 10.5 s finishes.
# expect-stdout: "finished after the wait\n"
# piped-only
import time

time.sleep(10.5)
print("finished after the wait")
