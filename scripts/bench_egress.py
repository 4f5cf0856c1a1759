"""The "egress" section of ``scripts/bench``: what the egress allowlist costs a connection.

A client inside a worker's sandbox (planned by ``engine.sandbox``, bubblewrap: an empty network
namespace; its confinement applied, then the forwarder started, as a worker does) reaches
servers on the host's loopback through the forwarder and the proxy (``engine.net.EgressGate``, run
by this process); the same client on the host reaches them directly.  The servers run in a
process of their own; the two sides alternate, round by round, so both see the same machine.

- ``setup_ms``: from ``connect`` until the connection can carry bytes: direct, the TCP
  connect; through the proxy, the connect to the forwarder and the CONNECT until its ``200``
  (the proxy's decision and its dial included); ``added_ms`` is the difference of the medians;
- ``first_byte_ms``: the same, plus one byte echoed back;
- ``bulk_mb_s``: ``bulk_mb`` MiB downloaded in one connection (median of the rounds), and
  ``ratio`` tunnel over direct;
- ``relay_cpu_ms_per_mb``: CPU the two relays spend per MB of the bulk transfer (the proxy's
  process; the forwarder, as the kernel counts it): what the tunnel costs whatever the
  machine's load, which moves the rates;
- ``forwarder_start_ms``: what starting the forwarder costs a sandbox that has an allowlist
  (binding, forking; a sandbox without one starts nothing, and no proxy runs for it);
- ``worker_start_ms``: a forked worker of a real ``Engine`` started (``start_worker``, to its
  hello) without an allowlist and with one (its gate opened, its forwarder started), the two
  alternating; ``added_ms`` the difference of the medians.

``python scripts/bench_egress.py [--quick]`` runs the section alone.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _section  # noqa: E402 - scripts/_section.py, beside this file

from engine.net import Allowlist, EgressGate  # noqa: E402
from engine.sandbox import SandboxPolicy, host_support  # noqa: E402
from engine.sandbox._plan import plan  # noqa: E402

SERVERS = r'''
import os, socket, sys, threading
size = int(sys.argv[1])
blob = os.urandom(1 << 20)
def serve(sock, handle):
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
def source(conn):
    with conn:
        for _ in range(size):
            conn.sendall(blob)
ports = []
for handle in (echo, source):
    sock = socket.create_server(("127.0.0.2", 0), backlog=128)
    ports.append(sock.getsockname()[1])
    threading.Thread(target=serve, args=(sock, handle), daemon=True).start()
print(*ports, flush=True)
sys.stdin.read()
'''

#: Runs on the host (direct) or in the sandbox after its confinement (through the forwarder).
CLIENT = r'''
import json, os, socket, sys, time
echo, source, setups, mib, port = (int(a) for a in sys.argv[-5:])
def connect(target):
    if not port:
        return socket.create_connection(("127.0.0.2", target))
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"CONNECT 127.0.0.2:%d HTTP/1.1\r\n\r\n" % target)
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return s
setup, first = [], []
for _ in range(setups):
    t0 = time.perf_counter()
    s = connect(echo)
    t1 = time.perf_counter()
    s.sendall(b"x")
    s.recv(1)
    t2 = time.perf_counter()
    s.close()
    setup.append((t1 - t0) * 1000)
    first.append((t2 - t0) * 1000)
def cpu():  # the forwarder's CPU seconds (none on the direct side)
    if not port:
        return 0.0
    fields = open(f"/proc/{FWD.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
buf = bytearray(1 << 18)
print("BULK", flush=True)  # (the bench counts the proxy's CPU from here)
c0, t0 = cpu(), time.perf_counter()
got = 0
with connect(source) as s:
    while n := s.recv_into(buf):
        got += n
seconds = time.perf_counter() - t0
assert got == mib << 20, got
print(json.dumps({"setup": setup, "first": first, "mb_s": got / seconds / 1e6, "start": START,
                  "forwarder_cpu_s": cpu() - c0}), flush=True)
'''

INSIDE = r'''
import sys, time
from worker._confine import apply
from worker.contract.confinement import Confinement
from worker.egress import open_way_out
apply(Confinement.from_json(sys.argv[1]))
t0 = time.perf_counter()
FWD = open_way_out(sys.argv[2])
START = (time.perf_counter() - t0) * 1000
sys.argv.append(str(FWD.port))
'''


def _stats(values: list[float], digits: int = 3) -> dict:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), digits),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], digits), "n": len(ordered)}


def measure(quick: bool = False, base: Path | None = None) -> dict:
    """The section's figures (``base`` is not used: a root run's sandbox must reach its socket
    directory through directories every user may enter)."""
    rounds, setups, mib = (2, 20, 64) if quick else (5, 200, 256)
    if host_support().bwrap is None:
        return {"note": f"no sandbox with a network namespace here ({host_support().bwrap_problem})"}
    top = Path(tempfile.mkdtemp(prefix="agentloop-bench-egress-"))
    top.chmod(0o755)
    try:
        figures = asyncio.run(_measure(top, rounds, setups, mib))
        figures["worker_start_ms"] = asyncio.run(_worker_starts(top, 10 if quick else 40))
        return figures
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def _measure(top: Path, rounds: int, setups: int, mib: int) -> dict:
    sockets, workspace, project = top / "sockets" / "w", top / "w" / "workspace", top / "project"
    for d in (sockets, workspace, project):
        d.mkdir(parents=True)
    box = plan(SandboxPolicy(mode="bwrap"), socket_dir=sockets, workspace=workspace, cwd=project,
               output_dir=top / "w" / "outputs", python=sys.executable)
    servers = subprocess.Popen([sys.executable, "-c", SERVERS, str(mib)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        echo, source = (int(p) for p in servers.stdout.readline().split())
        path = sockets / "egress.sock"
        allow = Allowlist.parse([f"127.0.0.2:{echo}", f"127.0.0.2:{source}"])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **box.env}
        sides: dict[str, list[dict]] = {"direct": [], "tunnel": []}
        async with EgressGate(path, allow) as gate:
            box.grant(path)
            args = [str(echo), str(source), str(setups), str(mib)]
            for _ in range(rounds):
                sides["direct"].append(await _client([sys.executable, "-c", "START = None\n" + CLIENT, *args, "0"],
                                                     env, project))
                sides["tunnel"].append(await _client([*box.argv_prefix, sys.executable, "-c", INSIDE + CLIENT,
                                                      box.confine.to_json(), str(path), *args], env, box.cwd))
            refused = sum(r.verdict != "allowed" for r in gate.records)
    finally:
        servers.kill()
        servers.wait()
    figures = {}
    for key, name in (("setup", "setup_ms"), ("first", "first_byte_ms")):
        figures[name] = {side: _stats([v for run in runs for v in run[key]]) for side, runs in sides.items()}
        figures[name]["added_ms"] = round(figures[name]["tunnel"]["p50"] - figures[name]["direct"]["p50"], 3)
    bulk = {side: round(statistics.median(run["mb_s"] for run in runs)) for side, runs in sides.items()}
    bulk["ratio"] = round(bulk["tunnel"] / bulk["direct"], 2) if bulk["direct"] else None
    mb = mib * (1 << 20) / 1e6
    cpu = {who: round(statistics.median(run[f"{who}_cpu_s"] for run in sides["tunnel"]) * 1000 / mb, 3)
           for who in ("gate", "forwarder")}
    added = figures["setup_ms"]["added_ms"]
    return {
        **figures, "bulk_mb_s": bulk, "bulk_mb": mib, "rounds": rounds, "relay_cpu_ms_per_mb": cpu,
        "forwarder_start_ms": _stats([run["start"] for run in sides["tunnel"]]),
        "targets": {"setup": {"target": "at most ~2 ms added to a connection's set-up", "value": added,
                              "met": added <= 2.0},
                    "bulk": {"target": "bulk through the tunnel at least half a direct loopback copy",
                             "value": bulk["ratio"], "met": None if bulk["ratio"] is None else bulk["ratio"] >= 0.5}},
        "refused": refused,
    }


async def _worker_starts(top: Path, starts: int) -> dict:
    """Worker starts (ms, to the hello) of two engines, one with an allowlist, taken in turn."""
    from engine.launch import WorkerSettings
    from engine.workers import Engine

    took: dict[str, list[float]] = {"without": [], "with": []}
    settings = WorkerSettings(state_dir=top / "state")  # (the bench leaves nothing in the user's state)
    async with Engine(settings, cwd=top, workspace=top / "plain", pool=0) as plain, \
            Engine(settings.replace(allow_net=["127.0.0.2:9"]), cwd=top, workspace=top / "listed", pool=0) as listed:
        for engine in (plain, listed):  # (each engine's fork server started before any is timed)
            await (await engine.start_worker("warm")).close()
        for i in range(starts):
            for side, engine in (("without", plain), ("with", listed)):
                began = time.perf_counter()
                worker = await engine.start_worker(f"w{i}")
                took[side].append((time.perf_counter() - began) * 1000)
                await worker.close()
    out = {side: _stats(values) for side, values in took.items()}
    out["added_ms"] = round(out["with"]["p50"] - out["without"]["p50"], 3)
    return out


async def _client(argv: list[str], env: dict, cwd: str | Path) -> dict:
    """The client's figures, and the CPU this process (the proxy's) spent during its bulk
    transfer (``gate_cpu_s``)."""
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    async with asyncio.timeout(600):
        errors = asyncio.ensure_future(proc.stderr.read())
        began, lines = None, []
        while line := await proc.stdout.readline():
            if line == b"BULK\n":
                began = time.process_time()
            else:
                lines.append(line)
        spent = 0.0 if began is None else time.process_time() - began
        await proc.wait()
        err = await errors
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"egress bench client failed: {err.decode()[-2000:]}")
    return {**json.loads(lines[-1].decode()), "gate_cpu_s": spent}


def table(section: dict) -> str:
    if "note" in section:
        return f"egress: {section['note']}"
    s, f, b = section["setup_ms"], section["first_byte_ms"], section["bulk_mb_s"]
    w = section["worker_start_ms"]
    met = {True: "met", False: "NOT met", None: "—"}
    return (f"egress: connection set-up p50 {s['tunnel']['p50']} ms through the proxy against {s['direct']['p50']} ms "
            f"direct (+{s['added_ms']} ms, target <= 2 ms: {met[section['targets']['setup']['met']]}); first byte back "
            f"+{f['added_ms']} ms; {section['bulk_mb']} MiB in one connection: {b['tunnel']} MB/s through the tunnel "
            f"against {b['direct']} MB/s direct (x{b['ratio']}, target >= 0.5: {met[section['targets']['bulk']['met']]}; "
            f"CPU per MB: proxy {section['relay_cpu_ms_per_mb']['gate']} ms, forwarder "
            f"{section['relay_cpu_ms_per_mb']['forwarder']} ms); "
            f"the forwarder starts in {section['forwarder_start_ms']['p50']} ms; a forked worker starts in "
            f"{w['with']['p50']} ms with an allowlist against {w['without']['p50']} ms without (+{w['added_ms']} ms)")


def main(argv: list[str] | None = None) -> int:
    return _section.main("scripts/bench_egress.py", __doc__, "2 rounds, 20 connections, 64 MiB", measure, table, argv)


if __name__ == "__main__":
    sys.exit(main())
