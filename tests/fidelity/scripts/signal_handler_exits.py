# A handler that exits: the exit status is the handler's.
import signal
import sys
import time


def on_term(signum, frame):
    print("terminating", flush=True)
    sys.exit(3)


signal.signal(signal.SIGALRM, on_term)
signal.setitimer(signal.ITIMER_REAL, 0.2)
while True:
    time.sleep(1)
