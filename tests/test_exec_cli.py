"""`agentloop exec` as a user runs it: a real process, real workers, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine._process import descendants

from .conftest import alive, processes_with, read_line, wait_until

AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def run_exec(tmp_path: Path, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    return subprocess.run([*AGENTLOOP, "exec", *args, "-"], input=code, capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=timeout)


def test_exec_finished(tmp_path):
    proc = run_exec(tmp_path, "import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert proc.returncode == 0
    assert proc.stdout == "out\n"
    assert proc.stderr.endswith("err\n")


def test_exec_raised_prints_the_traceback(tmp_path):
    proc = run_exec(tmp_path, "print('before')\nraise ValueError('bad')")
    assert proc.returncode == 1
    assert proc.stdout == "before\n"
    assert 'File "<stdin>", line 2' in proc.stderr and "ValueError: bad" in proc.stderr


def test_exec_deadline(tmp_path):
    started = time.monotonic()
    proc = run_exec(tmp_path, "import time; time.sleep(60)", "--timeout", "500ms")
    assert proc.returncode == 124
    assert "timed out after 0.5 s" in proc.stderr
    assert time.monotonic() - started < 30


def test_exec_worker_signal(tmp_path):
    # A core-dumping signal is taken by the worker's main thread while the block runs in
    # another: the block waits for it, as a single-threaded script would not need to.
    proc = run_exec(tmp_path, "import os, signal, time; os.kill(os.getpid(), signal.SIGSEGV); time.sleep(30)")
    assert proc.returncode == 128 + 11
    assert "worker died: signal 11 (SIGSEGV)" in proc.stderr


def test_exec_json(tmp_path):
    proc = run_exec(tmp_path, "print('x' * 10)", "--json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["status"] == "ok" and report["exit_code"] == 0
    assert report["output_bytes"] == 11 and report["truncated"] is False
    assert set(report) == {"status", "exit_code", "duration_s", "output_bytes", "truncated", "output_file"}
    assert "xxxxxxxxxx" in proc.stderr  # the code's stdout moves aside for the JSON


def test_exec_bad_duration_is_a_usage_error(tmp_path):
    proc = run_exec(tmp_path, "pass", "--timeout", "soon")
    assert proc.returncode == 2
    assert "250ms, 30s, 5m, 1h or plain seconds" in proc.stderr


def test_exec_own_error(tmp_path):
    (tmp_path / "blocker").write_text("")
    proc = run_exec(tmp_path, "pass", "--workspace", str(tmp_path / "blocker" / "ws"))
    assert proc.returncode == 125
    assert proc.stderr.startswith("agentloop: ") and "Traceback" not in proc.stderr


def test_exec_from_file(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print(sum(range(10)))")
    proc = subprocess.run([*AGENTLOOP, "exec", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "45\n"


COORDINATOR = """
import asyncio, sys
from engine.engine import Engine
DAEMON = ("import os\\n"
          "if os.fork() == 0:\\n"
          "    os.setsid()\\n"
          "    if os.fork() == 0:\\n"
          "        os.execvp('sleep', ['sleep', '{token}'])\\n"
          "    os._exit(0)\\n")
async def main():
    engine = Engine()
    engine.open()
    for _ in range(2):
        w = await engine.start_worker()
        await w.run(DAEMON)
        asyncio.ensure_future(w.run("import time; time.sleep(1000)", timeout=1000))
    print("ready", flush=True)
    await asyncio.sleep(1000)
asyncio.run(main())
"""


def test_coordinator_sigkill_leaves_no_process_behind(tmp_path):
    token = f"77{os.getpid()}{int(time.time()) % 100000}"
    script = tmp_path / "coord.py"
    script.write_text(COORDINATOR.replace("{token}", token))
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=tmp_path, env=env, text=True)
    try:
        assert read_line(proc.stdout, 60).strip() == "ready"
        assert wait_until(lambda: len(processes_with(token)) == 2, 10)
        before = set(descendants(proc.pid))  # bwrap, its init, the workers, the daemons
        assert set(processes_with("; from worker.")) & before
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        assert wait_until(lambda: not processes_with(token), 5), "daemons survived the coordinator"
        assert wait_until(lambda: not [p for p in before if alive(p)], 5), "workers survived the coordinator"
        assert time.monotonic() - started < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_with(token):
            os.kill(pid, signal.SIGKILL)


def test_exec_limits_are_settable(tmp_path):
    proc = run_exec(tmp_path, "x = bytearray(300 * 1024 * 1024)", "--memory", "100M")
    assert proc.returncode == 1 and "MemoryError" in proc.stderr
    fine = run_exec(tmp_path, "x = bytearray(30 * 1024 * 1024); print('fits')", "--memory", "200M")
    assert fine.returncode == 0 and fine.stdout == "fits\n"
    bad = run_exec(tmp_path, "pass", "--memory", "lots")
    assert bad.returncode == 2 and "512M, 2G" in bad.stderr


TERMINAL = ("import os, shutil, sys\n"
            "print(sys.stdout.isatty(), sys.stderr.isatty(), os.isatty(1), shutil.get_terminal_size())\n"
            "print('line one\\nline two')\n")


def _at_a_terminal(argv: list[str], cwd: Path) -> tuple[bytes, int]:
    """Run ``argv`` with a terminal of 40 rows and 132 columns as its stdin, stdout and stderr."""
    import fcntl
    import pty
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
        os.chdir(cwd)
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        os.execve(argv[0], argv, env)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child and everything it started closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return out, os.waitstatus_to_exitcode(status)


def test_exec_at_a_terminal_gives_the_code_a_terminal(tmp_path):
    # As under python at the same terminal: isatty() true, the terminal's size, lines as written.
    tmp_path.chmod(0o755)  # shown to the workers, so no note about it
    script = tmp_path / "tty.py"
    script.write_text(TERMINAL)
    direct = _at_a_terminal([sys.executable, str(script)], tmp_path)
    ours = _at_a_terminal([sys.executable, "-m", "engine.cli", "exec", str(script)], tmp_path)
    assert direct == (b"True True True os.terminal_size(columns=132, lines=40)\r\nline one\r\nline two\r\n", 0)
    assert ours == direct
    # Piped (or --json), the code gets pipes, as under python.
    piped = run_exec(tmp_path, TERMINAL)
    assert piped.stdout.startswith("False False False")


def test_an_unprivileged_exec_adds_nothing_to_the_codes_stderr(unprivileged):
    """As a plain user (no writable cgroup here, as for most), the code's stderr is python's,
    byte for byte: how this machine bounds workers is for ``doctor`` and ``-v``, not every run."""
    project = unprivileged.home / "project"
    project.mkdir()
    (project / "script.py").write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n")
    unprivileged.own(project, project / "script.py")
    env = {**unprivileged.env, "XDG_STATE_HOME": str(unprivileged.home / "state")}
    python = subprocess.run([*unprivileged.python, "script.py"], capture_output=True, text=True, cwd=project,
                            timeout=60)
    ours = subprocess.run([*unprivileged.agentloop, "exec", "script.py"], capture_output=True, text=True,
                          cwd=project, env=env, timeout=60)
    assert (ours.returncode, ours.stdout, ours.stderr) == (python.returncode, python.stdout, python.stderr) \
        == (3, "out\n", "err\n"), ours.stderr
    verbose = subprocess.run([*unprivileged.agentloop, "-v", "exec", "script.py"], capture_output=True, text=True,
                             cwd=project, env=env, timeout=60)
    if "no memory cgroup" not in verbose.stderr:
        pytest.skip(reason="this user has a writable memory cgroup here: no detail to say")
    assert verbose.stderr.count("no memory cgroup") == 1


def test_a_workspace_made_for_the_run_goes_with_its_parents_unless_written(tmp_path):
    made = tmp_path / "new" / "deeper" / "ws"
    proc = run_exec(tmp_path, "print('hi')", "--workspace", str(made))
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "new").exists()  # nothing was written: nothing is left
    kept = run_exec(tmp_path, f"open({str(made / 'x.txt')!r}, 'w').write('x')", "--workspace", str(made))
    assert kept.returncode == 0, kept.stderr
    assert (made / "x.txt").read_text() == "x"
