"""Tracebacks of the code a worker runs, as the code's author would see them: the runtime's
own frames left out, each block's file named after the block (``<block b1>``)."""

from __future__ import annotations

import os
import traceback

__all__ = ["block_filename", "format_user_error"]

_WORKER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def block_filename(block_id: str) -> str:
    return f"<block {block_id}>"


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_WORKER_DIR) and "asyncio" + os.sep not in filename.replace(
        "/", os.sep)


def _is_block(filename: str, block_file: str | None) -> bool:
    return filename == block_file or filename.startswith("<block ")


def _trim(te: traceback.TracebackException, seen: set[int], block_file: str | None) -> None:
    """Drop the worker's own frames (and asyncio's scaffolding around a task) from a traceback."""
    if id(te) in seen:
        return
    seen.add(id(te))
    frames = list(te.stack)
    start = next((i for i, f in enumerate(frames) if _is_block(f.filename, block_file)), 0)
    te.stack = traceback.StackSummary.from_list(
        [f for f in frames[start:] if _is_user_file(f.filename)])
    for nested in (te.__cause__, te.__context__):
        if nested is not None:
            _trim(nested, seen, block_file)


def format_user_error(exc: BaseException, block_file: str | None = None) -> str:
    """A traceback of the user's frames only, with the block's own line numbers and source.
    ``block_file``: the name the block was compiled under, when it is not ``<block ID>``."""
    if isinstance(exc, SyntaxError) and exc.filename and _is_block(exc.filename, block_file):
        return "".join(traceback.format_exception_only(exc))  # raised by compile(): no user frames
    te = traceback.TracebackException.from_exception(exc)
    _trim(te, set(), block_file)
    return "".join(te.format())
