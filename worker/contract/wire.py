"""The ZeroMQ channel between coordinator and worker: one msgpack map per frame.

Every request that concerns a block carries its ``id``; every ``Run`` ends with exactly one
``Done`` for the same id.  The handshake is versioned: the worker opens with ``Hello``
(protocol version, token, pid) and the coordinator answers ``Welcome`` or drops the
connection.  A handshaken worker that sends anything ``TO_COORDINATOR.parse`` refuses (several
frames, bytes that do not decode, a type not listed, a field out of its bounds) has broken the
protocol, and the coordinator kills it.

Coordinator -> worker (``TO_WORKER``)
    welcome  {v}                           the hello was accepted
    run      {id, code, script?}           start a block; ``script`` (a block run as ``python
                                           FILE ARGS`` would run: ``exec``): {path, argv, stdin}
    stdin    {id, data, eof}               bytes for a script's stdin; ``eof`` once it has ended
    cancel   {id, reason, after?, grace?}  interrupt a block: ``reason`` "timeout" (a
                                           ``TimeoutError`` saying the deadline of ``after``
                                           seconds passed) or "cancel" (what Ctrl-C gives); the
                                           coordinator kills the worker if it has not stopped
                                           ``grace`` s later
    reply    {cid, ok, value?, error?}     the answer to a worker's ``call``
    req      {rid, op, args}               a control request (bind, export, inject, describe, env)
    shutdown {}                            finish: answer ``bye`` and exit

Worker -> coordinator (``TO_COORDINATOR``)
    hello    {v, token, pid}
    out      {id, o: [[stream, bytes], ...], raw?}  output; stream 1 = stdout, 2 = stderr;
                                           ``raw`` ([stream, n]) only on the output pipe, where
                                           n bytes of fd-level output follow (``contract.output``)
    done     {id, status, error, vars, code?, note?}  status: ok | error | cancelled | exit
                                           (SystemExit; ``code`` the exit status); ``note``:
                                           what an interrupt did, in words
    call     {cid, name, args, kwargs, block?}  call a host function (``self``, tools)
    resp     {rid, ok, value?, error?}     the answer to a ``req``
    display  {id, data}                    something the block showed (``display(obj)``, a figure):
                                           ``data`` a MIME bundle, {type: PNG bytes | text},
                                           bounded as ``contract.display`` says; at most
                                           ``MAX_DISPLAYS`` a block.  Sent after the block's
                                           output written before it, before its ``done``
    stuck    {id, why}                     an interrupt cannot reach the block: only a kill stops it
    stopping {id, why}                     the interrupt was given and the block runs on: the
                                           words for a kill, should the grace run out
    bye      {}                            the answer to ``shutdown``, the worker's last message
"""

from __future__ import annotations

from typing import Any

from .display import check_bundle
from .framing import decode, encode
from .limits import MAX_CHUNK, MAX_ERROR, MAX_FRAME, MAX_ID, MAX_NAME, MAX_NOTE, MAX_VAR_NAME, MAX_VARS
from .schema import (
    Catalogue,
    ContractError,
    Message,
    field,
    is_any,
    is_blob,
    is_choice,
    is_flag,
    is_int,
    is_list,
    is_map,
    is_number,
    is_optional,
    is_text,
    message,
)

__all__ = ["PROTOCOL_VERSION", "Message", "TO_COORDINATOR", "TO_WORKER", "Bye", "Call", "Cancel", "Display", "Done", "Hello", "Out",
           "Reply", "Req", "Resp", "Run", "ScriptSpec", "Shutdown", "Stdin", "Stopping", "Stuck", "Welcome",
           "decode_message", "done", "encode"]

PROTOCOL_VERSION = 3

_id = is_text(MAX_ID)
_seq = is_int(0, 2**53)


# -- coordinator -> worker ------------------------------------------------------------------------

@message("welcome")
class Welcome(Message):
    v: int = field(is_int(0, 2**16), PROTOCOL_VERSION)


@message("script")
class ScriptSpec(Message):
    """How a ``Run`` runs as a script: ``path`` (None: code read from stdin), ``argv``, and
    whether ``Stdin`` messages follow."""

    path: str | None = field(is_optional(is_text(MAX_ID)), None)
    argv: tuple[str, ...] = field(is_list(is_text(MAX_FRAME), 65536), ())
    stdin: bool = field(is_flag, False)


def _script(value: Any) -> ScriptSpec:
    if type(value) is dict:
        return ScriptSpec.from_wire(value)
    if isinstance(value, ScriptSpec):
        return value
    raise ContractError("not a script map")


@message("run")
class Run(Message):
    id: str = field(_id)
    code: str = field(is_text(MAX_FRAME))
    script: ScriptSpec | None = field(is_optional(_script), None)

    def to_wire(self) -> dict[str, Any]:
        out = {"t": "run", "id": self.id, "code": self.code}
        if self.script is not None:
            spec = self.script.to_wire()
            del spec["t"]
            out["script"] = spec
        return out


@message("stdin")
class Stdin(Message):
    id: str = field(_id)
    data: bytes = field(is_blob(MAX_FRAME))
    eof: bool = field(is_flag, False)


@message("cancel")
class Cancel(Message):
    """``after``: the deadline the block had, in seconds (for the words of its TimeoutError)."""

    id: str = field(_id)
    reason: str = field(is_choice("timeout", "cancel"), "cancel")
    after: float | None = field(is_optional(is_number(0)), None)
    grace: float | None = field(is_optional(is_number(0)), None)


@message("reply")
class Reply(Message):
    cid: int = field(_seq)
    ok: bool = field(is_flag)
    value: Any = field(is_any, None)
    error: str | None = field(is_optional(is_text(MAX_FRAME)), None)


@message("req")
class Req(Message):
    rid: int = field(_seq)
    op: str = field(is_text(MAX_NAME))
    args: dict = field(is_map(is_text(MAX_NAME), is_any, 4096), {})


@message("shutdown")
class Shutdown(Message):
    pass


TO_WORKER = Catalogue("coordinator to worker", (Welcome, Run, Stdin, Cancel, Reply, Req, Shutdown))


# -- worker -> coordinator ------------------------------------------------------------------------

@message("hello")
class Hello(Message):
    token: str = field(is_text(MAX_NAME))
    pid: int = field(is_int(0, 2**31))
    v: int = field(is_int(0, 2**16), PROTOCOL_VERSION)


def _chunk(value: Any) -> tuple[int, bytes]:
    if type(value) not in (list, tuple) or len(value) != 2 or value[0] not in (1, 2) or type(value[0]) is not int \
            or type(value[1]) is not bytes or len(value[1]) > MAX_CHUNK:
        raise ContractError("not a [stream, bytes] chunk")
    return value[0], value[1]


def _raw(value: Any) -> tuple[int, int]:
    if type(value) not in (list, tuple) or len(value) != 2 or value[0] not in (1, 2) or type(value[0]) is not int \
            or type(value[1]) is not int or not 0 < value[1] <= MAX_CHUNK:
        raise ContractError("not a [stream, size] of moved bytes")
    return value[0], value[1]


@message("out")
class Out(Message):
    id: str = field(_id)
    o: tuple[tuple[int, bytes], ...] = field(is_list(_chunk, MAX_FRAME), ())
    raw: tuple[int, int] | None = field(is_optional(_raw), None)

    def to_wire(self) -> dict[str, Any]:  # (the hot path: no generic walk)
        if self.raw is None:
            return {"t": "out", "id": self.id, "o": self.o}
        return {"t": "out", "id": self.id, "o": self.o, "raw": self.raw}


@message("done")
class Done(Message):
    id: str = field(_id)
    status: str = field(is_choice("ok", "error", "cancelled", "exit"))
    error: str = field(is_text(MAX_ERROR), "")
    vars: tuple[str, ...] = field(is_list(is_text(MAX_VAR_NAME), MAX_VARS), ())
    code: int | None = field(is_optional(is_int(0, 255)), None)
    note: str = field(is_text(MAX_NOTE), "")

    def to_wire(self) -> dict[str, Any]:  # (the hot path: no generic walk)
        out = {"t": "done", "id": self.id, "status": self.status, "error": self.error, "vars": self.vars}
        if self.code is not None:
            out["code"] = self.code
        if self.note:
            out["note"] = self.note
        return out


def done(block_id: str, status: str, error: str = "", variables: list[str] | tuple = (), code: int | None = None,
         note: str = "") -> Done:
    """A ``Done``, its words cut to the contract's bounds (a traceback may be longer)."""
    if code is not None:
        code = code if 0 <= code <= 255 else code & 0xFF
    if len(error) > MAX_ERROR:
        error = error[:MAX_ERROR // 2] + "\n[... cut ...]\n" + error[-(MAX_ERROR // 2 - 20):]
    names = tuple(v for v in variables if len(v) <= MAX_VAR_NAME)[:MAX_VARS]
    return Done(block_id, status, error, names, code, note[:MAX_NOTE])


@message("call")
class Call(Message):
    cid: int = field(_seq)
    name: str = field(is_text(MAX_NAME))
    args: tuple = field(is_list(is_any, MAX_FRAME), ())
    kwargs: dict = field(is_map(is_text(MAX_NAME), is_any, 4096), {})
    block: str | None = field(is_optional(_id), None)


@message("resp")
class Resp(Message):
    rid: int = field(_seq)
    ok: bool = field(is_flag)
    value: Any = field(is_any, None)
    error: str | None = field(is_optional(is_text(MAX_FRAME)), None)


@message("display")
class Display(Message):
    id: str = field(_id)
    data: dict = field(check_bundle)

    def to_wire(self) -> dict[str, Any]:
        return {"t": "display", "id": self.id, "data": self.data}


@message("stuck")
class Stuck(Message):
    id: str = field(_id)
    why: str = field(is_text(MAX_NOTE), "")


@message("stopping")
class Stopping(Message):
    id: str = field(_id)
    why: str = field(is_text(MAX_NOTE), "")


@message("bye")
class Bye(Message):
    pass


TO_COORDINATOR = Catalogue("worker to coordinator", (Hello, Out, Done, Call, Resp, Display, Stuck, Stopping, Bye))


def decode_message(frame: bytes, catalogue: Catalogue, max_size: int = MAX_FRAME) -> Message:
    """One frame of this channel as a typed message; ContractError (FrameError included) if it
    is not one of ``catalogue``'s."""
    return catalogue.parse(decode(frame, max_size))

