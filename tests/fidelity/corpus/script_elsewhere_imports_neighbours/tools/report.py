# cd data && python ../tools/report.py: its neighbours import, the data is read from the cwd.
# cwd: data
# read-only: tools
# expect-stdout: 'rows 3, total 60\n'
import csv

from helpers import total

with open("numbers.csv", newline="") as f:
    rows = list(csv.DictReader(f))
print(f"rows {len(rows)}, total {total(int(r['n']) for r in rows)}")
