"""A model's reasoning, told apart from its answer while the reply streams in.

Servers hand reasoning over in two ways: as a field of its own (``reasoning_content`` from
llama-server with ``--reasoning-format``, DeepSeek-style APIs and older vLLM parsers,
``reasoning`` from newer vLLM and OpenRouter), or inline, as ``<think>...</think>`` in the
content.  ``ThinkSplitter`` sorts streamed content pieces into the two, so the display can
show reasoning dimmed and never as the answer; what is sent back to the model is decided
by ``strip_think``, and reasoning never is.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["CLOSE", "OPEN", "REASONING_FIELDS", "ThinkSplitter", "reasoning_of", "strip_think"]

OPEN = "<think>"
CLOSE = "</think>"
#: Fields of a delta or a message that carry reasoning, in the order they are looked for.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def reasoning_of(part: dict[str, Any]) -> str:
    """The reasoning text a stream delta or a whole message carries in a field of its own ("" if none)."""
    for key in REASONING_FIELDS:
        value = part.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


class ThinkSplitter:
    """Splits content, piece by piece, into reasoning (inside ``<think>...</think>``) and answer.

    A tag cut between two pieces is held back until the next piece completes or refutes it,
    so no part of a tag is ever shown as text.  Only an explicit ``<think>`` opens reasoning: a
    reply whose template opened it in the prompt (a bare ``</think>`` later) cannot be told
    apart live, and shows as answer; ``strip_think`` still removes it from the transcript.
    """

    def __init__(self) -> None:
        self.inside = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of ``text`` and what was held back before it."""
        buffer, self._held = self._held + text, ""
        reasoning: list[str] = []
        answer: list[str] = []
        while buffer:
            tag = CLOSE if self.inside else OPEN
            out = reasoning if self.inside else answer
            at = buffer.find(tag)
            if at == -1:
                keep = _partial_suffix(buffer, tag)
                out.append(buffer[:len(buffer) - keep])
                self._held = buffer[len(buffer) - keep:]
                break
            out.append(buffer[:at])
            buffer = buffer[at + len(tag):]
            self.inside = not self.inside
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """(reasoning, answer) of what was held back, at the end of the reply."""
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


_THINK_PAIR_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_think(text: str) -> str:
    """The reply without its reasoning scratchpad, stripped of surrounding whitespace.

    Removes every ``<think>...</think>``. A stray ``</think>`` left over (the chat template opened
    the block in the prompt) means everything up to the last one was reasoning: only what follows
    it is kept. An ``<think>`` that never closes is reasoning cut off mid-way: it and everything
    after it are dropped, so code drafted in an unfinished thought never runs.
    """
    text = _THINK_PAIR_RE.sub("", text)
    close = text.rfind("</think>")
    if close != -1:
        text = text[close + len("</think>"):]
    opened = text.find("<think>")
    if opened != -1:
        text = text[:opened]
    return text.strip()
