"""Runs of one batch see nothing of each other: not through their workers' files, not through
the repository tools (which run in the coordinator's name), whatever path the model spells."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from engine.scripted import ScriptedServer

from ..test_batch import CODE, echo_last, records, run_batch, write_tasks

pytestmark = pytest.mark.attack


def test_a_batch_run_reaches_nothing_of_another(tmp_path: Path):
    secret = "run-a-secret-" + secrets.token_hex(8)
    runs = tmp_path / "out.runs"
    plant = f"open('secret.txt', 'w').write({secret!r}); print('planted')"
    steal = f"""
import os
def probe(name, fn):
    try:
        print(name, repr(fn())[:200])
    except Exception as exc:
        print(name, type(exc).__name__)
targets = {{
    "relative": "../../a/workspace/secret.txt",
    "absolute": {str(runs / "a" / "workspace" / "secret.txt")!r},
    "transcript": {str(runs / "a" / "transcript.jsonl")!r},
    "results": {str(tmp_path / "out.jsonl")!r},
}}
for name, path in targets.items():
    probe("open_" + name, lambda: open(path).read())
probe("listdir_runs", lambda: os.listdir({str(runs)!r}))
probe("tool_read", lambda: read_file("out.runs/a/workspace/secret.txt"))
probe("tool_read_dotdot", lambda: read_file("x/../out.runs/a/transcript.jsonl"))
probe("tool_results", lambda: read_file("out.jsonl"))
probe("tool_list", lambda: list_dir("out.runs"))
probe("tool_search", lambda: search("run-a-secret"))
os.symlink({str(runs)!r}, "runs_link")
probe("tool_link", lambda: read_file("out.runs/b/workspace/runs_link/a/workspace/secret.txt"))
"""
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "a", "task": "[a]"}, {"id": "b", "task": "[b]"}])
    script = {"[a]": [CODE.format(plant), "done"], "[b]": [CODE.format(steal), echo_last]}
    with ScriptedServer(script) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "1",
                         "--tools", "repo", "--root", str(tmp_path))
        sent = json.dumps([r for r in server.requests if '"[b]"' in json.dumps(r["messages"])])
    assert proc.returncode == 0, proc.stderr
    by_id = {r["id"]: r for r in records(tmp_path / "out.jsonl")}
    assert by_id["a"]["status"] == by_id["b"]["status"] == "answered", by_id
    assert (runs / "a" / "workspace" / "secret.txt").read_text() == secret  # it was there to steal
    answer = by_id["b"]["answer"]
    for name in ("open_relative", "open_absolute", "open_transcript", "open_results", "listdir_runs",
                 "tool_read", "tool_read_dotdot", "tool_results", "tool_list", "tool_search", "tool_link"):
        assert f"{name} " in answer, (name, answer)
    assert secret not in answer and secret not in sent
    assert "transcript.jsonl" not in answer.split("open_transcript")[0]  # nothing listed
    assert "'a'" not in answer  # run a's directory is listed nowhere
