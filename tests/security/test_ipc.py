"""The coordinator's sockets: another worker's channel, another run's, a host service's unix
socket, and forged frames on the worker's own channel.

A worker's view holds its own socket directory only, so other runs' channels do not exist for
it and other workers' are absent or, where visible, not its to connect to; on its own channel
the coordinator hears only the peer that completed the handshake, so a second connection's
frames are dropped."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from engine.workers import Engine

from .harness import (
    ABSENT,
    WAIT,
    Host,
    agent_attack,
    assert_still_works,
    attack,
    block,
    needs_namespaces,
)

pytestmark = pytest.mark.attack

# Another worker's socket: absent from the worker's view, or there but not its to connect to.
REFUSED = (ABSENT, "PermissionError EACCES")


def _socket_paths(engine: Engine) -> list[str]:
    assert engine.launcher.sock_root is not None
    return sorted(str(p / "sock") for p in engine.launcher.sock_root.glob("w*"))  # (gone once connected)


def _own_socket(worker) -> str:
    """The socket the coordinator bound for this worker's current process."""
    return str(worker.session.sock_dir / "sock")


async def test_other_workers_and_runs_sockets_are_unreachable(engine, worker, host: Host):
    needs_namespaces()
    victim = await engine.start_worker("victim")
    async with Engine(cwd=host.cwd, state_dir=host.root / "other-state",
                      workspace=host.root / "other-workspace") as other_run:
        stranger = await other_run.start_worker("stranger")
        own = _own_socket(worker)
        others = _socket_paths(engine) + _socket_paths(other_run)
        assert own in others and len(others) >= 3  # and the victim's, the stranger's, idle workers'
        with socket.socket(socket.AF_UNIX) as service:  # a host service's pathname socket
            service.bind(str(host.outside / "service.sock"))
            service.listen()
            got = await attack(worker, f'''
import socket
for path in {others + [str(host.outside / "service.sock")]!r}:
    probe("connect:" + path, lambda: socket.socket(socket.AF_UNIX).connect(path))
probe("runtime_dir", lambda: _os.listdir({str(engine.launcher.sock_root.parent)!r}))
''')
            service.setblocking(False)
            with pytest.raises(BlockingIOError):
                service.accept()
        assert got["connect:" + str(host.outside / "service.sock")] == ABSENT, got.probes
        for path in _socket_paths(other_run):
            assert got["connect:" + path] == ABSENT, (path, got.probes)
        for path in _socket_paths(engine):
            if path != own:
                assert got["connect:" + path] in REFUSED, (path, got.probes)
        assert got["runtime_dir"] == f"ok [{engine.launcher.sock_root.name!r}]", got.probes
        for w in (victim, stranger):
            result = await w.run("print('untouched')", timeout=WAIT)
            assert result.output == "untouched\n", result
    await assert_still_works(worker)


async def test_other_workers_socket_directories_are_not_visible(engine, worker):
    """What the mount namespace promises: of the run's socket directories, the worker's view
    holds its own only (it cannot even learn how many workers the run has)."""
    needs_namespaces()
    victim = await engine.start_worker("victim")
    got = await attack(worker, f'probe("run_dir", lambda: sorted(_os.listdir({str(engine.launcher.sock_root)!r})))\n')
    own = _own_socket(worker).split("/")[-2]
    assert got["run_dir"] == f"ok [{own!r}]", got.probes
    result = await victim.run("print('untouched')", timeout=WAIT)
    assert result.output == "untouched\n", result
    await assert_still_works(worker)


async def test_forged_frames_on_the_own_channel_are_dropped(worker, caplog):
    """A second connection to the worker's own socket tries to forge output and a `done` for a
    block that is running: the socket's file is gone once the worker is in, so nothing reaches
    the coordinator, and the block ends when it really ends, with its real output only."""
    caplog.set_level(logging.WARNING, logger="agentloop")
    setup = await worker.run("import threading\nrelease = threading.Event()", timeout=WAIT)
    assert setup.ok, setup
    victim = asyncio.ensure_future(worker.run(
        f"print('genuine' if release.wait({WAIT}) else 'never released')", timeout=2 * WAIT, block_id="victim"))
    got = await attack(worker, f'''
import msgpack, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect("ipc://" + {_own_socket(worker)!r})
forged = [
    {{"t": "hello", "v": 1, "token": "0" * 32, "pid": 1}},
    {{"t": "out", "id": "victim", "o": [[1, b"forged output\\n"]]}},
    {{"t": "done", "id": "victim", "status": "ok", "error": "", "vars": ["forged"]}},
]
for msg in forged:
    s.send(msgpack.packb(msg, use_bin_type=True))
s.send(b"\\xc1 not msgpack")
s.close()
ctx.term()
print("forged: sent", len(forged) + 1)
''')
    assert got["forged"] == "sent 4", got.probes

    assert not victim.done()
    released = await worker.run("release.set()", timeout=WAIT)
    assert released.ok, released
    result = await asyncio.wait_for(victim, WAIT)
    assert (result.status, result.output) == ("ok", "genuine\n"), result
    assert "dropped a frame" not in caplog.text  # no forged frame ever arrived
    await assert_still_works(worker)


async def test_agent_cannot_reach_other_sockets(engine, host: Host):
    needs_namespaces()
    victims = [await engine.start_worker(f"victim{i}") for i in range(2)]
    paths = _socket_paths(engine)
    code = f'''
import socket
reached = []
for path in {paths!r}:
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        reached.append(path)
    except OSError:
        pass
print("reached:", len(reached))
'''
    run = await agent_attack(engine, block("attack", code), name="sockets")
    # At most one: the agent's own, when its worker came from the idle pool listed above.
    reached = int(run.blocks["attack"].split("reached:")[1].split()[0])
    assert reached <= 1, run.blocks
    for victim in victims:
        result = await victim.run("print('untouched')", timeout=WAIT)
        assert result.output == "untouched\n", result
    run.assert_kept_working()
