"""Root workers' uids: one per workspace, never handed to another workspace while anything of
an earlier holder lives, across processes; first choices nobody can aim at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from engine.sandbox import _uids

from .conftest import read_line

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root coordinator switches workers' uids")


def _colliding(parent: Path, count: int = 2, first=_uids.first_uid) -> list[str]:
    """``count`` workspace paths whose first choice of uid is the same."""
    seen: dict[int, list[str]] = {}
    for i in range(10_000_000):
        path = str(parent / f"ws-{i}")
        same = seen.setdefault(first(path), [])
        same.append(path)
        if len(same) == count:
            return same
    raise AssertionError("no collision found")


class _Holder:
    """Another process that claims ``workspace`` and holds it until it ends."""

    def __init__(self, workspace: str) -> None:
        code = f"import sys\nfrom engine.sandbox import _uids\nprint(_uids.claim_uid({workspace!r}), flush=True)\nsys.stdin.read()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.uid = int(read_line(self.proc.stdout, 30))

    def end(self, sig: int | None = None) -> None:
        if sig is not None:
            self.proc.send_signal(sig)
        self.proc.communicate(b"", timeout=30)


def test_colliding_workspaces_alive_at_once_get_different_uids(tmp_path):
    first, second = _colliding(tmp_path)
    holder = _Holder(first)
    try:
        assert _uids.claim_uid(second) != holder.uid
        assert _uids.claim_uid(first) == holder.uid  # the same workspace shares it
        _uids.release_uid(first)
        _uids.release_uid(second)
    finally:
        holder.end()
    # The holder is gone, and nothing of it lives: the first choice is free again.
    assert _uids.claim_uid(second) == holder.uid
    _uids.release_uid(second)


@pytest.mark.parametrize("sig", [None, signal.SIGKILL], ids=["exits", "is-killed"])
def test_every_holder_holds_its_own_claim(sig, tmp_path):
    first, second = _colliding(tmp_path)
    holder = _Holder(first)
    assert _uids.claim_uid(first) == holder.uid  # a second run on the workspace
    holder.end(sig)
    try:
        assert _uids.claim_uid(second) != holder.uid  # still claimed: by the second run
        _uids.release_uid(second)
    finally:
        _uids.release_uid(first)
    assert _uids.claim_uid(second) == holder.uid
    _uids.release_uid(second)


def test_a_uid_is_not_handed_on_while_a_process_runs_with_it(tmp_path):
    # The holder is killed; a process of its uid lives on (what its workers started).
    first, second = _colliding(tmp_path)
    holder = _Holder(first)
    holder.end(signal.SIGKILL)
    left = subprocess.Popen(["sleep", "60"], user=holder.uid, group=holder.uid)
    try:
        assert _uids.claim_uid(second) != holder.uid
        _uids.release_uid(second)
    finally:
        left.kill()
        left.wait()
    assert _uids.claim_uid(second) == holder.uid
    _uids.release_uid(second)


def test_a_uid_is_not_handed_on_while_its_workspace_keeps_it(tmp_path):
    # What the earlier holder's workers wrote is still its uid's: whoever got it could read it.
    first, second = _colliding(tmp_path)
    uid = _uids.claim_uid(first)
    os.mkdir(first)
    os.chown(first, 0, uid)
    _uids.release_uid(first)
    assert _uids.claim_uid(second) != uid
    _uids.release_uid(second)
    os.chown(first, 0, 0)  # the workspace was given up: the uid may go to another
    assert _uids.claim_uid(second) == uid
    _uids.release_uid(second)


def test_names_chosen_to_collide_do_not(tmp_path):
    # crc32 (or any unkeyed hash) collisions are found in milliseconds; they mean nothing here.
    crc = _colliding(tmp_path, 3, lambda path: zlib.crc32(path.encode()) % _uids.UID_SPAN)
    assert len({_uids.first_uid(path) for path in crc}) == 3


def test_claims_in_one_process_are_counted(tmp_path):
    workspace = str(tmp_path / "ws")
    uid = _uids.claim_uid(workspace)
    assert _uids.claim_uid(workspace) == uid and _uids.uid_of(workspace) == uid
    _uids.release_uid(workspace)
    assert _uids.uid_of(workspace) == uid  # one claim left
    _uids.release_uid(workspace)
    assert _uids.uid_of(workspace) is None
