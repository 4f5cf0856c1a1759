# 2>&1: python block-buffers stdout on a pipe, so stderr's lines come first.
# merge-stderr
# piped-only
# expect-stdout: "err one\nerr two\nout one\nout two\n"
import sys

print("out one")
print("err one", file=sys.stderr)
print("out two")
print("err two", file=sys.stderr)
