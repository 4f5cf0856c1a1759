"""The fork server's channels: the coordinator writes requests to its stdin, it writes reports
to its stdout, each a frame (``framing``) holding one msgpack map; inside the server, the
processes it forks for a worker report on a pipe of their own.

Coordinator -> fork server (``TO_SERVER``)
    spawn  {id, endpoint, env, cwd, private_net, tmp_bytes, own_workspace?, exec?, hide, show,
            stderr?}
           fork a worker for ``endpoint`` with ``env`` in ``cwd``; ``exec``: an argv the forked
           process runs instead of serving as a worker (a sample slot); ``hide``/``show``: what
           of the server's view its namespace init covers and binds back (path, read-only);
           ``own_workspace``: an empty tmpfs of its own there; ``stderr``: a fifo that becomes
           its stderr instead of the server's
Fork server -> coordinator (``TO_COORDINATOR``)
    ready   {pid}          it has imported what it shares and serves
    spare   {pid}          a namespace init made ahead for the next request (its cgroups may be
                           made and entered ahead)
    forked  {id, pid}      the request's namespace init exists; ``spawned`` follows once the
                           process below it does
    spawned {id, pid}      done (pid: the init's, in the server's namespace)
    failed  {id, error}    not done, in words
    exited  {id, pid, status}  a worker's init was reaped (status as a shell's $?)

Pids are numbered in the server's PID namespace; the coordinator maps them to its own.

The processes the server forks for one worker -> fork server (``REPORTS``, their report pipe;
see ``worker.fork_server``: B makes the namespaces, C is their init, D the worker.  Each report
a frame holding ASCII JSON: the process that checks whether this kernel allows the server's
namespaces, ``worker.fork_server.probe``, may run without msgpack.  The server hands C its
``spawn`` down a pipe framed as its stdin is)
    init    {pid}          from B: C exists; its pid, in the server's namespace
    child   {pid}          from C: D (the worker, or a sample slot) exists; its pid, in C's
"""

from __future__ import annotations

from .limits import MAX_ID, MAX_NAME, MAX_NOTE
from .schema import (
    Catalogue,
    ContractError,
    Message,
    field,
    is_flag,
    is_int,
    is_list,
    is_map,
    is_optional,
    is_text,
    message,
)

__all__ = ["MAX_INSIDE", "MAX_REPORT", "MAX_REQUEST", "REPORTS", "TO_COORDINATOR", "TO_SERVER", "Child", "Exited",
           "Failed", "Forked", "Init", "Message", "Ready", "Spare", "Spawn", "Spawned"]

#: Bounds of one frame each way: a request carries an environment and a few paths.
MAX_REQUEST = 1024 * 1024
MAX_REPORT = 64 * 1024
#: Bound of a frame on the report pipe (a pid in a map).
MAX_INSIDE = 64

_path = is_text(MAX_ID)
_pid = is_int(0, 2**31)
_rid = is_int(0, 2**53)


def _shown(value: object) -> tuple[str, bool]:
    if type(value) not in (list, tuple) or len(value) != 2 or type(value[1]) is not bool:
        raise ContractError("not a [path, read-only] pair")
    return _path(value[0]), value[1]


@message("spawn")
class Spawn(Message):
    id: int = field(_rid)
    endpoint: str = field(_path)
    env: dict = field(is_map(is_text(MAX_NAME), is_text(1 << 16), 1024), {})
    cwd: str = field(_path, "/")
    private_net: bool = field(is_flag, True)
    tmp_bytes: int = field(is_int(0, 2**50), 512 << 20)
    own_workspace: str | None = field(is_optional(_path), None)
    exec: tuple[str, ...] | None = field(is_optional(is_list(is_text(1 << 20), 1024)), None)
    hide: tuple[str, ...] = field(is_list(_path, 64), ())
    show: tuple[tuple[str, bool], ...] = field(is_list(_shown, 64), ())
    stderr: str | None = field(is_optional(_path), None)


TO_SERVER = Catalogue("coordinator to fork server", (Spawn,))


@message("ready")
class Ready(Message):
    pid: int = field(_pid)


@message("spare")
class Spare(Message):
    pid: int = field(_pid)


@message("forked")
class Forked(Message):
    id: int = field(_rid)
    pid: int = field(_pid)


@message("spawned")
class Spawned(Message):
    id: int = field(_rid)
    pid: int = field(_pid)


@message("failed")
class Failed(Message):
    id: int = field(_rid)
    error: str = field(is_text(MAX_NOTE * 4))


@message("exited")
class Exited(Message):
    id: int = field(_rid)
    pid: int = field(_pid)
    status: int = field(is_int(0, 255))


TO_COORDINATOR = Catalogue("fork server to coordinator", (Ready, Spare, Forked, Spawned, Failed, Exited))


# -- inside the server: a worker's namespace init and the process below it -> the server --------

@message("init")
class Init(Message):
    pid: int = field(_pid)


@message("child")
class Child(Message):
    pid: int = field(_pid)


REPORTS = Catalogue("namespace init to fork server", (Init, Child))
