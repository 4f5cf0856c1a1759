# SIGINT sent to the process: KeyboardInterrupt where the main thread waits; then a handler
# of the script's own.
import os
import signal
import threading
import time

print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    time.sleep(30)
except KeyboardInterrupt:
    print("KeyboardInterrupt in the sleep")

got = threading.Event()
signal.signal(signal.SIGINT, lambda signum, frame: got.set())
os.kill(os.getpid(), signal.SIGINT)
print("handler ran:", got.wait(5))
