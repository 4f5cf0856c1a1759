"""Three read-only repository tools, and the guard that runs tool calls without raising at the model.

``RepoTools(root)`` offers ``list_dir``, ``read_file`` and ``search``, confined to ``root`` with
symlinks resolved. The same tools reach a model two ways:

- as host functions: ``RepoTools(root).functions()`` gives plain callables whose signature and
  docstring are what the model reads; a refusal is a ``ToolError`` whose message is the text to show.
- as OpenAI function tools: ``TOOL_SCHEMAS`` describes them, and
  ``execute_tool_call(call, impls)`` runs one ``tool_calls`` entry and always returns text.

``schema_for(name, fn)`` builds a function-tool schema from any callable, so other host functions
can be offered the second way too. Read-only on purpose: an agent is exactly as dangerous as its
tools.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

MAX_RESULT = 8_000  # chars of tool output fed back per call
SKIP_DIRS = frozenset({".git", "target", "node_modules", "build", "__pycache__", ".cache"})
MAX_MATCHES = 100
MAX_SEARCH_FILE = 2_000_000  # bytes; bigger files are skipped by search
MAX_READ_LIMIT = 1000  # lines one read_file call may show
_MATCH_LINE_CHARS = 200

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


class ToolError(Exception):
    """A tool refusing a request the model made; the message is what the model reads. Never fatal.

    Deliberately outside ``AgentloopError``: it is a fault of the model's request, reported as words.
    """


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


class RepoTools:
    """Read-only views of the files under one root; nothing the model passes reaches outside it."""

    def __init__(self, root: str | os.PathLike[str], max_result: int = MAX_RESULT) -> None:
        real = os.path.realpath(os.fspath(root))
        if not os.path.isdir(real):
            raise ConfigError(f"repository root is not a directory: {root}")
        self._root = real
        self.max_result = max_result

    @property
    def root(self) -> Path:
        """The root, with symlinks resolved."""
        return Path(self._root)

    def _resolve(self, path: str) -> str:
        """Confine a path the model asked for to the root, symlinks resolved (``..`` and links alike)."""
        try:
            full = os.path.realpath(os.path.join(self._root, path))
        except ValueError as exc:  # embedded NUL byte
            raise ToolError(f"bad path {path!r}: {exc}") from None
        if not self._inside(full):
            raise ToolError(f"path escapes the project root: {path}")
        return full

    def _inside(self, full: str) -> bool:
        return full == self._root or full.startswith(self._root.rstrip(os.sep) + os.sep)  # root "/" too

    def _open(self, full: str, shown: str, flags: int = os.O_RDONLY) -> int:
        """Open ``full`` (already confined by ``_resolve``) one component at a time from the root,
        never following a link.  The path was checked a moment ago; code running beside us may
        swap a directory for a symlink in between, and this open then fails instead of leaving
        the root."""
        rel = os.path.relpath(full, self._root)
        parts = [] if rel == "." else rel.split(os.sep)
        fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                mode = flags if last else os.O_RDONLY | os.O_DIRECTORY
                nfd = os.open(part, mode | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ToolError(f"{shown} changed while being read (a link appeared in its path)") from None
            if exc.errno == errno.ENOENT:
                raise ToolError(f"no such file: {shown}") from None
            raise
        return fd

    def list_dir(self, path: str = ".") -> str:
        """List one directory: entries with a trailing / for
        subdirectories and a byte size for files.

        Args:
            path: directory, relative to the project root
        """
        full = self._resolve(path)
        if not os.path.isdir(full):
            raise ToolError(f"not a directory: {path}")
        fd = self._open(full, path, os.O_RDONLY | os.O_DIRECTORY)
        rows = []
        try:
            for name in sorted(os.listdir(fd)):
                try:
                    st = os.stat(name, dir_fd=fd)  # follows links, as the seed's listing did ...
                    if not self._inside(os.path.realpath(os.path.join(full, name))):
                        raise OSError  # ... but says nothing of what lies outside the root
                except OSError:  # a dangling or escaping link; one bad entry must not hide the rest
                    rows.append(f"{name} (unreadable)")
                    continue
                rows.append(f"{name}/" if stat.S_ISDIR(st.st_mode) else f"{name} ({st.st_size} bytes)")
        finally:
            os.close(fd)
        return truncate("\n".join(rows) or "(empty directory)", self.max_result)

    def read_file(self, path: str, offset: int = 1, limit: int = 200) -> str:
        """Read a text file with line numbers. Large files are
        windowed — pass offset (1-based first line) and limit
        (max lines) to page through.

        Args:
            path: file, relative to the project root
            offset: first line to show, 1-based (default 1)
            limit: max lines to show (default 200)
        """
        full = self._resolve(path)
        if os.path.isdir(full):
            raise ToolError(f"{path} is a directory — use list_dir")
        if not os.path.exists(full):
            raise ToolError(f"no such file: {path}")
        if not os.path.isfile(full):  # a FIFO or device would block or never end
            raise ToolError(f"not a regular file: {path}")
        offset = _as_int("offset", offset)
        limit = _as_int("limit", limit)
        fd = self._open(full, path)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for a FIFO or device meanwhile
            os.close(fd)
            raise ToolError(f"not a regular file: {path}")
        os.set_blocking(fd, True)
        with open(fd, errors="replace") as f:
            lines = f.readlines()
        if not lines:
            return "(empty file)"
        offset = max(1, offset)
        limit = max(1, min(limit, MAX_READ_LIMIT))
        window = lines[offset - 1:offset - 1 + limit]
        if not window:
            raise ToolError(f"{path} has only {len(lines)} lines; offset {offset} is past the end")
        out = "".join(f"{i}\t{line}" for i, line in enumerate(window, offset))
        last = offset + len(window) - 1
        if last < len(lines):
            out += (f"\n[agent] showing lines {offset}-{last} of {len(lines)} — "
                    f"call again with offset={last + 1} for more")
        return truncate(out, self.max_result)

    def search(self, pattern: str, path: str = ".") -> str:
        """Search file contents under a directory with a Python
        regular expression. Returns path:line: text matches.
        Use a specific pattern — results cap at 100 matches.

        Args:
            pattern: Python regex to find
            path: directory to search, relative to the project root (default: whole root)
        """
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise ToolError(f"bad regex {pattern!r}: {exc}") from None
        start = self._resolve(path)
        if os.path.isfile(start):  # one file named: search just it, rather than report nothing
            parent = self._open(os.path.dirname(start), path, os.O_RDONLY | os.O_DIRECTORY)
            files: Iterator[tuple[int, str, str]] = iter([(parent, os.path.basename(start), start)])
        elif os.path.isdir(start):
            parent = self._open(start, path, os.O_RDONLY | os.O_DIRECTORY)
            files = self._walk(parent, start)
        else:
            raise ToolError(f"not a directory: {path}")
        try:
            return self._search(rx, files, pattern, path)
        finally:
            os.close(parent)

    def _search(self, rx: re.Pattern[str], files: Iterator[tuple[int, str, str]], pattern: str,
                path: str) -> str:
        hits: list[str] = []
        for dir_fd, name, full in files:
            for lineno, line in _matching_lines(dir_fd, name, rx):
                rel = os.path.relpath(full, self._root)
                hits.append(f"{rel}:{lineno}: {line.rstrip()[:_MATCH_LINE_CHARS]}")
                if len(hits) >= MAX_MATCHES:
                    hits.append(f"[agent] {MAX_MATCHES}-match cap hit — tighten the pattern or narrow the path")
                    return truncate("\n".join(hits), self.max_result)
        return truncate("\n".join(hits) or f"no matches for {pattern!r} under {path}", self.max_result)

    def _walk(self, start_fd: int, start: str) -> Iterator[tuple[int, str, str]]:
        """(directory fd, name, path) of the files under ``start`` in sorted order; SKIP_DIRS
        pruned, symlinks never followed.  ``os.fwalk`` descends through directory handles and
        checks each is the directory it listed, so a directory swapped for a link is not entered."""
        for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=start_fd):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for fname in sorted(filenames):
                yield dir_fd, fname, os.path.normpath(os.path.join(start, dirpath, fname))

    def functions(self) -> dict[str, Callable[..., str]]:
        """The three tools as plain functions bound to this root, for use as host functions.

        Each keeps the method's name, signature and docstring (``inspect.signature`` and
        ``inspect.getdoc`` give what the model should see); refusals raise ``ToolError``.
        """
        return {name: _as_function(getattr(self, name)) for name in ("list_dir", "read_file", "search")}


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
    except (TypeError, ValueError):
        raise ToolError(f"{name} must be an integer, got {value!r}") from None


def _matching_lines(dir_fd: int, name: str, rx: re.Pattern[str]) -> Iterator[tuple[int, str]]:
    """(line number, line) of each match in one file; links, non-regular, big and binary files
    yield nothing.  Opened without following links and checked once open: no swap in between."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:  # a link (ELOOP), unreadable, or gone since the walk: skip it like the rest
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SEARCH_FILE:
            return
        os.set_blocking(fd, True)
        f = open(fd, errors="replace")
        fd = -1  # the file object owns it now
        with f:
            if "\0" in f.read(1024):  # binary
                return
            f.seek(0)
            for lineno, line in enumerate(f, 1):
                if rx.search(line):
                    yield lineno, line
    except OSError:  # unreadable, or gone since the walk: skip it like the rest
        return
    finally:
        if fd >= 0:
            os.close(fd)


# ---------------------------------------------------------------- executing tool calls
# The rule that keeps a loop alive: whatever goes wrong comes back as the tool result, in words.

def parse_arguments(raw: Any) -> dict | str:
    """A tool call's arguments as a dict, or the words telling the model what was wrong."""
    if isinstance(raw, Mapping):  # some servers send the object already parsed
        return dict(raw)
    try:
        args = json.loads(raw or "{}")
    except (json.JSONDecodeError, TypeError) as exc:
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
