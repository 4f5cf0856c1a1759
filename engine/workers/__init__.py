"""The workers of a run: ``Engine`` (which workers, the warm pool, shutdown, ``map``), ``Worker``
(one worker process: blocks, deadlines, host calls) and the session that frames its socket."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "Engine": "_pool", "Worker": "_worker", "WorkerState": "_worker"
}

if TYPE_CHECKING:
    from ._pool import Engine
    from ._worker import Worker, WorkerState

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Engine", "Worker", "WorkerState"
]
