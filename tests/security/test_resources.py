"""Resource exhaustion: memory, disk, file descriptors and output.  Each limit ends the attack
with an error the code can see (MemoryError, EFBIG, ENOSPC, EMFILE) or, for output, a
bounded result with the exact byte count — and the same worker goes on running code."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine.results import HEAD_BYTES, TAIL_BYTES, OutputChunk
from engine.sandbox import SandboxPolicy
from engine.sandbox._plan import MiB
from engine.workers import Engine

from .harness import WAIT, Host, agent_attack, assert_still_works, attack, block, needs_namespaces

pytestmark = pytest.mark.attack


async def _keeps_namespace(worker, pid: int | None) -> None:
    """The attack ended inside the worker: same process, variables intact, code runs."""
    assert worker.pid == pid
    result = await worker.run("print(canary)", timeout=WAIT)
    assert (result.status, result.output) == ("ok", "alive\n"), result
    await assert_still_works(worker)


async def _plant_canary(worker) -> int | None:
    result = await worker.run("canary = 'alive'", timeout=WAIT)
    assert result.ok, result
    return worker.pid


# -- memory (RLIMIT_DATA, 2 GiB by default) --------------------------------------------------

# bytes(n) is calloc'd: the kernel hands out zero pages lazily, so the bomb costs the host no
# real memory, while RLIMIT_DATA counts every byte of it.
MEMORY_GRADUAL = '''
hoard = []
try:
    while True:
        hoard.append(bytes(128 << 20))
except MemoryError:
    print("hoarded:", len(hoard) * 128)
del hoard
'''


async def test_memory_bomb_in_one_allocation(engine, worker):
    pid = await _plant_canary(worker)
    got = await attack(worker, 'probe("alloc", lambda: len(bytes(3 << 30)))\n')
    assert got["alloc"] == "MemoryError", got.probes
    await _keeps_namespace(worker, pid)


async def test_memory_bomb_grows_to_the_limit(engine, worker):
    pid = await _plant_canary(worker)
    got = await attack(worker, MEMORY_GRADUAL)
    limit_mib = engine.settings.sandbox.memory_bytes // MiB
    assert limit_mib // 2 <= int(got["hoarded"]) < limit_mib, got.probes
    await _keeps_namespace(worker, pid)


async def test_agent_memory_bomb(engine):
    run = await agent_attack(engine, block("attack", "hog = bytes(3 << 30)\n"), name="memory")
    assert "MemoryError" in run.blocks["attack"], run.blocks
    run.assert_kept_working()


# -- disk -------------------------------------------------------------------------------------

# Smaller caps than the defaults (1 GiB per file, 512 MiB of /tmp), to keep the suite fast
# and the host's disk untouched; the mechanisms (RLIMIT_FSIZE, a size-capped tmpfs) are the
# same.  /tmp is the smaller of the two so each limit shows on its own.
FILE_CAP, TMP_CAP = 64 * MiB, 32 * MiB

FILL = '''
def fill(path, most):
    chunk = b"\\0" * (1 << 20)
    written = 0
    fd = _os.open(path, _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC, 0o600)
    try:
        while written < most:
            written += _os.write(fd, chunk)
    except OSError as exc:
        return type(exc).__name__ + " " + _errno.errorcode[exc.errno] + " at " + str(written)
    finally:
        _os.close(fd)
    return "no limit up to " + str(written)
'''


@pytest.fixture
async def small_engine(host: Host):
    policy = SandboxPolicy(max_file_bytes=FILE_CAP, tmp_bytes=TMP_CAP)
    async with Engine(cwd=host.cwd, state_dir=host.state, workspace=host.workspace, sandbox=policy) as eng:
        yield eng
    for big in host.workspace.glob("fill*"):
        big.unlink()


def _host_tmp_files(token: str) -> list[str]:
    return [n for n in os.listdir("/tmp") if token in n]


async def test_disk_fill_stops_at_the_file_size_limit(small_engine, host: Host):
    worker = await small_engine.start_worker("attacker")
    pid = await _plant_canary(worker)
    got = await attack(worker, FILL + f'''
print("workspace:", fill({str(host.workspace / "fill")!r}, {4 * FILE_CAP}))
print("second:", fill({str(host.workspace / "fill2")!r}, {4 * FILE_CAP}))
''')
    assert got["workspace"] == f"OSError EFBIG at {FILE_CAP}", got.probes  # SIGXFSZ is ignored
    assert got["second"] == f"OSError EFBIG at {FILE_CAP}", got.probes
    assert (host.workspace / "fill").stat().st_size == FILE_CAP
    await _keeps_namespace(worker, pid)


async def test_disk_fill_of_tmp_stays_in_its_tmpfs(small_engine, host: Host):
    needs_namespaces()
    worker = await small_engine.start_worker("attacker")
    pid = await _plant_canary(worker)
    got = await attack(worker, FILL + f'''
print("tmp:", fill("/tmp/{host.token}", {4 * TMP_CAP}))
print("shm:", fill("/dev/shm/{host.token}", {4 * TMP_CAP}))
''')
    for name in ("tmp", "shm"):
        match = re.fullmatch(r"OSError ENOSPC at (\d+)", got[name])
        assert match and TMP_CAP // 2 < int(match.group(1)) <= TMP_CAP, (name, got.probes)
    assert _host_tmp_files(host.token) == []
    assert not Path("/dev/shm", host.token).exists()
    await _keeps_namespace(worker, pid)


async def test_agent_disk_fill(small_engine, host: Host):
    code = FILL + f'print("filled:", fill({str(host.workspace / "fill")!r}, {4 * FILE_CAP}))\n'
    run = await agent_attack(small_engine, block("attack", code), name="disk")
    assert f"filled: OSError EFBIG at {FILE_CAP}" in run.blocks["attack"], run.blocks
    run.assert_kept_working()


# -- file descriptors (RLIMIT_NOFILE) ---------------------------------------------------------

# The descriptors stay open after the block: the attack does not clean up after itself.
FD_BOMB = '''
held = []
try:
    while True:
        held.append(_os.open("/dev/null", _os.O_RDONLY))
except OSError as exc:
    print("fds:", type(exc).__name__, _errno.errorcode[exc.errno], len(held))
probe("pipe", lambda: _os.pipe())
'''


async def test_fd_exhaustion(engine, worker):
    pid = await _plant_canary(worker)
    got = await attack(worker, FD_BOMB)
    words, _, count = got["fds"].rpartition(" ")
    assert words == "OSError EMFILE", got.probes
    assert 0 < int(count) < engine.settings.sandbox.max_open_files
    assert got["pipe"] == "OSError EMFILE", got.probes
    await _keeps_namespace(worker, pid)


async def test_fd_exhaustion_leaves_the_channel_working(engine, worker):
    """With every descriptor still taken, an ordinary block printing 100 kB (a table, a log)
    must still get its output back to the coordinator."""
    got = await attack(worker, FD_BOMB)
    assert got["fds"].startswith("OSError EMFILE"), got.probes
    result = await worker.run("print('y' * 100_000)", timeout=5)
    assert (result.status, result.output_bytes) == ("ok", 100_001), result
    assert not result.worker_killed, result
    await assert_still_works(worker)


async def test_agent_fd_exhaustion(engine):
    run = await agent_attack(engine, block("attack", FD_BOMB), name="fds")
    assert "fds: OSError EMFILE" in run.blocks["attack"], run.blocks
    run.assert_kept_working()


# -- output flood -----------------------------------------------------------------------------

FLOOD = '''
import sys
chunk = b"x" * (1 << 20)
for _ in range({py_mib}):
    sys.stdout.buffer.write(chunk)
for _ in range({fd_mib}):  # straight to fd 1, as a subprocess or C code would
    view = memoryview(chunk)
    while view:
        view = view[_os.write(1, view):]
'''


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


async def test_output_flood_keeps_the_coordinator_bounded(engine, worker):
    py_mib, fd_mib = 100, 20
    total = (py_mib + fd_mib) * MiB
    baseline, peak, seen = _rss(), [0], [0]

    def sample(chunk: OutputChunk) -> None:
        seen[0] += 1
        if seen[0] % 16 == 0:
            peak[0] = max(peak[0], _rss())

    got = await attack(worker, FLOOD.format(py_mib=py_mib, fd_mib=fd_mib), on_output=sample)
    result = got.result
    try:
        assert result.status == "ok", result.message
        assert result.output_bytes == total and result.truncated
        assert len(result.output.encode()) <= HEAD_BYTES + TAIL_BYTES + 200
        assert f"{total - HEAD_BYTES - TAIL_BYTES} bytes cut" in result.output
        assert result.output_file and os.path.getsize(result.output_file) == total
        assert peak[0] - baseline < 64 * MiB, (baseline, peak[0])
    finally:
        if result.output_file:
            os.unlink(result.output_file)
    await assert_still_works(worker)


async def test_agent_output_flood(engine):
    total = 20 * MiB
    run = await agent_attack(engine, block("attack", FLOOD.format(py_mib=10, fd_mib=10)), name="flood")
    text = run.blocks["attack"]
    cut = int(re.search(r"\[\.\.\. (\d+) bytes cut", text).group(1))
    shown = sum(len(run) for run in re.findall(r"x{100,}", text))
    assert cut + shown == total, (cut, shown)
    assert len(text) < 20_000  # the model reads a budget's worth, not 20 MiB
    for path in engine.output_dir.glob("*.txt"):
        path.unlink()
    run.assert_kept_working()
