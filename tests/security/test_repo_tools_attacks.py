"""Attacks on the coordinator through its repository tools (list_dir, read_file, search).

The tools read what model code wrote, with patterns the model chose.  Each test is one attack
on the coordinator that runs them: freezing it with a regex, crashing it with a deep tree,
bloating it with a huge file, reading outside the root or into an excluded path by racing a
link swap, or leaving a process behind.  The tools run in their own confined process; these
tests show that the coordinator is unharmed and the secret unseen.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.environment import ENV_ALLOWLIST
from engine.errors import ToolError
from engine.tools import RepoTools, execute_tool_call_async
from engine.tools._repo import execute_tool_call
from tests.conftest import wait_until
from worker.contract import confinement as _confine

pytestmark = pytest.mark.attack

#: Backtracks 2**40 times on a line of 40 a's and a b: hours in `re`, unless killed.
EVIL = r"(a+)+$"
EVIL_LINE = "a" * 40 + "b\n"
REPO = Path(__file__).resolve().parents[2]


def call(name: str, args: dict) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def outcome(fn: Callable[..., str], *args: object, **kwargs: object) -> str:
    """What the model would read: the result, or the refusal's words."""
    try:
        return fn(*args, **kwargs)
    except ToolError as exc:
        return f"ToolError: {exc}"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count: it is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@contextmanager
def flipping(a: Path, b: Path) -> Iterator[list[int]]:
    """Swap ``a`` and ``b`` (atomically, with renameat2) as fast as a thread can until the
    block ends; yields a one-item list counting the swaps."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("no renameat2 in this libc")
    count, stop = [0], threading.Event()

    def flip() -> None:
        while not stop.is_set():
            if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
                count[0] += 1

    thread = threading.Thread(target=flip, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive()


def race(calls: list[Callable[[], str]], rounds: int = 150, seconds: float = 10.0) -> list[str]:
    """Every call's outcome, ``rounds`` times over (or until ``seconds`` pass)."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    for _ in range(rounds):
        for fn in calls:
            seen.append(outcome(fn))
        if time.monotonic() > deadline:
            break
    return seen


# -- item 10: a pattern that never ends ---------------------------------------------------------

@pytest.fixture
def evil_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    (root / "evil.txt").write_text(EVIL_LINE)
    (root / "plain.txt").write_text("hello\n")
    return root


def test_catastrophic_regex_times_out_and_the_next_call_works(evil_root: Path):
    with RepoTools(evil_root, timeout=1.5) as tools:
        assert tools.list_dir() == "evil.txt (42 bytes)\nplain.txt (6 bytes)"
        first = tools.pid
        started = time.monotonic()
        out = execute_tool_call(call("search", {"pattern": EVIL}), tools.functions())
        took = time.monotonic() - started
        assert out == ("[agent] search timed out after 1.5 s: the pattern is too expensive (or the "
                       "directory too big); use a simpler pattern or a narrower path")
        assert 1.5 <= took < 5.0, took
        assert first is not None and not alive(first)  # killed, not left to spin
        assert tools.search("hello") == "plain.txt:1: hello"  # a fresh process answers
        assert tools.search(r"a+b$") == "evil.txt:1: " + EVIL_LINE.strip()
        assert tools.pid not in (None, first)


async def test_the_event_loop_keeps_running_while_a_search_backtracks(evil_root: Path, tmp_path: Path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x\n")
    with RepoTools(evil_root, timeout=3) as tools, RepoTools(other, timeout=3) as neighbour:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        search = asyncio.create_task(execute_tool_call_async(call("search", {"pattern": EVIL}),
                                                             tools.functions()))
        # Another run's tools (batch: one RepoTools per run) answer meanwhile.
        started = time.monotonic()
        listed = await asyncio.wait_for(execute_tool_call_async(call("list_dir", {}), neighbour.functions()), 10)
        neighbour_took = time.monotonic() - started
        out = await asyncio.wait_for(search, 30)
        stop.set()
        await asyncio.wait_for(ticker, 5)
    assert listed == "x.txt (2 bytes)"
    assert neighbour_took < 2.0, neighbour_took
    assert out.startswith("[agent] search timed out after 3 s")
    assert len(gaps) > 100 and max(gaps) < 0.5, (len(gaps), max(gaps))


def test_closing_the_tools_ends_a_call_in_flight_at_once(evil_root: Path):
    tools = RepoTools(evil_root, timeout=60)
    got: list[str] = []
    thread = threading.Thread(target=lambda: got.append(outcome(tools.search, EVIL)))
    thread.start()
    assert wait_until(lambda: tools.pid is not None, 10)
    pid = tools.pid
    started = time.monotonic()
    tools.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert got and got[0].startswith("ToolError: search failed: "), got
    assert pid is not None and not alive(pid)
    assert outcome(tools.list_dir) == "ToolError: list_dir: the repository tools were closed"


# -- item 5: swapping a directory for a link while a tool reads through it ------------------------

@pytest.fixture
def vault(tmp_path: Path) -> tuple[Path, str]:
    """A directory outside every root holding a 0600 file of a telltale name and size."""
    vault = tmp_path / "vault"
    vault.mkdir()
    name = "secret-" + secrets.token_hex(6) + ".key"
    (vault / name).write_text("TOPSECRET" + "s" * 31328)  # 31337 bytes
    (vault / name).chmod(0o600)
    return vault, name


def test_symlink_swap_race_never_reveals_a_file_outside_the_root(tmp_path: Path, vault: tuple[Path, str]):
    outside, secret = vault
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / secret).write_text("decoy\n")  # same name: what matters is what is reported
    (root / "d" / "inner").mkdir()
    os.symlink(outside, root / "link")
    with RepoTools(root) as tools:
        calls = [
            lambda: tools.list_dir("d"),
            lambda: tools.list_dir("."),
            lambda: tools.list_dir("d/inner/.."),
            lambda: tools.read_file(f"d/{secret}"),
            lambda: tools.search("TOPSECRET|decoy", "d"),
            lambda: tools.search("TOPSECRET"),
            lambda: tools.search("TOPSECRET", f"d/{secret}"),
        ]
        with flipping(root / "d", root / "link") as swaps:
            seen = race(calls)
        assert swaps[0] > 0
        assert outcome(tools.list_dir, ".") in ("d/\nlink (unreadable)", "d (unreadable)\nlink/")
    text = "\n".join(seen)
    assert "31337" not in text and "TOPSECRETsss" not in text
    assert "failed" not in text  # every race ends in a plain answer or a refusal in words
    assert f"{secret} (6 bytes)" in text  # the decoy was seen: the race did run through d


# -- item 11: a tree deeper than any recursion limit -----------------------------------------------

DEPTH = 2000


@pytest.fixture
def deep_root(tmp_path: Path) -> Iterator[Path]:
    """``d/d/.../d/bottom.txt``, DEPTH levels, built and removed by descriptors (its paths
    are longer than PATH_MAX)."""
    root = tmp_path / "deep"
    root.mkdir()
    (root / "top.txt").write_text("needle top\n")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(DEPTH):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    out = os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(out, b"needle bottom\n")
    os.close(out)
    os.close(fd)
    yield root
    # Bottom-up without recursion: hoist the second level over the first, drop the first.
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while os.path.lexists(root / "d"):
            d = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
            for name in os.listdir(d):
                if name == "d":
                    os.rename("d", "up", src_dir_fd=d, dst_dir_fd=top)
                else:
                    os.unlink(name, dir_fd=d)
            os.close(d)
            os.rmdir("d", dir_fd=top)
            if os.path.lexists(root / "up"):
                os.rename("up", "d", src_dir_fd=top, dst_dir_fd=top)
    finally:
        os.close(top)


def test_a_2000_level_tree_is_listed_read_and_searched(deep_root: Path):
    deep = "d/" * DEPTH
    with RepoTools(deep_root) as tools:
        assert tools.list_dir() == "d/\ntop.txt (11 bytes)"
        assert tools.list_dir(deep) == "bottom.txt (14 bytes)"
        assert tools.read_file(deep + "bottom.txt") == "1\tneedle bottom\n"
        assert tools.read_file(deep + "../" * DEPTH + "top.txt") == "1\tneedle top\n"
        found = tools.search("needle").splitlines()
        assert found[0] == "top.txt:1: needle top"
        assert found[-1] == "[agent] directories more than 128 levels down were not searched"
        near = "d/" * (DEPTH - 3)
        assert tools.search("needle", near) == f"{deep}bottom.txt:1: needle bottom"
        assert tools.search("needle", deep + "bottom.txt") == f"{deep}bottom.txt:1: needle bottom"


# -- item 12: files bigger than the coordinator should ever hold -----------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _write_big(path: Path, chunk: bytes, total: int) -> None:
    with open(path, "wb") as f:
        for _ in range(total // len(chunk)):
            f.write(chunk)


def test_huge_files_leave_the_coordinators_memory_alone(tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    line = b"x" * 63 + b"\n"
    _write_big(root / "lines.txt", line * 16384, 48 << 20)  # 48 MiB, 786432 lines
    _write_big(root / "oneline.txt", b"y" * (1 << 20), 150 << 20)  # 150 MiB, no newline
    with RepoTools(root, timeout=60) as tools:
        tools.list_dir()  # the tool process is up before measuring
        gc.collect()
        try:  # reset the peak, so VmHWM measures this test alone
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        before = _status_kb("VmRSS")
        first = tools.read_file("lines.txt", limit=50)
        late = tools.read_file("lines.txt", offset=786400, limit=1000)
        single = tools.read_file("oneline.txt")
        searched = tools.search("y{10}")
        via_guard = execute_tool_call(call("read_file", {"path": "oneline.txt", "limit": 1000}), tools.functions())
        peak = max(_status_kb("VmHWM"), _status_kb("VmRSS"))
    assert first.startswith("1\t" + "x" * 63 + "\n2\t")
    assert first.endswith("[agent] showing lines 1-50 of 786432 — call again with offset=51 for more")
    assert late.startswith("786400\t") and late.endswith("786432\t" + "x" * 63 + "\n")
    assert single.startswith("1\t" + "y" * 3000)
    assert single.endswith(f"…[agent] line cut at 4000 of {150 << 20} bytes\n")
    assert len(single) < 8000
    assert via_guard == single
    assert searched == "no matches for 'y{10}' under ."  # both are over the search size cap
    assert peak - before < 100 * 1024, f"coordinator RSS {before} kB -> peak {peak} kB"


# -- item 4: paths excluded from the tools (other runs' workspaces and transcripts) ----------------

SECRET = "EXCLUDED-" + secrets.token_hex(6)


@pytest.fixture
def batch_root(tmp_path: Path) -> Path:
    """A tools root holding a batch's runs directory and results file, and links into them."""
    root = tmp_path / "project"
    (root / "runs" / "r2" / "workspace").mkdir(parents=True)
    (root / "runs" / "r2" / "workspace" / "secret.txt").write_text(SECRET + "\n")
    (root / "runs" / "r2" / "transcript.jsonl").write_text(json.dumps({"msg": SECRET}) + "\n")
    (root / "results.jsonl").write_text(json.dumps({"answer": SECRET}) + "\n")
    (root / "sub").mkdir()
    (root / "sub" / "ok.txt").write_text("fine\n")
    os.symlink(root / "runs" / "r2", root / "peek")  # absolute
    os.symlink("runs/r2", root / "peek_rel")  # relative
    os.symlink("results.jsonl", root / "res")
    os.symlink("..", root / "sub" / "up")
    os.symlink("../sub/../runs", root / "sub" / "around")
    os.link(root / "results.jsonl", root / "copy.jsonl")  # the same file under another name
    return root


def test_excluded_paths_are_invisible_by_any_spelling(batch_root: Path, tmp_path: Path):
    os.symlink(batch_root / "runs", tmp_path / "runs_alias")
    exclude = [tmp_path / "runs_alias", batch_root / "results.jsonl"]  # given through a link, too
    with RepoTools(batch_root, exclude=exclude) as tools:
        assert tools.exclude == [batch_root / "runs", batch_root / "results.jsonl"]
        assert tools.list_dir() == ("peek (unreadable)\npeek_rel (unreadable)\nres (unreadable)\nsub/")
        assert tools.list_dir("sub") == "around (unreadable)\nok.txt (5 bytes)\nup/"
        for path in ["runs", "runs/r2", "./runs/", "sub/../runs/r2", "sub/up/runs", "sub/around",
                     "peek", "peek_rel", "peek/workspace", str(batch_root / "runs"), "runs/../sub"]:
            assert outcome(tools.list_dir, path) == f"ToolError: not a directory: {path}", path
            assert outcome(tools.search, "EXCLUDED", path) == f"ToolError: not a directory: {path}", path
        for path in ["results.jsonl", "res", "copy.jsonl", "sub/up/results.jsonl", "./runs/../results.jsonl",
                     "runs/r2/workspace/secret.txt", "peek/workspace/secret.txt", "peek_rel/transcript.jsonl",
                     "sub/around/r2/transcript.jsonl", str(batch_root / "results.jsonl")]:
            assert outcome(tools.read_file, path) == f"ToolError: no such file: {path}", path
            assert outcome(tools.search, "EXCLUDED", path) == f"ToolError: not a directory: {path}", path
        assert tools.search("EXCLUDED|fine") == "sub/ok.txt:1: fine"
        assert tools.search("EXCLUDED", "sub") == "no matches for 'EXCLUDED' under sub"
    with RepoTools(batch_root) as open_tools:  # without the exclusion: the tree does hold them
        assert SECRET in open_tools.read_file("peek/workspace/secret.txt")
        assert SECRET in open_tools.read_file("copy.jsonl")


def test_excluded_paths_stay_invisible_during_a_swap_race(batch_root: Path):
    (batch_root / "x").mkdir()
    (batch_root / "x" / "secret.txt").write_text("decoy\n")
    os.symlink("runs/r2/workspace", batch_root / "x_link")
    with RepoTools(batch_root, exclude=[batch_root / "runs", batch_root / "results.jsonl"]) as tools:
        calls = [
            lambda: tools.read_file("x/secret.txt"),
            lambda: tools.list_dir("x"),
            lambda: tools.search("EXCLUDED|decoy", "x"),
            lambda: tools.search("EXCLUDED|decoy"),
            lambda: tools.list_dir("."),
        ]
        with flipping(batch_root / "x", batch_root / "x_link") as swaps:
            seen = race(calls)
        assert swaps[0] > 0
    text = "\n".join(seen)
    assert SECRET not in text and "failed" not in text
    assert "1\tdecoy" in text  # the race did run through x


def test_a_root_inside_an_excluded_path_is_refused(batch_root: Path):
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="lies inside the excluded path"):
        RepoTools(batch_root / "runs" / "r2", exclude=[batch_root / "runs"])


# -- the tool process: confined, and never left behind ----------------------------------------------

def _server(pid: int) -> int:
    """The Python serving the tools: ``pid`` itself, or the innermost process bubblewrap runs."""
    from engine.launch import descendants

    for candidate in [*reversed(descendants(pid)), pid]:
        with open(f"/proc/{candidate}/comm") as f:
            if f.read().startswith("python"):
                return candidate
    return pid


def test_the_tool_process_is_confined_and_holds_no_secrets(evil_root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LLM_API_KEY", "sk-agentloop-tools-" + secrets.token_hex(8))
    secret = evil_root.parent / "outside" / "key.txt"
    secret.parent.mkdir()
    secret.write_text("outside the root\n")
    with RepoTools(evil_root) as tools:
        tools.list_dir()
        pid = _server(tools.pid)
        assert pid is not None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if kv)
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        # The workers' allowlist and nothing else (PWD: bubblewrap says where it started it).
        assert set(env) <= {name.encode() for name in (*ENV_ALLOWLIST, "PWD")}, env
        assert b"LLM_API_KEY" not in env and not any(b"sk-agentloop-tools-" in v for v in env.values())
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert argv[1:3] == [b"-I", b"-S"]
        assert status["NoNewPrivs"].strip() == "1"
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
        layers = tools.confinement
        assert "rlimits" in layers and "no_new_privs" in layers
        if _confine.seccomp_supported():
            assert status["Seccomp"].strip() == "2" and "seccomp" in layers
        if _confine.landlock_abi() >= 1:
            assert any(layer.startswith("landlock") for layer in layers)
        if pid != tools.pid:  # in bubblewrap: its view holds the root, not what lies beside it
            assert os.path.exists(f"/proc/{pid}/root{evil_root}/plain.txt")
            assert not os.path.exists(f"/proc/{pid}/root{secret.parent}")


def test_no_tool_process_is_left_behind(evil_root: Path):
    with RepoTools(evil_root) as tools:
        tools.list_dir()
        pid = tools.pid
    assert pid is not None and not alive(pid)  # close() killed and reaped it
    dropped = RepoTools(evil_root)  # dropped without close(): the collector ends it
    dropped.functions()["list_dir"]()
    pid = dropped.pid
    del dropped
    gc.collect()
    assert pid is not None and wait_until(lambda: not alive(pid), 10)


@pytest.mark.parametrize("ending, code", [("os.kill(os.getpid(), signal.SIGKILL)", -9),
                                          ("sys.exit(3)", 3)], ids=["killed", "exits"])
def test_the_tool_process_ends_with_its_coordinator(evil_root: Path, ending: str, code: int):
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from engine.tools import RepoTools
tools = RepoTools({str(evil_root)!r})
tools.list_dir()
print(tools.pid, flush=True)
{ending}
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    pid = int(done.stdout)
    assert wait_until(lambda: not alive(pid), 10), f"tool process {pid} outlived its coordinator"
