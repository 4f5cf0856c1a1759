"""Helpers of the attack suite: run model code as an attack, read its probes, drive the agent loop."""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.agent import RunResult, run_task
from engine.models import ModelConfig, ModelRegistry
from engine.results import BlockResult
from engine.sandbox import host_support
from engine.scripted import ScriptedServer
from engine.workers import Engine, Worker
from tests.conftest import processes_with, wait_until

#: The bound on every wait in this suite, in seconds.
WAIT = 30.0
#: How a probe reports a path the sandbox's mount and PID namespaces leave out entirely.
ABSENT = "FileNotFoundError ENOENT"
#: The coordinator's model key for the whole session: model code must never see it.
API_KEY = "sk-agentloop-test-" + secrets.token_hex(16)
#: Other credentials a coordinator typically holds in its environment.
OTHER_SECRETS = {"OPENAI_API_KEY": "sk-openai-" + secrets.token_hex(12),
                 "AWS_SECRET_ACCESS_KEY": "aws-" + secrets.token_hex(12)}


@dataclass
class Host:
    """Real targets on the host, all under the test's tmp directory.

    ``cwd`` is the project (shared read-only), ``workspace`` the worker's writable directory,
    ``outside`` a host directory that is neither, ``alice`` another user's home holding a
    private key.  ``token`` is unique to the test: it names files and marks processes."""

    root: Path
    cwd: Path
    workspace: Path
    state: Path
    outside: Path
    alice: Path
    alice_key: Path
    alice_secret: str
    token: str = field(default_factory=lambda: "agentloop-attack-" + secrets.token_hex(6))


def needs_namespaces() -> None:
    """Skip when bubblewrap cannot build namespaces here: the outcome asserted is theirs."""
    support = host_support()
    if support.bwrap is None:
        pytest.skip(reason=f"no PID/network/mount namespace on this host: {support.bwrap_problem}")


# -- running attacks -----------------------------------------------------------------------

#: Prepended to every attack: ``probe(name, fn)`` runs one attempt and prints
#: ``name: ok VALUE`` or ``name: ExceptionType ERRNO`` — the words the tests assert on.
PRELUDE = '''\
import ctypes as _ctypes
import errno as _errno
import os as _os

_libc = _ctypes.CDLL(None, use_errno=True)


def probe(name, fn):
    try:
        value = fn()
    except Exception as exc:
        code = getattr(exc, "errno", None)
        words = type(exc).__name__
        if isinstance(code, int):
            words += " " + _errno.errorcode.get(code, str(code))
    else:
        words = "ok" if value is None else "ok " + repr(value)[:300]
    print(name + ": " + words, flush=True)


def libc(fn_name, *args):
    """Call a libc function; -1 becomes OSError(errno), as os.* functions do."""
    result = getattr(_libc, fn_name)(*args)
    if result == -1:
        code = _ctypes.get_errno()
        raise OSError(code, _os.strerror(code))
    return result
'''

_PROBE_LINE = re.compile(r"^([\w./:=-]+): (.*)$", re.M)


@dataclass
class Attack:
    """An attack's result and its probe lines by name."""

    result: BlockResult
    probes: dict[str, str]

    def __getitem__(self, name: str) -> str:
        return self.probes[name]


def probes_in(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _PROBE_LINE.finditer(text)}


async def attack(worker: Worker, code: str, *, timeout: float = WAIT, **kwargs) -> Attack:
    """Run ``code`` (after the prelude) in ``worker`` as model code; never raises for what it did."""
    result = await worker.run(PRELUDE + code, timeout=timeout, **kwargs)
    return Attack(result, probes_in(result.output))


async def assert_still_works(worker: Worker) -> None:
    """The worker (or its replacement) runs an ordinary block."""
    result = await worker.run("print(6 * 7)", timeout=WAIT)
    assert (result.status, result.output) == ("ok", "42\n"), result


def in_pid_namespace(ns: str) -> list[int]:
    """Host pids of the processes in PID namespace ``ns`` (``pid:[inode]``, as the worker's
    own ``readlink("/proc/self/ns/pid")`` prints it).  Every process a worker forks, however
    it detaches, stays in that namespace, so this finds whatever a kill left behind."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") == ns:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def described(pids: list[int]) -> str:
    """What each of ``pids`` is (name, state, parent, where it waits) as /proc says, for a
    failure's message."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            out.append(f"{pid}: gone")
            continue
        try:  # (where in the kernel it waits, root only: zap_pid_ns_processes, say, for an init still ending)
            with open(f"/proc/{pid}/stack") as f:
                wchan = "|".join(line.split()[-1].split("+")[0] for line in f.read(2000).splitlines()[:3])
        except (OSError, IndexError):
            wchan = "?"
        out.append(f"{pid}: {fields.get('Name', '?').strip()} {fields.get('State', '?').strip()} "
                   f"ppid {fields.get('PPid', '?').strip()} NSpid {fields.get('NSpid', '?').strip()} in {wchan}")
    return "; ".join(out) or "none"


#: Attack code that prints the worker's PID namespace as ``pidns: pid:[inode]``.
PRINT_PID_NAMESPACE = 'print("pidns:", _os.readlink("/proc/self/ns/pid"), flush=True)\n'


# -- the agent loop --------------------------------------------------------------------------

def block(block_id: str, code: str, timeout: str = "30s") -> str:
    """A model reply with one <run_code> block (the attack prelude included)."""
    return f'<run_code id="{block_id}" timeout="{timeout}">\n{PRELUDE}{code}\n</run_code>'


FOLLOW_UP = '<run_code id="after">\nprint(6 * 7)\n</run_code>'
ANSWER = "contained"
_RESULT = re.compile(r"<run_code_result id=(\S+?) duration=[^>]*>\n(.*?)</run_code_result>", re.S)


@dataclass
class AgentRun:
    """A whole agent run: its result, what the model was sent, and each block's result text."""

    result: RunResult
    server: ScriptedServer
    found: dict[str, str]

    @property
    def blocks(self) -> _Blocks:
        return _Blocks(self.found, self.result)

    def assert_kept_working(self) -> None:
        """The run answered, and the block after the attack printed 42."""
        assert self.result.status == "answered", self.result
        assert self.result.answer == ANSWER
        assert self.found.get("after", "").strip() == "42", self.found


class _Blocks(dict):
    """Block results by id; a missing one fails with how the run ended, not a bare KeyError."""

    def __init__(self, found: dict[str, str], result: RunResult) -> None:
        super().__init__(found)
        self.result = result

    def __missing__(self, block_id: str) -> str:
        raise AssertionError(f"no result for block {block_id!r}: the run ended {self.result.status} "
                             f"({self.result.error}); results: {dict(self)}")


async def agent_attack(engine: Engine, *replies, name: str, functions: dict | None = None) -> AgentRun:
    """Run the agent loop on a scripted model that sends ``replies`` (attack blocks or
    callables building them), then a harmless block, then the answer.  ``functions`` are
    host functions offered to the model's code, as ``--tools`` offers them."""
    task = f"security check: {name}"
    with ScriptedServer({task: [*replies, FOLLOW_UP, ANSWER]}) as server:
        models = ModelRegistry({"default": ModelConfig(alias="default", base_url=server.url,
                                                       model="scripted", timeout=WAIT)}, "default")
        result = await run_task(task, models=models, engine=engine, functions=functions, timeout=90)
    blocks: dict[str, str] = {}
    for body in server.requests:
        for message in body["messages"]:
            if message["role"] == "user":
                blocks.update(_RESULT.findall(message["content"]))
    return AgentRun(result, server, blocks)


def gone(token: str, timeout: float = WAIT) -> bool:
    """Whether every host process whose command line holds ``token`` has ended (bounded wait)."""
    return wait_until(lambda: not processes_with(token), timeout)



# -- other local users -------------------------------------------------------------------------
# Loopback and /tmp are shared by every account of the machine.  The attacks of one user on
# another run ``alice`` (the victim) and ``bob`` (the attacker) as real processes of theirs,
# started by a root suite through setpriv with the system's Python: they cannot enter a venv
# beneath root's home, so what the commands import is copied where they can read it.

#: The interpreter alice and bob run (a venv of root's may sit where they cannot enter).
SYSTEM_PYTHON = "/usr/bin/python3"


def other_users_problem(*names: str) -> str | None:
    """Why the suite cannot run commands as ``names`` here (None: it can)."""
    import pwd
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0:
        return "only root can run commands as other users"
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            return f"no user {name} on this machine"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) not installed"
    same = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True, timeout=WAIT).stdout.strip() if os.access(SYSTEM_PYTHON, os.X_OK) else ""
    if same != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}"
    return None


def as_user(name: str) -> list[str]:
    """The argv prefix that runs a command as ``name`` (its own groups, nothing of root's)."""
    return ["setpriv", f"--reuid={name}", f"--regid={name}", "--init-groups"]


def readable_pythonpath(imports: str) -> tuple[str, Path]:
    """A PYTHONPATH any user can use to run what ``imports`` imports: this project, the venv's
    packages, and copies of the packages taken from directories others cannot enter; and the
    directory of copies, for the caller to remove."""
    import shutil
    import subprocess
    import sys
    import sysconfig
    import tempfile

    from tests.conftest import REPO

    purelib = sysconfig.get_paths()["purelib"]
    listing = "\nimport sys\nfor m in list(sys.modules.values()):\n    print(getattr(m, '__file__', None) or '')"
    out = subprocess.run([sys.executable, "-c", imports + listing], capture_output=True, text=True,
                         timeout=WAIT, cwd="/", check=True).stdout.split()
    bases = {os.path.realpath(p) for p in sys.path if p.endswith("-packages")} - {os.path.realpath(purelib)}
    copies = Path(tempfile.mkdtemp(prefix="agentloop-users-path-"))
    for file in out:
        base = next((b for b in bases if file.startswith(b + "/")), None)
        if base is None:
            continue
        top = os.path.join(base, os.path.relpath(file, base).split("/")[0])
        target = copies / os.path.basename(top)
        if not target.exists() and os.path.exists(top):
            (shutil.copytree if os.path.isdir(top) else shutil.copy2)(top, target)
    subprocess.run(["chmod", "-R", "a+rX", str(copies)], check=True, timeout=WAIT)
    os.chmod(copies, 0o755)
    return f"{REPO}:{purelib}:{copies}", copies
