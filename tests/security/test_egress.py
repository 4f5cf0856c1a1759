"""The egress allowlist attacked from inside a real sandbox.

Each test plans a worker's sandbox (``engine.sandbox`` ``plan``, bubblewrap: an empty network
namespace), opens a gate (``engine.net.EgressGate``) on a socket in the sandbox's socket directory,
and runs code in the sandbox as a worker would: its confinement applied, then the forwarder
started (``worker.egress.open_way_out``), then the attack.  Servers and canaries listen on the
host's loopback only (``tests.net_servers``); every attack shows it ran (the proxy's own answer,
a record, an error of the kernel's) and leaves every canary untouched.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.net import Allowlist, EgressGate, Limits
from engine.sandbox import SandboxPolicy
from engine.sandbox._plan import plan
from tests.net_servers import (
    ALLOWED,
    WAIT,
    BlobSource,
    Echo,
    Index,
    Resolver,
    Sink,
    certificate,
)

from .harness import needs_namespaces

pytestmark = pytest.mark.attack

#: What runs first in the sandbox: what a worker does before any code of the model's.
INSIDE = r'''
import json, os, socket, subprocess, sys
from worker._confine import apply
from worker.contract.confinement import Confinement
from worker.egress import open_way_out
applied = apply(Confinement.from_json(sys.argv[1]))
FWD = open_way_out(sys.argv[2])
ARGS = json.loads(sys.argv[3])
print("READY " + json.dumps({"applied": applied, "port": FWD.port, "pid": FWD.pid}), flush=True)


def probe(name, fn):
    try:
        value = fn()
    except Exception as exc:
        code = getattr(exc, "errno", None)
        import errno
        words = type(exc).__name__ + ("" if not isinstance(code, int) else " " + errno.errorcode.get(code, str(code)))
    else:
        words = "ok" if value is None else "ok " + str(value)[:300]
    print(name + ": " + words.replace("\n", " "), flush=True)


def ask(data, to=None, timeout=20, head=False):
    """Raw bytes to the forwarder (``to``: a unix socket's path instead); the first line of the
    answer, read until it closes (``head``: until its head ends, for a tunnel that stays open)."""
    if to:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        s.connect(to)
    else:
        s = socket.create_connection(("127.0.0.1", FWD.port), timeout=timeout)
    with s:
        s.sendall(data)
        out = b""
        while (not head or b"\r\n\r\n" not in out) and (chunk := s.recv(65536)):
            out += chunk
    return out.split(b"\r\n", 1)[0].decode("latin-1")


def pause():
    print("PAUSE", flush=True)
    sys.stdin.readline()
'''


@dataclass
class Run:
    rc: int
    ready: dict
    out: dict[str, str]
    stdout: str
    stderr: str

    def __getitem__(self, name: str) -> str:
        assert name in self.out, f"probe {name!r} never ran: {self.stdout[-2000:]} {self.stderr[-2000:]}"
        return self.out[name]


class Sandbox:
    """A worker's sandbox with a gate in its socket directory."""

    def __init__(self, base: Path, name: str = "w1") -> None:
        self.base = base
        self.socket_dir = base / "sockets" / name
        self.workspace, self.output, self.cwd = base / name / "workspace", base / name / "outputs", base / "project"
        for d in (self.socket_dir, self.workspace, self.output, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        self.plan = plan(SandboxPolicy(mode="bwrap"), socket_dir=self.socket_dir, workspace=self.workspace,
                         cwd=self.cwd, output_dir=self.output, python=sys.executable)
        self.socket = self.socket_dir / "egress.sock"
        self.gate: EgressGate | None = None

    async def open(self, entries: list[str], resolver: Resolver | None = None, limits: Limits | None = None) -> EgressGate:
        self.gate = await EgressGate(self.socket, Allowlist.parse(entries), resolver=resolver, limits=limits).start()
        self.plan.grant(self.socket)  # (root's workers run as the run's uid)
        return self.gate

    async def run(self, code: str, *, args: dict | None = None, socket: Path | None = None,
                  between: Callable[[], Awaitable[None]] | None = None, timeout: float = 4 * WAIT) -> Run:
        """Run ``code`` (after ``INSIDE``) in the sandbox; ``between`` runs when it says PAUSE."""
        argv = [*self.plan.argv_prefix, sys.executable, "-c", INSIDE + code, self.plan.confine.to_json(),
                str(socket or self.socket), json.dumps(args or {})]
        env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8", **self.plan.env}
        proc = await asyncio.create_subprocess_exec(*argv, cwd=self.plan.cwd, env=env, start_new_session=True,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        lines: list[str] = []
        try:
            async with asyncio.timeout(timeout):
                assert proc.stdout is not None and proc.stdin is not None
                while line := (await proc.stdout.readline()).decode():
                    if line == "PAUSE\n":
                        if between is not None:
                            await between()
                        proc.stdin.write(b"\n")
                        await proc.stdin.drain()
                        continue
                    lines.append(line)
                err = await proc.stderr.read()  # type: ignore[union-attr]
                await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        stdout = "".join(lines)
        assert stdout.startswith("READY "), f"the sandbox did not start: {stdout[-2000:]} {err.decode()[-3000:]}"
        ready = json.loads(stdout.splitlines()[0][6:])
        out = {}
        for line in stdout.splitlines()[1:]:
            name, sep, value = line.partition(": ")
            if sep:
                out[name] = value
        return Run(proc.returncode or 0, ready, out, stdout, err.decode())


@pytest.fixture
def base():
    needs_namespaces()
    d = Path(tempfile.mkdtemp(prefix="agentloop-egress-"))
    d.chmod(0o755)  # (root's workers run as another uid: they must reach the socket directory)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def box(base):
    sandbox = Sandbox(base)
    yield sandbox
    if sandbox.gate is not None:
        await sandbox.gate.close()


PIP = '''
target = "/tmp/site"
done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                       "--no-input", "--retries", "0", "--timeout", "20", "--index-url", ARGS["url"],
                       *(["--trusted-host", ARGS["host"]] if ARGS["host"] else []), "--target", target,
                       *ARGS.get("pip", []), "egresstest"],
                      capture_output=True, text=True, timeout=180)
print("pip: rc", done.returncode, flush=True)
print("pip_says: " + " | ".join(l for l in (done.stdout + done.stderr).splitlines() if "agentloop" in l or "ERROR" in l)[-1500:], flush=True)
sys.path.insert(0, target)
probe("import", lambda: __import__("egresstest").INSTALLED)
'''


async def test_pip_installs_from_a_listed_index_and_nothing_else(box, index, canaries):
    await box.open([index.address])
    run = await box.run(PIP, args={"url": index.url, "host": index.address})
    assert run["pip"] == "rc 0" and run["import"] == "ok egresstest", run.stdout
    assert [path for _, path, _ in index.requests] == ["/simple/egresstest/", f"/files/{index.wheel_name}"]
    assert all(r.verdict == "allowed" and r.method == "GET" and r.address == ALLOWED for r in box.gate.records)
    # Without the entry: the same install fails, in words that name the option (pip shows an
    # index's HTTP errors with -vv only), and the index never hears of it.
    await box.gate.close()
    index.requests.clear()
    await box.open([])
    run = await box.run(PIP, args={"url": index.url, "host": index.address, "pip": ["-vv"]})
    assert run["pip"] == "rc 1" and run["import"].startswith("ModuleNotFoundError"), run.stdout
    assert "403" in run["pip_says"] and f"--allow-net {index.address}" in run["pip_says"], run["pip_says"]
    assert index.requests == []
    assert box.gate.records and all(r.verdict == "refused" and r.why == "not-listed" for r in box.gate.records)


async def test_pip_through_a_listed_name_dials_the_checked_address(box, index, canaries):
    resolver = Resolver({"pypi.test": [ALLOWED]})
    await box.open([f"pypi.test:{index.port}", index.address], resolver=resolver)
    run = await box.run(PIP, args={"url": f"http://pypi.test:{index.port}/simple/", "host": f"pypi.test:{index.port}"})
    assert run["pip"] == "rc 0" and run["import"] == "ok egresstest", run.stdout
    assert index.requests and all(h["host"] == f"pypi.test:{index.port}" for _, _, h in index.requests)
    assert set(resolver.lookups) == {"pypi.test"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed: no certificate to serve TLS with")
async def test_pip_over_https_goes_through_a_checked_tunnel(box, canaries):
    cert, key = certificate(box.cwd, "pypi.test")
    index = Index(tls=(cert, key))
    try:
        resolver = Resolver({"pypi.test": [ALLOWED]})
        await box.open([f"pypi.test:{index.port}", index.address], resolver=resolver)
        run = await box.run(PIP, args={"url": f"https://pypi.test:{index.port}/simple/", "host": "",
                                       "pip": ["--cert", cert]})
        assert run["pip"] == "rc 0" and run["import"] == "ok egresstest", run.stdout
        assert index.requests and all(r.method == "CONNECT" and r.address == ALLOWED and r.status == 200
                                      for r in box.gate.records)
        # The same name, unlisted: pip says the proxy's words (its retries show the reason phrase).
        await box.gate.close()
        index.requests.clear()
        await box.open([index.address], resolver=resolver)
        run = await box.run(PIP, args={"url": f"https://pypi.test:{index.port}/simple/", "host": "",
                                       "pip": ["--cert", cert, "--retries", "1"]})
        assert run["pip"] == "rc 1", run.stdout
        assert (f"Tunnel connection failed: 403 Forbidden: agentloop: the host pypi.test is not on this sandbox's "
                f"network allowlist; to allow it: --allow-net pypi.test:{index.port}") in run["pip_says"], run.stdout
        assert index.requests == [] and resolver.lookups == ["pypi.test"]  # (only while it was listed)
    finally:
        index.close()


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
async def test_npm_reads_its_proxy_variables(box, index, canaries):
    code = f'''
done = subprocess.run(["npm", "view", "egresstest", "version", "--registry", "http://{index.address}/npm/",
                       "--fetch-retries", "0", "--no-update-notifier"], capture_output=True, text=True, timeout=120)
print("npm: rc", done.returncode, done.stdout.strip(), flush=True)
print("npm_says: " + " | ".join(done.stderr.splitlines())[-800:], flush=True)
'''
    await box.open([index.address])
    run = await box.run(code)
    assert run["npm"] == "rc 0 1.0.0", run.stdout
    assert [p for _, p, _ in index.requests] == ["/npm/egresstest"]
    await box.gate.close()
    index.requests.clear()
    await box.open([])
    run = await box.run(code)
    assert run["npm"].startswith("rc 1") and "403" in run["npm_says"], run.stdout
    assert index.requests == []


async def test_without_the_proxy_nothing_reaches_the_host(box, index, canaries):
    tcp1, tcp3, _, udp = canaries
    await box.open([index.address])
    run = await box.run(f'''
probe("tcp_loopback", lambda: socket.create_connection(("127.0.0.1", {tcp1.port}), timeout=5).close())
probe("tcp_other", lambda: socket.create_connection(("127.0.0.3", {tcp3.port}), timeout=5).close())
probe("tcp_listed_direct", lambda: socket.create_connection(("{ALLOWED}", {index.port}), timeout=5).close())
probe("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x" * 100, ("127.0.0.1", {udp.port})))
probe("dns", lambda: socket.getaddrinfo("pypi.org", 443))
probe("dns_query", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(
    b"\\x12\\x34\\x01\\x00\\x00\\x01" + bytes(6) + b"\\x04pypi\\x03org\\x00\\x00\\x01\\x00\\x01", ("127.0.0.1", {udp.port})))
for how in (["--noproxy", "*"], ["--proxy", ""]):
    done = subprocess.run(["curl", "-sS", "--max-time", "5", *how, "http://127.0.0.3:{tcp3.port}/"], capture_output=True, text=True)
    print("curl_" + how[0].strip("-") + ": rc", done.returncode, flush=True)
bare = {{k: v for k, v in os.environ.items() if "proxy" not in k.lower()}}
done = subprocess.run([sys.executable, "-c", "import urllib.request as u; u.urlopen('http://127.0.0.3:{tcp3.port}/', timeout=5)"],
                      env=bare, capture_output=True, text=True)
print("unset: " + done.stderr.strip().splitlines()[-1], flush=True)
import urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
probe("urllib_no_proxy", lambda: opener.open("http://{index.address}/echo", timeout=5))
probe("via_proxy", lambda: urllib.request.urlopen("http://{index.address}/echo", timeout=20).status)
probe("interfaces", lambda: [n for _, n in socket.if_nameindex()])
# What the forwarder needs never widens the filter: no raw, packet, other netlink or vsock
# sockets, no io_uring (which opens sockets seccomp never sees).
probe("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
probe("packet", lambda: socket.socket(17, socket.SOCK_RAW, 0))
probe("uevent", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 15))
probe("vsock", lambda: socket.socket(40, socket.SOCK_STREAM, 0))
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def io_uring():
    if libc.syscall(425, 8, ctypes.create_string_buffer(120)) == -1:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
probe("io_uring", io_uring)
''')
    for name in ("tcp_loopback", "tcp_other", "tcp_listed_direct"):
        assert run[name] in ("ConnectionRefusedError ECONNREFUSED", "OSError ENETUNREACH"), (name, run.stdout)
    assert run["udp"] == "ok 100" and run["dns_query"].startswith("ok")  # (sent into the sandbox's own loopback)
    assert run["dns"].startswith("gaierror"), run.stdout
    assert run["curl_noproxy"] == "rc 7" and run["curl_proxy"] == "rc 7", run.stdout  # (couldn't connect)
    assert "Connection refused" in run["unset"], run.stdout
    assert run["urllib_no_proxy"].startswith("URLError"), run.stdout
    assert run["via_proxy"] == "ok 200" and run["interfaces"] == "ok ['lo']", run.stdout  # (the attack could have worked)
    for name in ("raw", "packet", "uevent", "vsock", "io_uring"):
        assert run[name] == "PermissionError EPERM", (name, run.stdout)
    assert [path for _, path, _ in index.requests] == ["/echo"]


SPELLINGS = ["127.1", "0x7f.0.0.1", "0x7f000001", "2130706433", "0177.0.0.1", "127.000.000.001", "0", "0.0.0.0",
             "[::]", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::127.0.0.1]", "[64:ff9b::7f00:1]",
             "[2002:7f00:1::]", "[fe80::1%25lo]", "localhost", "localhost.", "LOCALHOST", "foo.localhost",
             "127.0.0.1", "127.0.0.1.", "[::ffff:127.0.0.3]", "127.0.0.3", "loop.test", "private.test"]


async def test_refused_through_the_forwarder_and_through_the_socket_itself(box, index, canaries):
    tcp1, tcp3, tcp2, _ = canaries
    resolver = Resolver({"loop.test": ["127.0.0.1"], "private.test": ["10.0.0.1"], "mixed.test": ["93.184.216.34", "127.0.0.3"]})
    await box.open([index.address, f"loop.test:{tcp1.port}", f"private.test:{tcp1.port}", f"mixed.test:{tcp3.port}"],
                   resolver=resolver)
    spellings = [f"{h}:{tcp1.port}" for h in SPELLINGS] + [f"mixed.test:{tcp3.port}", f"127.0.0.3:{tcp3.port}",
                                                           "evil.example:443", f"{ALLOWED}:{tcp2.port}"]
    run = await box.run(f'''
sock = {str(box.socket)!r}
for i, target in enumerate(ARGS["targets"]):
    for to in (None, sock):
        where = "fwd" if to is None else "sock"
        probe(f"connect_{{where}}_{{i}}", lambda: ask(f"CONNECT {{target}} HTTP/1.1\\r\\nHost: {{target}}\\r\\n\\r\\n".encode(), to))
        probe(f"plain_{{where}}_{{i}}", lambda: ask(f"GET http://{{target}}/ HTTP/1.1\\r\\nHost: {{target}}\\r\\n\\r\\n".encode(), to))
a = "{index.address}"
probe("host_header", lambda: ask(f"GET http://{{a}}/echo HTTP/1.1\\r\\nHost: 127.0.0.3:{tcp3.port}\\r\\n\\r\\n".encode()))
probe("kept_alive", lambda: ask(f"GET http://{{a}}/echo HTTP/1.1\\r\\nHost: {{a}}\\r\\nConnection: keep-alive\\r\\n\\r\\n"
                                f"GET http://127.0.0.3:{tcp3.port}/ HTTP/1.1\\r\\nHost: 127.0.0.3:{tcp3.port}\\r\\n\\r\\n".encode()))
probe("socks5", lambda: ask(b"\\x05\\x01\\x00"))
probe("socks4", lambda: ask(b"\\x04\\x01" + ({tcp1.port}).to_bytes(2, "big") + bytes([127, 0, 0, 1]) + b"\\x00"))
done = subprocess.run(["curl", "-sS", "--max-time", "10", "https://evil.example/"], capture_output=True, text=True)
print("curl_https: rc", done.returncode, done.stderr.strip()[-200:], flush=True)
done = subprocess.run(["curl", "-sS", "--max-time", "10", "http://127.0.0.3:{tcp3.port}/"], capture_output=True, text=True)
print("curl_http: " + done.stdout.strip()[-300:], flush=True)

# A relay inside the sandbox: it re-sends, from a process of its own, what a client sends it.
import threading
relay = socket.create_server(("127.0.0.1", 0))
def copy(src, dst):
    while data := src.recv(65536):
        dst.sendall(data)
    dst.shutdown(socket.SHUT_WR)
def serve():
    while True:
        c, _ = relay.accept()
        u = socket.create_connection(("127.0.0.1", FWD.port))
        threading.Thread(target=copy, args=(c, u), daemon=True).start()
        threading.Thread(target=copy, args=(u, c), daemon=True).start()
threading.Thread(target=serve, daemon=True).start()
def via_relay(data):
    with socket.create_connection(relay.getsockname(), timeout=20) as s:
        s.sendall(data)
        return s.recv(4096).split(b"\\r\\n", 1)[0].decode()
probe("relay", lambda: via_relay(f"CONNECT 127.0.0.3:{tcp3.port} HTTP/1.1\\r\\n\\r\\n".encode()))
# A CONNECT inside an allowed tunnel reaches the allowed server, which is no proxy.
def nested():
    with socket.create_connection(("127.0.0.1", FWD.port), timeout=20) as s:
        s.sendall(f"CONNECT {{a}} HTTP/1.1\\r\\n\\r\\n".encode())
        first = s.recv(4096)
        s.sendall(f"CONNECT 127.0.0.3:{tcp3.port} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n".encode())
        return first.split(b"\\r\\n")[0].decode() + " then " + s.recv(4096).split(b"\\r\\n")[0].decode()
probe("nested", nested)
''', args={"targets": spellings}, timeout=6 * WAIT)
    for i, target in enumerate(spellings):
        for where in ("fwd", "sock"):
            for kind in ("connect", "plain"):
                answer = run[f"{kind}_{where}_{i}"]
                assert answer.startswith(("ok HTTP/1.1 400 ", "ok HTTP/1.1 403 ")), (target, kind, where, answer)
    assert run["host_header"].startswith("ok HTTP/1.1 400") and "another host" in run["host_header"]
    assert run["kept_alive"].startswith("ok HTTP/1.") and " 200 " in run["kept_alive"]
    assert run["socks5"].startswith("ok HTTP/1.1 400") and "SOCKS is not offered" in run["socks5"]
    assert run["socks4"].startswith("ok HTTP/1.1 400") and "SOCKS is not offered" in run["socks4"]
    assert run["curl_https"].startswith("rc 56") and "403" in run["curl_https"], run.stdout
    assert "is not on this sandbox's network allowlist; to allow it: --allow-net 127.0.0.3:" in run["curl_http"]
    assert run["relay"].startswith("ok HTTP/1.1 403"), run.stdout
    assert run["nested"] == "ok HTTP/1.1 200 Connection established then HTTP/1.1 501 Unsupported method ('CONNECT')"
    assert [p for _, p, _ in index.requests] == ["/echo"]  # the kept-alive connection's second request: never sent
    assert set(resolver.lookups) <= {"loop.test", "private.test", "mixed.test"}  # nothing unlisted looked up
    assert not any(r.address in ("127.0.0.1", "127.0.0.3", "10.0.0.1") for r in box.gate.records)


async def test_the_forwarder_is_confined_and_its_death_ends_the_network(box, index, canaries):
    await box.open([index.address])
    run = await box.run(f'''
import signal, time
status = dict(line.split(":\\t", 1) for line in open(f"/proc/{{FWD.pid}}/status").read().splitlines() if ":\\t" in line)
print("fwd_seccomp: " + status["Seccomp"], flush=True)
print("fwd_nnp: " + status["NoNewPrivs"], flush=True)
print("fwd_uid: " + status["Uid"].split()[0] + " me " + str(os.getuid()), flush=True)
print("fwd_caps: " + status["CapEff"], flush=True)
print("fwd_comm: " + open(f"/proc/{{FWD.pid}}/comm").read().strip(), flush=True)
probe("fwd_mem", lambda: open(f"/proc/{{FWD.pid}}/mem", "rb").close())
probe("before", lambda: ask(b"GET http://{index.address}/echo HTTP/1.1\\r\\nHost: {index.address}\\r\\n\\r\\n"))
os.kill(FWD.pid, signal.SIGKILL)
os.waitpid(FWD.pid, 0)
probe("after", lambda: ask(b"GET http://{index.address}/echo HTTP/1.1\\r\\nHost: {index.address}\\r\\n\\r\\n"))
# Its port taken by code of the sandbox's own: what reaches it stays in the sandbox.
fake = socket.create_server(("127.0.0.1", FWD.port))
probe("impostor", lambda: socket.create_connection(("127.0.0.1", FWD.port), timeout=5).close())
''')
    me = run.stdout.split("fwd_uid: ")[1].split()
    assert run["fwd_seccomp"] == "2" and run["fwd_nnp"] == "1" and me[0] == me[2] and run["fwd_caps"] == "0000000000000000"
    assert run["fwd_comm"] == "agentloop-net" and run["fwd_mem"] in ("PermissionError EACCES", "PermissionError EPERM")
    assert run["before"].startswith("ok HTTP/1.1 200") or run["before"].startswith("ok HTTP/1.0 200"), run.stdout
    assert run["after"] == "ConnectionRefusedError ECONNREFUSED", run.stdout
    assert run["impostor"] == "ok" and len(index.requests) == 1


async def test_closing_the_gate_mid_run_leaves_no_way_out(box, index, canaries):
    await box.open([index.address])
    request = f"GET http://{index.address}/echo HTTP/1.1\\r\\nHost: {index.address}\\r\\n\\r\\n"
    run = await box.run(f'''
probe("before", lambda: ask(b"{request}"))
s = socket.create_connection(("127.0.0.1", FWD.port), timeout=20)
s.sendall(b"CONNECT {index.address} HTTP/1.1\\r\\n\\r\\n")
probe("tunnel", lambda: s.recv(4096).split(b"\\r\\n")[0].decode())
pause()
probe("open_tunnel", lambda: s.recv(4096))
probe("after", lambda: ask(b"{request}"))
probe("socket", lambda: ask(b"{request}", {str(box.socket)!r}))
probe("direct", lambda: socket.create_connection(("{ALLOWED}", {index.port}), timeout=5).close())
''', between=box.gate.close)
    assert run["before"].startswith("ok HTTP/1.") and run["tunnel"] == "ok HTTP/1.1 200 Connection established"
    assert run["open_tunnel"] in ("ok b''", "ConnectionResetError ECONNRESET")  # the open tunnel ended with the gate
    assert run["after"] in ("ok ", "ConnectionResetError ECONNRESET", "BrokenPipeError EPIPE"), run.stdout  # (the forwarder closes at once)
    assert run["socket"] in ("FileNotFoundError ENOENT", "ConnectionRefusedError ECONNREFUSED"), run.stdout
    assert run["direct"] in ("ConnectionRefusedError ECONNREFUSED", "OSError ENETUNREACH")
    assert len(index.requests) == 1


async def test_a_hundred_tunnels_and_64_mib_each_way(box, canaries):
    echo, source, sink = Echo(), BlobSource(64 << 20), Sink()
    try:
        await box.open([echo.address, source.address, sink.address])
        run = await box.run(f'''
import asyncio, hashlib
async def one(i):
    r, w = await asyncio.open_connection("127.0.0.1", FWD.port)
    w.write(b"CONNECT {echo.address} HTTP/1.1\\r\\n\\r\\n")
    head = await r.readuntil(b"\\r\\n\\r\\n")
    w.write(b"%05d" % i * 2000)
    data = await r.readexactly(10000)
    w.close()
    return head.startswith(b"HTTP/1.1 200") and data == b"%05d" % i * 2000
async def many():
    return sum(await asyncio.gather(*(one(i) for i in range(100))))
probe("tunnels", lambda: asyncio.run(many()))
def tunnel(target):
    s = socket.create_connection(("127.0.0.1", FWD.port), timeout=60)
    s.sendall(f"CONNECT {{target}} HTTP/1.1\\r\\n\\r\\n".encode())
    head = b""
    while not head.endswith(b"\\r\\n\\r\\n"):
        head += s.recv(1)
    return s
def download():
    digest, size = hashlib.sha256(), 0
    with tunnel("{source.address}") as s:
        while data := s.recv(1 << 18):
            digest.update(data)
            size += len(data)
    return digest.hexdigest(), size
probe("download", download)
def upload():
    chunk = hashlib.sha256(b"agentloop").digest() * (1 << 15)
    with tunnel("{sink.address}") as s:
        for _ in range(64):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        return s.recv(4096).decode().strip()
probe("upload", upload)
''')
        assert run["tunnels"] == "ok 100", run.stdout
        assert run["download"] == f"ok ('{source.sha256}', {64 << 20})", run.stdout
        assert run["upload"] == f"ok {source.sha256} {64 << 20}", run.stdout
        assert echo.connections == 100 and source.connections == sink.connections == 1
    finally:
        for server in (echo, source, sink):
            server.close()


async def test_each_sandbox_is_bound_to_its_own_gate(base, index, canaries):
    echo = Echo()
    a, b = Sandbox(base, "a"), Sandbox(base, "b")
    try:
        await a.open([index.address])
        await b.open([echo.address])
        code = f'''
probe("own", lambda: ask(b"CONNECT {echo.address} HTTP/1.1\\r\\n\\r\\n", head=True))
probe("others_socket", lambda: ask(b"CONNECT {echo.address} HTTP/1.1\\r\\n\\r\\n", ARGS["other"]))
probe("listing", lambda: sorted(os.listdir(os.path.dirname(ARGS["other"]))))
'''
        run_a = await a.run(code, args={"other": str(b.socket)})
        run_b = await b.run(code, args={"other": str(a.socket)})
        assert run_a["own"].startswith("ok HTTP/1.1 403"), run_a.stdout  # a's policy, whatever b allows
        assert run_a["others_socket"] == "FileNotFoundError ENOENT" and run_a["listing"] == "FileNotFoundError ENOENT"
        assert run_b["own"] == "ok HTTP/1.1 200 Connection established", run_b.stdout  # (the target was reachable)
        assert echo.connections == 1
    finally:
        for box in (a, b):
            if box.gate is not None:
                await box.gate.close()
        echo.close()
