import threading

me = threading.current_thread()
print(me is threading.main_thread(), me.name, me.daemon)
seen = []
worker = threading.Thread(target=lambda: seen.append(threading.current_thread() is threading.main_thread()))
worker.start()
worker.join()
print(seen, worker.daemon)
