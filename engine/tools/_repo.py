"""Three read-only repository tools, and the guard that runs tool calls without raising at the model.

``RepoTools(root)`` offers ``list_dir``, ``read_file`` and ``search``, confined to ``root`` with
symlinks resolved and to none of the paths in ``exclude=``. The same tools reach a model two ways:

- as host functions: ``RepoTools(root).functions()`` gives plain callables whose signature and
  docstring are what the model reads; a refusal is a ``ToolError`` whose message is the text to show.
- as OpenAI function tools: ``TOOL_SCHEMAS`` describes them, and
  ``execute_tool_call(call, impls)`` runs one ``tool_calls`` entry and always returns text.

The tools' work (walking, reading, matching the model's regex) never runs in the coordinator:
it runs in a confined tool process (``worker.tool_server``, ``worker.repo_tools``) that is
killed when a call passes its deadline, so no pattern, file or tree can freeze, crash or bloat
the coordinator.  ``schema_for(name, fn)`` builds a function-tool schema from any callable, so
other host functions can be offered the second way too. Read-only on purpose: an agent is
exactly as dangerous as its tools.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, ToolBusy, ToolClosed, ToolCrash, ToolError, ToolTimeout
from engine.tools._process import ToolProcess
from worker.contract import tools
from worker.contract.bounded_json import loads as bounded_loads
from worker.contract.tools import (  # noqa: F401 - the tools' bounds, re-exported
    MAX_MATCHES,
    MAX_READ_LIMIT,
    MAX_RESULT,
    MAX_SEARCH_FILE,
    SKIP_DIRS,
    truncate,
)

__all__ = [
    "MAX_ARG_CHARS", "RepoTools", "TOOL_SCHEMAS", "TOOL_TIMEOUT", "execute_tool_call",
    "execute_tool_call_async", "parse_arguments", "schema_for"
]

#: Seconds one tool call may take before its process is killed.
TOOL_TIMEOUT = 10.0
#: Longest path and pattern a call may pass (a request frame stays small).
MAX_ARG_CHARS = 65_536

_TIMED_OUT = {
    "search": "search timed out after {t:g} s: the pattern is too expensive (or the directory too big); "
              "use a simpler pattern or a narrower path",
    "read_file": "read_file timed out after {t:g} s: the file is too big to reach that offset; "
                 "use search to find the lines you need",
    "list_dir": "list_dir timed out after {t:g} s: the directory is too big to list",
}

# The contract shown to a model that speaks OpenAI tool calls; kept word for word.
TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "list_dir",
        "description": "List one directory: entries with a trailing / for "
                       "subdirectories and a byte size for files.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string",
                     "description": "directory, relative to the project root"},
        }, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file with line numbers. Large files are "
                       "windowed — pass offset (1-based first line) and limit "
                       "(max lines) to page through.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "file, relative to the project root"},
            "offset": {"type": "integer", "description": "first line to show, 1-based (default 1)"},
            "limit": {"type": "integer", "description": "max lines to show (default 200)"},
        }, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Search file contents under a directory with a Python "
                       "regular expression. Returns path:line: text matches. "
                       "Use a specific pattern — results cap at 100 matches.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "description": "Python regex to find"},
            "path": {"type": "string",
                     "description": "directory to search, relative to the project root (default: whole root)"},
        }, "required": ["pattern"]}}},
]


class RepoTools:
    """Read-only views of the files under one root; nothing the model passes reaches outside it,
    nor into a path of ``exclude`` (by any spelling, ``..`` or link, even one made mid-call).

    Each call is a request to the tools' own process, started on first use, confined to reading
    the root, and killed when the call passes ``timeout`` seconds (the model reads why; the
    next call starts a fresh one).  ``close()`` (or ``with``) ends it; so do garbage
    collection, the coordinator's exit and its death.
    """

    def __init__(self, root: str | os.PathLike[str], max_result: int = MAX_RESULT, *,
                 exclude: Iterable[str | os.PathLike[str]] = (), timeout: float = TOOL_TIMEOUT) -> None:
        given = os.path.abspath(os.fspath(root))
        real = os.path.realpath(given)
        if not os.path.isdir(real):
            raise ConfigError(f"repository root is not a directory: {root}")
        if not timeout > 0:
            raise ConfigError(f"tool timeout must be positive, got {timeout!r}")
        self._root = real
        self._given = given  # absolute paths spelled through the root as given are accepted too
        self.max_result = max_result
        self.timeout = float(timeout)
        self._exclude = _exclusions(real, exclude)
        self._process = ToolProcess(real, [list(c) for c in self._exclude])

    @property
    def root(self) -> Path:
        """The root, with symlinks resolved."""
        return Path(self._root)

    @property
    def exclude(self) -> list[Path]:
        """The excluded paths under the root, resolved."""
        return [Path(self._root, *c) for c in self._exclude]

    @property
    def pid(self) -> int | None:
        """The tool process's pid while one runs, else None."""
        return self._process.pid

    @property
    def confinement(self) -> list[str]:
        """The layers the tool process last started applied to itself (empty before a call)."""
        return list(self._process.layers)

    def close(self) -> None:
        """End the tool process; later calls are refused.  Idempotent."""
        self._process.close()

    def __enter__(self) -> RepoTools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_dir(self, path: str = ".") -> str:
        """List one directory: entries with a trailing / for
        subdirectories and a byte size for files.

        Args:
            path: directory, relative to the project root
        """
        return self._call("list_dir", path=self._path(path))

    def read_file(self, path: str, offset: int = 1, limit: int = 200) -> str:
        """Read a text file with line numbers. Large files are
        windowed — pass offset (1-based first line) and limit
        (max lines) to page through.

        Args:
            path: file, relative to the project root
            offset: first line to show, 1-based (default 1)
            limit: max lines to show (default 200)
        """
        path = self._path(path)
        offset = min(max(1, _as_int("offset", offset)), 1 << 62)
        limit = max(1, min(_as_int("limit", limit), MAX_READ_LIMIT))
        return self._call("read_file", path=path, offset=offset, limit=limit)

    def search(self, pattern: str, path: str = ".") -> str:
        """Search file contents under a directory with a Python
        regular expression. Returns path:line: text matches.
        Use a specific pattern — results cap at 100 matches.

        Args:
            pattern: Python regex to find
            path: directory to search, relative to the project root (default: whole root)
        """
        if not isinstance(pattern, str):
            raise ToolError(f"pattern must be a string, got {pattern!r}")
        if len(pattern) > MAX_ARG_CHARS:
            raise ToolError(f"pattern too long ({len(pattern)} chars, at most {MAX_ARG_CHARS})")
        return self._call("search", pattern=pattern, path=self._path(path))

    def _path(self, path: Any) -> str:
        """The model's path, checked for what the tool process cannot be sent."""
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str):
            raise ToolError(f"path must be a string, got {path!r}")
        if "\0" in path:
            raise ToolError(f"bad path {path!r}: embedded null byte")
        if len(path) > MAX_ARG_CHARS:
            raise ToolError(f"path too long ({len(path)} chars, at most {MAX_ARG_CHARS})")
        if self._given != self._root and (path == self._given or path.startswith(self._given + "/")):
            path = self._root + path[len(self._given):]
        return path

    def _call(self, op: str, **args: Any) -> str:
        """One request to the tool process, its reply as text or ToolError words."""
        try:
            reply = self._process.request(tools.Request(op, args, min(self.max_result, tools.MAX_TEXT)), self.timeout)
        except ToolTimeout:
            raise ToolError(_TIMED_OUT[op].format(t=self.timeout)) from None
        except ToolBusy:
            raise ToolError(f"{op}: the repository tools are busy with other calls; try again") from None
        except ToolClosed:
            raise ToolError(f"{op}: the repository tools were closed") from None
        except ToolCrash as exc:
            raise ToolError(f"{op} failed: {exc}; the next call starts the tools afresh") from None
        if isinstance(reply, tools.Ok):
            return truncate(reply.text, self.max_result)
        if isinstance(reply, tools.Refused):
            raise ToolError(reply.error)
        raise ToolError(f"{op} failed: {reply.error if isinstance(reply, tools.Failed) else reply.kind}")

    def functions(self) -> dict[str, Callable[..., str]]:
        """The three tools as plain functions bound to this root, for use as host functions.

        Each keeps the method's name, signature and docstring (``inspect.signature`` and
        ``inspect.getdoc`` give what the model should see); refusals raise ``ToolError``.
        """
        return {name: _as_function(getattr(self, name)) for name in ("list_dir", "read_file", "search")}


def _exclusions(root: str, paths: Iterable[str | os.PathLike[str]]) -> list[tuple[str, ...]]:
    """The excluded paths as components below ``root`` (resolved; they need not exist yet).
    Paths outside the root hide nothing and are dropped; one holding the root is refused."""
    out = []
    for p in paths:
        real = os.path.realpath(os.fspath(p))
        if os.path.commonpath([real, root]) == real:
            raise ConfigError(f"the repository root {root} lies inside the excluded path {p}")
        rel = os.path.relpath(real, root)
        if rel != ".." and not rel.startswith(".." + os.sep):
            out.append(tuple(rel.split(os.sep)))
    return out


def _as_function(method: Callable[..., str]) -> Callable[..., str]:
    """A plain function calling ``method``, wearing its name, docstring and (self-less) signature."""
    def tool(*args: Any, **kwargs: Any) -> str:
        return method(*args, **kwargs)

    tool.__name__ = tool.__qualname__ = method.__name__
    tool.__doc__ = method.__doc__
    tool.__module__ = method.__module__
    tool.__signature__ = inspect.signature(method, eval_str=True)  # type: ignore[attr-defined]
    tool.__annotations__ = dict(typing.get_type_hints(method))
    return tool


def _as_int(name: str, value: Any) -> int:
    """``value`` as an int, or a ToolError the model can act on (``"12"`` and ``12.0`` are accepted)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ToolError(f"{name} must be an integer, got {value!r}") from None


# ---------------------------------------------------------------- executing tool calls
# The rule that keeps a loop alive: whatever goes wrong comes back as the tool result, in words.

def parse_arguments(raw: Any) -> dict | str:
    """A tool call's arguments as a dict, or the words telling the model what was wrong."""
    if isinstance(raw, Mapping):  # some servers send the object already parsed
        return dict(raw)
    try:
        args = bounded_loads(raw or "{}")
    except (ValueError, TypeError) as exc:  # not JSON, or beyond the bounds (too deep, a number too long)
        return f"[agent] arguments were not valid JSON ({exc}) — resend the call with corrected JSON"
    if not isinstance(args, dict):
        return "[agent] arguments must be a JSON object"
    return args


def _prepare(call: Mapping[str, Any], impls: Mapping[str, Callable[..., Any]]
             ) -> tuple[str, Callable[..., Any], dict, bool] | str:
    """(name, impl, args, signature_checked) for a tool call, or the words for why it cannot run."""
    fn_block = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn_block, Mapping):
        fn_block = {}
    name = fn_block.get("name", "")
    impl = impls.get(name) if isinstance(name, str) else None
    if impl is None:
        return f"[agent] unknown tool {name!r} — available: {', '.join(impls) or '(none)'}"
    args = parse_arguments(fn_block.get("arguments"))
    if isinstance(args, str):
        return args
    checked = True
    try:
        inspect.signature(impl).bind(**args)
    except TypeError as exc:
        return f"[agent] bad arguments for {name}: {exc}"
    except ValueError:  # no signature to check against (some builtins): a TypeError will have to tell
        checked = False
    return name, impl, args, checked


def _failure(name: str, exc: Exception, checked: bool) -> str:
    if isinstance(exc, ToolError):
        return f"[agent] {exc}"
    if isinstance(exc, TypeError) and not checked:
        return f"[agent] bad arguments for {name}: {exc}"
    return f"[agent] {name} failed: {exc}"  # OSError and anything else a tool lets out


def execute_tool_call(call: Mapping[str, Any], impls: Mapping[str, Callable[..., Any]],
                      max_result: int = MAX_RESULT) -> str:
    """Run one OpenAI ``tool_calls`` entry against ``impls``; always returns text, never raises.

    Arguments are bound to the signature before the call, so a TypeError from inside a tool is
    reported as its failure, not as the model's bad arguments.
    """
    prepared = _prepare(call, impls)
    if isinstance(prepared, str):
        return prepared
    name, impl, args, checked = prepared
    try:
        out = impl(**args)
    except Exception as exc:  # noqa: BLE001 - never raise at the model
        return _failure(name, exc, checked)
    return truncate(out if isinstance(out, str) else str(out), max_result)


async def execute_tool_call_async(call: Mapping[str, Any], impls: Mapping[str, Callable[..., Any]],
                                  max_result: int = MAX_RESULT) -> str:
    """``execute_tool_call`` for an event loop: coroutine functions are awaited, plain ones run
    in a thread so a slow tool does not stall the loop."""
    prepared = _prepare(call, impls)
    if isinstance(prepared, str):
        return prepared
    name, impl, args, checked = prepared
    try:
        if inspect.iscoroutinefunction(impl):
            out = await impl(**args)
        else:
            out = await asyncio.to_thread(impl, **args)
    except Exception as exc:  # noqa: BLE001 - never raise at the model
        return _failure(name, exc, checked)
    return truncate(out if isinstance(out, str) else str(out), max_result)


# ---------------------------------------------------------------- schemas from callables

_JSON_TYPES: dict[Any, str] = {
    str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ARGS_HEADERS = {"args:", "arguments:", "parameters:", "params:"}
_SECTION_RE = re.compile(r"^[A-Z][A-Za-z ]*:$")  # "Returns:", "Raises:", "Example:" ...


def schema_for(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """An OpenAI function-tool schema for ``fn``, from its signature and docstring.

    The description is the docstring up to its first section (``Args:``, ``Returns:`` ...);
    parameter descriptions come from an ``Args:`` section of ``name: text`` lines. Types map
    str/int/float/bool/list/dict (and their generic forms, and ``X | None``) to JSON types; anything
    else gets no type. Required = parameters without a default. ``*args``/``**kwargs`` are left out;
    positional-only parameters cannot be passed by name, so they are refused (ConfigError).
    """
    if not _NAME_RE.match(name):
        raise ConfigError(f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'")
    try:
        sig = _signature(fn)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot read the signature of {name!r}: {exc}") from exc
    description, param_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in sig.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigError(f"{name}: parameter {param.name!r} is positional-only; "
                              "tool arguments are passed by name")
        prop: dict[str, Any] = {}
        json_type = _json_type(param.annotation)
        if json_type:
            prop["type"] = json_type
        if param.name in param_docs:
            prop["description"] = param_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": function}


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature with string annotations evaluated one by one; those that cannot be stay strings."""
    sig = inspect.signature(fn)
    scope = getattr(inspect.unwrap(fn), "__globals__", {})
    params = []
    for param in sig.parameters.values():
        annotation = param.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, scope)  # what inspect's eval_str does, per parameter
            except Exception:  # a name only the function's body knows, or not an expression at all
                pass
        params.append(param.replace(annotation=annotation))
    return sig.replace(parameters=params)


def _json_type(annotation: Any) -> str | None:
    """The JSON Schema type for a Python annotation, or None when there is no plain answer."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):  # unevaluated: only the bare builtin names are certain
        return {t.__name__: j for t, j in _JSON_TYPES.items()}.get(annotation.strip())
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(members[0]) if len(members) == 1 else None
    return _JSON_TYPES.get(origin or annotation)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a cleaned docstring.

    In an ``Args:`` section an entry is a line at the section's own indent reading ``name: text``
    (or ``name (type): text``); deeper lines continue it. Description lines of one paragraph are
    joined with spaces, paragraphs kept apart by a blank line.
    """
    lines = doc.splitlines()
    i = 0
    while i < len(lines) and not _SECTION_RE.match(lines[i].strip()):
        i += 1
    description = _paragraphs(lines[:i])
    params: dict[str, str] = {}
    while i < len(lines):
        header = lines[i].strip().lower()
        i += 1
        section: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i][0].isspace()):
            section.append(lines[i])
            i += 1
        if header in _ARGS_HEADERS:
            params.update(_parse_args(section))
    return description, params


def _parse_args(section: list[str]) -> dict[str, str]:
    entries = [line for line in section if line.strip()]
    if not entries:
        return {}
    base = _indent(entries[0])
    params: dict[str, str] = {}
    current: str | None = None
    for line in entries:
        text = line.strip()
        head, sep, rest = text.partition(":")
        name = head.split("(")[0].strip()
        if _indent(line) <= base and sep and name.isidentifier():
            current = name
            params[name] = rest.strip()
        elif current is not None:
            params[current] = f"{params[current]} {text}".strip()
    return params


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _paragraphs(lines: list[str]) -> str:
    paragraphs: list[str] = []
    current: list[str] = []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)
