"""``agentloop serve``: SandboxFusion's ``/run_code``, answered field for field by a real server
(a subprocess, real sandboxes), asked by a SandboxFusion-shaped client written here with urllib
as verl's reward code writes its requests."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.durations import parse_duration
from engine.launch import descendants

from .conftest import read_line, wait_until
from .test_samples import HOSTILE, LOOK

pytest.importorskip("uvicorn")

AGENTLOOP = [sys.executable, "-m", "engine.cli"]
#: Seconds a server may take to say it listens, a request to be answered, the server to go.
START, CALL, GONE = 60, 60, 30


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT/TOKEN/
    token: str
    log: list[str]

    @property
    def bare(self) -> str:
        """The URL without the token: what a request that carries none asks."""
        return self.url.rsplit("/", 2)[0] + "/"


@contextlib.contextmanager
def serving(tmp_path: Path, *options: str, verbose: bool = False, token_file: Path | None = None) -> Iterator[Server]:
    state = tmp_path / "state"
    (tmp_path / "cwd").mkdir(exist_ok=True)
    proc = subprocess.Popen([*AGENTLOOP, *(["-v"] if verbose else []), "serve", "--http", "127.0.0.1:0", *options],
                            cwd=tmp_path / "cwd",
                            env={**os.environ, "XDG_STATE_HOME": str(state)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    try:
        deadline = time.monotonic() + START
        while not (log and "serving SandboxFusion's /run_code at" in log[-1]) and time.monotonic() < deadline:
            line = read_line(proc.stderr, deadline - time.monotonic())
            assert line, f"the server said nothing more before it served: {log}"
            log.append(line)
        url = log[-1].split(" at ", 1)[1].split()[0]
        token = (token_file or state / "agentloop" / "server-token").read_text().strip()
        assert url == f"{url.rsplit('/', 2)[0]}/{token}/" and url.startswith("http://127.0.0.1:")
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        yield Server(proc, url, token, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(GONE)


def post(url: str, body, headers: dict | None = None, timeout: float = CALL) -> tuple[int, dict | list | str]:
    """POST ``body`` as JSON, as SandboxFusion's clients do; (HTTP status, the decoded answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        with contextlib.suppress(ValueError):
            return exc.code, json.loads(text)
        return exc.code, text


def run_code(server: Server, code: str, **fields) -> dict:
    """What verl's ``call_sandbox_api`` posts (its fields, its defaults), answered 200."""
    body = {"compile_timeout": 10, "run_timeout": 10, "code": code, "stdin": "", "language": "python",
            "files": {}, "fetch_files": [], **fields}
    status, answer = post(server.url + "run_code", body)
    assert status == 200, answer
    return answer


RESPONSE = {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
RUN_RESULT = {"status", "execution_time", "return_code", "stdout", "stderr"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("serve"), "--parallel", "4", "--timeout", "20s", "--memory", "512M",
                 "--max-body", "2M") as s:
        yield s


def test_a_run_is_answered_field_for_field_as_sandboxfusion_answers(server):
    ok = run_code(server, "print('hello')")
    assert set(ok) == RESPONSE and set(ok["run_result"]) == RUN_RESULT
    assert (ok["status"], ok["message"], ok["compile_result"], ok["executor_pod_name"], ok["files"]) == \
        ("Success", "", None, None, {})
    run = ok["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "hello\n", "")
    assert isinstance(run["execution_time"], float) and 0 < run["execution_time"] < CALL
    failed = run_code(server, "import sys\nprint('out')\nsys.exit(3)")
    assert (failed["status"], failed["run_result"]["status"], failed["run_result"]["return_code"]) == \
        ("Failed", "Finished", 3)
    raised = run_code(server, "def f():\n    1/0\nf()\n")
    assert (raised["status"], raised["run_result"]["return_code"]) == ("Failed", 1)
    assert 'File "sample.py", line 2, in f' in raised["run_result"]["stderr"]
    assert "ZeroDivisionError" in raised["run_result"]["stderr"]
    killed = run_code(server, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert (killed["status"], killed["run_result"]["return_code"]) == ("Failed", -signal.SIGKILL)
    # The smallest request SandboxFusion takes: code and language.
    status, bare = post(server.url + "run_code", {"code": "print(2)", "language": "python"})
    assert status == 200 and bare["run_result"]["stdout"] == "2\n"


def test_stdin_files_in_and_fetched_files_out(server):
    code = ("import os, sys\nname = input()\ndata = open('data/in.bin', 'rb').read()\n"
            "open('out.txt', 'w').write(name.upper() + str(len(data)))\n"
            "os.symlink('/etc/hostname', 'link')\nos.mkdir('deep')\nopen('deep/b.bin', 'wb').write(data[::-1])\n"
            "print(sys.argv[1:])\n")
    got = run_code(server, code, stdin="alice\n", args=["-x"],
                   files={"data/in.bin": base64.b64encode(bytes(range(256))).decode(), "skipped": None},
                   fetch_files=["out.txt", "deep/b.bin", "link", "missing.txt", "data/in.bin"])
    assert got["status"] == "Success", got
    assert got["run_result"]["stdout"] == "['-x']\n"
    files = {k: base64.b64decode(v) for k, v in got["files"].items()}
    # As SandboxFusion: a missing file is left out; here a link is too (never followed).
    assert files == {"out.txt": b"ALICE256", "deep/b.bin": bytes(range(256))[::-1], "data/in.bin": bytes(range(256))}


def test_the_deadline_is_time_limit_exceeded_and_the_servers_bound_holds(server):
    started = time.monotonic()
    got = run_code(server, "print('started', flush=True)\nwhile True:\n    pass\n", run_timeout=1)
    took = time.monotonic() - started
    assert (got["status"], got["run_result"]["status"], got["run_result"]["return_code"]) == \
        ("Failed", "TimeLimitExceeded", None)
    assert got["run_result"]["stdout"] == "started\n" and 1 <= got["run_result"]["execution_time"] < 10
    assert took < 20
    # A run_timeout past the server's --timeout is lowered to it, and the message says so.
    capped = run_code(server, "print(1)", run_timeout=3600)
    assert capped["status"] == "Success" and "past this server's 20 s; 20 s applied" in capped["message"]


def test_memory_limits_hold_and_no_request_raises_the_servers(server):
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))\n"
    low = run_code(server, bomb, memory_limit_MB=128, run_timeout=20)
    assert low["status"] == "Failed", low
    assert low["run_result"]["return_code"] in (1, -signal.SIGKILL), low  # MemoryError, or the kernel's kill
    assert "went over its memory limit (128 MiB)" in low["message"] or "MemoryError" in low["run_result"]["stderr"]
    # 200 MiB fits the server's 512 MiB, not a request's 128 MiB.
    fits = "x = bytearray(200 << 20)\nprint(len(x) >> 20)\n"
    assert run_code(server, fits)["run_result"]["stdout"] == "200\n"
    assert run_code(server, fits, memory_limit_MB=128)["status"] == "Failed"
    high = run_code(server, bomb, memory_limit_MB=1 << 20, run_timeout=20)
    assert high["status"] == "Failed" and "memory_limit_MB 1048576 is past this server's 512 MiB" in high["message"]


def test_another_language_is_refused_in_words(server):
    got = run_code(server, '#include <stdio.h>\nint main() { return 0; }', language="cpp")
    assert got["status"] == "SandboxError" and got["run_result"] is None
    assert "language 'cpp' is not run here: agentloop serve runs Python only" in got["message"]


def test_requests_not_of_sandboxfusions_shape_are_refused_in_words(server):
    for body, words in [({"language": "python"}, "code: a string is required"),
                        ({"code": "1", "language": "python", "run_timeout": "ten"}, "run_timeout: a number"),
                        ({"code": "1", "language": "python", "files": {"../x": "eA=="}}, "not a path inside"),
                        ({"code": "1", "language": "python", "files": {"x": "%%%"}}, "is not base64"),
                        ([1, 2], "a request is a JSON object")]:
        status, answer = post(server.url + "run_code", body)
        assert (status, words in answer["detail"]) == (422, True), (body, answer)
    status, answer = post(server.url + "run_code", b"{not json")
    assert status == 422 and "not JSON" in answer["detail"]


def test_no_token_or_a_wrong_one_is_refused_before_anything_runs(server, tmp_path):
    planted = tmp_path / "ran"
    body = {"code": f"open({str(planted)!r}, 'w')", "language": "python"}
    status, answer = post(server.bare + "run_code", body)
    assert status == 401 and "only requests that carry its token" in answer
    status, answer = post(server.bare + "run_code", body, {"Authorization": "Bearer " + "x" * 43})
    assert (status, answer) == (403, "wrong token")
    status, answer = post(server.bare.rstrip("/") + "/" + "y" * 43 + "/run_code", body)
    assert status == 401
    status, answer = post(server.bare + "run_code", {"code": "print(5)", "language": "python"},
                          {"Authorization": f"Bearer {server.token}"})
    assert status == 200 and answer["run_result"]["stdout"] == "5\n"
    assert not planted.exists()


def test_a_body_over_the_bound_is_413_in_words(server):
    status, answer = post(server.url + "run_code", {"code": "#" * (3 << 20), "language": "python"})
    assert status == 413 and "over this server's" in answer["detail"] and "--max-body" in answer["detail"]


def test_a_thousand_requests_eight_at_once_none_lost_or_mixed_up(server):
    def one(i: int) -> tuple[int, str]:
        got = run_code(server, f"import sys\nprint({i})\nprint({i}, file=sys.stderr)\nsys.exit({i % 3})")
        return i, got

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = dict(pool.map(one, range(1000)))
    assert sorted(answers) == list(range(1000))
    wrong = {i: a for i, a in answers.items() if a["run_result"]["stdout"] != f"{i}\n"
             or a["run_result"]["stderr"] != f"{i}\n" or a["run_result"]["return_code"] != i % 3
             or a["status"] != ("Success" if i % 3 == 0 else "Failed")}
    assert wrong == {}


def test_a_batch_is_answered_in_order_and_hostile_samples_cost_only_their_own(server):
    rows = [*HOSTILE, LOOK]
    batch = [{"code": r["code"], "language": "python",
              "run_timeout": parse_duration(r.get("timeout", "10s"))} for r in rows]
    batch.append({"code": "print('after')", "language": "python"})
    status, answers = post(server.url + "run_batch", batch, timeout=CALL * 3)
    assert status == 200 and len(answers) == len(batch)
    got = {r["id"]: a for r, a in zip(rows, answers, strict=False)}
    assert got["fork-bomb"]["run_result"]["status"] == "TimeLimitExceeded"
    assert got["endless"]["run_result"]["status"] == "TimeLimitExceeded"
    assert got["kill-group"]["run_result"]["return_code"] == -signal.SIGKILL
    assert got["memory-bomb"]["status"] == "Failed"
    fill = got["fill-tmp"]  # its /tmp is full, or (tmpfs is memory) its memory limit is reached first
    assert "No space left on device" in fill["run_result"]["stderr"] or "memory limit" in fill["message"], fill
    assert got["plant"]["run_result"]["return_code"] == 9
    assert got["look"]["status"] == "Success", got["look"]  # nothing planted is visible to another
    assert answers[-1]["run_result"]["stdout"] == "after\n"
    status, answer = post(server.url + "run_batch", {"code": "1"})
    assert status == 422 and "a JSON array" in answer["detail"]


def test_past_the_queue_a_request_is_429_and_sigterm_drains_what_runs(tmp_path):
    with serving(tmp_path, "--parallel", "1", "--queue", "1", verbose=True) as s:
        answers: dict[int, tuple] = {}

        def slow(i: int) -> None:
            answers[i] = post(s.url + "run_code", {"code": f"import time\ntime.sleep(1.5)\nprint({i})",
                                                   "language": "python"})

        running = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
        for t in running:
            t.start()
        # One runs and one waits (the server says so with -v): a third has no room.
        assert wait_until(lambda: any("2 running or waiting" in line for line in s.log), CALL), s.log
        status, answer = post(s.url + "run_code", {"code": "print('third')", "language": "python"})
        assert status == 429 and "1 run and 1 wait; retry later" in answer["detail"]
        status, answer = post(s.url + "run_batch", [{"code": "1", "language": "python"}] * 3)
        assert status == 413 and "send smaller batches" in answer["detail"]  # (it could never be let in)
        # Connections past --parallel + --queue + 64 are answered 503 before they are read.
        host, port = s.url.split("/")[2].split(":")
        idle = [socket.create_connection((host, int(port)), timeout=CALL) for _ in range(1 + 1 + 64)]
        try:
            status, answer = post(s.url + "v1/ping", b"")
        finally:
            for conn in idle:
                conn.close()
        assert (status, answer) == (503, "Service Unavailable")
        below = descendants(s.proc.pid)
        s.proc.send_signal(signal.SIGTERM)
        for t in running:
            t.join(CALL)
        assert s.proc.wait(GONE) == 0
        assert {i: (a[0], a[1]["run_result"]["stdout"]) for i, a in answers.items()} == \
            {0: (200, "0\n"), 1: (200, "1\n")}
        assert wait_until(lambda: not [p for p in below if os.path.exists(f"/proc/{p}")], GONE)


def test_a_bind_beyond_loopback_warns(tmp_path):
    proc = subprocess.Popen([*AGENTLOOP, "serve", "--http", "0.0.0.0:0"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = read_line(proc.stderr, START)
        assert "warning: 0.0.0.0:0 is reachable beyond this machine" in first, first
        assert "serving SandboxFusion's /run_code" in read_line(proc.stderr, START)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(GONE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(GONE)
        proc.stderr.close()


def test_doctor_checks_a_running_service_and_never_prints_its_token(server):
    def doctor(url: str) -> subprocess.CompletedProcess:
        return subprocess.run([*AGENTLOOP, "doctor", "--serve", url], capture_output=True, text=True, timeout=CALL)

    fine = doctor(server.url)
    assert fine.returncode == 0, fine.stdout + fine.stderr
    assert "answers, and takes the token" in fine.stdout and "✓ runs a sample" in fine.stdout
    assert server.token not in fine.stdout + fine.stderr
    refused = doctor(server.bare)
    assert refused.returncode == 1 and "refuses the token (HTTP 401)" in refused.stdout


def test_a_sample_reaches_neither_the_server_nor_its_token(server):
    port = int(server.url.split(":")[2].split("/")[0])
    state = Path(server.log[-1].split("kept in ", 1)[1].split(";")[0])  # the token file, as the start line says
    attack = f"""
import os, signal, socket
def probe(name, fn):
    try:
        print(name, repr(fn())[:80])
    except Exception as exc:
        print(name, type(exc).__name__)
probe("token", lambda: open({str(state)!r}).read())
probe("state", lambda: os.listdir({str(state.parent)!r}))
probe("port", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2))
for pid in (1, os.getppid()):
    probe(f"kill {{pid}}", lambda: os.kill(pid, signal.SIGKILL))
    probe(f"environ {{pid}}", lambda: open(f"/proc/{{pid}}/environ", "rb").read())
"""
    got = run_code(server, attack)
    lines = dict(line.split(" ", 1) if not line.startswith(("kill", "environ")) else
                 (" ".join(line.split(" ", 2)[:2]), line.split(" ", 2)[2]) for line in
                 got["run_result"]["stdout"].splitlines())
    assert lines["token"] in ("FileNotFoundError", "PermissionError"), got
    assert "server-token" not in lines["state"], got  # (at most the skeleton of the runs' directory)
    assert lines["port"] in ("ConnectionRefusedError", "OSError", "TimeoutError"), got  # a network of its own
    for key in ("kill 1", "environ 1"):
        assert lines[key] in ("PermissionError", "ProcessLookupError", "FileNotFoundError"), got
    assert server.token not in json.dumps(got)
    assert run_code(server, "print('still serving')")["run_result"]["stdout"] == "still serving\n"


def test_token_file_names_the_token_and_one_others_may_read_is_refused(tmp_path):
    token = "t" * 40
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o644)
    refused = subprocess.run([*AGENTLOOP, "serve", "--http", "127.0.0.1:0", "--token-file", str(path)],
                             capture_output=True, text=True, timeout=START, cwd=tmp_path,
                             env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})
    assert refused.returncode == 125 and "must be yours and no one else's" in refused.stderr, refused.stderr
    path.chmod(0o600)
    with serving(tmp_path, "--token-file", str(path), token_file=path) as s:
        assert s.url.endswith(f"/{token}/")
        status, answer = post(s.bare + "run_code", {"code": "print(7)", "language": "python"},
                              {"Authorization": f"Bearer {token}"})
        assert status == 200 and answer["run_result"]["stdout"] == "7\n"
