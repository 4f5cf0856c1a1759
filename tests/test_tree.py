"""engine.trees and batch's workspace handling on trees of any shape: deep, wide, full of
symlinks and special files.  No recursion, no symlink followed, no file descriptor per level."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine.batch.run import _clear, _place_files
from engine.batch.tasks import pack_files
from engine.errors import TreeError
from engine.trees import copy_tree, disk_usage, remove_tree, walk


@pytest.fixture(autouse=True)
def _no_deep_tree_left(tmp_path: Path):
    """Whatever a test left goes, even when it failed: pytest removes old tmp directories with
    shutil.rmtree, which a deep tree left behind would make fail in every later session."""
    yield
    for entry in list(tmp_path.iterdir()):
        remove_tree(entry)


def _open_fds() -> set[str]:
    """The descriptors open now.  A leak adds one; other tests' objects the collector finalizes
    meanwhile may only take some away, so callers check for a subset, not equality."""
    return set(os.listdir("/proc/self/fd"))


def deep(root: Path, depth: int) -> None:
    """``depth`` nested directories ``d`` under ``root``, a file in each (fd-relative: deeper
    than PATH_MAX allows by path)."""
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = below
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.close(fd)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory the trees link to: nothing in it may be touched."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    return out


def test_a_tree_deeper_than_path_max_is_walked_measured_and_removed(tmp_path: Path, outside: Path):
    root = tmp_path / "root"
    root.mkdir()
    deep(root, 3000)  # "d/" * 3000 is 6000 bytes: beyond PATH_MAX
    (root / "link").symlink_to(outside)
    fds = _open_fds()
    entries = list(walk(root))
    assert len(entries) == 3000 * 2 + 1
    assert max(len(e.parts) for e in entries) == 3001
    assert entries[0].parts == ("d",) and entries[-1].parts == ("link",)  # parents first, name order
    assert disk_usage(root) >= 3000 * 512
    assert _open_fds() <= fds
    assert remove_tree(root) and not root.exists()
    assert _open_fds() <= fds
    assert (outside / "keep.txt").read_text() == "keep"


def test_symlinks_are_entries_never_followed(tmp_path: Path, outside: Path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "to-dir").symlink_to(outside)
    (root / "to-file").symlink_to(outside / "keep.txt")
    kinds = {e.parts: stat.S_IFMT(e.stat.st_mode) for e in walk(root)}
    assert kinds == {("a",): stat.S_IFDIR, ("a", "to-dir"): stat.S_IFLNK, ("to-file",): stat.S_IFLNK}
    with pytest.raises(OSError):
        list(walk(root / "a" / "to-dir"))  # a symlink as the root is not a directory here
    link = tmp_path / "link"
    link.symlink_to(outside)
    assert remove_tree(link) and not link.is_symlink() and (outside / "keep.txt").exists()
    assert remove_tree(root) and not root.exists()
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert remove_tree(tmp_path / "absent")
    file = tmp_path / "file"
    file.write_text("x")
    assert remove_tree(file) and not file.exists()


def test_walks_are_bounded(tmp_path: Path):
    root = tmp_path / "wide"
    root.mkdir()
    for i in range(50):
        (root / f"f{i}").write_text("x")
    with pytest.raises(TreeError):
        list(walk(root, max_entries=10))
    assert not remove_tree(root, max_entries=10) and root.exists()  # says it did not finish
    assert remove_tree(root) and not root.exists()


def test_copy_keeps_modes_times_and_symlinks_and_leaves_special_files_out(tmp_path: Path, outside: Path):
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    tool = src / "bin" / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o750)
    os.utime(tool, ns=(1_000_000_000, 2_000_000_000))
    (src / "bin" / "to-outside").symlink_to(outside)
    os.mkfifo(src / "fifo")
    dst = tmp_path / "dst"
    copy_tree(src, dst)
    assert stat.S_IMODE((dst / "bin" / "tool").stat().st_mode) == 0o750
    assert (dst / "bin" / "tool").stat().st_mtime_ns == 2_000_000_000
    assert os.readlink(dst / "bin" / "to-outside") == str(outside)
    assert not (dst / "fifo").exists()
    with pytest.raises(FileExistsError):
        copy_tree(src, dst)


def test_batch_packs_places_and_clears_with_the_same_walk(tmp_path: Path, outside: Path):
    kit = tmp_path / "kit"
    (kit / "sub").mkdir(parents=True)
    (kit / "sub" / "a.txt").write_text("a")
    (kit / "b.txt").write_text("b")
    (kit / "b.txt").chmod(0o640)
    (kit / "alias").symlink_to(kit / "b.txt")  # packed as the file it names, as before
    (kit / "dir-link").symlink_to(outside)  # a directory elsewhere: not packed
    os.mkfifo(kit / "fifo")  # opening it must not block the packing
    packed = pack_files([str(kit)])
    assert [(name, data, mode) for name, data, mode in packed] == [
        ("kit/alias", b"b", 0o640), ("kit/b.txt", b"b", 0o640), ("kit/sub/a.txt", b"a", 0o644)]

    class Spec:
        files = (str(kit),)

    run = tmp_path / "run"
    placed = _place_files(run / "workspace", Spec(), None)
    assert placed == [run / "workspace" / "kit", run / "workspace" / "files"]  # (files: the run's ./files)
    assert (run / "workspace" / "kit" / "sub" / "a.txt").read_text() == "a"
    assert os.readlink(run / "workspace" / "kit" / "dir-link") == str(outside)
    deep(run / "workspace", 2000)
    (run / "state").mkdir()
    (run / "transcript.jsonl").write_text("{}\n")
    _clear(run, first=False)  # a retry: the workspace and state go, the transcript stays
    assert sorted(p.name for p in run.iterdir()) == ["transcript.jsonl"]
    _clear(run, first=True)
    assert run.is_dir() and not any(run.iterdir())
    assert (outside / "keep.txt").read_text() == "keep"
