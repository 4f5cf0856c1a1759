"""The coordinator against its own workers: a hostile worker must not freeze, flood or crash it.

Deep directory trees where the coordinator walks (the workspace, the worker's socket
directory, a batch run's directory), an endless output line, a heartbeat flood, a burst of
sub-agents, and garbage on the worker's own channel to the coordinator.  Each attack runs
through real sandboxed workers, real ZeroMQ and, for the agent loop, the scripted model
server; each ends in a bounded, worded outcome and a coordinator that goes on working.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

from engine.agent import _subagents as subagents
from engine.agent import run_task
from engine.agent._loop import MAX_AGENT_NAME
from engine.batch.run import _clear
from engine.models import ModelConfig, ModelRegistry
from engine.observe import ConsoleDisplay
from engine.sandbox import workspace_excess
from engine.scripted import ScriptedServer
from engine.trees import disk_usage, remove_tree
from engine.workers import Engine, WorkerState
from worker.contract.limits import MAX_DISPLAYS

from .harness import WAIT, Host, agent_attack, assert_still_works, attack, block

pytestmark = pytest.mark.attack


@pytest.fixture(autouse=True)
def _no_deep_tree_left(tmp_path: Path):
    """Set up first, so torn down last: whatever a test left in its tmp directory goes, even
    when it failed.  pytest removes old tmp directories with shutil.rmtree, which a deep tree
    left behind would make fail, in every later session on this machine."""
    yield
    for entry in list(tmp_path.iterdir()):
        remove_tree(entry)

# -- 11: deep directory trees ----------------------------------------------------------------

DEPTH = 2000


def deep_tree(directory: str, outside: Path) -> str:
    """Attack code: a DEPTH-level tree under ``directory``, a file and a symlink to the host's
    ``outside`` directory at every level (fd-relative: no path is ever longer than one name)."""
    return f'''
fd = _os.open({directory!r}, _os.O_RDONLY)
for level in range({DEPTH}):
    _os.mkdir("d", dir_fd=fd)
    below = _os.open("d", _os.O_RDONLY, dir_fd=fd)
    _os.close(fd)
    fd = below
    _os.close(_os.open("f", _os.O_WRONLY | _os.O_CREAT, 0o600, dir_fd=fd))
    _os.symlink({str(outside)!r}, "out", dir_fd=fd)
_os.close(fd)
print("built", {DEPTH}, flush=True)
'''


def _plant(outside: Path) -> Path:
    keep = outside / "keep.txt"
    keep.write_text("host data\n")
    return keep


async def test_deep_workspace_tree_is_measured_removed_and_cleared_by_batch(engine: Engine, worker, host: Host):
    keep = _plant(host.outside)
    got = await attack(worker, deep_tree(str(host.workspace), host.outside))
    assert got.result.ok and "built 2000" in got.result.output, got.result
    # The workspace size check between blocks, and the measure of the tree, at full depth.
    assert await asyncio.to_thread(workspace_excess, engine.settings.sandbox, host.workspace) is None
    assert await asyncio.to_thread(disk_usage, host.workspace) > 0
    await assert_still_works(worker)
    await engine.shutdown()  # the fixture's shutdown then does nothing
    # What batch does before an attempt: remove the workspace (and state) a worker wrote.
    await asyncio.to_thread(_clear, host.root, False)
    assert not host.workspace.exists() and not host.state.exists()
    assert keep.read_text() == "host data\n"  # the symlinks were removed, not followed


async def test_deep_tree_in_the_socket_directory_is_removed_with_the_worker(engine: Engine, worker, host: Host):
    keep = _plant(host.outside)
    sock_dir = worker.session.sock_dir
    code = ("import gc, zmq\n"
            "ch = next(o for o in gc.get_objects() if type(o).__name__ == 'Channel')\n"
            "sock_dir = _os.path.dirname(ch.sock.getsockopt_string(zmq.LAST_ENDPOINT)[len('ipc://'):])\n"
            "try:\n" + _indent(deep_tree("SOCK_DIR", host.outside).replace("'SOCK_DIR'", "sock_dir")) +
            "except OSError:  # read-only (EROFS), or not its own (EACCES)\n    print('denied', flush=True)\n")
    got = await attack(worker, code)
    assert got.result.ok and re.search(r"^(built 2000|denied)$", got.result.output, re.M), got.result
    if "denied" in got.result.output:
        # This sandbox keeps the socket directory read-only to the worker; a weaker one (no
        # bubblewrap, or --sandbox none) does not.  Build the same tree as such a worker would.
        _deep_tree_on_host(sock_dir, host.outside)
    assert (sock_dir / "d" / "d").is_dir()
    await worker.restart()  # the kill releases the socket directory, tree and all
    assert not sock_dir.exists()
    await assert_still_works(worker)
    await engine.shutdown()
    assert keep.read_text() == "host data\n"


def _indent(code: str) -> str:
    return "".join(f"    {line}\n" for line in code.strip("\n").splitlines())


def _deep_tree_on_host(directory: Path, outside: Path) -> None:
    """What ``deep_tree`` makes a worker do, done here."""
    fd = os.open(directory, os.O_RDONLY)
    for _ in range(DEPTH):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = below
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.symlink(outside, "out", dir_fd=fd)
    os.close(fd)


async def test_agent_run_survives_a_deep_workspace_tree(engine: Engine, host: Host):
    run = await agent_attack(engine, block("attack", deep_tree(str(host.workspace), host.outside)),
                             name="deep tree")
    assert "built 2000" in run.blocks["attack"], run.blocks
    run.assert_kept_working()
    assert remove_tree(host.workspace / "d") and not (host.workspace / "d").exists()


# -- 12: memory amplification ----------------------------------------------------------------

ENDLESS_LINE = 150 << 20


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


async def test_an_endless_line_keeps_the_coordinator_memory_bounded(engine: Engine, host: Host):
    # The live console display of `agentloop run`, writing nowhere: it is what split and joined
    # the line before.
    with open(os.devnull, "w") as sink:
        display = ConsoleDisplay(Console(file=sink, force_terminal=False, width=120))
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: measure this test alone
        except OSError as exc:
            pytest.skip(f"cannot reset this process's peak memory (VmHWM) to measure: {exc}")
        baseline = _status_kib("VmRSS")
        code = (f"import sys\nsys.stdout.write('x' * {ENDLESS_LINE})\nsys.stdout.flush()\n"
                "print('', flush=True)\nprint('tail line')\n")
        task = "security check: endless line"
        with ScriptedServer({task: [block("attack", code, timeout="120s"),
                                    '<run_code id="after">\nprint(6 * 7)\n</run_code>', "contained"]}) as server:
            result = await run_task(task, models=_models(server), engine=engine, display=display, timeout=180)
        peak = _status_kib("VmHWM")
    rise_mib = (peak - baseline) / 1024
    print(f"coordinator VmHWM rise while a block printed a {ENDLESS_LINE >> 20} MiB line: {rise_mib:.1f} MiB")
    assert result.status == "answered", result
    texts = "".join(m["content"] for body in server.requests for m in body["messages"] if m["role"] == "user")
    kept = re.search(r"\[\.\.\. \d+ bytes cut; the whole output is in (\S+) \.\.\.\]", texts)
    assert kept, texts[-3000:]
    Path(kept.group(1)).unlink()  # 150 MiB the tmp directory need not keep
    assert "tail line" in texts and "42" in texts
    assert rise_mib < 100, f"the coordinator grew by {rise_mib:.0f} MiB"


def _models(server: ScriptedServer) -> ModelRegistry:
    return ModelRegistry({"default": ModelConfig(alias="default", base_url=server.url, model="scripted",
                                                 timeout=WAIT)}, "default")


# -- 13: heartbeat floods --------------------------------------------------------------------

def _until(seen_text: str, then: str):
    """A scripted turn: ``then`` once ``seen_text`` reached the model, else a plain wait."""
    def turn(body: dict) -> str:
        seen = "".join(m["content"] for m in body["messages"] if m["role"] == "user")
        return then if seen_text in seen else "waiting"
    return turn


SLOW_BLOCK = '<run_code id="slow" timeout="30s"{hb}>\nimport time\nfor i in range(6):\n' \
             '    print("tick", i, flush=True)\n    time.sleep(0.5)\nprint("slept")\n</run_code>'


@pytest.mark.parametrize("how", ["run_agent tag", "self.run_agent", "run_code tag"])
async def test_a_one_millisecond_heartbeat_does_not_flood_the_model(engine: Engine, how: str):
    if how == "run_agent tag":
        first = '<run_agent name="ticker" heartbeat="1ms">child: sleep a while</run_agent>'
    elif how == "self.run_agent":
        first = ('<run_code>\nh = self.run_agent("child: sleep a while", name="ticker", heartbeat=0.001)\n'
                 'print("started", h.name)\n</run_code>')
    else:
        first = SLOW_BLOCK.format(hb=' heartbeat="1ms"')
    done_marker = "slept" if how == "run_code tag" else "<agent_result name=ticker"
    script = {"parent: watch the ticker": [first] + [_until(done_marker, "all done")] * 40,
              "child: sleep a while": [SLOW_BLOCK.format(hb=' heartbeat="1ms"')] + [_until("slept", "child done")] * 40}
    started = time.monotonic()
    with ScriptedServer(script) as server:
        result = await run_task("parent: watch the ticker", models=_models(server), engine=engine, timeout=90)
    elapsed = time.monotonic() - started
    assert result.status == "answered" and result.answer == "all done", result
    parent = server.conversation("parent: watch the ticker")
    child = server.conversation("child: sleep a while")
    # At most one message per second caused by heartbeats, plus the start, results and answers.
    print(f"{how}: {len(parent)} parent and {len(child)} child requests in {elapsed:.1f} s")
    assert len(parent) <= elapsed + 4, (len(parent), elapsed)
    assert len(child) <= elapsed + 4, (len(child), elapsed)
    assert len(parent) <= 12 and len(child) <= 12
    beats = "".join(m["content"] for b in parent for m in b["messages"] if m["role"] == "user")
    assert "<agent_status name=ticker" in beats or "<running id=slow" in beats


async def test_heartbeats_of_many_sources_share_one_message_per_second(engine: Engine):
    blocks = "\n".join(SLOW_BLOCK.replace('id="slow"', f'id="slow{i}"').format(hb=' heartbeat="1ms"')
                       for i in range(3))
    first = blocks + '\n<run_agent name="ticker" heartbeat="1ms">child: sleep a while</run_agent>'

    def turn(body: dict) -> str:
        seen = "".join(m["content"] for m in body["messages"] if m["role"] == "user")
        done = seen.count("<run_code_result id=slow") == 3 and "<agent_result name=ticker" in seen
        return "all done" if done else "waiting"

    script = {"parent: many tickers": [first] + [turn] * 40,
              "child: sleep a while": [SLOW_BLOCK.format(hb="")] + [_until("slept", "child done")] * 40}
    started = time.monotonic()
    with ScriptedServer(script) as server:
        result = await run_task("parent: many tickers", models=_models(server), engine=engine, timeout=90)
    elapsed = time.monotonic() - started
    assert result.status == "answered" and result.answer == "all done", result
    parent = server.conversation("parent: many tickers")
    print(f"4 heartbeat sources at 1ms: {len(parent)} parent requests in {elapsed:.1f} s")
    assert len(parent) <= elapsed + 6, (len(parent), elapsed)
    messages = [b["messages"][-1]["content"] for b in parent]
    assert any(m.count("<running id=slow") >= 2 and "<agent_status name=ticker" in m for m in messages), messages


# -- 14: unbounded sub-agents ----------------------------------------------------------------

FAN_OUT = '''
hs, refused = [], []
for i in range(40):
    try:
        hs.append(self.run_agent(f"child job {i}", name=f"w{i}"))
    except Exception as exc:
        refused.append(str(exc))
print("started", len(hs), "refused", len(refused))
print("refusal:", refused[0] if refused else "")
print("live workers", await census())
self.cancel_subagents()
'''


async def test_forty_sub_agents_at_once_are_bounded_and_refused_in_words(engine: Engine):
    async def census() -> int:
        """The worker processes this run holds (the coordinator counts)."""
        return sum(1 for w in engine.workers if w.state is not WorkerState.CLOSED)

    child = ['<run_code>\nimport time\ntime.sleep(20)\n</run_code>', "child done"]
    script = {"parent: fan out": [f"<run_code id=\"fan\" timeout=\"60s\">\n{FAN_OUT}</run_code>",
                                  _until("<agent_result", "all done")] + ["waiting"] * 60,
              "child job": child}
    with ScriptedServer(script) as server:
        result = await run_task("parent: fan out", models=_models(server), engine=engine, timeout=120,
                                functions={"census": census})
    assert result.status == "answered", result
    texts = "".join(m["content"] for b in server.conversation("parent: fan out")
                    for m in b["messages"] if m["role"] == "user")
    assert "started 8 refused 32" in texts, texts[:2000]
    assert "8 sub-agents working, its limit (max_subagents=8)" in texts
    assert "wait for one to finish" in texts and "cancel" in texts
    live = int(re.search(r"live workers (\d+)", texts).group(1))
    print("workers while 40 sub-agents were asked for:", live)
    assert live <= 1 + 8, live


ONE_AFTER_ANOTHER = '''
first = self.run_agent("child job first", name="first")
print("first:", await first)
for i in range(12):
    print(await self.run_agent(f"child job {i}", name=f"s{i}"), end=" ")
print()
print("live workers", await census())
try:
    first.new_task("child job again")
except Exception as exc:
    print("follow-up:", exc)
print("first still says:", first.result())
'''


async def test_sub_agents_one_after_another_do_not_pile_up_workers(engine: Engine):
    async def census() -> int:
        return sum(1 for w in engine.workers if w.state is not WorkerState.CLOSED)

    script = {"parent: one after another": [f'<run_code id="seq" timeout="90s">\n{ONE_AFTER_ANOTHER}</run_code>',
                                            "all done"],
              "child job": ["answered"]}
    with ScriptedServer(script) as server:
        result = await run_task("parent: one after another", models=_models(server), engine=engine,
                                timeout=120, functions={"census": census})
    assert result.status == "answered", result
    text = server.conversation("parent: one after another")[1]["messages"][-1]["content"]
    assert "first: answered" in text and "answered " * 12 in text, text
    live = int(re.search(r"live workers (\d+)", text).group(1))
    print("workers after 13 sub-agents one after another:", live)
    assert live <= 1 + 8, text
    assert "follow-up: sub-agent 'first' was closed to make room for newer ones" in text, text
    assert "first still says: answered" in text


async def test_sub_agent_tags_beyond_the_limit_are_answered_with_an_error(engine: Engine):
    tags = "\n".join(f'<run_agent name="k{i}">kid task {i}</run_agent>' for i in range(5))
    script = {"parent: tags": [tags, _until("<agent_result name=k1", "done")] + ["waiting"] * 40,
              "kid task": ["kid answer"]}
    with ScriptedServer(script) as server:
        result = await run_task("parent: tags", models=_models(server), engine=engine, timeout=60,
                                max_subagents=2)
    assert result.status == "answered", result
    second = server.conversation("parent: tags")[1]["messages"][-1]["content"]
    refused = re.findall(r"<error name=(k\d)>\nCould not start this sub-agent: this run already has 2 "
                         r"sub-agents working", second)
    assert refused == ["k2", "k3", "k4"], second


START_AND_CANCEL = '''
try:
    self.run_agent("child job", name="n" * 100_000)
except Exception as exc:
    print("long name:", exc)
started = 0
try:
    for i in range(MAX_STARTED + 50):
        handle = self.run_agent("child job", name=f"c{i}")
        started += 1
        handle.cancel()
        await handle  # its [cancelled]: the next one finds its slot free
except Exception as exc:
    print("refused after", started, "-", exc)
'''


async def test_starting_and_cancelling_sub_agents_in_a_loop_is_bounded(engine: Engine, monkeypatch):
    """Every sub-agent is kept, by the name the code chose, until the run ends: the names are
    short and their number is bounded, so a loop of starts and cancels cannot grow the
    coordinator without end.  (The bound scaled down, so that the loop takes seconds.)"""
    monkeypatch.setattr(subagents, "MAX_STARTED", 30)
    code = START_AND_CANCEL.replace("MAX_STARTED", "30")
    script = {"parent: start and cancel": [f'<run_code id="loop" timeout="120s">\n{code}</run_code>', "all done"],
              "child job": ["waiting"] * 4}
    with ScriptedServer(script) as server:
        result = await run_task("parent: start and cancel", models=_models(server), engine=engine, timeout=180)
    assert result.status == "answered", result
    text = server.conversation("parent: start and cancel")[1]["messages"][-1]["content"]
    assert f"long name: a sub-agent's name is a string of at most {MAX_AGENT_NAME} characters" in text, text
    assert "refused after 30 - this run has started 30 sub-agents, the most one run may" in text, text


# -- 18: garbage on the worker's own channel --------------------------------------------------

#: The start of a PNG (its signature and IHDR chunk, 64x48): what a display's image must begin with.
PNG_HEADER = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00@\x00\x00\x000\x08\x06\x00\x00\x00"

# The worker's code finds its channel (its socket and the lock around it) and writes on it.
FIND_CHANNEL = '''
import gc, time
import zmq
channel = next(o for o in gc.get_objects() if type(o).__name__ == "Channel")
def send(*frames):
    with channel._lock:
        channel.sock.send_multipart(list(frames))
'''

GARBAGE = {
    "not msgpack": 'send(b"\\xc1 this is not msgpack")',
    "oversized map": 'send(b"\\xdf\\xff\\xff\\xff\\xff")',
    "unknown type": 'import msgpack\nsend(msgpack.packb({"t": "evil", "id": "x"}))',
    "many parts": 'send(*[b"part"] * 100_000)',
    "oversized frame": 'send(b"\\x00" * (33 << 20))',
    "malformed output": 'import msgpack\nsend(msgpack.packb({"t": "out", "id": "x", "o": [[1, "str, not bytes"]]}))',
    # Forged displays: a PNG that is text, one over the bound, a frame cut short, data that is
    # no PNG, a MIME type that is not carried, and more displays than a block may send.
    "a display of the wrong type": 'import msgpack\nsend(msgpack.packb({"t": "display", "id": "x", '
                                   '"data": {"image/png": "not bytes"}}))',
    "a huge display": 'import msgpack\nsend(msgpack.packb({"t": "display", "id": "x", "data": {"image/png": '
                      f'{PNG_HEADER!r} + bytes(5 << 20)}}}}))',
    "a truncated display": 'import msgpack\nsend(msgpack.packb({"t": "display", "id": "x", "data": {"image/png": '
                           f'{PNG_HEADER!r} + bytes(1000)}}}})[:-500])',
    "a display that is no PNG": 'import msgpack\nsend(msgpack.packb({"t": "display", "id": "x", '
                                '"data": {"image/png": b"GIF89a" + bytes(100)}}))',
    "a display of a type not carried": 'import msgpack\nsend(msgpack.packb({"t": "display", "id": "x", '
                                       '"data": {"application/x-evil": "x"}}))',
    "too many displays": 'import msgpack\nfrom worker.capture import current_block\n'
                         'for i in range(MAX_DISPLAYS + 1):\n'
                         '    send(msgpack.packb({"t": "display", "id": current_block.get(), '
                         f'"data": {{"image/png": {PNG_HEADER!r}}}}}))\n'.replace("MAX_DISPLAYS", str(MAX_DISPLAYS)),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
async def test_garbage_on_the_own_channel_stops_the_worker_at_once(worker, kind: str):
    await worker.run("canary = 1", timeout=WAIT)
    code = FIND_CHANNEL + GARBAGE[kind] + '\nprint("sent", flush=True)\ntime.sleep(120)\n'
    result = await _stopped_for_the_protocol(worker, code)
    assert "and was stopped; the namespace was reset (lost variables: canary)" in result.message


async def _stopped_for_the_protocol(worker, code: str):
    """Run ``code``: the worker must be stopped at once for breaking the protocol, and its
    replacement must work.  The block's result."""
    started = time.monotonic()
    got = await attack(worker, code, timeout=60)
    took = time.monotonic() - started
    assert took < 10, f"the block waited {took:.1f} s for its deadline"
    assert got.result.status == "killed" and got.result.worker_killed, got.result
    assert got.result.message.startswith("the worker broke the protocol ("), got.result.message
    assert worker.state is not WorkerState.CLOSED
    await assert_still_works(worker)
    return got.result


# -- 18b: garbage in the worker's own output pipe -----------------------------------------------

# The worker's code finds the write end of its output pipe (engine.launch) and writes on it.
FIND_PIPE = '''
import gc, os, time
import msgpack
pipe = next(o for o in gc.get_objects() if type(o).__name__ == "PipeWriter")
def write(data):
    os.write(pipe.fd, data)
def frame(msg):
    data = msgpack.packb(msg)
    write(len(data).to_bytes(4, "big") + data)
'''

PIPE_GARBAGE = {
    "a length over the limit": 'write(b"\\xff\\xff\\xff\\xff")',
    "a length of zero": 'write(b"\\x00\\x00\\x00\\x00")',
    "not msgpack": 'write(b"\\x00\\x00\\x00\\x02\\xc1\\xc1")',
    "not output": 'frame({"t": "done", "id": "x", "status": "ok"})',
    "malformed output": 'frame({"t": "out", "id": "x", "o": [[1, "str, not bytes"]]})',
    "a malformed moved chunk": 'frame({"t": "out", "id": "x", "o": [], "raw": [3, 10]})',
    "a moved chunk over the limit": 'frame({"t": "out", "id": "x", "o": [], "raw": [1, 1 << 30]})',
}


@pytest.mark.parametrize("kind", list(PIPE_GARBAGE))
async def test_garbage_in_the_own_output_pipe_stops_the_worker_at_once(worker, kind: str):
    if worker.session.pipes is None:
        pytest.skip(reason="this worker sends its output over its socket")
    await worker.run("canary = 1", timeout=WAIT)
    await _stopped_for_the_protocol(worker, FIND_PIPE + PIPE_GARBAGE[kind] + '\ntime.sleep(120)\n')


async def test_agent_loop_goes_on_after_a_worker_broke_the_protocol(engine: Engine):
    code = FIND_CHANNEL + 'send(b"\\xc1garbage")\ntime.sleep(120)\n'
    started = time.monotonic()
    run = await agent_attack(engine, block("attack", code, timeout="60s"), name="garbage")
    assert time.monotonic() - started < 20
    assert "[the worker broke the protocol (undecodable frame" in run.blocks["attack"], run.blocks
    run.assert_kept_working()


async def test_agent_loop_goes_on_after_a_forged_display(engine: Engine):
    code = (FIND_CHANNEL + 'import msgpack\nsend(msgpack.packb({"t": "display", "id": "x", '
            '"data": {"image/png": "not bytes"}}))\ntime.sleep(120)\n')
    started = time.monotonic()
    run = await agent_attack(engine, block("attack", code, timeout="60s"), name="forged display")
    assert time.monotonic() - started < 20
    assert "[the worker broke the protocol (it sent a malformed message: display.data: a display's image/png " \
           "is not bytes" in run.blocks["attack"], run.blocks
    run.assert_kept_working()


def test_tree_helpers_never_follow_a_symlink(tmp_path: Path):
    keep = tmp_path / "outside" / "keep.txt"
    keep.parent.mkdir()
    keep.write_text("x")
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "link").symlink_to(keep.parent)
    (root / "top").symlink_to(keep.parent)
    assert disk_usage(root) < 64 * 1024
    assert remove_tree(root) and not root.exists()
    assert keep.read_text() == "x"
    link = tmp_path / "link"
    link.symlink_to(keep.parent)
    assert remove_tree(link) and not link.exists() and keep.exists()
