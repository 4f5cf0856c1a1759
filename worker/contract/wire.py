"""The ZeroMQ channel between coordinator and worker: one msgpack map per frame.

Every request that concerns a block carries its ``id``; every ``Run`` ends with exactly one
``Done`` for the same id.  The handshake is versioned: the worker opens with ``Hello``
(protocol version, token, pid) and the coordinator answers ``Welcome`` or drops the
connection.  A handshaken worker that sends anything ``TO_COORDINATOR.parse`` refuses (several
frames, bytes that do not decode, a type not listed, a field out of its bounds), or answers a
request with another request's reply (``REPLIES`` says which answers which), has broken the
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
    shutdown {}                            finish: answer ``bye`` and exit
  control requests, each answered by its own reply or by ``refused`` for the same ``rid``:
    bind     {host: [{name, signature, doc, is_async}, ...], agent, rid}
                                           give the namespace a stub of each host function
                                           (and ``self``, the agent's, with ``agent``)
    export   {names, rid}                  hand these objects over (to a sub-agent)
    inject   {items: {name: item}, rid}    put handed-over objects in the namespace; an item:
                                           {kind, value?, data?, name?}: plain data by
                                           ``value``, a pickle made in a worker by ``data``,
                                           a host function by ``name`` (export's only)
    describe {names, rid}                  the namespace listing of these objects
    env      {rid}                         the machine as the worker sees it
    fork     {children: [{endpoint, token}], caller?, rid}
                                           fork the process once per child, each of which
                                           dials its ``endpoint`` and says ``hello`` with its
                                           ``token``; refused while a block other than
                                           ``caller`` (the block asking, through ``self``) runs

Worker -> coordinator (``TO_COORDINATOR``)
    hello    {v, token, pid}
    out      {id, o: [[stream, bytes], ...], raw?}  output; stream 1 = stdout, 2 = stderr;
                                           ``raw`` ([stream, n]) only on the output pipe, where
                                           n bytes of fd-level output follow (``contract.output``)
    done     {id, status, error, vars, code?, note?}  status: ok | error | cancelled | exit
                                           (SystemExit; ``code`` the exit status); ``note``:
                                           what an interrupt did, in words
    call     {cid, name, args, kwargs, block?}  call a host function (``self``, tools)
    bound    {rid, names}                  bind's answer: the names it defined
    exported {rid, items: {name: item}, errors: {name: words}}  export's: what can go, and why
                                           the rest cannot
    injected {rid, names}                  inject's: the names it defined
    described {rid, entries}               describe's: one listing entry per object found
    environment {rid, python, os, cpu?, ram, packages}  env's
    forked   {rid, pids}                   fork's: each child's pid, as the worker numbers it
    refused  {rid, error}                  the request failed, in words
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
    is_message,
    is_number,
    is_optional,
    is_plain,
    is_text,
    message,
)

__all__ = ["MAX_DOC", "MAX_ENTRY", "MAX_FORKS", "MAX_HANDED", "PLAIN_DEPTH", "PROTOCOL_VERSION", "REPLIES", "REQUESTS", "Message",
           "TO_COORDINATOR", "TO_WORKER", "Bind", "Bound", "Bye", "Call", "Cancel", "Describe", "Described", "Display", "Done", "Env",
           "Environment", "Export", "Exported", "Fork", "ForkChild", "Forked", "Hello", "HostFunction", "Inject", "Injected", "Item", "Out", "Refused",
           "Reply", "Run", "ScriptSpec", "Shutdown", "Stdin", "Stopping", "Stuck", "Welcome", "decode_message", "described",
           "done", "encode", "environment", "exported", "handed_items", "host_function", "refused"]

PROTOCOL_VERSION = 5

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


@message("run")
class Run(Message):
    id: str = field(_id)
    code: str = field(is_text(MAX_FRAME))
    script: ScriptSpec | None = field(is_optional(is_message(ScriptSpec)), None)


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


@message("shutdown")
class Shutdown(Message):
    pass


# -- control requests (coordinator -> worker) and their replies (worker -> coordinator) ---------
# A request is built without its ``rid`` (0): the coordinator's ``Worker.request`` numbers it.

#: Bounds of a control request and its reply: objects handed over or described at once, the
#: words of a host function's signature and docstring, of one listing entry, and how deep
#: plain data handed over by value may nest (the worker pickles anything deeper).
MAX_HANDED = 4096
MAX_DOC = 64 * 1024
MAX_ENTRY = 64 * 1024
PLAIN_DEPTH = 32
_name = is_text(MAX_NAME)
_names = is_list(_name, MAX_HANDED)


@message("host")
class HostFunction(Message):
    """A host function as a worker shows it: its stub's name, signature, docstring, and whether
    calling it is awaited.  ``host_function`` builds one within the bounds."""

    name: str = field(_name)
    signature: str = field(is_text(MAX_DOC), "(*args, **kwargs)")
    doc: str = field(is_text(MAX_DOC), "")
    is_async: bool = field(is_flag, False)


def host_function(name: str, signature: str, doc: str = "", is_async: bool = False) -> HostFunction:
    """A ``HostFunction``, its words cut to the contract's bounds (a docstring may be longer;
    a signature longer than the bound is shown as ``(*args, **kwargs)``)."""
    if len(signature) > MAX_DOC:
        signature = "(*args, **kwargs)"
    return HostFunction(name, signature, _cut(doc, MAX_DOC), is_async)


@message("item")
class Item(Message):
    """One object handed from a namespace to another: plain data by ``value``, a pickle made
    in a worker by ``data`` (which the coordinator relays and never unpickles), or a host
    function by ``name`` (from ``export`` only: the coordinator binds it where it goes)."""

    kind: str = field(is_choice("value", "pickle", "host"))
    value: Any = field(is_plain(PLAIN_DEPTH), None)
    data: bytes | None = field(is_optional(is_blob(MAX_FRAME)), None)
    name: str | None = field(is_optional(_name), None)

    def validate(self) -> None:
        given = {"value": self.data is None and self.name is None,
                 "pickle": self.data is not None and self.value is None and self.name is None,
                 "host": self.name is not None and self.value is None and self.data is None}
        if not given[self.kind]:
            raise ContractError(f"item: a {self.kind!r} item with the fields of another kind")


_items = is_map(_name, is_message(Item), MAX_HANDED)


def handed_items(value: Any) -> dict[str, Item]:
    """Objects handed over as a map of plain data (the items a worker's ``self.run_agent``
    sends with its call), checked as an ``inject``'s are; ContractError otherwise."""
    return _items(value)


@message("bind")
class Bind(Message):
    host: tuple[HostFunction, ...] = field(is_list(is_message(HostFunction), MAX_HANDED), ())
    agent: bool = field(is_flag, False)
    rid: int = field(_seq, 0)


@message("export")
class Export(Message):
    names: tuple[str, ...] = field(_names, ())
    rid: int = field(_seq, 0)


@message("inject")
class Inject(Message):
    items: dict[str, Item] = field(_items, {})
    rid: int = field(_seq, 0)

    def validate(self) -> None:
        if any(item.kind == "host" for item in self.items.values()):
            raise ContractError("inject: a host function is bound, not injected")


@message("describe")
class Describe(Message):
    names: tuple[str, ...] = field(_names, ())
    rid: int = field(_seq, 0)


@message("env")
class Env(Message):
    rid: int = field(_seq, 0)


#: Children one ``fork`` may ask for.
MAX_FORKS = 256


@message("child")
class ForkChild(Message):
    """Where one child of a ``fork`` connects, and the token of its ``hello``."""

    endpoint: str = field(is_text(4096))
    token: str = field(is_text(MAX_NAME))


@message("fork")
class Fork(Message):
    children: tuple[ForkChild, ...] = field(is_list(is_message(ForkChild), MAX_FORKS), ())
    caller: str | None = field(is_optional(_id), None)
    rid: int = field(_seq, 0)


#: The control requests, each of which may run user code in the worker (a pickle's, a
#: ``__repr__``), so a worker handles them as it handles a ``run``.
REQUESTS = (Bind, Export, Inject, Describe, Env, Fork)

TO_WORKER = Catalogue("coordinator to worker", (Welcome, Run, Stdin, Cancel, Reply, *REQUESTS, Shutdown))


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
    error = _cut(error, MAX_ERROR)
    names = tuple(v for v in variables if len(v) <= MAX_VAR_NAME)[:MAX_VARS]
    return Done(block_id, status, error, names, code, note[:MAX_NOTE])


@message("call")
class Call(Message):
    cid: int = field(_seq)
    name: str = field(is_text(MAX_NAME))
    args: tuple = field(is_list(is_any, MAX_FRAME), ())
    kwargs: dict = field(is_map(is_text(MAX_NAME), is_any, 4096), {})
    block: str | None = field(is_optional(_id), None)


@message("bound")
class Bound(Message):
    rid: int = field(_seq)
    names: tuple[str, ...] = field(_names, ())


@message("exported")
class Exported(Message):
    rid: int = field(_seq)
    items: dict[str, Item] = field(_items, {})
    errors: dict[str, str] = field(is_map(_name, is_text(MAX_NOTE), MAX_HANDED), {})


def exported(rid: int, items: dict[str, dict], errors: dict[str, str]) -> Exported:
    """An ``Exported`` of what ``worker.proxy.export`` made, its words cut to the bounds."""
    return Exported(rid, {name: Item(**item) for name, item in items.items()},
                    {name: _cut(words, MAX_NOTE) for name, words in errors.items()})


@message("injected")
class Injected(Message):
    rid: int = field(_seq)
    names: tuple[str, ...] = field(_names, ())


@message("described")
class Described(Message):
    rid: int = field(_seq)
    entries: tuple[str, ...] = field(is_list(is_text(MAX_ENTRY), MAX_HANDED), ())


def described(rid: int, entries: list[str]) -> Described:
    """A ``Described``, each entry cut to the bound (an object with many long docstrings)."""
    return Described(rid, tuple(_cut(entry, MAX_ENTRY) for entry in entries))


@message("environment")
class Environment(Message):
    """Python's version, the OS, the cores, the memory, the installed distributions, as the
    worker sees them (the system prompt's words)."""

    rid: int = field(_seq)
    python: str = field(is_text(64), "")
    os: str = field(_name, "")
    cpu: int | None = field(is_optional(is_int(0, 1 << 20)), None)
    ram: str = field(_name, "")
    packages: tuple[str, ...] = field(is_list(_name, 1024), ())


@message("forked")
class Forked(Message):
    rid: int = field(_seq)
    pids: tuple[int, ...] = field(is_list(is_int(1, 2**31), MAX_FORKS), ())


def environment(rid: int, info: dict) -> Environment:
    """An ``Environment`` of what ``worker.environment.describe_environment`` found, cut to
    the bounds."""
    return Environment(rid, info["python"][:64], info["os"][:MAX_NAME], info["cpu"], info["ram"][:MAX_NAME],
                       tuple(p for p in info["packages"] if len(p) <= MAX_NAME)[:1024])


@message("refused")
class Refused(Message):
    rid: int = field(_seq)
    error: str = field(is_text(MAX_ERROR))


def refused(rid: int, error: str) -> Refused:
    return Refused(rid, _cut(error, MAX_ERROR))


#: Which reply answers which request (any request may be answered by ``Refused``).
REPLIES: dict[type[Message], type[Message]] = {Bind: Bound, Export: Exported, Inject: Injected, Describe: Described,
                                               Env: Environment, Fork: Forked}


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit // 2] + "\n[... cut ...]\n" + text[-(limit // 2 - 20):]


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


TO_COORDINATOR = Catalogue("worker to coordinator", (Hello, Out, Done, Call, Bound, Exported, Injected, Described,
                                                     Environment, Forked, Refused, Display, Stuck, Stopping, Bye))


def decode_message(frame: bytes, catalogue: Catalogue, max_size: int = MAX_FRAME) -> Message:
    """One frame of this channel as a typed message; ContractError (FrameError included) if it
    is not one of ``catalogue``'s."""
    return catalogue.parse(decode(frame, max_size))

