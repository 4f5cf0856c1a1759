"""The sample slot's channel: one unix stream socket between the coordinator and a slot, each
message a frame (``framing``) holding one msgpack map.  One sample at a time.

Slot -> coordinator (``TO_COORDINATOR``)
    hello   {token, pid}   the slot is ready (the token the coordinator gave it)
    failed  {error}        it cannot serve (said instead of hello)
    result  {id, status, timed_out, killed, out, err, rss_kb, seconds, note, retire, fetched}
            ``status``: the sample process's wait status (None: it could not be started, ``note``
            says why); ``out``/``err``: [head, tail, total bytes] of stdout and stderr, head and
            tail at most the request's ``keep`` bytes each; ``retire``: the sample left
            something that outlives it, and the slot must not run another; ``fetched``: [path,
            bytes] of the files ``fetch`` named that the sample's workspace held as it ended,
            ``fetch_bytes`` at most in all
Coordinator -> slot (``TO_SLOT``)
    run     {id, code, path, argv, stdin, files, env, timeout, keep, fetch, fetch_bytes}
            ``files``: [path, bytes, mode] written into the sample's workspace first; ``stdin``:
            what its stdin reads (None: an end of file at once); ``fetch``: paths in the
            workspace to send back when the code ends

``SlotSettings`` is what a slot is told once, at its start (``contract.start``).
"""

from __future__ import annotations

from typing import Any

from .limits import MAX_FRAME, MAX_ID, MAX_NAME, MAX_NOTE
from .schema import (
    Catalogue,
    ContractError,
    Message,
    field,
    is_blob,
    is_flag,
    is_int,
    is_list,
    is_map,
    is_number,
    is_optional,
    is_text,
    message,
)

__all__ = ["MAX_FETCHED", "MAX_REQUEST", "TO_COORDINATOR", "TO_SLOT", "Failed", "Hello", "Message", "Result", "RunSample",
           "SlotSettings"]

#: Code, stdin and files of one sample: the largest request a slot reads.
MAX_REQUEST = 64 * 1024 * 1024
#: Files one sample may name to be sent back when it ends (``fetch``).
MAX_FETCHED = 256


def _file(value: Any) -> tuple[str, bytes, int]:
    if type(value) not in (list, tuple) or len(value) != 3:
        raise ContractError("not a [path, bytes, mode] file")
    return is_text(MAX_ID)(value[0]), is_blob(MAX_REQUEST)(value[1]), is_int(0, 0o7777)(value[2])


def _stdin(value: Any) -> str | bytes:
    if type(value) is str:
        return value
    return is_blob(MAX_REQUEST)(value)


@message("run")
class RunSample(Message):
    id: int = field(is_int(0, 2**53))
    code: str = field(is_text(MAX_REQUEST))
    path: str = field(is_text(MAX_ID), "sample.py")
    argv: tuple[str, ...] = field(is_list(is_text(MAX_FRAME), 65536), ())
    stdin: str | bytes | None = field(is_optional(_stdin), None)
    files: tuple[tuple[str, bytes, int], ...] = field(is_list(_file, 65536), ())
    env: dict = field(is_map(is_text(MAX_NAME), is_text(1 << 16), 1024), {})
    timeout: float = field(is_number(0), 10.0)
    keep: int = field(is_int(0, 1 << 28), 8192)  # bytes of head and of tail kept of each stream
    fetch: tuple[str, ...] = field(is_list(is_text(MAX_ID), MAX_FETCHED), ())
    fetch_bytes: int = field(is_int(0, MAX_REQUEST), 0)


TO_SLOT = Catalogue("coordinator to slot", (RunSample,))


@message("hello")
class Hello(Message):
    token: str = field(is_text(MAX_NAME))
    pid: int = field(is_int(0, 2**31))


@message("failed")
class Failed(Message):
    error: str = field(is_text(MAX_NOTE * 4))


def _parts(value: Any) -> tuple[bytes, bytes, int]:
    if type(value) not in (list, tuple) or len(value) != 3 or type(value[0]) is not bytes \
            or type(value[1]) is not bytes or type(value[2]) is not int \
            or value[2] < len(value[0]) + len(value[1]):
        raise ContractError("not [head, tail, total]")
    return value[0], value[1], value[2]


_NOTHING = (b"", b"", 0)


def _fetched(value: Any) -> tuple[str, bytes]:
    if type(value) not in (list, tuple) or len(value) != 2:
        raise ContractError("not a [path, bytes] file")
    return is_text(MAX_ID)(value[0]), is_blob(MAX_REQUEST)(value[1])


@message("result")
class Result(Message):
    id: int = field(is_int(0, 2**53))
    status: int | None = field(is_optional(is_int(-(2**31), 2**31)), None)
    timed_out: bool = field(is_flag, False)
    killed: bool = field(is_flag, False)
    out: tuple[bytes, bytes, int] = field(_parts, _NOTHING)
    err: tuple[bytes, bytes, int] = field(_parts, _NOTHING)
    rss_kb: int | None = field(is_optional(is_int(0, 2**50)), None)
    seconds: float = field(is_number(0), 0.0)
    note: str = field(is_text(MAX_NOTE * 4), "")
    retire: bool = field(is_flag, False)
    fetched: tuple[tuple[str, bytes], ...] = field(is_list(_fetched, MAX_FETCHED), ())

    def within(self, keep: int, fetch: tuple[str, ...] = (), fetch_bytes: int = 0) -> Result:
        """This result, if its heads and tails are at most ``keep`` bytes each and its fetched
        files are among ``fetch``, ``fetch_bytes`` at most in all (what was asked)."""
        if any(len(part) > keep for stream in (self.out, self.err) for part in stream[:2]):
            raise ContractError(f"result: more than the {keep} bytes of output asked for")
        if any(path not in fetch for path, _ in self.fetched) or \
                sum(len(data) for _, data in self.fetched) > fetch_bytes:
            raise ContractError("result: files that were not asked for, or more bytes of them")
        return self


TO_COORDINATOR = Catalogue("slot to coordinator", (Hello, Failed, Result))


@message("slot")
class SlotSettings(Message):
    """What a slot is told once, at its start: the workspace path its samples start in, the
    size of their ``/tmp``, ``/dev/shm`` and workspace, the grace between a deadline's interrupt
    and the kill, whether its network namespace is private, its socket directory, the modules
    it imports before the first sample (``--preload``), the run's output directory (which no
    sample is shown) and the endpoint it connects to (here, not on its command line, which
    every sample could read).  Held in the slot's ``StartSpec``."""

    workspace: str = field(is_text(MAX_ID))
    tmp_bytes: int = field(is_int(0, 2**50))
    grace: float = field(is_number(0, 60))
    socket_dir: str = field(is_text(MAX_ID))
    private_net: bool = field(is_flag, True)
    preload: tuple[str, ...] = field(is_list(is_text(MAX_NAME), 256), ())
    outputs: str = field(is_text(MAX_ID), "")
    endpoint: str = field(is_text(MAX_ID), "")
