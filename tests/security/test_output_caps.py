"""What block outputs leave on the host is bounded: per file, per run and per batch, with the
model told when what it printed was not all kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.results import FILE_CAP, OUTPUT_CAP
from engine.scripted import ScriptedServer

from ..test_batch import CODE, records, run_batch, write_tasks

pytestmark = pytest.mark.attack

MiB = 1 << 20
#: A closing line per cut file, at most.
_NOTES = 64 * 1024


def _print(mib: int) -> str:
    """A block that prints ``mib`` MiB."""
    return CODE.format(f"import sys\nchunk = b'x' * (1 << 20)\nfor _ in range({mib}):\n"
                       "    sys.stdout.buffer.write(chunk)")


def _kept(runs: Path) -> int:
    """Bytes the runs' block outputs keep on disk."""
    return sum(p.stat().st_size for p in runs.glob("*/state/runs/*/outputs/*") if p.is_file())


def _told(server: ScriptedServer, marker: str) -> list[str]:
    """The code results the model was sent, of the conversations whose task holds ``marker``."""
    told = []
    for body in server.requests:
        messages = body["messages"]
        if any(marker in m["content"] for m in messages if m["role"] == "user"):
            told = [m["content"] for m in messages if m["role"] == "user" and "<run_code_result" in m["content"]]
    return told


def test_a_batch_run_leaves_at_most_its_cap(tmp_path: Path):
    """The attack as it was found: blocks of a batch run printing a file's cap each (a batch
    keeps every run's outputs).  The run keeps at most OUTPUT_CAP in all, and the model is told
    which output was cut and why."""
    blocks = OUTPUT_CAP // FILE_CAP + 1
    script = {"[big]": [_print(FILE_CAP // MiB + 1)] * blocks + ["done"]}
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "big", "task": "[big] print"}])
    with ScriptedServer(script) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", timeout=600)
        told = _told(server, "[big]")
    try:
        kept = _kept(tmp_path / "out.runs")
    finally:  # a gigabyte: not left for pytest's last three runs
        shutil.rmtree(tmp_path / "out.runs", ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    assert records(tmp_path / "out.jsonl")[0]["status"] == "answered"
    assert kept <= OUTPUT_CAP + blocks * _NOTES
    assert len(told) == blocks, told
    assert all("the file's cap of 256 MiB" in t for t in told[:-1]), [t[-600:] for t in told]
    assert "none of it was kept in a file (the run's output files reached their cap of 1 GiB)" in told[-1], \
        told[-1][-600:]


def test_the_runs_of_a_batch_leave_at_most_its_cap(tmp_path: Path):
    script, rows = {}, []
    for i in range(3):
        script[f"[r{i}]"] = [_print(16), _print(16), "done"]
        rows.append({"id": f"r{i}", "task": f"[r{i}] print"})
    write_tasks(tmp_path / "tasks.jsonl", rows)
    with ScriptedServer(script) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "1",
                         "--max-output", "24M", "--max-batch-output", "40M", timeout=300)
        told = {f"r{i}": _told(server, f"[r{i}]") for i in range(3)}
    assert proc.returncode == 0, proc.stderr
    assert {r["status"] for r in records(tmp_path / "out.jsonl")} == {"answered"}
    assert _kept(tmp_path / "out.runs") <= 40 * MiB + 6 * _NOTES
    assert "the run's output files reached their cap of 24 MiB" in told["r0"][1], told["r0"][1][-600:]
    assert "the batch's output files reached their cap of 40 MiB" in told["r1"][1], told["r1"][1][-600:]
    assert "none of it was kept in a file (the batch's" in told["r2"][0], told["r2"][0][-600:]
