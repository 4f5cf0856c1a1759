# Bytes through sys.stdin.buffer to sys.stdout.buffer, unchanged and undecoded.
# stdin: b'\xff\xfe raw \x00 bytes\r\n'
# expect-stdout: b'\xff\xfe raw \x00 bytes\r\n'
# piped-only
import sys

sys.stdout.buffer.write(sys.stdin.buffer.read())
