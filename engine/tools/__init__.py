"""The read-only repository tools (``list_dir``, ``read_file``, ``search``), run in a sandboxed tool
process, and the guard that turns every tool call into words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "execute_tool_call_async": "_repo", "MAX_RESULT": "_repo", "parse_arguments": "_repo", "RepoTools":
    "_repo", "schema_for": "_repo", "TOOL_SCHEMAS": "_repo"
}

if TYPE_CHECKING:
    from ._repo import (
        MAX_RESULT,
        TOOL_SCHEMAS,
        RepoTools,
        execute_tool_call_async,
        parse_arguments,
        schema_for,
    )

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "MAX_RESULT", "RepoTools", "TOOL_SCHEMAS", "execute_tool_call_async", "parse_arguments",
    "schema_for"
]
