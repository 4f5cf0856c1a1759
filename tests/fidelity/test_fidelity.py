"""Differential: ``agentloop exec FILE ARGS`` gives what ``python FILE ARGS`` gives, under the
same interpreter: byte for byte the same stdout and stderr, the same exit status (or death by
the same signal), the same files left in the directory, with the same modes and owners.

Two corpora: ``corpus/`` (one directory per case, its script saying how it is run and what
python shows: ``harness.py``) and the older ``scripts/`` (single files; ``CASES`` gives their
arguments and stdin).  Every new case runs piped and at a terminal, as the user running the
tests and, when that is root, as ``nobody``; the older scripts run piped, as both users.  The runs go on in a pool of threads (each case in a
directory of its own): a test waits for its own pair only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from .harness import Case, Runner, nobody_problem

SCRIPTS = Path(__file__).parent / "scripts"
CORPUS = Path(__file__).parent / "corpus"

#: Arguments and stdin of the older scripts that take some; the rest get none and an empty stdin.
CASES = {
    "argv.py": (["a", "b c", "--flag", "-x"], ""),
    "stdin_greet.py": ([], "Bob\nrest of it\n"),
    "argparse_args.py": (["1", "2", "39", "--scale", "0.5", "-v"], ""),
    "argparse_error.py": (["not-a-number"], ""),
}


def _older(path: Path) -> Case:
    args, stdin = CASES.get(path.name, ([], ""))
    return Case(f"scripts-{path.stem}", SCRIPTS, run=path.name, args=args, stdin=stdin.encode())


NEW = [Case.load(d) for d in sorted(CORPUS.iterdir()) if d.is_dir()]
OLD = [_older(p) for p in sorted(SCRIPTS.glob("*.py"))]
_NOBODY = nobody_problem()
VARIANTS = [("self", False), ("self", True), ("nobody", False), ("nobody", True)]
#: Runs at once: most of a run is waiting (for a process to start, for a sleep).
PARALLEL = 4


class _Outcomes:
    """Every pair the selected tests need, run ahead in a pool."""

    def __init__(self, selected: list[tuple[Case, tuple[str, bool]]]) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="fidelity-", dir="/tmp"))
        self.base.chmod(0o755)  # (nobody runs in it)
        for user in ("self", "nobody"):  # (agentloop's state: a private directory of each user's)
            (self.base / f"state-{user}").mkdir(mode=0o700)
        if os.geteuid() == 0:
            os.chown(self.base / "state-nobody", 65534, 65534)
        self.runners = {v: Runner(self.base, *v) for v in VARIANTS}
        self.pool = ThreadPoolExecutor(PARALLEL)
        self.futures: dict[tuple[str, tuple[str, bool]], Future] = {}
        for case, variant in selected:
            self._submit(case, variant)

    def _submit(self, case: Case, variant: tuple[str, bool]) -> Future:
        key = (case.name, variant)
        if key not in self.futures:
            self.futures[key] = self.pool.submit(self.runners[variant].both, case)
        return self.futures[key]

    def get(self, case: Case, variant: tuple[str, bool]):
        return self._submit(case, variant).result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def outcomes(request):
    selected = [(item.callspec.params["case"], item.callspec.params["variant"]) for item in request.session.items
                if getattr(item, "callspec", None) is not None and item.module is request.module]
    runs = _Outcomes(selected)
    yield runs
    runs.close()


def _variant(user: str, terminal: bool):
    marks = [pytest.mark.skip(reason=_NOBODY)] if user == "nobody" and _NOBODY else []
    return pytest.param((user, terminal), id=f"{user}-{'terminal' if terminal else 'piped'}", marks=marks)


def _pairs():
    """Every new case in every variant; the older scripts, which are about what a runtime did
    to a script, piped (as they always ran), as both users."""
    for case in NEW + OLD:
        for user, terminal in VARIANTS:
            if not terminal or (case in NEW and not case.piped_only):
                yield pytest.param(case, _variant(user, terminal).values[0], id=f"{case.name}-{user}-"
                                   f"{'terminal' if terminal else 'piped'}", marks=_variant(user, terminal).marks)


@pytest.mark.parametrize("case, variant", list(_pairs()))
def test_exec_is_python(case: Case, variant, outcomes):
    python, ours = outcomes.get(case, variant)
    if case in NEW:
        assert python.expectation_problems(case, variant[1]) == [], python
    assert ours.exit == python.exit, (ours, python)
    assert ours.stdout == python.stdout
    assert ours.stderr == python.stderr
    assert ours.files == python.files


def test_the_corpus_covers_every_class_it_is_meant_to():
    # At least 40 new cases, and none without an expectation of its own.
    assert len(NEW) >= 40
    assert [c.name for c in NEW if not (c.expect_stdout or c.expect_stderr or c.expect_files or c.expect_exit)] == []
