# SIGTERM with no handler: python dies of it, 143, and prints nothing.
# send: SIGTERM
# expect-exit: 143
# expect-stdout: "ready\n"
import time

print("ready", flush=True)
time.sleep(60)
print("not reached")
