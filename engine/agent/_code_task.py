"""A ``<run_code>`` block of an agent: run in its worker, shown live, reported by heartbeats."""

from __future__ import annotations

import asyncio
import base64
import inspect
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from engine.agent import _tags as tags
from engine.errors import AgentloopError
from engine.results import BlockResult, OutputChunk, Shown
from engine.sandbox import SandboxPolicy, workspace_excess
from engine.workers import Worker
from worker.contract import wire

__all__ = [
    "BlockHost", "CodeTask", "DISPLAY_LINE_BYTES", "HEARTBEAT_FLOOR", "OUTPUT_BUDGET",
    "heartbeat_interval", "host_spec", "task_text", "words"
]

#: Bytes of a block's output the model sees in one result (head and tail, the rest counted).
OUTPUT_BUDGET = 16_000
#: Shortest heartbeat interval; also the shortest time between two messages that heartbeat
#: reports alone cause (``heartbeat="1ms"`` would otherwise be a request flood).
HEARTBEAT_FLOOR = 1.0
#: Bytes of one output line the live display is shown; the rest of the line is counted only
#: in the block's result.  Displays split and join lines (a console keeps an unterminated line
#: until its newline), so an endless line must never reach them whole.
DISPLAY_LINE_BYTES = 16 * 1024
_DISPLAY_CUT = b" [... the rest of this line is not shown live]"
#: A connection's fields in its ``connection`` event (``engine.net.ConnectionRecord``'s).
_CONNECTION = ("host", "port", "method", "verdict", "why", "words", "status", "address", "sent", "received",
               "seconds")


def heartbeat_interval(seconds: float | None) -> float | None:
    """The interval heartbeats really come at: none stays none, and nothing is shorter than
    ``HEARTBEAT_FLOOR``."""
    return max(seconds, HEARTBEAT_FLOOR) if seconds else None


class _LineCut:
    """Output for the live display, every line cut to ``limit`` bytes (per stream, across
    chunks); the first cut of a line says so."""

    def __init__(self, limit: int = DISPLAY_LINE_BYTES) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}  # bytes of the unterminated line so far, per stream

    def __call__(self, stream: str, data: bytes) -> bytes:
        used = self._open.get(stream, 0)
        parts = data.split(b"\n")
        if used + len(parts[0]) <= self.limit and max(map(len, parts)) <= self.limit:  # the usual case
            self._open[stream] = used + len(parts[0]) if len(parts) == 1 else len(parts[-1])
            return data
        shown = []
        for i, part in enumerate(parts):
            if i:
                used = 0
            room = self.limit - used
            shown.append(part if len(part) <= room else part[:room] + _DISPLAY_CUT if room >= 0 else b"")
            used += len(part)
        self._open[stream] = used
        return b"\n".join(shown)


def host_spec(name: str, fn: Callable) -> wire.HostFunction:
    """What a worker needs to build a stub for host function ``fn`` (a ``wire.Bind``'s)."""
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(*args, **kwargs)"
    return wire.host_function(name, signature, inspect.getdoc(fn) or "", inspect.iscoroutinefunction(fn))


@dataclass(frozen=True)
class BlockHost:
    """What a block needs of the agent that asked for it, handed down (a block never reaches
    into its agent): the ``worker`` it runs in, ``emit`` for display events, ``heartbeat`` to
    queue a report for the model (``report``, ``key``), ``writable`` for the words on where code
    may write, and the sandbox policy and workspace whose size is checked between blocks."""

    worker: Worker
    emit: Callable[..., None]
    heartbeat: Callable[[Callable[[], str], Hashable], None]
    writable: Callable[[], str]
    sandbox: SandboxPolicy
    workspace: Path


class CodeTask:
    """One ``<run_code>`` block running in the agent's worker, with its heartbeats."""

    def __init__(self, host: BlockHost, request: tags.CodeRequest, block_id: str) -> None:
        self.host = host
        self.request = request
        self.id = block_id
        self.started = time.monotonic()
        self.started_at = datetime.now()
        self.interval = heartbeat_interval(request.heartbeat)
        self._fresh = bytearray()  # output since the last heartbeat (bounded)
        self._fresh_skipped = 0
        self._reported = 0  # bytes already shown in earlier heartbeats
        self._shown = _LineCut()
        #: What the block displayed, once it has ended (``BlockResult.displays``).
        self.displays: list[Shown] = []
        self._work: asyncio.Future[BlockResult] | None = None
        self.task = asyncio.ensure_future(self._run())

    def _on_output(self, chunk: OutputChunk) -> None:
        data = chunk.data
        if len(data) >= OUTPUT_BUDGET:  # replaces what is fresh: never grow by a big chunk
            self._fresh_skipped += len(self._fresh) + len(data) - OUTPUT_BUDGET
            self._fresh = bytearray(data[-OUTPUT_BUDGET:])
        else:
            self._fresh += data
            if len(self._fresh) > 2 * OUTPUT_BUDGET:
                cut = len(self._fresh) - OUTPUT_BUDGET
                self._fresh_skipped += cut
                del self._fresh[:cut]
        shown = self._shown(chunk.stream, data)
        if shown:
            self.host.emit("output", id=self.id, stream=chunk.stream, text=shown.decode("utf-8", "replace"))

    def _on_display(self, shown: Shown, data: dict) -> None:
        """One line in the live display; the recording gets what a viewer shows of it (the PNG,
        the SVG, the HTML as text), so that a page made from it needs nothing else."""
        fields: dict[str, Any] = {"index": shown.index, "line": shown.line(), "text": shown.text,
                                  "width": shown.width, "height": shown.height, "files": dict(shown.files),
                                  "note": shown.note}
        png = data.get("image/png")
        if isinstance(png, bytes):
            fields["png"] = base64.b64encode(png).decode("ascii")
        for mime, key in (("image/svg+xml", "svg"), ("text/html", "html")):
            if isinstance(data.get(mime), str):
                fields[key] = data[mime]
        self.host.emit("display", id=self.id, **fields)

    def is_running(self) -> bool:
        return not self.task.done()

    async def _run(self) -> str:
        host, req = self.host, self.request
        self._work = asyncio.ensure_future(host.worker.run(
            req.code, timeout=req.timeout, block_id=self.id, on_output=self._on_output, budget=OUTPUT_BUDGET,
            on_display=self._on_display))
        try:
            while not self._work.done():
                await asyncio.wait([self._work], timeout=self.interval)
                if not self._work.done() and self.interval:
                    host.emit("progress", id=self.id, current=time.monotonic() - self.started,
                              output=bytes(self._fresh).decode("utf-8", "replace"))
                    host.heartbeat(self._report, ("run_code", self.id))
        except asyncio.CancelledError:
            self._work.cancel()
            await asyncio.wait([self._work])
            raise
        facts: dict[str, Any] = {}
        try:
            result = self._work.result()
            self.displays = result.displays
            body = result.text()
            status = result.status
            facts = {"output_bytes": result.output_bytes, "killed": result.worker_killed,
                     "lost": result.lost_vars, "message": result.message}
            if result.refused_write():
                body += f"[note: {host.writable()}]"
        except asyncio.CancelledError:
            body, status = "[cancelled]", "cancelled"
        except AgentloopError as exc:  # the worker could not even be started again
            body, status = f"[failed] {exc}", "error"
        # The workspace is a bind mount that no quota caps: its size is checked between blocks.
        excess = await asyncio.to_thread(workspace_excess, host.sandbox, host.workspace)
        if excess:
            body += f"[{excess}]"
        duration = time.monotonic() - self.started
        taken = getattr(host.worker, "connections", None)  # (--allow-net: what the block's code reached)
        for connection in (await taken()) if callable(taken) else ():
            host.emit("connection", id=self.id, **{k: connection[k] for k in _CONNECTION if k in connection})
        host.emit("finished", id=self.id, duration=duration, cancelled=status != "ok" and status != "error",
                  output=body, status=status, **facts)
        return tags.format_code_result(self.id, duration, body)

    def _report(self) -> str:
        """The heartbeat as it is delivered: written then, so it holds all output since the last
        one delivered; nothing once the block has ended (its result says it all)."""
        return "" if self._work is None or self._work.done() else self.heartbeat()

    def heartbeat(self) -> str:
        """A ``<running>`` note with the output that is new since the last one."""
        fresh = bytes(self._fresh)
        skipped = self._fresh_skipped
        self._fresh.clear()
        self._fresh_skipped = 0
        before = self._reported
        self._reported += len(fresh) + skipped
        note = ""
        if before:
            note += f"[{before} bytes of output shown before]\n"
        if skipped:
            note += f"[... {skipped} bytes skipped ...]\n"
        elapsed = time.monotonic() - self.started
        deadline = self.started_at + timedelta(seconds=self.request.timeout)
        return tags.format_running(self.id, elapsed, datetime.now(), deadline,
                                   note + fresh.decode("utf-8", "replace"))


def words(exc: BaseException) -> str:
    """An exception in words: agentloop's own as their message, others with their type."""
    if isinstance(exc, AgentloopError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def task_text(task: asyncio.Task) -> str:
    """A finished block or sub-agent task as the words the model gets (an internal error too)."""
    if task.cancelled():
        return ""
    exc = task.exception()
    if exc is not None:
        return tags.format_error("", f"internal error: {words(exc)}")
    return task.result()
