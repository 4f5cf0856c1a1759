# signal.signal and signal.alarm need the main thread: an alarm ends a sleep early.
import signal
import time


class Expired(Exception):
    pass


def on_alarm(signum, frame):
    raise Expired(f"signal {signum}")


signal.signal(signal.SIGALRM, on_alarm)
signal.alarm(1)
started = time.monotonic()
try:
    time.sleep(30)
except Expired as exc:
    print("expired:", exc, round(time.monotonic() - started) <= 2)
finally:
    print("finally runs")
