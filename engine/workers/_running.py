"""A block in flight, as the worker's handle follows it: its output sink and displays, its
deadline and the interrupt's answers, and exactly one ``BlockResult`` when it ends."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from engine.results import BlockResult, OutputChunk, OutputSink, Shown
from engine.workers._displays import BlockDisplays

__all__ = ["RunningBlock"]


class RunningBlock:
    """Coordinator-side state of one running block."""

    def __init__(self, block_id: str, sink: OutputSink, timeout: float,
                 on_output: Callable[[OutputChunk], None] | None, budget: int | None = None,
                 displays: BlockDisplays | None = None,
                 on_display: Callable[[Shown, dict], None] | None = None) -> None:
        self.id = block_id
        self.budget = budget
        self.sink = sink
        self.displays = displays or BlockDisplays(lambda number: Path(os.devnull), None)
        self.on_display = on_display
        self.timeout = timeout
        self.on_output = on_output
        self.queue: asyncio.Queue | None = None
        self.started = time.monotonic()
        self.future: asyncio.Future[BlockResult] = asyncio.get_running_loop().create_future()
        self.timed_out = False
        self.stopping: asyncio.Future | None = None  # the stop a deadline started
        self.stuck = asyncio.Event()  # the worker says the interrupt cannot reach the block
        self.stuck_why = ""  # ... and why
        self.interrupted = False  # the worker has answered the interrupt (stuck or stopping)
        self.stopping_why = ""  # the worker's words on a block that runs on after its interrupt

    def finish(self, status: str, *, error: str = "", message: str = "", **extra) -> None:
        if self.future.done():
            return
        self.sink.close()
        file = self.sink.file
        self.future.set_result(BlockResult(
            id=self.id, status=status, output=self.sink.render(self.budget), output_bytes=self.sink.total,
            truncated=self.sink.truncated, output_file=str(file) if file else None,
            duration_s=time.monotonic() - self.started, error=error, message=message,
            displays=list(self.displays.shown), **extra))
