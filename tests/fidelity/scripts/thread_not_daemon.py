import threading
import time

done = threading.Event()


def work():
    done.wait(5)
    print("thread finished")


threading.Thread(target=work).start()
print("main finished")
time.sleep(0)
done.set()
