"""The one trust check of interpreters, as a structure: only ``trusted_python`` makes a
``TrustedPython``, and every function that runs an interpreter (or builds the command line
that will) checks a plain path through it first, so that none of them runs one the check
refuses — whoever calls it, from whatever start path.

The interpreter refused here is a virtual environment made inside a directory the record
says workers could write (``engine.trust.open_grant``), its python a link to this one, its
``.pth`` file appending to a marker whenever ``site`` runs it; the same layout elsewhere is
the control that shows the ``.pth`` really runs when the check lets an interpreter through."""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import pytest

from engine import trust
from engine.errors import UntrustedPython
from engine.sandbox import (
    SandboxPolicy,
    TrustedPython,
    probe,
    python_paths,
    runtime_argv,
    trusted_python,
    which_python,
)
from engine.sandbox import _interpreter as interpreter
from engine.sandbox import _plan as sandbox_plan
from worker.contract.confinement import Confinement

from .conftest import wait_until

VERSION = f"python{sys.version_info[0]}.{sys.version_info[1]}"


def _venv(top: Path, marker: Path) -> str:
    """A virtual environment at ``top`` whose ``.pth`` appends to ``marker``; its python."""
    real = os.path.realpath(sys.executable)
    site = top / "lib" / VERSION / "site-packages"
    site.mkdir(parents=True)
    (top / "bin").mkdir()
    (top / "bin" / "python").symlink_to(real)
    (top / "pyvenv.cfg").write_text(f"home = {os.path.dirname(real)}\ninclude-system-site-packages = false\n")
    (site / "evil.pth").write_text(f"import os; open({str(marker)!r}, 'a').write('ran\\n')\n")
    return str(top / "bin" / "python")


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """agentloop's record of what workers could write, the test's own."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def planted(tmp_path: Path, record: Path) -> tuple[str, Path]:
    """A python workers could have written (made while the record says they could), and its marker."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    grant = trust.open_grant(workspace)
    python = _venv(workspace / "v", tmp_path / "MARKER")
    grant.end()
    return python, tmp_path / "MARKER"


def test_only_the_check_makes_a_trusted_python():
    with pytest.raises(TypeError, match="trusted_python alone"):
        TrustedPython(sys.executable)
    checked = trusted_python(sys.executable)
    assert isinstance(checked, TrustedPython) and isinstance(checked, str)
    again = pickle.loads(pickle.dumps(checked))  # (to a Ray task: a plain path, checked there again)
    assert again == checked and type(again) is str


RUNNERS = {
    "trusted_python": lambda python: trusted_python(python),
    "probe": probe,
    "python_paths": python_paths,
    "runtime_packages": interpreter.runtime_packages,
    "runtime_dirs": interpreter.runtime_dirs,
    "not_importable": lambda python: interpreter.not_importable(python, ("json",)),
    "runtime_argv": lambda python: runtime_argv(python, "worker.confiner:main"),
    "check_workspace": lambda python: interpreter.check_workspace(Path("/nonexistent-workspace"), python),
    "plan": lambda python: sandbox_plan.plan(SandboxPolicy(), socket_dir=Path("/nonexistent/s"),
                                             workspace=Path("/nonexistent/w"), cwd=Path("/"), output_dir=None,
                                             python=python),
    "tools_plan": lambda python: sandbox_plan.tools_plan("/", python, Confinement()),
}


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_every_function_that_runs_an_interpreter_checks_it_first(planted, runner):
    python, marker = planted
    with pytest.raises(UntrustedPython, match="is not used: .*could write"):
        RUNNERS[runner](python)
    assert not marker.exists(), f"{runner} ran the planted interpreter"


def test_control_the_same_interpreter_made_elsewhere_is_run(tmp_path, record):
    python = _venv(tmp_path / "elsewhere" / "v", tmp_path / "MARKER")
    checked = trusted_python(python)
    assert checked == python and (tmp_path / "MARKER").read_text().startswith("ran")  # (site ran, in the probe)


def test_every_source_goes_through_the_check(planted, tmp_path, monkeypatch):
    python, marker = planted
    monkeypatch.chdir(tmp_path)
    for env, words in ((("VIRTUAL_ENV", os.path.dirname(os.path.dirname(python))), "the active virtual environment"),
                       (("AGENTLOOP_PYTHON", python), "AGENTLOOP_PYTHON")):
        monkeypatch.delenv("VIRTUAL_ENV", raising=False)
        monkeypatch.delenv("AGENTLOOP_PYTHON", raising=False)
        monkeypatch.setenv(*env)
        with pytest.raises(UntrustedPython, match=f"chosen by {words}.*is not used"):
            which_python()
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    monkeypatch.delenv("AGENTLOOP_PYTHON", raising=False)
    with pytest.raises(UntrustedPython, match="chosen by --python"):
        which_python(python)
    (tmp_path / "agentloop.toml").write_text(f'python = "{python}"\n')
    with pytest.raises(UntrustedPython, match="chosen by python in agentloop.toml"):
        which_python()
    (tmp_path / "agentloop.toml").unlink()
    chosen, by = which_python()  # the default, agentloop's own, checked all the same
    assert isinstance(chosen, TrustedPython) and by.startswith("default")
    assert not marker.exists()


def test_a_pth_planted_beside_a_trusted_interpreter_is_refused(tmp_path, record):
    # The start of an interpreter reads ``<its name>._pth`` beside it (it replaces sys.path):
    # one that appeared while workers could write there refuses the interpreter.
    top = tmp_path / "tools"
    python = _venv(top / "v", tmp_path / "MARKER")
    trusted_python(python)
    # The venv must be older than the grant by more than the margin a window is widened by
    # (the kernel's coarse clock): otherwise its link, not the ._pth, is what is refused.
    newest = max(os.lstat(p).st_ctime for p in (top / "v" / "bin", top / "v" / "bin" / "python"))
    assert wait_until(lambda: time.time() > newest + 2 * trust.MARGIN, 1)
    grant = trust.open_grant(top / "v" / "bin")
    (top / "v" / "bin" / "python._pth").write_text("/nonexistent\n")
    grant.end()
    with pytest.raises(UntrustedPython, match=r"python\._pth changed"):
        trusted_python(python)
