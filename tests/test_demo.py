"""`agentloop demo` as a newcomer runs it: a real process, real workers, a scripted model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.agent._display import read_recording
from engine.cli.demo import COMPLETE

AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def _events(recording: list[dict], type: str, **match) -> list[dict]:
    return [e for e in recording if e["type"] == type and all(e.get(k) == v for k, v in match.items())]


def test_demo_runs_every_part_of_the_engine(tmp_path: Path):
    record = tmp_path / "demo.jsonl"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("LLM_URL", None)  # the demo needs no model server, and must not look for one
    proc = subprocess.run([*AGENTLOOP, "demo", "--record", str(record)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(COMPLETE)
    assert "871" in proc.stdout  # the sub-agent's answer, quoted in the final one
    display = [line for line in proc.stderr.splitlines() if not line.startswith("agentloop: warning")]
    assert "scripted model, no LLM involved" in display[0]

    events = read_recording(record)
    assert events[0]["type"] == "note" and "scripted model, no LLM involved" in events[0]["message"]

    # Two blocks overlapped in time: both started before either finished.
    starts = {e["id"]: e["t"] for e in _events(events, "launched", name="main")}
    ends = {e["id"]: e["t"] for e in _events(events, "finished", name="main")}
    assert max(starts["left"], starts["right"]) < min(ends["left"], ends["right"])

    # Heartbeats while a block ran.
    assert _events(events, "progress", name="main", id="ticker")

    # A block stuck in C hit its deadline and its worker was killed.
    [stuck] = _events(events, "finished", name="main", id="stuck")
    assert stuck["status"] == "timeout"
    assert "worker was killed" in stuck["output"] and "lost variables" in stuck["output"]
    [after] = _events(events, "finished", name="main", id="after")
    assert "nothing (this is a fresh worker)" in after["output"]

    # A sub-agent, handed a function, used it and answered.
    assert _events(events, "agent_started", name="helper", parent="main")
    [search] = _events(events, "finished", name="helper", id="search")
    assert search["status"] == "ok" and search["output"].startswith("871 178")
    assert _events(events, "agent_finished", name="helper", status="answered")


def test_demo_help_says_it_is_scripted():
    proc = subprocess.run([*AGENTLOOP, "demo", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "scripted model, no LLM involved" in proc.stdout
