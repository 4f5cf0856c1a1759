"""The wire format between coordinator and worker: one msgpack map per ZeroMQ message.

Every message is a map with a string ``t`` (its type), built by the constructor of the same
name below and by nothing else, so the vocabulary is this module's.  Requests that concern a
block carry its ``id``; every ``run`` ends with exactly one ``done`` for the same id.  The
handshake is versioned: the worker opens with ``hello`` (protocol version, token, pid) and the
coordinator answers ``welcome`` or drops the connection.

Coordinator -> worker
    welcome  {v}                          the hello was accepted
    run      {id, code, script}           start a block; ``script`` (only for a script run as
                                          ``python FILE ARGS`` would: ``exec``) is {path, argv, stdin}
    stdin    {id, data, eof}              bytes for a script's stdin; ``eof`` once it has ended
    cancel   {id, reason, deadline, grace}  interrupt a block: ``reason`` "timeout" (a
                                          ``TimeoutError`` naming ``deadline`` seconds) or
                                          "cancel" (what Ctrl-C gives); the coordinator kills
                                          the worker if it has not stopped ``grace`` s later
    reply    {cid, ok, value|error}       answer to a worker's ``call``
    req      {rid, op, args}              a control request (bind, export, inject, describe, env)
    shutdown {}                           finish: answer ``bye`` and exit

Worker -> coordinator
    hello    {v, token, pid}
    out      {id, o: [[stream, bytes], ...], raw}   batched output; stream 1 = stdout, 2 = stderr;
                                          ``raw`` ([stream, n]) only in a local worker's output
                                          pipe, where n bytes of fd-level output follow the
                                          frame (see ``_outpipe``)
    done     {id, status, error, vars, code, note}  status: ok | error | cancelled | exit
                                          (SystemExit; ``code`` is the exit status, as the
                                          interpreter's); ``note``: what an interrupt did, in words
    call     {cid, name, args, kwargs, block}  call a host function (``self``, tools) for a block
    resp     {rid, ok, value|error}       answer to a ``req``
    stuck    {id, why}                    an interrupt cannot reach the block: only a kill stops it
    stopping {id, why}                    the interrupt was given and the block runs on: the
                                          words for a kill, should the grace run out
    bye      {}                           the answer to ``shutdown``, the worker's last message

Decoding is bounded: the coordinator never trusts sizes a worker claims.  A message is
exactly one frame of at most ``MAX_FRAME`` bytes, and an output chunk at most ``MAX_CHUNK``
bytes.  A handshaken worker that sends anything else (several frames, bytes that do not
decode, a type not listed above, a malformed message) has broken the protocol, and the
coordinator kills it.  This module imports only msgpack, so the worker stays cheap to start.
"""

from __future__ import annotations

from typing import Any

import msgpack

PROTOCOL_VERSION = 1

#: Largest frame either side accepts.  Big enough for a batch of output or a pickled
#: object handed to a sub-agent (half of it); anything larger is a hostile or broken peer.
#: With the coordinator's receive queue of 4 messages, what a worker can make it hold unread
#: stays under 100 MiB.
MAX_FRAME = 24 * 1024 * 1024

#: Largest output chunk in an ``out`` message.  The worker cuts its output into pieces of
#: ``capture.MAX_BATCH`` (256 KiB); the bound keeps one message from costing the coordinator
#: more than a few MiB however the frame was made.
MAX_CHUNK = 1024 * 1024

STDOUT = 1
STDERR = 2


#: Message types by direction: what each side may receive.
TO_WORKER = ("welcome", "run", "stdin", "cancel", "reply", "req", "shutdown")
TO_COORDINATOR = ("hello", "out", "done", "call", "resp", "stuck", "stopping", "bye")


def welcome() -> dict[str, Any]:
    return {"t": "welcome", "v": PROTOCOL_VERSION}


def run(block_id: str, code: str, script: dict[str, Any] | None = None) -> dict[str, Any]:
    """``script``: {path (str or None for code read from stdin), argv (list of str), stdin
    (bool: ``input`` messages follow)}; left out for an agent's block."""
    if script is None:
        return {"t": "run", "id": block_id, "code": code}
    return {"t": "run", "id": block_id, "code": code, "script": script}


def stdin(block_id: str, data: bytes, eof: bool) -> dict[str, Any]:
    return {"t": "stdin", "id": block_id, "data": data, "eof": eof}


def cancel(block_id: str, reason: str = "cancel", deadline: float | None = None,
           grace: float | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"t": "cancel", "id": block_id, "reason": reason}
    if deadline is not None:
        msg["deadline"] = deadline
    if grace is not None:
        msg["grace"] = grace
    return msg


def reply(cid: Any, *, value: Any = None, error: str | None = None) -> dict[str, Any]:
    """The answer to ``call`` ``cid``: its value, or (``error`` given) the words of a failure."""
    if error is not None:
        return {"t": "reply", "cid": cid, "ok": False, "error": error}
    return {"t": "reply", "cid": cid, "ok": True, "value": value}


def req(rid: int, op: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"t": "req", "rid": rid, "op": op, "args": args}


def shutdown() -> dict[str, Any]:
    return {"t": "shutdown"}


def hello(token: str, pid: int) -> dict[str, Any]:
    return {"t": "hello", "v": PROTOCOL_VERSION, "token": token, "pid": pid}


def out(block_id: str, chunks: list, raw: list | None = None) -> dict[str, Any]:
    if raw is None:
        return {"t": "out", "id": block_id, "o": chunks}
    return {"t": "out", "id": block_id, "o": chunks, "raw": raw}


def done(block_id: str, status: str, error: str, variables: list, code: int | None = None,
         note: str = "") -> dict[str, Any]:
    """``code``: the exit status, for status ``exit`` only; ``note``: what an interrupt did."""
    msg = {"t": "done", "id": block_id, "status": status, "error": error, "vars": variables}
    if code is not None:
        msg["code"] = code
    if note:
        msg["note"] = note
    return msg


def call(cid: int, name: str, args: list, kwargs: dict, block: str | None) -> dict[str, Any]:
    return {"t": "call", "cid": cid, "name": name, "args": args, "kwargs": kwargs, "block": block}


def resp(rid: Any, *, value: Any = None, error: str | None = None) -> dict[str, Any]:
    """The answer to ``req`` ``rid``: its value, or (``error`` given) the words of a failure."""
    if error is not None:
        return {"t": "resp", "rid": rid, "ok": False, "error": error}
    return {"t": "resp", "rid": rid, "ok": True, "value": value}


def stuck(block_id: str, why: str) -> dict[str, Any]:
    return {"t": "stuck", "id": block_id, "why": why}


def stopping(block_id: str, why: str) -> dict[str, Any]:
    return {"t": "stopping", "id": block_id, "why": why}


def bye() -> dict[str, Any]:
    return {"t": "bye"}


class WireError(ValueError):
    """A frame that is not a well-formed message of this protocol."""


def encode(msg: dict[str, Any]) -> bytes:
    """Pack one message.  Bytes stay bytes, str stays str (``use_bin_type``)."""
    return msgpack.packb(msg, use_bin_type=True)


def decode(frame: bytes, max_size: int = MAX_FRAME) -> dict[str, Any]:
    """Unpack one message with every length bounded by the frame itself.

    Raises WireError for oversized frames, bad msgpack, trailing data, or a payload that
    is not a map with a string ``t``.
    """
    if len(frame) > max_size:
        raise WireError(f"frame of {len(frame)} bytes exceeds {max_size}")
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=len(frame),
            max_bin_len=len(frame),
            max_array_len=len(frame),
            max_map_len=len(frame) // 2 + 1,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise WireError("frame is not a message map with a string 't'")
    return msg
