"""Servers on the host's loopback for the egress tests, each recording what reached it.

Only loopback addresses are ever bound or named: 127.0.0.2 holds the servers a test allows
(a PEP 503 index serving a wheel built here, an echo, a source and a sink of bulk bytes), and
``Canary`` listeners on other loopback addresses and ports record any contact at all.  A test
resolver (``Resolver``) maps names to loopback or private addresses and logs every lookup.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import socket
import subprocess
import threading
import zipfile
from ipaddress import ip_address
from pathlib import Path

__all__ = ["ALLOWED", "BlobSource", "Canary", "Echo", "Index", "Resolver", "Sink", "UdpCanary", "WAIT", "certificate",
           "wheel"]

#: Where the servers a test allows listen.
ALLOWED = "127.0.0.2"
#: The bound on every wait, in seconds.
WAIT = 30.0


def wheel(name: str = "egresstest", version: str = "1.0") -> tuple[str, bytes]:
    """(file name, bytes) of a minimal pure-Python wheel whose module says it was installed."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"INSTALLED = {name!r}\n".encode(),
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: agentloop-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            zf.writestr(path, data)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def certificate(directory: Path, name: str) -> tuple[str, str]:
    """(cert, key) files of a self-signed certificate for ``name`` and 127.0.0.2 (openssl)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name},IP:{ALLOWED}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=WAIT)
    cert.chmod(0o644)
    return str(cert), str(key)


class _Threaded:
    """A TCP server on ``host`` run by threads; ``port``, ``address`` and ``close``."""

    def __init__(self, host: str = ALLOWED) -> None:
        self.sock = socket.create_server((host, 0), backlog=256)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(WAIT)
            try:
                self.handle(conn)
            except OSError:
                pass

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Echo(_Threaded):
    """Sends back whatever it receives, until the client ends."""

    def handle(self, conn: socket.socket) -> None:
        while data := conn.recv(1 << 16):
            conn.sendall(data)


class BlobSource(_Threaded):
    """Sends ``size`` pseudo-random bytes to each client, then closes; ``sha256`` of them."""

    def __init__(self, size: int, host: str = ALLOWED) -> None:
        self.chunk = hashlib.sha256(b"agentloop").digest() * (1 << 15)  # 1 MiB
        self.size = size
        digest = hashlib.sha256()
        for start in range(0, size, len(self.chunk)):
            digest.update(self.chunk[:size - start])
        self.sha256 = digest.hexdigest()
        super().__init__(host)

    def handle(self, conn: socket.socket) -> None:
        left = self.size
        while left:
            part = self.chunk[:left]
            conn.sendall(part)
            left -= len(part)


class Sink(_Threaded):
    """Reads until the client ends its side, then answers the sha256 and size of what came."""

    def handle(self, conn: socket.socket) -> None:
        digest, size = hashlib.sha256(), 0
        while data := conn.recv(1 << 18):
            digest.update(data)
            size += len(data)
        conn.sendall(f"{digest.hexdigest()} {size}\n".encode())


class Index:
    """A PEP 503 simple index on ``host`` serving ``wheel()``, and ``/echo`` (the request as
    JSON); ``requests`` holds (method, path, headers) of every request, in order."""

    def __init__(self, host: str = ALLOWED, tls: tuple[str, str] | None = None) -> None:
        self.wheel_name, self.wheel = wheel()
        digest = hashlib.sha256(self.wheel).hexdigest()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        page = (f'<!DOCTYPE html><html><body><a href="/files/{self.wheel_name}#sha256={digest}">'
                f"{self.wheel_name}</a></body></html>").encode()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive offered: the proxy must close anyway

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                index.requests.append((self.command, self.path, headers))
                if self.path.rstrip("/") == "/simple/egresstest":
                    body, kind = page, "text/html"
                elif self.path == f"/files/{index.wheel_name}":
                    body, kind = index.wheel, "application/octet-stream"
                elif self.path == "/npm/egresstest":  # an npm registry's document of one package
                    body = json.dumps({"name": "egresstest", "dist-tags": {"latest": "1.0.0"}, "versions": {
                        "1.0.0": {"name": "egresstest", "version": "1.0.0",
                                  "dist": {"tarball": f"http://{index.address}/npm/egresstest-1.0.0.tgz"}}}}).encode()
                    kind = "application/json"
                elif self.path.startswith("/echo"):
                    length = int(self.headers.get("Content-Length") or 0)
                    data = self.rfile.read(length) if length else b""
                    body = json.dumps({"method": self.command, "path": self.path, "headers": headers,
                                       "body": data.decode("latin-1")}).encode()
                    kind = "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_POST = do_PUT = do_HEAD = do_GET

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:  # (cert, key): the same index over TLS
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.host, self.port = host, self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}/simple/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Canary:
    """A TCP listener nothing may reach: it never accepts until ``assert_untouched``, which
    shows that the test's own marker is the first and only connection ever queued."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0), backlog=64)
        self.host, self.port = host, self.sock.getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def assert_untouched(self) -> None:
        with socket.create_connection((self.host, self.port), timeout=WAIT) as marker:
            self.sock.settimeout(WAIT)
            conn, _ = self.sock.accept()
            with conn:
                marker.sendall(b"marker")
                conn.settimeout(WAIT)
                assert conn.recv(16) == b"marker", f"something reached the canary at {self.address}"
        self.sock.setblocking(False)
        try:
            extra, _ = self.sock.accept()
        except BlockingIOError:
            return
        extra.close()
        raise AssertionError(f"more than the marker reached the canary at {self.address}")

    def close(self) -> None:
        self.sock.close()


class UdpCanary:
    """A UDP socket nothing may reach (``assert_untouched`` as ``Canary``'s, by datagram)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]

    def assert_untouched(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            tx.sendto(b"marker", (self.host, self.port))
        self.sock.settimeout(WAIT)
        assert self.sock.recv(65536) == b"marker", "a datagram reached the UDP canary"
        self.sock.setblocking(False)
        try:
            self.sock.recv(65536)
        except BlockingIOError:
            return
        raise AssertionError("more than the marker reached the UDP canary")

    def close(self) -> None:
        self.sock.close()


class Resolver:
    """A resolver for the gate: ``answers`` maps a name to its addresses (a list of lists
    answers the first for the first lookup, and so on: a rebinding resolver); ``lookups``
    logs every name asked for.  Unknown names fail as the system resolver does."""

    def __init__(self, answers: dict[str, list]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.lookups.append(name)
        got = self.answers.get(name)
        if got is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if got and isinstance(got[0], list):
            got = got[min(self.lookups.count(name), len(got)) - 1]
        return [str(ip_address(a)) for a in got]
