"""Code samples: many independent programs, each run as ``python sample.py`` in a sandbox of
its own, by sample slots that run one after another."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "cancelled": "_sample", "check_env": "_sample", "FETCH_CAP": "_sample", "FILES_CAP": "_sample", "map_samples": "_sample",
    "OUTPUT_BYTES": "_sample", "Sample": "_sample", "SampleResult": "_sample", "SCRIPT_NAME": "_sample",
    "SlotPool": "_slots", "classify": "_status", "Ending": "_status", "STATUSES": "_status"
}

if TYPE_CHECKING:
    from ._sample import (
        FETCH_CAP,
        FILES_CAP,
        OUTPUT_BYTES,
        SCRIPT_NAME,
        Sample,
        SampleResult,
        cancelled,
        check_env,
        map_samples,
    )
    from ._slots import SlotPool
    from ._status import STATUSES, Ending, classify

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Ending", "FETCH_CAP", "FILES_CAP", "OUTPUT_BYTES", "SCRIPT_NAME", "STATUSES", "Sample", "SampleResult",
    "SlotPool", "cancelled", "check_env", "classify", "map_samples"
]
