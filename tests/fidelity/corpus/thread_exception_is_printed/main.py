# An exception in a thread is printed by threading.excepthook; the script goes on and exits 0.
# expect-stdout: "after\n"
# expect-stderr: "RuntimeError: in thread"
# expect-stderr: "Exception in thread worker"
import threading


def work():
    raise RuntimeError("in thread")


t = threading.Thread(target=work, name="worker")
t.start()
t.join()
print("after")
