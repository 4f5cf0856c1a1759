"""Shared fixtures: real engines with real workers, in a private directory per test."""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.launch import WorkerSettings, fork_server_refusal
from engine.models import _server as model_server
from engine.scripted import _sequence as sequence
from engine.workers import Engine
from tests import net_servers

REPO = Path(__file__).resolve().parent.parent


#: Why workers start cold here (None: a fork server forks them, as root or unprivileged).
NO_FORK_SERVER = fork_server_refusal(WorkerSettings())
needs_fork_server = pytest.mark.skipif(NO_FORK_SERVER is not None, reason=str(NO_FORK_SERVER))


@pytest.fixture(autouse=True, scope="session")
def _private_state(tmp_path_factory):
    """agentloop's state (its record of what workers could write among it) goes to a directory
    of the session's, not to the home of whoever runs the tests; a test may set its own."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture(autouse=True)
def _fresh_model_probes():
    """Each test asks its servers afresh: a port reused by a later test's server must not
    answer with what an earlier server said."""
    model_server.forget()
    yield
    model_server.forget()


@pytest.fixture(autouse=True)
def _valid_model_requests():
    """Every request a scripted server receives during a test must be a message sequence a
    strict server accepts (``engine.scripted._sequence.sequence_problems``); the test fails otherwise.
    A test that sends invalid ones on purpose takes them itself with ``sequence.take_invalid()``."""
    sequence.take_invalid()
    yield
    invalid = sequence.take_invalid()
    if invalid:
        pytest.fail("a scripted server received requests a strict server refuses:\n" + "\n".join(invalid),
                    pytrace=False)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A working directory for the run (the worker's cwd), with state kept under tmp."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


@pytest.fixture
async def engine(run_dir: Path, tmp_path: Path):
    async with Engine(cwd=run_dir, state_dir=tmp_path / "state") as eng:
        yield eng


@pytest.fixture
async def worker(engine: Engine):
    return await engine.start_worker("test")


NOBODY = 65534
#: The interpreter nobody runs agentloop with here (one it may read: a root-owned venv may sit
#: where nobody can enter), with this checkout and the venv's packages on its path.
SYSTEM_PYTHON = "/usr/bin/python3"
_SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@dataclasses.dataclass
class Unprivileged:
    """A plain user to run commands as: nobody when the tests run as root, else the user itself.
    ``python``: the argv prefix that runs Python as that user; ``home``: a directory of theirs."""

    python: list[str]
    env: dict[str, str]
    home: Path

    @property
    def agentloop(self) -> list[str]:
        return [*self.python, "-m", "engine.cli"]

    def own(self, *paths: Path) -> None:
        """Give ``paths`` to the user (nothing to do when the user is the one running the tests)."""
        if os.geteuid() == 0:
            for path in paths:
                os.chown(path, NOBODY, NOBODY)


@functools.cache
def _nobody_problem() -> str | None:
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) not installed"
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    if version != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}"
    probe = subprocess.run([*_SETPRIV, SYSTEM_PYTHON, "-c", "import engine.cli"], cwd="/",
                           env=_nobody_env(), capture_output=True, timeout=60)
    if probe.returncode != 0:
        return f"nobody cannot import this project: {probe.stderr.decode()[-200:]}"
    return None


def _nobody_env() -> dict[str, str]:
    path = f"{REPO}:{sysconfig.get_paths()['purelib']}"
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": path}


@pytest.fixture
def unprivileged() -> Iterator[Unprivileged]:
    """A plain user and a directory of theirs that they can reach (a root test's tmp_path is
    0700); skips where root cannot become nobody."""
    base = Path(tempfile.mkdtemp(prefix="agentloop-unprivileged-"))
    try:
        if os.geteuid() != 0:
            yield Unprivileged([sys.executable], {**os.environ, "HOME": str(base)}, base)
            return
        problem = _nobody_problem()
        if problem:
            pytest.skip(reason=problem)
        os.chmod(base, 0o755)
        os.chown(base, NOBODY, NOBODY)
        yield Unprivileged([*_SETPRIV, SYSTEM_PYTHON], {**_nobody_env(), "HOME": str(base)}, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def closed_port() -> int:
    """A loopback port nobody listens on (one just freed): a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie waiting for a parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def processes_with(token: str) -> list[int]:
    """Host pids whose command line contains ``token``."""
    found = []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# -- Ray: tests marked `ray` start a real local cluster; `--skip-ray` leaves them out ----------

def pytest_addoption(parser):
    parser.addoption("--skip-ray", action="store_true", default=False,
                     help="Skip the tests marked `ray` (they start a local Ray cluster).")


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: starts a real local Ray cluster (skip with --skip-ray)")


def pytest_collection_modifyitems(config, items):
    _group_for_workers(items)
    if not config.getoption("--skip-ray"):
        return
    skip = pytest.mark.skip(reason="--skip-ray")
    for item in items:
        if "ray" in item.keywords:
            item.add_marker(skip)


def _group_for_workers(items) -> None:
    """With pytest-xdist (``scripts/test`` runs the suite on a worker per core, ``--dist
    loadgroup``), tests that share something costly run in one worker, so that it is made once:
    the tests of a module with a module- or class-scoped fixture of ours (test_view's 1,000-run
    batch, say) stay together, and every Ray test shares one worker and so one cluster. The rest
    are spread test by test."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if "ray" in item.keywords or any(d.argname == "ray_cluster" for d in defs):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif any(d.scope in ("module", "class") and str(d.baseid).startswith("tests") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def read_line(stream, timeout: float):
    """The next line of a subprocess's pipe, or an empty one when none comes within
    ``timeout`` seconds: a test that waits for a line never waits longer than that."""
    got: list = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if got:
        return got[0]
    return "" if isinstance(stream, io.TextIOBase) else b""


@pytest.fixture(scope="session")
def ray_cluster():
    """A 2-CPU local cluster offering 2 agent slots; yields (address, environment to connect).
    One per test session: Ray keeps the first token it was started with for the process."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    token = secrets.token_hex(16)
    os.environ["RAY_AUTH_TOKEN"] = token  # a token of our own: nothing is written to ~/.ray
    os.environ.pop("RAY_AUTH_MODE", None)  # unset: ray.init() turns token mode on by itself
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, resources={"agent_slot": 2}, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        yield address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- the egress tests' servers (tests/net_servers.py) ----------------------------------------

@pytest.fixture
def index():
    """A PEP 503 index on ``net_servers.ALLOWED`` serving a wheel the test makes."""
    server = net_servers.Index()
    yield server
    server.close()


@pytest.fixture
def canaries():
    """Listeners no attack may reach: other loopback addresses and ports, and UDP."""
    found = [net_servers.Canary("127.0.0.1"), net_servers.Canary("127.0.0.3"),
             net_servers.Canary(net_servers.ALLOWED), net_servers.UdpCanary("127.0.0.1")]
    yield found
    for canary in found:
        canary.assert_untouched()
        canary.close()
