# The main thread ends first; python waits for a non-daemon thread, then runs atexit.
# expect-stdout: "main done\nworker done\natexit\n"
import atexit
import threading
import time

atexit.register(print, "atexit")
started = threading.Event()


def worker():
    started.set()
    time.sleep(0.2)
    print("worker done")


threading.Thread(target=worker).start()
started.wait()
print("main done")
