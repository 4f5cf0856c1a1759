# SIGINT: KeyboardInterrupt where the script waits, the traceback, then death by SIGINT (130).
# send: SIGINT
# expect-exit: 130
# expect-stderr: "in wait_here\n    time.sleep(60)\nKeyboardInterrupt\n"
import sys
import threading
import time


def wait_here():
    time.sleep(60)


def announce(main):
    # "ready" once the main thread waits in wait_here, so that is where the signal lands.
    while sys._current_frames()[main].f_code.co_name != "wait_here":
        time.sleep(0.01)
    print("ready", flush=True)


# (Not a daemon: one caught holding stdout's lock at shutdown would make python itself abort.)
threading.Thread(target=announce, args=(threading.get_ident(),)).start()
try:
    wait_here()
finally:
    print("finally ran", flush=True)
