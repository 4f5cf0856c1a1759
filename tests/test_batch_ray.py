"""`agentloop batch --ray` against a real local Ray cluster (skip with --skip-ray).

The cluster is started here with ``ray.init`` and token authentication on, as Ray 2.60 does by
default; the batch runs as its own process and connects the way a user would: its address plus
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in the environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from engine.scripted import Delay, ScriptedServer

from .conftest import wait_until
from .test_batch import AGENTLOOP, CODE, echo_last, line_count, processes_under, records, write_tasks

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def ray_batch(server, tmp_path: Path, cluster, *args: str) -> subprocess.Popen:
    address, auth = cluster
    env = {**os.environ, **auth, "LLM_URL": server.url, "LLM_MODEL": "scripted",
           "XDG_STATE_HOME": str(tmp_path / "state")}
    return subprocess.Popen([*AGENTLOOP, "batch", "tasks.jsonl", "-o", "out.jsonl", "--ray", address, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        proc.kill()


def test_eight_runs_on_ray_killed_midway_and_resumed(ray_cluster, tmp_path):
    (tmp_path / "in.txt").write_text("from-the-driver")
    script = {"[f0]": [CODE.format("print(open('in.txt').read())"), echo_last],
              "[m0]": [CODE.format("print(1)")] * 3}
    rows = [{"id": "f0", "task": "[f0] read", "files": ["in.txt"]}, {"id": "m0", "task": "[m0]", "max_messages": 1}]
    for i in range(6):
        script[f"[r{i}]"] = [Delay(0.5, f"ray answer {i}")]
        rows.append({"id": f"r{i}", "task": f"[r{i}] wait"})
    write_tasks(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with ScriptedServer(script) as server:
        proc = ray_batch(server, tmp_path, ray_cluster)
        try:
            assert wait_until(lambda: line_count(out) >= 3, 120), proc.stderr.read() if proc.poll() else ""
        finally:
            proc.kill()
            proc.communicate(timeout=60)
        data = out.read_bytes()
        finished = [json.loads(line)["id"] for line in data[:data.rfind(b"\n") + 1].splitlines()]
        assert 3 <= len(finished) < 8
        # Ray ends a dead driver's actors once it notices the driver is gone: seconds, but on a
        # loaded 2-core machine (the suite's other worker busy) more than a minute was seen.
        assert wait_until(lambda: not processes_under(tmp_path), 180), "runs outlived their driver"

        proc = ray_batch(server, tmp_path, ray_cluster)
        stderr = finish(proc)
        assert proc.returncode == 0, stderr
        assert f"{len(finished)} done before" in stderr
        starts = Counter(r.key for r in server.received if r.turn == 0)
        assert all(starts[f"[{k}]"] == 1 for k in finished)  # finished runs are not started again
    final = records(out)
    counts = Counter(r["id"] for r in final)
    assert sorted(counts) == sorted(r["id"] for r in rows) and set(counts.values()) == {1}
    by_id = {r["id"]: r for r in final}
    assert by_id["f0"]["status"] == "answered" and "from-the-driver" in by_id["f0"]["answer"]
    assert (by_id["m0"]["status"], by_id["m0"]["infrastructure"]) == ("failed", False)
    assert all(by_id[f"r{i}"]["answer"] == f"ray answer {i}" for i in range(6))
    assert all(r["node"] for r in final)
    assert Path(by_id["f0"]["transcript"]).exists()


def test_hung_runs_time_out_and_ctrl_c_cancels_on_ray_leaving_no_workers(ray_cluster, tmp_path):
    hang = CODE.format("import time; time.sleep(600)")
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "t0", "task": "[t0] hang", "timeout": "2s"},
                                           {"id": "c0", "task": "[c0] hang"}, {"id": "c1", "task": "[c1] hang"},
                                           {"id": "n0", "task": "[n0] never started"}])
    out = tmp_path / "out.jsonl"
    with ScriptedServer({"[t0]": [hang], "[c0]": [hang], "[c1]": [hang], "[n0]": ["never"]}) as server:
        proc = ray_batch(server, tmp_path, ray_cluster)
        try:
            assert wait_until(lambda: line_count(out) >= 1, 120)
            assert records(out)[0]["id"] == "t0" and records(out)[0]["status"] == "timed_out"
            assert server.wait_requests(3, timeout=60)  # c0 and c1 hold both slots now
            proc.send_signal(signal.SIGINT)
            stderr = finish(proc, 120)
        finally:
            proc.kill()
        assert proc.returncode == 130, stderr
        status = {r["id"]: r["status"] for r in records(out)}
        assert status == {"t0": "timed_out", "c0": "cancelled", "c1": "cancelled"}
        assert server.conversation("[n0]") == []
    assert wait_until(lambda: not processes_under(tmp_path), 60), "cancelled Ray tasks left workers"


def test_an_unreachable_cluster_is_reported(tmp_path):
    pytest.importorskip("ray")
    write_tasks(tmp_path / "tasks.jsonl", [{"id": 1, "task": "x"}])
    env = {**os.environ, "LLM_URL": "http://127.0.0.1:9/v1"}
    proc = subprocess.run([*AGENTLOOP, "batch", "tasks.jsonl", "-o", "out.jsonl", "--ray", "127.0.0.1:9"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 125
    assert "cannot connect to the Ray cluster at 127.0.0.1:9: Connection refused" in proc.stderr


def test_without_the_token_the_error_says_what_to_set(ray_cluster, tmp_path):
    address, _ = ray_cluster
    write_tasks(tmp_path / "tasks.jsonl", [{"id": 1, "task": "x"}])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    proc = subprocess.run([*AGENTLOOP, "batch", "tasks.jsonl", "-o", "out.jsonl", "--ray", address],
                          capture_output=True, text=True, cwd=tmp_path, env={**env, "HOME": str(tmp_path)},
                          timeout=120)
    assert proc.returncode == 125, proc.stderr
    assert "RAY_AUTH_MODE=token" in proc.stderr and "RAY_AUTH_TOKEN" in proc.stderr
