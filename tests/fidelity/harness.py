"""Running one script both ways: ``python FILE ARGS`` and ``agentloop exec FILE ARGS``.

A case of the corpus is a directory holding the script and whatever it reads or imports; the
script's first comment lines say how it is run and what python shows:

    # args: a "b c"            its arguments (shell words)
    # stdin: 'text\\n'          its stdin (a Python literal; default: empty)
    # stdin-file: data.txt      its stdin redirected from this file of the case
    # cwd: data                 run from this directory of the case (default: the case's own)
    # run: tools/report.py      the script (default: main.py)
    # env: NAME=VALUE           a variable set for both runs
    # pipe: head -n 1           its stdout goes through this command
    # merge-stderr              2>&1
    # send: SIGTERM             sent once the script printed a line ``ready``
    # expect-exit: 0            what python exits with (128+N for signal N; default 0)
    # expect-stdout: 'text'     python's stdout holds this (Python literal; repeatable)
    # expect-stderr: 'text'     python's stderr holds this
    # expect-file: out.json     the script leaves this file
    # piped-only                no terminal variant (the script's point is a pipe)
    # read-only: tools          a directory exec shows read-only where python writes (the
                                script's own, outside the current directory): what python
                                writes there (its bytecode cache) is left out of the comparison

Both runs happen one after the other in the same directory, restored in between, so paths in
tracebacks are the same; what is compared is stdout, stderr, the exit status and every file
left in the directory (type, mode, owner, content).  The expectations are checked against
python's run, so that both sides doing nothing cannot pass.

Variants: as the user running the tests and as ``nobody`` (root only, through ``setpriv``, with
the system's Python and this checkout on PYTHONPATH), piped and at a terminal (stdout and stderr
on a pty, cooked as a terminal is; stdin piped, so it is not read at the terminal).
"""

from __future__ import annotations

import ast
import hashlib
import os
import pty
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY_PATH = f"{REPO}:{sysconfig.get_paths()['purelib']}"
WAIT = 120.0  # seconds: the bound on one run
SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL")


@dataclass
class Case:
    """One script of the corpus and how it is run."""

    name: str
    source: Path  # the case's directory
    run: str = "main.py"
    cwd: str = "."
    args: list[str] = field(default_factory=list)
    stdin: bytes = b""
    stdin_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    pipe: list[str] | None = None
    merge_stderr: bool = False
    send: int | None = None
    piped_only: bool = False
    expect_exit: int = 0
    expect_stdout: list[bytes] = field(default_factory=list)
    expect_stderr: list[bytes] = field(default_factory=list)
    expect_files: list[str] = field(default_factory=list)
    read_only: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, directory: Path) -> Case:
        case = cls(directory.name, directory)
        script = directory / "main.py"
        lines = script.read_bytes().decode("utf-8", "replace").splitlines() if script.exists() else []
        run_line = next((line for line in lines if line.startswith("# run: ")), None)
        if run_line:
            case.run = run_line.removeprefix("# run: ").strip()
            lines = (directory / case.run).read_text().splitlines()
        for line in lines:
            if not line.startswith("# "):
                break
            key, _, value = line[2:].partition(":")
            value = value.strip()
            if key == "args":
                case.args = shlex.split(value)
            elif key == "stdin":
                case.stdin = _literal(value)
            elif key == "stdin-file":
                case.stdin_file = value
            elif key == "cwd":
                case.cwd = value
            elif key == "env":
                name, _, text = value.partition("=")
                case.env[name] = text
            elif key == "pipe":
                case.pipe = shlex.split(value)
            elif key == "merge-stderr":
                case.merge_stderr = True
            elif key == "send":
                case.send = int(getattr(signal, value))
            elif key == "piped-only":
                case.piped_only = True
            elif key == "expect-exit":
                case.expect_exit = int(value)
            elif key == "expect-stdout":
                case.expect_stdout.append(_literal(value))
            elif key == "expect-stderr":
                case.expect_stderr.append(_literal(value))
            elif key == "expect-file":
                case.expect_files.append(value)
            elif key == "read-only":
                case.read_only.append(value)
        return case


def _literal(text: str) -> bytes:
    value = ast.literal_eval(text)
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value


@dataclass(frozen=True)
class Outcome:
    stdout: bytes
    stderr: bytes
    exit: int
    files: tuple

    def expectation_problems(self, case: Case, terminal: bool) -> list[str]:
        """What python's run should show but does not (the case's own check of itself).  At a
        terminal both streams are the terminal's, whose newlines are ``\\r\\n``."""
        out, err = self.stdout, self.stderr
        if terminal:
            out = err = out.replace(b"\r\n", b"\n")
        problems = [f"exit {self.exit}, expected {case.expect_exit}"] if self.exit != case.expect_exit else []
        problems += [f"stdout lacks {t!r}" for t in case.expect_stdout if t not in out]
        problems += [f"stderr lacks {t!r}" for t in case.expect_stderr if t not in err]
        names = {entry[0] for entry in self.files}
        problems += [f"no file {f}" for f in case.expect_files if f not in names]
        return problems


def nobody_problem() -> str | None:
    """Why the tests cannot run as ``nobody`` here, or None."""
    if os.geteuid() != 0:
        return "not root: the tests run as this (unprivileged) user already"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) is not installed"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing"
    same = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True, timeout=WAIT).stdout.strip()
    if same != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}"
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", SYSTEM_PYTHON,
                            "-c", "import engine.cli.exec, click"], cwd="/", capture_output=True, timeout=WAIT,
                           env={"PYTHONPATH": NOBODY_PATH, "PATH": "/usr/bin:/bin"})
    if probe.returncode != 0:
        return f"nobody cannot import this project: {probe.stderr.decode()[-200:]}"
    return None


class Runner:
    """Runs cases in one variant: ``user`` (``self`` or ``nobody``), ``terminal`` (bool)."""

    def __init__(self, base: Path, user: str, terminal: bool) -> None:
        self.base, self.user, self.terminal = base, user, terminal
        self.python = sys.executable if user == "self" else SYSTEM_PYTHON
        # Python's defaults (no PYTHONUNBUFFERED and the like), and nothing exec would hold back.
        env = {k: v for k, v in os.environ.items() if not any(w in k.upper() for w in SECRET_WORDS)
               and not k.startswith(("PYTHON", "PYTEST", "COLUMNS", "LINES"))}
        env["XDG_STATE_HOME"] = str(base / f"state-{user}")
        env.pop("VIRTUAL_ENV", None)
        env.pop("AGENTLOOP_PYTHON", None)
        if user == "nobody":
            env["PYTHONPATH"] = NOBODY_PATH
        self.env = env

    def both(self, case: Case) -> tuple[Outcome, Outcome]:
        """python's outcome, then agentloop's, in the same directory."""
        where = self.base / f"{case.name}-{self.user}-{'tty' if self.terminal else 'pipe'}"
        python = self._once(case, where, [self.python])
        # (-P: the case's directory, which may hold an engine.py of its own, is not on agentloop's path.)
        ours = self._once(case, where, [self.python, "-P", "-m", "engine.cli", "exec",
                                        *(["--color"] if self.terminal else [])])
        return python, ours

    def _once(self, case: Case, where: Path, command: list[str]) -> Outcome:
        if where.exists():
            shutil.rmtree(where)
        shutil.copytree(case.source, where, symlinks=True)
        if self.user == "nobody":
            for path in [where, *where.rglob("*")]:
                os.lchown(path, NOBODY, NOBODY)
        cwd = where / case.cwd
        script = os.path.relpath(where / case.run, cwd)
        argv = [*command, script, *case.args]
        if self.user == "nobody":
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        env = {**self.env, **case.env}
        stdout, stderr, code = self._run(case, argv, cwd, env, where)
        files = tuple(e for e in snapshot(where)
                      if not any(e[0].startswith(f"{d}/__pycache__") for d in case.read_only))
        return Outcome(stdout, stderr, code, files)

    def _run(self, case: Case, argv: list[str], cwd: Path, env: dict, where: Path) -> tuple[bytes, bytes, int]:
        stdin = open(where / case.stdin_file, "rb") if case.stdin_file else subprocess.PIPE  # noqa: SIM115
        master = slave = None
        if self.terminal and not case.piped_only:
            master, slave = pty.openpty()
            out_target = err_target = slave
        else:
            out_target = subprocess.PIPE
            err_target = subprocess.STDOUT if case.merge_stderr else subprocess.PIPE
        try:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=out_target, stderr=err_target, cwd=cwd, env=env)
        finally:
            if slave is not None:
                os.close(slave)
            if stdin is not subprocess.PIPE:
                stdin.close()
        head = None
        if case.pipe and master is None:
            head = subprocess.Popen(case.pipe, stdin=proc.stdout, stdout=subprocess.PIPE)
            proc.stdout.close()
        collected = _Collector(master if master is not None else (head or proc).stdout,
                               None if master is not None or case.merge_stderr else proc.stderr)
        try:
            if proc.stdin is not None:
                threading.Thread(target=_feed, args=(proc.stdin, case.stdin), daemon=True).start()
            if case.send is not None:
                marker = b"ready\r\n" if master is not None else b"ready\n"
                assert collected.wait_for(marker, WAIT), f"{case.name}: no 'ready' line"
                proc.send_signal(case.send)
            proc.wait(WAIT)
            if head is not None:
                head.wait(WAIT)
            out, err = collected.finish()
        finally:
            for p in (proc, head):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            if master is not None:
                os.close(master)
        code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode
        return out, err, code


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the script never read it
        pass


class _Collector:
    """Reads a stdout (a pipe or a pty master) and a stderr pipe to their ends, in threads."""

    def __init__(self, out, err) -> None:
        self.out, self.err = bytearray(), bytearray()
        self._changed = threading.Condition()
        self._threads = [threading.Thread(target=self._read, args=(out, self.out), daemon=True)]
        if err is not None:
            self._threads.append(threading.Thread(target=self._read, args=(err, self.err), daemon=True))
        for t in self._threads:
            t.start()

    def _read(self, source, into: bytearray) -> None:
        fd = source if isinstance(source, int) else source.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            with self._changed:
                into += chunk
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, marker: bytes, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: marker in self.out or not self._threads[0].is_alive(), timeout) \
                and marker in self.out

    def finish(self) -> tuple[bytes, bytes]:
        for t in self._threads:
            t.join(WAIT)
        return bytes(self.out), bytes(self.err)


def snapshot(top: Path) -> tuple:
    """Every entry below ``top`` (``top`` itself as ``.``): its type, mode, owner and content."""
    entries = []
    for path in [top, *sorted(top.rglob("*"))]:
        st = path.lstat()
        rel = "." if path == top else str(path.relative_to(top))
        if stat.S_ISLNK(st.st_mode):
            content = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            content = ""
        entries.append((rel, stat.filemode(st.st_mode), st.st_uid, st.st_gid, content))
    return tuple(entries)


