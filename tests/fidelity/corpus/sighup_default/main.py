# SIGHUP (a terminal closed): python dies of it, 129.
# send: SIGHUP
# expect-exit: 129
import time

print("ready", flush=True)
time.sleep(60)
