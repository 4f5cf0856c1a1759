# sys.exit("message"): the message on stderr, status 1; a SystemExit of 300 wraps to 44.
# expect-exit: 1
# expect-stderr: "config missing\n"
import sys

try:
    sys.exit(300)
except SystemExit as exc:
    print("code", exc.code)
sys.exit("config missing")
