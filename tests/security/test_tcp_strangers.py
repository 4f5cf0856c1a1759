"""A worker reached over TCP (``Engine(transport="tcp")``): strangers who dial its port cost
the coordinator nothing — no connection, no buffered byte — and the worker runs on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from engine.sandbox import SandboxPolicy
from engine.workers import Engine

from .harness import WAIT, assert_still_works

pytestmark = pytest.mark.attack

MiB = 1 << 20
STRANGERS = 60

# Strangers, in a process of their own: ``zmq`` ones speak plain ZeroMQ and send a 20 MB
# message each (what grew the coordinator by 1.2 GB); ``raw`` ones open a CurveZMQ handshake
# whose first command claims 20 MB and send all of it but the last byte (ZeroMQ reads a
# handshake command whole before it can refuse it).  Each prints how far it got.
FLOOD = r'''
import select, socket, struct, sys, time
import zmq
host, port, mode, n, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
size = 20 << 20
payload = b"x" * size
kept = []
connected = 0
if mode == "zmq":
    ctx = zmq.Context()
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 0)
        s.connect(f"tcp://{host}:{port}")
        try:
            s.send(payload)
        except zmq.Again:
            pass
        kept.append(s)
else:
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" * 32
    first = greeting + b"\x06" + struct.pack(">Q", size) + b"\x05HELLO" + payload[:size - 7]
    for _ in range(n):  # all dialled at once
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        kept.append(s)
    _, ready, _ = select.select([], kept, [], 3)
    for s in ready:
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            connected += 1
            s.setblocking(True)
            s.settimeout(3)
            try:
                s.sendall(first)
            except OSError:
                pass
print(f"connected {connected}", flush=True)
time.sleep(hold)
'''


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("mode", ["zmq", "raw"])
async def test_strangers_on_a_workers_tcp_port_cost_the_coordinator_nothing(mode: str, tmp_path: Path):
    (tmp_path / "project").mkdir()
    policy = SandboxPolicy(network=True)  # the worker dials the coordinator over the host's loopback
    async with Engine(cwd=tmp_path / "project", state_dir=tmp_path / "state", transport="tcp",
                      sandbox=policy) as engine:
        worker = await engine.start_worker("victim")
        session = worker.session
        host, port = session.sock.getsockopt_string(zmq.LAST_ENDPOINT)[len("tcp://"):].rsplit(":", 1)
        running = asyncio.ensure_future(worker.run("import time; time.sleep(1); print('real')",
                                                   timeout=WAIT, block_id="work"))
        before = peak = _rss()
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, host, port, mode, str(STRANGERS), "3"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            while flood.poll() is None:  # sampled while the strangers are there
                peak = max(peak, _rss())
                await asyncio.sleep(0.05)
            out, err = flood.communicate(timeout=WAIT)
        finally:
            if flood.poll() is None:
                flood.kill()
                flood.wait()
        assert flood.returncode == 0, err
        result = await running
        assert (result.status, result.output) == ("ok", "real\n"), result
        # A stranger's message would cost 20 MB here; all of them 1.2 GB.
        assert peak - before < 32 * MiB, (out, (peak - before) / MiB)
        assert session.dropped == 0
        await assert_still_works(worker)
        assert worker.session is session  # nothing cost the worker anything either
