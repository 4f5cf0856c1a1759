"""What a bench section run alone does (``scripts/bench_samples.py``, ``scripts/bench_batch.py``):
``--quick`` or not, the table line on a terminal, then the section as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def main(prog: str, doc: str, quick_help: str, measure: Callable[[bool], dict], table: Callable[[dict], str],
         argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    section = measure(ap.parse_args(argv).quick)
    if sys.stdout.isatty():
        print(table(section) + "\n")
    print(json.dumps(section, indent=2))
    return 0
