"""Runs of one batch see nothing of each other: not through their workers' files (forked by the
batch's one fork server or started cold), not through the repository tools (which run in the
coordinator's name), whatever path the model spells."""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from engine.launch import SharedForkServer, WorkerSettings
from engine.scripted import ScriptedServer
from engine.workers import Engine

from ..conftest import NO_FORK_SERVER
from ..test_batch import CODE, echo_last, records, run_batch, write_tasks
from .harness import ABSENT, WAIT, assert_still_works, attack, needs_namespaces

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


@pytest.fixture(params=["beneath /tmp", "elsewhere"])
def batch_dirs(request, tmp_path: Path, monkeypatch):
    """Where a batch's runs directory and sockets lie: beneath /tmp (which each worker gets
    afresh), or elsewhere (where an empty tmpfs covers them)."""
    if request.param == "beneath /tmp":
        yield tmp_path / "out.runs"
        return
    base = Path(tempfile.mkdtemp(prefix="al-", dir="/var/tmp"))
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
        yield base / "out.runs"
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_runs_sharing_the_batchs_fork_server_reach_nothing_of_each_other(batch_dirs: Path):
    """The workers of two runs, forked at once by the batch's one fork server: run b's code,
    given the real paths of run a (its workspace, its outputs, its socket directory), finds
    none of them, cannot uncover the runs directory nor write to its cover, nor reach run a
    through the namespace's init; run a's worker goes on untouched."""
    needs_namespaces()
    if NO_FORK_SERVER:
        pytest.skip(reason=NO_FORK_SERVER)
    runs = batch_dirs
    shared = SharedForkServer(runs, WorkerSettings())
    engines = []
    for name in ("a", "b"):
        ws = runs / name / "workspace"
        engines.append(Engine(max_workers=4, cwd=ws, workspace=ws, state_dir=runs / name / "state", pool=0,
                              shared_fork_server=shared, keep_output=True))
    secret = "run-a-secret-" + secrets.token_hex(8)
    try:
        a, b = [await e.start_worker("main") for e in engines]
        await a.run(f"open('secret.txt', 'w').write({secret!r})", timeout=WAIT)
        a_ws, a_out = engines[0].workspace, engines[0].output_dir
        a_sock = a.session.sock_dir
        assert (a_ws / "secret.txt").exists() and a_out.is_dir() and (a_sock / "stderr").exists()
        got = await attack(b, f'''
A_WS, A_OUT, A_SOCK, RUNS = {str(a_ws)!r}, {str(a_out)!r}, {str(a_sock)!r}, {str(runs)!r}
probe("read_secret", lambda: open(A_WS + "/secret.txt").read())
probe("list_workspace", lambda: _os.listdir(A_WS))
probe("list_outputs", lambda: _os.listdir(A_OUT))
probe("list_socket_dir", lambda: _os.listdir(A_SOCK))
probe("open_stderr", lambda: open(A_SOCK + "/stderr", "wb"))
probe("list_runs", lambda: sorted(_os.listdir(RUNS)))
probe("write_cover", lambda: open(RUNS + "/planted", "w"))
probe("mkdir_cover", lambda: _os.mkdir(RUNS + "/a"))
probe("umount_cover", lambda: libc("umount2", RUNS.encode(), 2))
probe("init_root", lambda: _os.listdir("/proc/1/root" + A_WS))
probe("init_cwd", lambda: _os.readlink("/proc/1/cwd"))
probe("init_fds", lambda: _os.listdir("/proc/1/fd"))
probe("open_by_handle", lambda: libc("open_by_handle_at", -100, None, 0))
probe("cover", lambda: [(f[f.index("-") + 1], f[5].split(",")[0]) for f in map(str.split, open("/proc/self/mountinfo"))
                         if f[4] == RUNS][-1])  # the topmost mount there
''')
        assert got.result.status == "ok", got.result
        for name in ("read_secret", "list_workspace", "list_outputs", "list_socket_dir", "open_stderr"):
            assert got[name] == ABSENT, (name, got.probes)
        assert got["list_runs"] == "ok ['b']", got.probes
        for name in ("write_cover", "mkdir_cover"):
            assert got[name].split()[-1] in ("EROFS", "EACCES"), (name, got.probes)
        if not str(runs).startswith("/tmp/"):  # an empty tmpfs covers the runs directory, read-only
            assert got["cover"].startswith("ok ('tmpfs', ") and "'ro'" in got["cover"], got.probes
        assert got["umount_cover"].split()[-1] in ("EPERM", "EACCES"), got.probes
        # The namespace's init is root's (root's server), or hidden from the worker's /proc
        # (unprivileged: it shares the worker's uid).
        for name in ("init_root", "init_cwd", "init_fds"):
            assert got[name].split()[-1] in ("EACCES", "EPERM", "ENOENT"), (name, got.probes)
        assert got["open_by_handle"].split()[-1] in ("EACCES", "EPERM"), got.probes
        assert secret not in got.result.output
        await assert_still_works(a)
        assert (await a.run("print(open('secret.txt').read())", timeout=WAIT)).output == secret + "\n"
        await assert_still_works(b)
    finally:
        for e in engines:
            await e.shutdown()
        await shared.close()
