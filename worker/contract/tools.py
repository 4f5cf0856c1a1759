"""The tool process's channel: the coordinator writes to its stdin, it answers on its stdout,
each message a frame (``framing``) holding one ASCII JSON object (lone surrogates of
undecodable file names travel as escapes, which msgpack's UTF-8 strings cannot carry).

Coordinator -> tool process (``TO_TOOLS``)
    init     {root, exclude, parent, confine}   the tree to serve, what of it to leave out, the
                                                coordinator's pid (0: not its parent), and the
                                                confinement it applies before serving (a
                                                ``Confinement``'s map)
    request  {op, args, max_result}             one tool call (``list_dir``, ``read_file``, ``search``)
Tool process -> coordinator (``TO_COORDINATOR``)
    ready    {layers}     confined (the layers applied) and serving
    fatal    {error}      it could not confine itself: it serves nothing
    ok       {text}       a request's result
    refused  {error}      the request is refused (outside the root, a link, ...)
    failed   {error}      it could not be answered
"""

from __future__ import annotations

from .confinement import Confinement
from .limits import MAX_ID, MAX_NAME
from .schema import Catalogue, Message, field, is_any, is_int, is_list, is_map, is_message, is_text, message

__all__ = ["MAX_MATCHES", "MAX_READ_LIMIT", "MAX_REPLY", "MAX_REQUEST", "MAX_RESULT", "MAX_SEARCH_FILE", "MAX_TEXT",
           "SKIP_DIRS", "TO_COORDINATOR", "TO_TOOLS", "Failed", "Fatal", "Init", "Message", "Ok", "Ready", "Refused",
           "Request", "truncate"]

MAX_REQUEST = 4 << 20
MAX_REPLY = 16 << 20

#: What the tools show, the same on both sides (the model reads these bounds in results).
MAX_RESULT = 8_000  # chars of tool output fed back per call
MAX_TEXT = 1_000_000  # chars one reply may carry whatever max_result asks (bounds the frame)
SKIP_DIRS = frozenset({".git", "target", "node_modules", "build", "__pycache__", ".cache"})
MAX_MATCHES = 100
MAX_SEARCH_FILE = 2_000_000  # bytes; bigger files are skipped by search
MAX_READ_LIMIT = 1000  # lines one read_file call may show


def truncate(text: str, max_result: int = MAX_RESULT) -> str:
    """``text`` cut so that it, with the note saying so, fits in ``max_result`` chars.

    The note is counted inside the limit, so truncating twice changes nothing: a result capped by a
    tool and then by ``execute_tool_call`` reads the same. (A limit shorter than the note itself
    leaves just the note.)
    """
    if len(text) <= max_result:
        return text
    note = (f"\n[agent] truncated — {len(text)} chars total; "
            "narrow the request (offset/limit, tighter pattern)")
    return text[:max(0, max_result - len(note))] + note


@message("init")
class Init(Message):
    root: str = field(is_text(MAX_ID))
    exclude: tuple = field(is_list(is_list(is_text(MAX_ID), 64), 4096), ())
    parent: int = field(is_int(0, 2**31), 0)
    confine: Confinement = field(is_message(Confinement), Confinement())


@message("request")
class Request(Message):
    op: str = field(is_text(MAX_NAME))
    args: dict = field(is_map(is_text(MAX_NAME), is_any, 64), {})
    max_result: int = field(is_int(0, MAX_REPLY), 0)


TO_TOOLS = Catalogue("coordinator to tool process", (Init, Request))


@message("ready")
class Ready(Message):
    layers: tuple[str, ...] = field(is_list(is_text(MAX_NAME), 64), ())


@message("fatal")
class Fatal(Message):
    error: str = field(is_text(MAX_REPLY))


@message("ok")
class Ok(Message):
    text: str = field(is_text(MAX_REPLY))


@message("refused")
class Refused(Message):
    error: str = field(is_text(MAX_REPLY))


@message("failed")
class Failed(Message):
    error: str = field(is_text(MAX_REPLY))


TO_COORDINATOR = Catalogue("tool process to coordinator", (Ready, Fatal, Ok, Refused, Failed))
