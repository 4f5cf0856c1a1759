"""What an agent's blocks displayed, on its way to the model with the results that carry it.

A finished block's result text already names each display (``BlockResult.text``: an image's
size and file, a text display's text), which is all a model that takes no images gets.  A model
that takes images (``ModelConfig.vision``, configured or learned from its server) also gets the
PNGs, as ``image_url`` parts of the user message that carries the results, at most
``MAX_IMAGES_A_MESSAGE`` a message; none once its endpoint has refused them.
"""

from __future__ import annotations

from typing import Any

from engine.agent._code_task import CodeTask
from engine.models import MAX_IMAGES_A_MESSAGE, Chat, ModelConfig, image_part
from engine.results import Shown

__all__ = ["Pictures"]


class Pictures:
    """The displays of finished blocks that no message has carried yet."""

    def __init__(self) -> None:
        self._waiting: list[Shown] = []

    def collect(self, work: Any) -> None:
        """Keep what a finished block displayed for the message that carries its result (once)."""
        if isinstance(work, CodeTask):
            self._waiting.extend(work.displays)
            work.displays = []

    def take(self, model: ModelConfig, chat: Chat | None) -> list[dict[str, Any]]:
        """The ``image_url`` parts for the next message (none for a model that takes no
        images); everything waiting is taken either way."""
        shown, self._waiting = self._waiting, []
        if not model.vision or (chat is not None and chat.images_refused):
            return []
        parts = [image_part(s.png) for s in shown if s.png]
        return [p for p in parts if p is not None][:MAX_IMAGES_A_MESSAGE]
