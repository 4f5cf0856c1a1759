"""A tqdm-style progress line redrawn with carriage returns, on stderr, then a result on stdout."""
import sys

for i in range(0, 101, 5):
    sys.stderr.write(f"\rprogress {i:3d}% [{'#' * (i // 5):<20}]")
    sys.stderr.flush()
sys.stderr.write("\n")
print("finished")
