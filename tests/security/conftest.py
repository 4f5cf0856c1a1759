"""The attack suite: hostile model code run through real sandboxed workers of a real Engine.

Every test marked ``attack`` is one attack.  It runs the code exactly as model code runs (a
worker of an ``Engine`` with the default sandbox policy, or the whole agent loop against a
scripted model), asserts the safe outcome on the host, and then shows that the worker — or
its replacement after a kill — still runs ordinary code.  The run ends with the line
``security: N attacks tried, M contained``: tried counts the attacks that ran (not skipped),
contained the ones whose test passed.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from engine.workers import Engine, Worker

from .harness import API_KEY, OTHER_SECRETS, Host
from .users import _alice_path, user  # noqa: F401  (fixtures: a command run as the suite's user or alice)

# -- the summary line ----------------------------------------------------------------------

_outcomes: dict[str, str] = {}  # nodeid -> "passed" | "failed" | "skipped"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attack: one attack of the security suite (counted in its summary line)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "attack" not in report.keywords:
        return
    seen = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"  # in any phase, teardown included
    elif report.skipped and seen is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and seen is None:
        _outcomes[report.nodeid] = "passed"


def pytest_terminal_summary(terminalreporter) -> None:
    tried = [o for o in _outcomes.values() if o != "skipped"]
    if tried:
        terminalreporter.write_line(
            f"security: {len(tried)} attacks tried, {tried.count('passed')} contained")


# -- fixtures ------------------------------------------------------------------------------

@pytest.fixture
def host(tmp_path: Path) -> Host:
    """The host's targets, all under the test's tmp directory (see `Host`)."""
    cwd, workspace, outside = tmp_path / "project", tmp_path / "workspace", tmp_path / "outside"
    alice = tmp_path / "home" / "alice"
    for d in (cwd, workspace, outside, alice / ".ssh"):
        d.mkdir(parents=True)
    (cwd / "main.py").write_text("print('the project')\n")
    secret = "alice-private-key-" + secrets.token_hex(8)
    key = alice / ".ssh" / "id_ed25519"
    key.write_text(secret + "\n")
    key.chmod(0o600)
    return Host(tmp_path, cwd, workspace, tmp_path / "state", outside, alice, key, secret)


@pytest.fixture
async def engine(host: Host, monkeypatch: pytest.MonkeyPatch):
    """A real engine with the default sandbox policy, run by a coordinator that holds API keys."""
    monkeypatch.setenv("LLM_API_KEY", API_KEY)
    for name, value in OTHER_SECRETS.items():
        monkeypatch.setenv(name, value)
    async with Engine(cwd=host.cwd, state_dir=host.state, workspace=host.workspace) as eng:
        yield eng


@pytest.fixture
async def worker(engine: Engine) -> Worker:
    return await engine.start_worker("attacker")
