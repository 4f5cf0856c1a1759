# Data processing: a CSV in, a JSON summary written beside it.
# expect-stdout: "wrote summary.json: 3 regions\n"
# expect-file: summary.json
import csv
import json
from collections import defaultdict

sales = defaultdict(float)
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        sales[row["region"]] += float(row["amount"])
with open("summary.json", "w") as f:
    json.dump(dict(sorted(sales.items())), f, indent=2)
print(f"wrote summary.json: {len(sales)} regions")
