"""`agentloop exec FILE` as a user runs it: a real process, a real sandbox, python's exit statuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.launch import descendants
from engine.sandbox import host_support

from .conftest import alive, processes_with, read_line, wait_until

#: ``-P``: the test's directory, which may hold a module named like one agentloop imports, is
#: not on agentloop's own path (the ``agentloop`` command never has it there).
AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]


def run_exec(tmp_path: Path, code: str, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    return subprocess.run([*AGENTLOOP, "exec", *args, "-"], input=code, capture_output=True, text=True,
                          cwd=tmp_path, env=environ, timeout=timeout)


def test_exec_finished(tmp_path):
    proc = run_exec(tmp_path, "import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "out\n", "err\n")


def test_exec_raised_prints_the_traceback(tmp_path):
    proc = run_exec(tmp_path, "print('before')\nraise ValueError('bad')")
    assert proc.returncode == 1
    assert proc.stdout == "before\n"
    assert 'File "<stdin>", line 2' in proc.stderr and "ValueError: bad" in proc.stderr


def test_exec_deadline_is_timeouts(tmp_path):
    # As timeout(1): SIGTERM at the deadline (the script's default disposition ends it), 124.
    started = time.monotonic()
    # (5 s: the script is asleep by then, however loaded the machine.)
    proc = run_exec(tmp_path, "import time\nprint('start', flush=True)\ntime.sleep(60)", "--timeout", "5s")
    assert proc.returncode == 124
    assert proc.stdout == "start\n"
    assert proc.stderr == "agentloop: the script ran past its --timeout of 5 s: stopped by SIGTERM\n"
    assert time.monotonic() - started < 30


def test_exec_deadline_kills_a_script_that_ignores_sigterm(tmp_path):
    # Started with SIGTERM ignored (nohup-style), the script keeps it ignored, as from a shell:
    # the deadline's SIGTERM does nothing and the sandbox is killed after the grace.
    (tmp_path / "s.py").write_text("import signal, time\nprint(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True)\n"
                                   "time.sleep(60)\n")
    started = time.monotonic()
    proc = subprocess.run([*AGENTLOOP, "exec", "--timeout", "2s", "s.py"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    assert proc.returncode == 124
    assert proc.stdout == "True\n"
    assert proc.stderr == "agentloop: the script ran past its --timeout of 2 s: killed after the 5 s grace\n"
    assert 6.5 < time.monotonic() - started < 60


def test_a_script_killed_by_a_signal_dies_of_it(tmp_path):
    proc = run_exec(tmp_path, "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert proc.returncode == -signal.SIGSEGV  # a shell shows 139, as for python
    assert (proc.stdout, proc.stderr) == ("bye\n", "")


def test_exec_json(tmp_path):
    proc = run_exec(tmp_path, "print('x' * 10)\nraise SystemExit(3)", "--json")
    assert proc.returncode == 3
    report = json.loads(proc.stdout)
    assert report["status"] == "error" and report["exit_code"] == 3 and report["signal"] is None
    assert set(report) == {"status", "exit_code", "signal", "duration_s", "message", "created"}
    assert proc.stderr == "x" * 10 + "\n"  # the script's stdout moves aside for the JSON


@pytest.mark.parametrize("args, words", [
    (["--timeout", "soon"], "250ms, 30s, 5m, 1h or plain seconds"),
    (["--memory", "lots"], "512M, 2G"),
    (["--bogus"], "No such option '--bogus'"),
    (["--workspace", "elsewhere"], "--workspace DIR goes with --read-only"),
    (["--keep-output"], "--keep-output and --max-output are for workers"),
    (["--max-output", "2G"], "--keep-output and --max-output are for workers"),
    (["--preload", "json"], "--preload is for workers"),
])
def test_usage_errors_are_agentloops_own(tmp_path, args, words):
    # One line and 125: never the 2 of a script's own argparse error; an unknown option is
    # never taken for the file.
    proc = run_exec(tmp_path, "print('ran')", *args)
    assert proc.returncode == 125 and proc.stdout == ""
    assert proc.stderr.startswith("agentloop: ") and words in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_a_file_that_is_not_there_is_agentloops_error(tmp_path):
    proc = subprocess.run([*AGENTLOOP, "exec", "nowhere.py"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=60)
    assert (proc.returncode, proc.stderr) == (125, "agentloop: cannot open nowhere.py: No such file or directory\n")


def test_exec_from_file(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print(sum(range(10)))")
    proc = subprocess.run([*AGENTLOOP, "exec", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == "45\n"


def test_a_file_of_26_mb_runs(tmp_path):
    # python reads a file of any size; nothing of ours sits between (no frame limit).
    script = tmp_path / "big.py"
    script.write_text("DATA = '" + "x" * (26 * 1024 * 1024) + "'\nprint(len(DATA))\n")
    proc = subprocess.run([*AGENTLOOP, "exec", "big.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{26 * 1024 * 1024}\n", "")


def test_stdin_from_a_file_is_the_file(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"\x00\x01" * 1000)
    code = "import os, sys\nst = os.fstat(0)\nprint(st.st_size, os.lseek(0, 0, os.SEEK_END), len(sys.stdin.buffer.read()))\n"
    (tmp_path / "s.py").write_text(code)
    with open(tmp_path / "data.bin", "rb") as f:
        proc = subprocess.run([*AGENTLOOP, "exec", "s.py"], stdin=f, capture_output=True, text=True, cwd=tmp_path,
                              timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "2000 2000 0\n"), proc.stderr


def test_head_closes_the_pipe_and_agentloop_says_nothing(tmp_path):
    (tmp_path / "many.py").write_text("import signal\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
                                      "for i in range(10**6):\n    print(i)\n")
    proc = subprocess.run(["bash", "-c", f"{' '.join(AGENTLOOP)} exec many.py | head -n 2; echo ${{PIPESTATUS[0]}}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.stdout == "0\n1\n141\n" and proc.stderr == ""


def test_the_environment_passes_through_but_its_secrets(tmp_path):
    (tmp_path / "agentloop.toml").write_text('[models.x]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n'
                                            'api_key_env = "VENDOR_CREDS"\n')
    code = ("import os\nfor k in ('MYAPP_MODE', 'OPENAI_API_KEY', 'GITHUB_TOKEN', 'DB_PASSWORD', 'aws_secret',"
            " 'LLM_API_KEY', 'VENDOR_CREDS', 'PASSED_TOKEN', 'SET_HERE'):\n    print(k, os.environ.get(k))\n")
    env = {"MYAPP_MODE": "fast", "OPENAI_API_KEY": "sk-1", "GITHUB_TOKEN": "gh", "DB_PASSWORD": "pw",
           "aws_secret": "s", "LLM_API_KEY": "k", "VENDOR_CREDS": "v", "PASSED_TOKEN": "passed"}
    proc = run_exec(tmp_path, code, "--env", "PASSED_TOKEN", "--env", "SET_HERE=yes", **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["MYAPP_MODE fast", "OPENAI_API_KEY None", "GITHUB_TOKEN None",
                                        "DB_PASSWORD None", "aws_secret None", "LLM_API_KEY None",
                                        "VENDOR_CREDS None", "PASSED_TOKEN passed", "SET_HERE yes"]


def test_the_script_writes_the_current_directory_as_the_user(tmp_path):
    # Files are the caller's, and the directory's own owner and mode do not change.
    project = tmp_path / "project"
    project.mkdir(mode=0o751)
    project.chmod(0o751)
    before = project.stat()
    (project / "w.py").write_text("import os\nopen('out.txt', 'w').write('x')\nos.mkdir('made')\n"
                                  "print(sorted(os.listdir('.')))\n")
    proc = subprocess.run([*AGENTLOOP, "exec", "w.py"], capture_output=True, text=True, cwd=project, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "['made', 'out.txt', 'w.py']\n"), proc.stderr
    after = project.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)
    for name in ("out.txt", "made"):
        st = (project / name).stat()
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())


def test_read_only_restores_the_strict_rule(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "w.py").write_text("open('files/ok.txt', 'w').write('ok')\nopen('out.txt', 'w')\n")
    proc = subprocess.run([*AGENTLOOP, "exec", "--read-only", "w.py"], capture_output=True, text=True, cwd=project,
                          timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("OSError: [Errno 30] Read-only file system: 'out.txt'")
    assert (project / "files" / "ok.txt").read_text() == "ok"
    # Nothing written: no ./files left behind.
    (project / "n.py").write_text("print('nothing')\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "n.py").write_text("print('nothing')\n")
    proc = subprocess.run([*AGENTLOOP, "exec", "--read-only", "n.py"], capture_output=True, text=True, cwd=other,
                          timeout=60)
    assert proc.returncode == 0 and sorted(os.listdir(other)) == ["n.py"]


def test_a_home_directory_is_not_written_whole(tmp_path):
    proc = subprocess.run([*AGENTLOOP, "exec", "-"], input="print(1)\n", capture_output=True, text=True,
                          cwd=os.path.expanduser("~"), timeout=60)
    assert proc.returncode == 125
    assert "home directory" in proc.stderr and "--read-only" in proc.stderr


def test_exec_limits_are_settable(tmp_path):
    proc = run_exec(tmp_path, "x = bytearray(300 * 1024 * 1024)", "--memory", "100M")
    assert proc.returncode == 1 and "MemoryError" in proc.stderr
    fine = run_exec(tmp_path, "x = bytearray(30 * 1024 * 1024); print('fits')", "--memory", "200M")
    assert fine.returncode == 0 and fine.stdout == "fits\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="a memory cgroup needs root (or a delegated subtree)")
def test_a_memory_cgroup_kill_is_said(tmp_path):
    # /dev/shm escapes RLIMIT_DATA, not the cgroup: the kernel kills, agentloop says why.
    code = "data = b'x' * (8 << 20)\nwith open('/dev/shm/fill', 'wb') as f:\n    for _ in range(64):\n        f.write(data)\n"
    proc = run_exec(tmp_path, code, "--memory", "128M")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stderr.endswith("agentloop: the script was killed: over its memory limit (--memory)\n")


def test_sigterm_reaches_the_script_and_agentloop_dies_as_it_did(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGUSR1, lambda *a: print('usr1', flush=True))\n"
                      "print('ready', flush=True)\nwhile True:\n    time.sleep(1)\n")
    proc = subprocess.Popen([*AGENTLOOP, "exec", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert read_line(proc.stdout, 60) == "ready\n"
        proc.send_signal(signal.SIGUSR1)
        assert read_line(proc.stdout, 60) == "usr1\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def _clean_up(proc: subprocess.Popen, token: str) -> None:
    """Whatever a failed test left: the command, and every process carrying ``token``."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in processes_with(token):
        os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_exec_leaves_no_process_behind(tmp_path):
    token = f"77{os.getpid()}{int(time.time()) % 100000}"
    script = tmp_path / "daemon.py"
    script.write_text("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                      f"        os.execvp('sh', ['sh', '-c', 'touch started; exec sleep {token}'])\n    os._exit(0)\n"
                      "while not os.path.exists('started'):\n    time.sleep(0.05)\n"
                      "print('ready', flush=True)\ntime.sleep(1000)\n")
    proc = subprocess.Popen([*AGENTLOOP, "exec", str(script)], stdout=subprocess.PIPE, cwd=tmp_path, text=True)
    try:
        assert read_line(proc.stdout, 60) == "ready\n"
        assert wait_until(lambda: processes_with(token), 60)  # (the daemon has started: it exec's sleep)
        before = set(descendants(proc.pid))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if host_support().bwrap is None:  # (without a PID namespace a daemon outlives us: README)
            before -= set(processes_with(token))
        assert wait_until(lambda: not [p for p in before if alive(p)], 10), "the sandbox outlived agentloop"
    finally:
        _clean_up(proc, token)


COORDINATOR = """
import asyncio, sys
from engine.workers import Engine
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
        _clean_up(proc, token)


# -- at a terminal ------------------------------------------------------------------------------

def _at_a_terminal(argv: list[str], cwd: Path, keys: list[tuple[bytes, bytes]] = ()) -> tuple[bytes, int]:
    """Run ``argv`` with a terminal of 40 rows and 132 columns as its stdin, stdout and stderr;
    ``keys``: (what to wait for on the screen, what to type then)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
        os.chdir(cwd)
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        os.execve(argv[0], argv, env)
    out = b""
    todo = list(keys)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if todo and todo[0][0] in out:
            os.write(fd, todo.pop(0)[1])
            out += b"\0"  # (a screen's later text is looked for after this point)
            continue
        if not select.select([fd], [], [], 1)[0]:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child and everything it started closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return out.replace(b"\0", b""), os.waitstatus_to_exitcode(status)


TERMINAL = ("import os, shutil, sys\n"
            "print(sys.stdout.isatty(), sys.stderr.isatty(), os.isatty(1), shutil.get_terminal_size())\n"
            "print('line one\\nline two')\n")


def _both_at_a_terminal(tmp_path: Path, code: str, keys=()) -> tuple[tuple[bytes, int], tuple[bytes, int]]:
    tmp_path.chmod(0o755)
    script = tmp_path / "script.py"
    script.write_text(code)
    direct = _at_a_terminal([sys.executable, str(script)], tmp_path, keys)
    ours = _at_a_terminal([*AGENTLOOP, "exec", str(script)], tmp_path, keys)
    return direct, ours


def test_exec_at_a_terminal_gives_the_code_a_terminal(tmp_path):
    # As under python at the same terminal: isatty() true, the terminal's size, lines as written.
    direct, ours = _both_at_a_terminal(tmp_path, TERMINAL)
    assert direct == (b"True True True os.terminal_size(columns=132, lines=40)\r\nline one\r\nline two\r\n", 0)
    # (A layer this machine does not give this user is said first, in one line: a plain user's
    # memory cgroup, where none is delegated.)
    said = b"".join(line for line in ours[0].splitlines(True) if not line.startswith(b"agentloop: sandbox: "))
    assert (said, ours[1]) == direct
    # Piped (or --json), the code gets pipes, as under python.
    piped = run_exec(tmp_path, TERMINAL)
    assert piped.stdout.startswith("False False False")


def test_input_at_a_terminal(tmp_path):
    # Keystrokes reach input(); the echo and the line editing are the terminal's (a backspace).
    code = "name = input('name? ')\nprint(f'hello {name}!')\nprint(repr(input('more? ')))\n"
    direct, ours = _both_at_a_terminal(tmp_path, code, [(b"name? ", b"Bobx\x7f\r"), (b"more? ", b"\x04")])
    assert direct[1] == 1 and b"hello Bob!" in direct[0] and b"EOFError" in direct[0]
    assert ours == direct


def test_ctrl_c_typed_at_a_terminal(tmp_path):
    code = ("import time\ntry:\n    print('ready', flush=True)\n    while True:\n        time.sleep(1)\n"
            "except KeyboardInterrupt:\n    print('interrupted')\n    raise SystemExit(5)\n")
    direct, ours = _both_at_a_terminal(tmp_path, code, [(b"ready\r\n", b"\x03")])
    assert direct == (b"ready\r\n^C" + b"interrupted\r\n", 5)
    assert ours == direct


def test_a_progress_bar_redraws_its_line(tmp_path):
    code = "import sys\nfor i in range(3):\n    sys.stdout.write(f'\\r{i}/2 [' + '#' * i + ']\\b')\nprint()\n"
    direct, ours = _both_at_a_terminal(tmp_path, code)
    assert direct == (b"\r0/2 []\b\r1/2 [#]\b\r2/2 [##]\b\r\n", 0)
    assert ours == direct


def test_without_bubblewrap_the_script_runs_and_leaves_nothing_of_the_sandbox(tmp_path):
    # Landlock alone: no private /tmp, so $TMPDIR is a .tmp in the directory, gone again after.
    from engine.sandbox import host_support as support

    if support().landlock_abi < 1:
        pytest.skip("no Landlock here")
    (tmp_path / "w.py").write_text("import os, tempfile\nopen('out.txt', 'w').write('x')\n"
                                   "print(tempfile.gettempdir() == os.path.abspath('.tmp'), os.getpid() > 2)\n"
                                   "raise SystemExit(4)\n")
    proc = subprocess.run([*AGENTLOOP, "exec", "--sandbox", "landlock", "w.py"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (4, "True True\n", "")
    assert sorted(os.listdir(tmp_path)) == ["out.txt", "w.py"]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def test_a_stopped_script_stops_agentloop_and_fg_continues_both(tmp_path):
    # Ctrl-Z at a shell (SIGTSTP to the job): the script stops, then agentloop, as the job's
    # one process would; SIGCONT (fg) continues both, and the script goes on to its end.
    (tmp_path / "go.py").write_text("import os, time\nprint(os.getpid(), flush=True)\n"
                                    "while not os.path.exists('go'):\n    time.sleep(0.05)\nprint('went')\n")
    proc = subprocess.Popen([*AGENTLOOP, "exec", "go.py"], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert read_line(proc.stdout, 60) == "2\n"  # (its PID in its namespace)
        script = next(p for p in descendants(proc.pid) if open(f"/proc/{p}/cmdline").read().split("\0")[1] == "go.py")
        proc.send_signal(signal.SIGTSTP)
        assert wait_until(lambda: _state(script) == "T" and _state(proc.pid) == "T", 30)
        (tmp_path / "go").touch()
        time.sleep(0.3)  # (not a synchronisation: stopped, it must not have seen the file go by)
        assert _state(script) == "T"
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(60) == 0
        assert proc.stdout.read() == "went\n"
    finally:
        proc.kill()
        proc.wait()


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
    proc = run_exec(tmp_path, "print('hi')", "--read-only", "--workspace", str(made))
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "new").exists()  # nothing was written: nothing is left
    kept = run_exec(tmp_path, f"open({str(made / 'x.txt')!r}, 'w').write('x')", "--read-only", "--workspace", str(made))
    assert kept.returncode == 0, kept.stderr
    assert (made / "x.txt").read_text() == "x"


def test_exec_is_python_without_displays(tmp_path):
    """``exec FILE`` runs as ``python FILE``: no ``display``, matplotlib's own default backend
    (``plt.show()`` shows nothing), ``Image.show()`` Pillow's own."""
    pytest.importorskip("matplotlib")
    code = ("import builtins, matplotlib\nprint('display' in globals() or hasattr(builtins, 'display'))\n"
            "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nprint(matplotlib.get_backend())\n"
            "from PIL import ImageShow\nprint(type(ImageShow._viewers[0]).__module__ if ImageShow._viewers else None)")
    proc = run_exec(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "False" and lines[1].lower() == "agg" and lines[2] != "worker.display", proc.stdout
