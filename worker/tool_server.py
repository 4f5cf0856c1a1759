"""The tool process: serves the repository tools (``worker.repo_tools``) to the coordinator.

Started by ``engine._tool_process`` as ``command()`` (``python -I -S -c`` with an absolute path:
nothing in the current directory or in site-packages' ``.pth`` hooks runs), with cwd ``/`` and
an environment holding nothing but PATH and LANG.  In order, before it reads a single request:
it dies with its parent (PR_SET_PDEATHSIG), opens the root, then confines itself with
``worker._confine.apply`` (rlimits: DATA, CPU, FSIZE 0, NOFILE, CORE 0; every capability
dropped; no_new_privs; Landlock read-only beneath the root and nothing else; a seccomp filter
that refuses sockets), so that what a bug or a hostile tree could make it do is read the root.

Frames, both ways: a 4-byte big-endian length, then one JSON object (ASCII, so lone
surrogates of undecodable file names travel too).  The coordinator sends ``init`` {root,
exclude, parent, cpu_seconds}, this process answers {ready: [layers]} or {fatal: words};
then each request {op, ..., max_result} gets one reply: {ok: text} | {refused: words} |
{failed: words}.  Requests are bounded by MAX_REQUEST, replies by MAX_REPLY (the text is cut
to ``repo_tools.MAX_TEXT`` chars, whatever max_result asks).  EOF on stdin ends the process.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import unicodedata  # noqa: F401 - for \N{...} in patterns: nothing is importable once Landlock is on
import warnings

from . import _confine
from .repo_tools import MAX_TEXT, Refusal, Tree, truncate

HEADER = struct.Struct(">I")
MAX_REQUEST = 4 << 20
MAX_REPLY = 16 << 20
#: Limits of the tool process.  DATA bounds what a request can make it allocate; NOFILE
#: leaves room for a walk's MAX_DEPTH descriptors; FSIZE 0: it writes no file, ever.
MEMORY_BYTES = 512 << 20
OPEN_FILES = 256

_PR_SET_PDEATHSIG = 1
_EXIT_PARENT_GONE = 70
_EXIT_CONFINE = 71


class FrameError(ValueError):
    """A frame that breaks the protocol: too big, not JSON, not an object."""


def pack(obj: dict) -> bytes:
    """One frame holding ``obj``."""
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return HEADER.pack(len(data)) + data


def unpack(data: bytes) -> dict:
    """The object of one frame's body; FrameError when it is not a JSON object."""
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise FrameError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("not a JSON object")
    return obj


def command(python: str | None = None) -> list[str]:
    """The argv that starts this server: isolated (-I), without site (-S), importing this
    package by its absolute location (appended to sys.path, so it never shadows the stdlib)."""
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.append({home!r}); "
            "from worker.tool_server import main; main()")
    return [python or sys.executable, "-I", "-S", "-c", code]


def confinement(root: str, cpu_seconds: int) -> dict:
    """The ``_confine.apply`` spec of the tool process: read-only beneath ``root``, no network,
    no privilege; Landlock and seccomp where this kernel has them."""
    spec: dict = {
        "rlimits": {"DATA": [MEMORY_BYTES] * 2, "CPU": [cpu_seconds, cpu_seconds + 1],
                    "FSIZE": [0, 0], "NOFILE": [OPEN_FILES] * 2, "CORE": [0, 0]},
        "drop_caps": True,
        "no_new_privs": True,
    }
    if _confine.landlock_abi() >= 1:
        spec["landlock"] = {"ro": [root], "rw": [], "dev": [], "scope": True, "deny_tcp": True}
    if _confine.seccomp_supported():
        spec["seccomp"] = {"socket_families": [], "lock_session": True}
    return spec


def _read_exact(n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame() -> dict | None:
    """The next request, or None at EOF (the coordinator closed the pipe or died)."""
    head = _read_exact(HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_REQUEST:
        raise FrameError(f"request of {size} bytes exceeds {MAX_REQUEST}")
    body = _read_exact(size)
    return None if body is None else unpack(body)


def _write_frame(obj: dict) -> None:
    data = pack(obj)
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def _die_with_parent() -> None:
    """SIGKILL when the coordinator (the thread that started us) ends."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def handle(tree: Tree, req: dict) -> dict:
    """One request's reply; never raises for anything a request can cause."""
    op = req.get("op")
    max_result = min(int(req.get("max_result") or MAX_TEXT), MAX_TEXT)
    try:
        tree.refresh()
        if op == "list_dir":
            text = tree.list_dir(str(req["path"]))
        elif op == "read_file":
            text = tree.read_file(str(req["path"]), int(req["offset"]), int(req["limit"]))
        elif op == "search":
            text = tree.search(str(req["pattern"]), str(req["path"]))
        else:
            return {"failed": f"unknown request {op!r}"}
    except Refusal as exc:
        return {"refused": str(exc)}
    except MemoryError:
        return {"failed": "out of memory: the request needs more than the tools may use"}
    except OSError as exc:
        return {"failed": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a bug must come back as words, not end the process
        return {"failed": f"{type(exc).__name__}: {exc}"}
    return {"ok": truncate(text, max_result)}


def main() -> None:
    """Set up as the module docstring says, then serve until EOF.  Never returns."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    warnings.simplefilter("ignore")  # "possible nested set" &c: the model reads results, not these
    try:
        init = _read_frame()
        if init is None:
            os._exit(0)
        if init.get("parent") and os.getppid() != init.get("parent"):  # the coordinator died first
            os._exit(_EXIT_PARENT_GONE)
        root = str(init["root"])
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)  # Landlock would refuse it later
        tree = Tree(root_fd, root, [list(map(str, e)) for e in init.get("exclude", [])])
        layers = _confine.apply(confinement(root, int(init["cpu_seconds"])))
    except Exception as exc:  # noqa: BLE001 - a half-confined tool process must not serve
        _write_frame({"fatal": f"{type(exc).__name__}: {exc}"})
        os._exit(_EXIT_CONFINE)
    _write_frame({"ready": layers})
    # Nothing drains stderr while this process serves: a write there (a warning about a
    # pattern) could fill the pipe and stall a request.  Startup failures were said above.
    os.dup2(devnull, 2)
    os.close(devnull)
    while True:
        try:
            req = _read_frame()
        except FrameError as exc:
            _write_frame({"failed": f"bad request: {exc}"})
            os._exit(2)  # the stream is out of step: start afresh
        if req is None:
            os._exit(0)
        _write_frame(handle(tree, req))
