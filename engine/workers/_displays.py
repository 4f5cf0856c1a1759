"""What a block displayed, kept by the coordinator: each representation in a file of the run.

A ``display`` message has passed the contract's parser (``contract.display``: listed MIME types,
a PNG's header, every bound) before it gets here.  What is done with it is bounded too: at most
``MAX_DISPLAYS`` a block (one more is a broken worker), each file written once, never through a
link, with the run's output budget (``OutputBudget``) paying for it, so that images count
against the same cap as long outputs do.  The coordinator reads nothing of an image but its
header; the text a reader of text gets is the bundle's Markdown, else its plain text, cut.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from engine.errors import WorkerError
from engine.results import OutputBudget, Shown
from worker.contract.display import PNG, SVG, png_size
from worker.contract.limits import MAX_DISPLAYS

__all__ = ["BlockDisplays", "DisplayRefused", "KEPT_TYPES", "TEXT_CHARS"]

#: The representations kept as files (what a viewer shows), with their file names' endings.
KEPT_TYPES = {PNG: ".png", SVG: ".svg", "text/html": ".html"}
#: Characters of a display's text kept for a reader of text.
TEXT_CHARS = 8_000


class DisplayRefused(WorkerError):
    """A display no honest worker sends (beyond ``MAX_DISPLAYS`` for its block): the worker
    broke the protocol, and is stopped for it."""


class BlockDisplays:
    """The displays of one running block.  ``path(number)`` names the files of one display
    (``Launcher.display_path``: each representation adds its ending); ``budget`` is the run's
    output budget."""

    def __init__(self, path: Callable[[int], Path], budget: OutputBudget | None) -> None:
        self._path = path
        self._budget = budget
        self.shown: list[Shown] = []

    def add(self, data: dict[str, bytes | str]) -> Shown:
        """Keep one display's bundle (checked by the contract); DisplayRefused past the limit."""
        if len(self.shown) >= MAX_DISPLAYS:
            raise DisplayRefused(f"it sent more than {MAX_DISPLAYS} displays for one block")
        number = len(self.shown) + 1
        files: dict[str, str] = {}
        sizes: dict[str, int] = {}
        notes: list[str] = []
        stem: Path | None = None
        for mime, ending in KEPT_TYPES.items():
            value = data.get(mime)
            if value is None:
                continue
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
            sizes[mime] = len(raw)
            stem = stem or self._path(number)
            kept, why = self._keep(stem.with_name(stem.name + ending), raw)
            if kept is not None:
                files[mime] = kept
            elif why not in notes:
                notes.append(why)
        text_type = next((m for m in ("text/markdown", "text/plain") if isinstance(data.get(m), str)), "")
        text = str(data.get(text_type, ""))
        if len(text) > TEXT_CHARS:
            text = text[:TEXT_CHARS] + f"\n[... {len(text) - TEXT_CHARS} characters cut]"
        size = png_size(data[PNG]) if isinstance(data.get(PNG), bytes) else None  # (checked: a PNG's header)
        shown = Shown(number, files, sizes, text, text_type, *(size or (None, None)), note="; ".join(notes))
        self.shown.append(shown)
        return shown

    def _keep(self, path: Path, raw: bytes) -> tuple[str | None, str]:
        """Write one representation to its own new file: (its path, "") or (None, why not)."""
        if self._budget is not None:
            _, short = self._budget.take(len(raw))
            if short is not None:
                return None, short.why()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
        except OSError as exc:
            return None, f"it could not be written ({exc.strerror or exc})"
        return str(path), ""
