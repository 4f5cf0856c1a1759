# A progress bar redrawn with \r and \b on stderr, colour when it is a terminal.
# expect-stderr: "\r[##########] 100%"
import sys

color = sys.stderr.isatty()
for i in range(11):
    bar = "#" * i + "." * (10 - i)
    sys.stderr.write(f"\r[{bar}] {i * 10:3d}%")
    sys.stderr.flush()
sys.stderr.write("\b\b\b\bdone\n")
start, end = ("\x1b[32m", "\x1b[0m") if color else ("", "")
print(f"{start}finished{end}")
