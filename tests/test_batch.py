"""`agentloop batch` as a user runs it: a real process, real workers, the scripted model over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from engine.agent import RunResult
from engine.agent._display import read_recording
from engine.batch import ResultsFile, RunSettings, default_parallel, is_infrastructure, read_tasks
from engine.batch.results_file import Lock, redo_selector
from engine.batch.run import run_slug
from engine.errors import ConfigError, ModelError, WorkerError, WorkerStartError
from engine.launch import SharedForkServer, WorkerSettings, descendants
from engine.launch._fork_server import ForkedProcess
from engine.models import Chat, ModelConfig, load_models
from engine.sandbox import GiB, SandboxPolicy
from engine.scripted import Delay, Fail, ScriptedServer
from engine.workers import Engine

from .conftest import closed_port, needs_fork_server, wait_until

AGENTLOOP = [sys.executable, "-m", "engine.cli"]
CODE = "<run_code>\n{}\n</run_code>"


def echo_last(body: dict) -> str:
    """A turn that answers with what the last user message (a code result) said, its tags
    defused (the server cuts a reply at a result tag, as the stop sequences ask)."""
    return "echo: " + body["messages"][-1]["content"].replace("<", "[")


def write_tasks(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def env_for(server: ScriptedServer, tmp_path: Path) -> dict:
    # PYTHONPATH: the command runs this checkout's code, whatever checkout the venv was installed from.
    return {**os.environ, "LLM_URL": server.url, "LLM_MODEL": "scripted", "XDG_STATE_HOME": str(tmp_path / "state"),
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def run_batch(server: ScriptedServer, tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENTLOOP, "batch", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env_for(server, tmp_path), timeout=timeout)


def start_batch(server: ScriptedServer, tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*AGENTLOOP, "batch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env_for(server, tmp_path))


def processes_under(path: Path) -> list[int]:
    """Live processes whose command line or working directory lies under ``path`` (workers)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:
            continue
        if str(path).encode() in cmdline or cwd.startswith(str(path)):
            found.append(int(entry.name))
    return found


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


# ---------------------------------------------------------------------------------------------
# The task file
# ---------------------------------------------------------------------------------------------

def test_read_tasks_reports_each_invalid_line(tmp_path):
    (tmp_path / "in.txt").write_text("x")
    path = write_tasks(tmp_path / "tasks.jsonl", [
        {"id": "a", "task": "fine", "files": ["in.txt"], "timeout": "5m", "max_messages": 3, "extra": 1},
        "not json",
        "[1, 2]",
        {"task": "no id"},
        {"id": "a", "task": "again"},
        {"id": "b"},
        {"id": "c", "task": "t", "timeout": "soon"},
        {"id": "d", "task": "t", "files": ["missing.txt"]},
        {"id": "e", "task": "t", "model": "nope"},
        {"id": True, "task": "t"},
        "",
        {"id": 7, "task": "an integer id", "max_messages": 0},
        {"id": 8, "task": "last"},
    ])
    specs, problems = read_tasks(path, load_models(None, env={}))
    assert [s.id for s in specs] == ["a", 8]
    assert specs[0].timeout == 300 and specs[0].max_messages == 3
    assert specs[0].files == (str(tmp_path / "in.txt"),)
    lines = [p.split(":")[0] for p in problems]
    assert lines == ["line 2", "line 3", "line 4", "line 5", "line 6", "line 7", "line 8", "line 9", "line 10",
                     "line 12"]
    assert "duplicate id 'a' (first on line 1)" in problems[3]
    assert "unknown model 'nope'" in problems[7]
    assert "missing.txt" in problems[6]


def test_invalid_lines_stop_everything_before_it_starts(tmp_path):
    with ScriptedServer(["answered"]) as server:
        tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "a", "task": "[a]"}, "{oops", {"id": "a", "task": "x"}])
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl")
        assert proc.returncode == 125, proc.stderr
        assert "line 2: not JSON" in proc.stderr and "line 3: duplicate id 'a'" in proc.stderr
        assert "--skip-invalid" in proc.stderr
        assert not (tmp_path / "out.jsonl").exists() and server.requests == []

        proc = run_batch(server, tmp_path, str(tasks), "-o", "out.jsonl", "--skip-invalid")
        assert proc.returncode == 0, proc.stderr
        assert "skipping 2 invalid line(s)" in proc.stderr
        assert [(r["id"], r["status"]) for r in records(tmp_path / "out.jsonl")] == [("a", "answered")]


# ---------------------------------------------------------------------------------------------
# A batch with every kind of outcome
# ---------------------------------------------------------------------------------------------

def test_batch_of_20_with_mixed_outcomes(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.txt").write_text("payload-42")
    script: dict = {}
    rows: list = []
    for i in range(8):  # a plain answer
        script[f"[a{i}]"] = [f"answer {i}"]
        rows.append({"id": f"a{i}", "task": f"[a{i}] answer"})
    for i in range(4):  # code that reads (and changes) a file copied into the workspace, then an answer
        script[f"[f{i}]"] = [CODE.format("print(open('in.txt').read())\nopen('in.txt', 'a').write('+edited')"),
                             echo_last]
        rows.append({"id": f"f{i}", "task": f"[f{i}] read", "files": ["data/in.txt"]})
    for i in range(3):  # the model never finishes within its messages
        script[f"[m{i}]"] = [CODE.format("print(1)")] * 5
        rows.append({"id": f"m{i}", "task": f"[m{i}] loop", "max_messages": 2})
    for i in range(3):  # code that outlives the run's timeout
        script[f"[t{i}]"] = [CODE.format("import time; time.sleep(120)")]
        rows.append({"id": f"t{i}", "task": f"[t{i}] hang", "timeout": "1s"})
    for i in range(2):  # an endpoint that keeps failing
        script[f"[e{i}]"] = [Fail(500, times=1000, retry_after=0)]
        rows.append({"id": i + 100, "task": f"[e{i}] broken"})
    write_tasks(tmp_path / "tasks.jsonl", rows)
    with ScriptedServer(script) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "4")
    assert proc.returncode == 0, proc.stderr
    out = records(tmp_path / "out.jsonl")
    assert sorted(map(str, (r["id"] for r in out))) == sorted(str(r["id"]) for r in rows)
    by_id = {r["id"]: r for r in out}
    for i in range(8):
        r = by_id[f"a{i}"]
        assert (r["status"], r["answer"], r["messages"], r["attempts"]) == ("answered", f"answer {i}", 1, 1)
        assert r["tokens"]["in"] > 0 and r["tokens"]["out"] > 0 and r["model"] == "default"
    for i in range(4):
        r = by_id[f"f{i}"]
        assert r["status"] == "answered" and "payload-42" in r["answer"]
        assert Path(r["workspace"], "in.txt").read_text() == "payload-42+edited"
    for i in range(3):
        r = by_id[f"m{i}"]
        assert r["status"] == "failed" and "unfinished after 2 messages" in r["error"]
        assert r["infrastructure"] is False
        assert by_id[f"t{i}"]["status"] == "timed_out" and by_id[f"t{i}"]["duration_s"] < 60
    for i in (100, 101):
        assert by_id[i]["status"] == "failed" and by_id[i]["infrastructure"] is True
        assert "HTTP 500" in by_id[i]["error"]
    for r in out:
        events = read_recording(r["transcript"])
        assert events[0]["type"] == "note" and "attempt 1" in events[0]["message"]
        assert set(r) >= {"id", "status", "answer", "error", "messages", "tokens", "cost", "duration_s",
                          "attempts", "transcript", "workspace"}
    assert "[20/20]" in proc.stderr and "batch summary" in proc.stderr
    assert processes_under(tmp_path) == []


def test_the_runs_of_a_batch_share_their_connections_to_the_model(tmp_path):
    """One HTTP client per endpoint for the whole batch: 12 runs of two completions each, 2 at
    once, reach the model over at most 2 connections, each run's conversation its own."""
    script = {f"[c{i}]": [CODE.format(f"print({i} * 1000)"), echo_last] for i in range(12)}
    write_tasks(tmp_path / "tasks.jsonl", [{"id": f"c{i}", "task": f"[c{i}] run"} for i in range(12)])
    with ScriptedServer(script) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "2")
        completions = [r for r in server.received if r.path.endswith("/chat/completions")]
    assert proc.returncode == 0, proc.stderr
    by_id = {r["id"]: r for r in records(tmp_path / "out.jsonl")}
    assert all(by_id[f"c{i}"]["status"] == "answered" and f"{i * 1000}" in by_id[f"c{i}"]["answer"]
               for i in range(12)), by_id
    assert len(completions) == 24
    for r in completions:  # every request carried its own run's conversation and nothing of another's
        run = r.key.strip("[]")
        assert all(f"[{other}]" not in json.dumps(r.body) for other in by_id if other != run)
    assert len({r.peer for r in completions}) <= 2, Counter(r.peer for r in completions)


def test_files_and_directories_land_in_the_workspace_and_can_be_changed(tmp_path):
    (tmp_path / "kit" / "sub").mkdir(parents=True)
    (tmp_path / "kit" / "sub" / "a.txt").write_text("a")
    (tmp_path / "notes.md").write_text("n")
    code = ("import os\nopen('kit/sub/a.txt', 'a').write('+')\nopen('kit/sub/b.txt', 'w').write('b')\n"
            "open('notes.md', 'a').write('+')\nprint(sorted(os.listdir('kit/sub')))")
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "d", "task": "[d]", "files": ["kit", "notes.md"]}])
    with ScriptedServer({"[d]": [CODE.format(code), echo_last]}) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl")
    assert proc.returncode == 0, proc.stderr
    [record] = records(tmp_path / "out.jsonl")
    assert "['a.txt', 'b.txt']" in record["answer"], record["answer"]
    workspace = Path(record["workspace"])
    assert (workspace / "kit" / "sub" / "a.txt").read_text() == "a+"
    assert (workspace / "notes.md").read_text() == "n+"
    assert (tmp_path / "kit" / "sub" / "a.txt").read_text() == "a"  # the originals are left alone


# ---------------------------------------------------------------------------------------------
# Crashes and resume
# ---------------------------------------------------------------------------------------------

def test_sigkill_midway_then_resume_keeps_every_id_once(tmp_path):
    ids = [f"k{i:02d}" for i in range(20)]
    script = {f"[{k}]": [Delay(0.3, f"done {k}")] for k in ids}
    write_tasks(tmp_path / "tasks.jsonl", [{"id": k, "task": f"[{k}] wait"} for k in ids])
    out = tmp_path / "out.jsonl"
    with ScriptedServer(script) as server:
        proc = start_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "2")
        try:
            assert wait_until(lambda: line_count(out) >= 5, 60)
        finally:
            proc.kill()
            proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        assert wait_until(lambda: not processes_under(tmp_path), 60), "workers outlived their batch"
        data = out.read_bytes()
        finished = [json.loads(line)["id"] for line in data[:data.rfind(b"\n") + 1].splitlines()]
        assert 5 <= len(finished) < len(ids)
        resumed = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "2")
        assert resumed.returncode == 0, resumed.stderr
        counts = Counter(r["id"] for r in records(out))
        assert sorted(counts) == ids and set(counts.values()) == {1}
        assert all(r["status"] == "answered" for r in records(out)), [r for r in records(out) if r["status"] != "answered"]
        # What was finished is not asked again; what was running when killed is.
        assert all(len(server.conversation(f"[{k}]")) == 1 for k in finished)
        assert f"{len(finished)} done before" in resumed.stderr


def test_torn_last_line_is_cut_and_its_run_done_again(tmp_path):
    good = [json.dumps({"id": "p1", "status": "answered", "answer": "old"}),
            json.dumps({"id": "p2", "status": "failed", "answer": None})]
    out = tmp_path / "out.jsonl"
    out.write_text("\n".join(good) + "\n" + '{"id": "p3", "status": "answ')
    write_tasks(tmp_path / "tasks.jsonl", [{"id": f"p{i}", "task": f"[p{i}] go"} for i in range(1, 5)])
    with ScriptedServer({f"[p{i}]": [f"new {i}"] for i in range(1, 5)}) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl")
        assert proc.returncode == 0, proc.stderr
        assert "torn last line" in proc.stderr
        assert server.conversation("[p1]") == [] and server.conversation("[p2]") == []
    lines = out.read_text().splitlines()
    assert lines[:2] == good
    assert sorted(json.loads(line)["id"] for line in lines) == ["p1", "p2", "p3", "p4"]


def test_a_damaged_line_before_the_end_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "status": "answered"}\n{garbage\n{"id": "b", "status": "answered"}\n')
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "c", "task": "[c]"}])
    with ScriptedServer(["x"]) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl")
    assert proc.returncode == 125 and "out.jsonl:2: not a result record" in proc.stderr


def test_a_results_lock_is_held_by_one_and_leaves_no_file(tmp_path):
    path = tmp_path / ".out.jsonl.lock"
    held = Lock(path, "busy")
    with pytest.raises(ConfigError, match="busy"):
        Lock(path, "busy")
    held.release()
    assert not path.exists()
    again = Lock(path, "busy")  # free again, on a file of its own
    assert path.exists()
    again.release()


def test_results_file_redo_rewrites_without_the_selected_records(tmp_path):
    path = tmp_path / "out.jsonl"
    results = ResultsFile(path)
    assert results.open().done == {}
    for ident, status, infra in [("a", "answered", False), ("b", "cancelled", False), ("c", "failed", True),
                                 ("d", "failed", False)]:
        results.append({"id": ident, "status": status, "infrastructure": infra})
    results.close()
    again = ResultsFile(path)
    resumed = again.open(redo_selector([]))  # cancelled and infrastructure failures: always
    again.close()
    assert resumed.done == {"a": "answered", "d": "failed"} and resumed.dropped == 2
    assert [r["id"] for r in records(path)] == ["a", "d"]


# ---------------------------------------------------------------------------------------------
# Retries: the infrastructure's failures only
# ---------------------------------------------------------------------------------------------

def test_retries_an_endpoint_that_fails_then_recovers_but_never_the_model(tmp_path):
    script = {
        # 5 failures use up the client's own 4 retries: the first attempt fails, the second works.
        "[r1]": [Fail(503, times=5, retry_after=0), "recovered"],
        "[m1]": [CODE.format("print(1)")] * 3,
    }
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "r1", "task": "[r1] go"},
                                           {"id": "m1", "task": "[m1] go", "max_messages": 1}])
    with ScriptedServer(script) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--retries", "2",
                         "--retry-backoff", "50ms")
        assert len(server.conversation("[m1]")) == 1
    assert proc.returncode == 0, proc.stderr
    by_id = {r["id"]: r for r in records(tmp_path / "out.jsonl")}
    assert (by_id["r1"]["status"], by_id["r1"]["answer"], by_id["r1"]["attempts"]) == ("answered", "recovered", 2)
    notes = [e["message"] for e in read_recording(by_id["r1"]["transcript"]) if e["type"] == "note"]
    assert any("attempt 1" in n for n in notes) and any("attempt 2" in n for n in notes)
    assert (by_id["m1"]["status"], by_id["m1"]["attempts"], by_id["m1"]["infrastructure"]) == ("failed", 1, False)
    assert "after 2 attempts" in proc.stderr


def test_a_dead_endpoint_stops_the_batch_early(tmp_path):
    write_tasks(tmp_path / "tasks.jsonl", [{"id": i, "task": f"[{i}] go"} for i in range(12)])
    with ScriptedServer([Fail(502, times=10_000, retry_after=0)]) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "1")
        assert proc.returncode == 1, proc.stderr
        assert "5 runs in a row failed for infrastructure reasons" in proc.stderr
        assert len(records(tmp_path / "out.jsonl")) == 5
        assert "(5 infrastructure: a rerun runs them again)" in proc.stderr
        # A run that failed for its infrastructure is not done: the same command runs it again.
        redo = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "1")
    assert "5 record(s) removed to be run again" in redo.stderr
    assert "12 tasks, 0 done before, 12 to run" in redo.stderr


def test_an_endpoint_nobody_listens_on_stops_the_batch_before_it_makes_anything(tmp_path):
    write_tasks(tmp_path / "tasks.jsonl", [{"id": i, "task": f"[{i}] go"} for i in range(6)])
    url = f"http://127.0.0.1:{closed_port()}/v1"
    env = {**os.environ, "LLM_URL": url, "XDG_STATE_HOME": str(tmp_path / "state"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([*AGENTLOOP, "batch", "tasks.jsonl", "-o", "out.jsonl"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agentloop: nothing was run: the model at {url} does not "
                                                   "answer (connection refused). Start one there:"), proc.stderr
    assert lines[0].endswith("Then run the same command again.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state", "tasks.jsonl"]  # no results
    # No runs directory: the state holds at most what the workers' Python answered (kept to ask it less).
    assert [p.name for p in (tmp_path / "state" / "agentloop").iterdir()] in ([], ["probes"])


async def test_errors_of_the_infrastructure_are_told_apart(tmp_path):
    closed = ModelConfig(alias="x", base_url="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(ModelError) as unreachable:
        await Chat("s", closed, max_retries=0).send("hi")
    with ScriptedServer({"[500]": [Fail(500, times=10, retry_after=0)], "[404]": [Fail(404)]}) as server:
        live = ModelConfig(alias="x", base_url=server.url, model="m")
        with pytest.raises(ModelError) as status_500:
            await Chat("s", live, max_retries=0).send("[500]")
        with pytest.raises(ModelError) as status_404:
            await Chat("s", live, max_retries=0).send("[404]")

    def failed(exc: BaseException | str) -> RunResult:  # as run_task reports an exception
        if isinstance(exc, str):
            return RunResult(None, "failed", exc)
        return RunResult(None, "failed", str(exc), extra={"error_type": type(exc).__name__,
                                                          "http_status": getattr(exc, "status", None)})

    assert is_infrastructure(failed(unreachable.value))
    assert is_infrastructure(failed(status_500.value))
    assert not is_infrastructure(failed(status_404.value))
    assert not is_infrastructure(failed("Task unfinished after 3 messages"))
    assert not is_infrastructure(RunResult(None, "timed_out", "no answer within 1 s"))
    broken = tmp_path / "python"  # answers the sandbox's questions, dies as a worker
    broken.write_text(f'#!/bin/sh\n[ "$2" = -B ] && exit 3\nexec {sys.executable} "$@"\n')
    broken.chmod(0o755)
    engine = Engine(cwd=tmp_path, state_dir=tmp_path / "state", python=str(broken), start_timeout=20,
                    sandbox=SandboxPolicy(mode="none"))
    async with engine:
        with pytest.raises(WorkerStartError) as no_start:
            await engine.start_worker("main")
    assert is_infrastructure(failed(no_start.value))


# ---------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------

class Hang:
    """A turn that hangs (until the server closes) while ``on``, and answers once switched off."""

    def __init__(self) -> None:
        self.on = threading.Event()
        self.on.set()

    def __call__(self, body: dict):
        return Delay(120, "late") if self.on.is_set() else "answered at last"


def test_ctrl_c_cancels_running_runs_writes_them_and_resume_redoes_them(tmp_path):
    hang = Hang()
    script = {"[q1]": ["quick 1"], "[q2]": ["quick 2"], "*": [hang]}
    rows = [{"id": "q1", "task": "[q1]"}, {"id": "q2", "task": "[q2]"}]
    rows += [{"id": f"h{i}", "task": f"[h{i}] hang"} for i in range(6)]
    write_tasks(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with ScriptedServer(script) as server:
        proc = start_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "3")
        try:
            assert server.wait_requests(5, timeout=60)  # q1, q2 done; h0..h2 waiting on the model
            assert wait_until(lambda: line_count(out) == 2, 30)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr
        status = {r["id"]: r["status"] for r in records(out)}
        assert status == {"q1": "answered", "q2": "answered", "h0": "cancelled", "h1": "cancelled",
                          "h2": "cancelled"}
        # Cancelled runs are not done: the count stays at the two answered (and so do rate and ETA).
        counts = [line.split()[0] for line in stderr.splitlines() if line.startswith("[") and " cancelled " in line]
        assert counts == ["[2/8]"] * 3, stderr
        assert wait_until(lambda: not processes_under(tmp_path), 60), "cancelled runs left workers"

        hang.on.clear()
        resumed = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert "3 record(s) removed to be run again" in resumed.stderr
    final = records(out)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in rows)
    assert all(r["status"] == "answered" for r in final)


def test_second_ctrl_c_leaves_at_once_with_finished_lines_intact(tmp_path):
    # The block ignores cancellation, so the first Ctrl-C waits for the worker's grace period.
    stubborn = CODE.format("import time\nwhile True:\n    try:\n        time.sleep(60)\n    except BaseException:\n"
                           "        pass")
    script = {"[q]": ["quick"], "*": [stubborn]}
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "q", "task": "[q]"}, {"id": "s", "task": "[s] stubborn"}])
    out = tmp_path / "out.jsonl"
    with ScriptedServer(script) as server:
        proc = start_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "2")
        try:
            assert server.wait_requests(2, timeout=60)
            assert wait_until(lambda: line_count(out) == 1, 30)
            proc.send_signal(signal.SIGINT)
            for line in proc.stderr:
                if "interrupted" in line:
                    break
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130
    assert "left at once" in stderr
    assert [(r["id"], r["status"]) for r in records(out)][:1] == [("q", "answered")]
    assert wait_until(lambda: not processes_under(tmp_path), 60), "workers outlived their batch"


# ---------------------------------------------------------------------------------------------
# Progress, capacity, the rest
# ---------------------------------------------------------------------------------------------

def test_progress_bar_and_summary(tmp_path):
    write_tasks(tmp_path / "tasks.jsonl", [{"id": i, "task": f"[{i}]"} for i in range(3)])
    with ScriptedServer(["yes"]) as server:
        proc = run_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--progress", "bar")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" in proc.stderr and "3/3" in proc.stderr and "answered 3" in proc.stderr
    assert "runs / minute" in proc.stderr


def test_default_parallel_follows_cpus_and_memory():
    assert default_parallel(cpus=2, memory=23 * GiB) == 4
    assert default_parallel(cpus=16, memory=4 * GiB + 1) == 4
    assert default_parallel(cpus=1, memory=100 * 1024 * 1024) == 1
    assert default_parallel(cpus=256, memory=1024 * GiB) == 64
    assert default_parallel() >= 1


async def test_a_run_holds_at_most_its_workers(tmp_path):
    engine = Engine(max_workers=2, cwd=tmp_path, workspace=tmp_path / "ws", state_dir=tmp_path / "state")
    async with engine:
        first = await engine.start_worker("a")
        await engine.start_worker("b")
        with pytest.raises(WorkerError, match="already holds 2 workers"):
            await engine.start_worker("c")
        await first.close()
        await engine.start_worker("c")


def test_ids_become_distinct_directory_names():
    assert run_slug("task-7.a_b") == "task-7.a_b"
    names = {run_slug(k) for k in ["a/b", "a_b", "a b", "..", "", "x" * 200]}
    assert len(names) == 6 and all("/" not in n and n not in ("", ".", "..") for n in names)


def test_batch_module_does_not_import_ray():
    probe = "import sys, engine.batch; print('ray' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


# ---------------------------------------------------------------------------------------------
# One fork server for the batch
# ---------------------------------------------------------------------------------------------



def _proc_field(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    stat = _proc_field(pid, "stat")
    return int(stat[stat.rfind(")") + 2:].split()[1]) if stat else 0


def fork_servers_and_workers(root: int) -> tuple[list[int], list[int]]:
    """Below ``root``: the fork servers (``worker.fork_server``'s Python, child of its bubblewrap
    sandbox) and the workers they forked (each below its namespace's init, ``sleep``)."""
    servers, workers = [], []
    for pid in descendants(root):
        if "worker.fork_server" in _proc_field(pid, "cmdline") and _proc_field(pid, "comm") != "bwrap" \
                and _proc_field(_parent(pid), "comm") == "bwrap":
            servers.append(pid)
        elif _proc_field(_parent(pid), "comm") == "sleep":
            workers.append(pid)
    return servers, workers


def _below(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


#: Run ``a``'s first block: a secret in its workspace, and where its socket directory is (the
#: mount named ``.../r<N>/w<N>``), for the test to hand to run ``b``.
_PLANT = """
import json, os, re
open('secret.txt', 'w').write({secret!r})
points = [line.split()[4] for line in open('/proc/self/mountinfo')]
sock_dir = next(p for p in points if re.fullmatch(r'.*/r[0-9]+/w[0-9]+', p))
json.dump({{'sock_dir': sock_dir, 'workspace': os.getcwd()}}, open('where.json', 'w'))
print('planted')
"""

#: Run ``b``'s block: everything of run ``a`` it might reach, by the paths ``a`` really uses.
_REACH = """
import os, socket
def probe(name, fn):
    try:
        print(name, 'OK', repr(fn())[:300])
    except Exception as exc:
        print(name, type(exc).__name__)
A_WS, A_SOCK, RUNS = {ws!r}, {sock!r}, {runs!r}
probe('open_secret', lambda: open(A_WS + '/secret.txt').read())
probe('list_workspace', lambda: os.listdir(A_WS))
probe('list_run', lambda: os.listdir(os.path.dirname(A_WS)))
probe('open_transcript', lambda: open(os.path.dirname(A_WS) + '/transcript.jsonl').read())
probe('list_runs', lambda: sorted(os.listdir(RUNS)))
probe('list_socket_dir', lambda: os.listdir(A_SOCK))
probe('list_socket_root', lambda: sorted(os.listdir(os.path.dirname(os.path.dirname(A_SOCK)))))
probe('open_stderr', lambda: open(A_SOCK + '/stderr', 'wb'))
def connect():
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(A_SOCK + '/sock')
    return 'connected'
probe('connect_socket', connect)
probe('write_runs', lambda: open(RUNS + '/planted.txt', 'w').write('x'))
probe('own_workspace', lambda: sorted(os.listdir('.')))
"""


@needs_fork_server
def test_runs_share_one_fork_server_and_reach_nothing_of_each_other(tmp_path):
    """Two runs at once: one fork server forks both runs' workers, and run b's code, given
    the real paths of run a's workspace and socket, can neither read, list, write nor connect
    to them; run a's worker is untouched by it."""
    secret = "run-a-secret-" + os.urandom(8).hex()
    runs = tmp_path / "out.runs"
    seen: dict = {}
    probed = threading.Event()

    def b_reaches(body: dict) -> str:  # b's first turn: once a's worker is up and said where it is
        assert wait_until(lambda: (runs / "a" / "workspace" / "where.json").exists(), 60)
        where = json.loads((runs / "a" / "workspace" / "where.json").read_text())
        seen["where"] = where
        seen["fifo_there"] = Path(where["sock_dir"], "stderr").exists()  # the paths are real ones
        return CODE.format(_REACH.format(ws=where["workspace"], sock=where["sock_dir"], runs=str(runs)))

    def b_answers(body: dict) -> str:  # b's second turn: both runs' workers are alive now
        servers, workers = seen["tree"] = fork_servers_and_workers(seen["batch"])
        seen["forked"] = [w for w in workers if servers and _below(w, servers[0])]
        probed.set()
        return echo_last(body)

    def a_checks(body: dict) -> str:  # a's second turn: after b's attempts
        assert probed.wait(90)
        return CODE.format("print(open('secret.txt').read(), sorted(__import__('os').listdir('.')))")

    script = {"[a]": [CODE.format(_PLANT.format(secret=secret)), a_checks, echo_last],
              "[b]": [b_reaches, b_answers]}
    write_tasks(tmp_path / "tasks.jsonl", [{"id": "a", "task": "[a]"}, {"id": "b", "task": "[b]"}])
    with ScriptedServer(script) as server:
        proc = start_batch(server, tmp_path, "tasks.jsonl", "-o", "out.jsonl", "--parallel", "2")
        seen["batch"] = proc.pid
        try:
            _, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 0, stderr
    by_id = {r["id"]: r for r in records(tmp_path / "out.jsonl")}
    assert by_id["a"]["status"] == by_id["b"]["status"] == "answered", by_id

    servers, workers = seen["tree"]
    assert len(servers) == 1, seen["tree"]  # one fork server for the batch ...
    assert len(workers) >= 2 and seen["forked"] == workers  # ... forked both runs' workers

    answer = by_id["b"]["answer"]
    results = dict(line.split(" ", 1) for line in answer.splitlines() if line.startswith(
        ("open_", "list_", "connect_", "write_", "own_")))
    assert seen["fifo_there"]
    for name in ("open_secret", "list_workspace", "list_run", "open_transcript", "list_socket_dir",
                 "open_stderr", "connect_socket"):
        assert results[name] == "FileNotFoundError", (name, answer)
    assert results["write_runs"] in ("PermissionError", "OSError"), answer
    assert results["list_runs"] == "OK ['b']", answer  # its own run's directory, nothing else
    a_runs_sockets = Path(seen["where"]["sock_dir"]).parent.name
    assert results["list_socket_root"].startswith("OK [") and f"'{a_runs_sockets}'" not in results["list_socket_root"]
    assert "'secret.txt'" not in results["own_workspace"]
    assert secret not in answer and secret not in json.dumps(server.conversation("[b]"))
    assert secret in by_id["a"]["answer"] and "'where.json'" in by_id["a"]["answer"]  # a's worker is untouched
    assert not (runs / "planted.txt").exists()
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in [*servers, *workers]), 10), \
        "the fork server or a worker outlived its batch"


@needs_fork_server
async def test_a_shared_fork_server_serves_runs_alike_and_restarts(tmp_path):
    """Runs beneath the runs directory share the server (one pid); a run with another sandbox
    policy starts cold; a server that died is started again by the next worker; once it is
    closed, runs start cold."""
    runs = tmp_path / "runs"
    shared = SharedForkServer(runs, WorkerSettings())

    def run_engine(name: str, **kwargs) -> Engine:
        ws = runs / name / "workspace"
        return Engine(max_workers=4, cwd=ws, workspace=ws, state_dir=runs / name / "state", pool=0,
                      shared_fork_server=shared, keep_output=True, **kwargs)

    engines = [run_engine("a"), run_engine("b"), run_engine("c", sandbox=SandboxPolicy(tmp_bytes=GiB))]
    try:
        a, b, c = [await e.start_worker("main") for e in engines]
        assert isinstance(a.session.proc, ForkedProcess) and isinstance(b.session.proc, ForkedProcess)
        assert not isinstance(c.session.proc, ForkedProcess)  # not alike: its own, cold
        assert a.session.proc.server is b.session.proc.server
        first = shared.pid
        assert first is not None and _below(a.session.proc.pid, first) and _below(b.session.proc.pid, first)
        result = await b.run("import os; print(os.getcwd(), sorted(os.listdir('..')))", timeout=10)
        assert result.output.strip() == f"{runs / 'b' / 'workspace'} ['state', 'workspace']", result
        # What a worker writes to its own stderr (its runtime's last words) reaches its own
        # record only, never the server's stderr that another run's start failure would quote.
        said = await b.run("import os\nfor fd in map(int, os.listdir('/proc/self/fd')):\n"
                           "    try:\n        where = os.readlink(f'/proc/self/fd/{fd}')\n"
                           "    except OSError:\n        continue\n"
                           "    if where.endswith('/stderr'):\n        os.write(fd, b'b-was-here')\n", timeout=10)
        assert said.status == "ok", said
        for _ in range(100):
            if b"b-was-here" in b.session.proc.stderr_tail:
                break
            await asyncio.sleep(0.02)
        assert b"b-was-here" in b.session.proc.stderr_tail
        assert b"b-was-here" not in a.session.proc.stderr_tail + a.session.proc.server.stderr_tail

        os.kill(first, signal.SIGKILL)  # the server dies, and every worker it forked with it
        for _ in range(200):
            if shared.pid is None:
                break
            await asyncio.sleep(0.05)
        assert shared.pid is None
        again = await engines[0].start_worker("again")
        assert shared.pid not in (None, first) and (await again.run("print(6 * 7)", timeout=10)).output == "42\n"
    finally:
        for e in engines:
            await e.shutdown()
        await shared.close()
    assert shared.pid is None and not shared.socket_root.exists()
    async with run_engine("d") as late:  # a run after the batch's end starts cold
        assert not isinstance((await late.start_worker("main")).session.proc, ForkedProcess)


def test_the_batchs_fork_server_can_be_turned_off(tmp_path):
    models = load_models(None, env={})
    assert RunSettings(models=models, runs_dir=tmp_path, worker=WorkerSettings(fork_server=False)).shared_fork_server() is None
    shared = RunSettings(models=models, runs_dir=tmp_path).shared_fork_server()
    assert shared is not None and shared.pid is None  # nothing starts before a run needs a worker


def test_a_stopper_cancels_the_runs_of_one_scheduler_and_refuses_a_second(capsys):
    # The first interrupt cancels what the scheduler that adopted the stopper runs; a second
    # scheduler would silently take that interrupt from the first, so it is refused.
    from engine.batch.stopping import Stopper
    from engine.errors import AlreadyOwned

    stopper, cancelled = Stopper(), []
    stopper.adopt(lambda: cancelled.append("first"))
    with pytest.raises(AlreadyOwned, match="make a Stopper per batch"):
        stopper.adopt(lambda: cancelled.append("second"))
    stopper.interrupt()
    assert cancelled == ["first"] and stopper.stopping and stopper.reason == "interrupted"
    assert "cancelling the running runs" in capsys.readouterr().err
    unowned = Stopper()  # (the Ray scheduler asks ``interrupted`` instead)
    unowned.interrupt()
    assert unowned.interrupted
