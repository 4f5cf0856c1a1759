"""Threads, a thread pool and a lock: results in a fixed order."""
import threading
from concurrent.futures import ThreadPoolExecutor

total = 0
lock = threading.Lock()


def add(n):
    global total
    with lock:
        total += n
    return threading.current_thread().name.startswith("ThreadPoolExecutor")


with ThreadPoolExecutor(4) as pool:
    print(all(pool.map(add, range(1000))))
threads = [threading.Thread(target=add, args=(1,), name=f"t{i}") for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(total, threading.current_thread().name, threading.active_count())
