"""Root workers' uids: one per workspace, never shared by two live workspaces, across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest

from engine import _uids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root coordinator switches workers' uids")


def _colliding(prefix: str) -> tuple[str, str]:
    """Two workspace paths whose first choice of uid is the same."""
    seen: dict[int, str] = {}
    for i in range(1_000_000):
        path = f"/tmp/{prefix}-{i}"
        slot = zlib.crc32(path.encode()) % _uids.UID_SPAN
        if slot in seen:
            return seen[slot], path
        seen[slot] = path
    raise AssertionError("no collision found")


def test_two_live_workspaces_never_share_a_uid_even_across_processes(tmp_path):
    first, second = _colliding(tmp_path.name)
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom engine import _uids\n"
                               f"print(_uids.claim({first!r}), flush=True)\nsys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(holder.stdout.readline())
        mine = _uids.claim(second)
        assert mine != theirs
        assert _uids.claim(first) == theirs  # the same workspace shares the live claim
        _uids.release(first)
        _uids.release(second)
    finally:
        holder.communicate("", timeout=30)
    # The holder is gone, and with it its claim: the first choice is free again.
    again = _uids.claim(second)
    assert again == theirs
    _uids.release(second)


def test_claims_in_one_process_are_counted(tmp_path):
    workspace = str(tmp_path / "ws")
    uid = _uids.claim(workspace)
    assert _uids.claim(workspace) == uid and _uids.of(workspace) == uid
    _uids.release(workspace)
    assert _uids.of(workspace) == uid  # one claim left
    _uids.release(workspace)
    assert _uids.of(workspace) is None
