# SIGTERM with a handler: it runs, the finally blocks run, the exit status is the handler's.
# send: SIGTERM
# expect-exit: 4
# expect-stdout: "ready\ncleaning up\nfinally\n"
import signal
import sys
import threading
import time


def stop(signum, frame):
    print("cleaning up", flush=True)
    sys.exit(4)


def wait_here():
    time.sleep(60)


def announce(main):
    while sys._current_frames()[main].f_code.co_name != "wait_here":
        time.sleep(0.01)
    print("ready", flush=True)


signal.signal(signal.SIGTERM, stop)
# (Not a daemon: one caught holding stdout's lock at shutdown would make python itself abort.)
threading.Thread(target=announce, args=(threading.get_ident(),)).start()
try:
    wait_here()
finally:
    print("finally", flush=True)
