"""Images in a conversation: ``image_url`` parts of user messages, what they cost, how long they stay.

A model that takes images gets each as an OpenAI ``image_url`` part holding a
``data:image/png;base64,...`` URI, in a **user** message: OpenAI refuses images in a tool's
message (HTTP 400), so results given as tool answers have their images in the user message
that follows them.  The PNG is read from the file the coordinator wrote (bounded by the
contract's ``MAX_IMAGE``, its header checked again), never decoded.

What images cost is counted, not guessed from their base64: an endpoint of OpenAI's at its
documented rate (85 tokens, plus 170 for each 512-pixel tile of the image scaled to fit 2048 and
then 768 on its short side), any other at ``DEFAULT_IMAGE_TOKENS``, on the high side of what
vision encoders take (Qwen2.5-VL about one token per 28x28 pixels, clamped by the server).  The
server's own count (``usage.prompt_tokens``) replaces the estimate once it answers.  A
conversation keeps the last ``KEPT_IMAGES`` images; older ones become a line of text, so the
history re-sent with every request stays bounded.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Iterable
from typing import Any

from worker.contract.display import png_size
from worker.contract.limits import MAX_IMAGE

__all__ = ["DEFAULT_IMAGE_TOKENS", "KEPT_IMAGES", "MAX_IMAGES_A_MESSAGE", "content_chars", "has_images",
           "image_part", "image_tokens", "join_user", "keep_last_images", "strip_images"]

#: Tokens counted for an image where the server's rate is not known.
DEFAULT_IMAGE_TOKENS = 1500
#: Images attached to one message, and kept in a conversation's history, at most.
MAX_IMAGES_A_MESSAGE = 8
KEPT_IMAGES = 16
_PREFIX = "data:image/png;base64,"
_DROPPED = "[an image shown here earlier is no longer attached]"


def image_part(path: str) -> dict[str, Any] | None:
    """The ``image_url`` part of the PNG at ``path`` (a file the coordinator wrote), or None
    when it is not there, is larger than ``MAX_IMAGE`` or does not start as a PNG does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_IMAGE + 1)
    if len(data) > MAX_IMAGE or png_size(data) is None:
        return None
    return {"type": "image_url", "image_url": {"url": _PREFIX + base64.b64encode(data).decode("ascii")}}


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def image_tokens(part: dict[str, Any], openai: bool) -> int:
    """What one image part costs: OpenAI's documented rate for its endpoints, where the PNG's
    header tells the size, else ``DEFAULT_IMAGE_TOKENS``."""
    if not openai:
        return DEFAULT_IMAGE_TOKENS
    url = (part.get("image_url") or {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
    size = png_size(base64.b64decode(url[len(_PREFIX):len(_PREFIX) + 32])) if url.startswith(_PREFIX) else None
    if size is None:
        return DEFAULT_IMAGE_TOKENS
    width, height = size
    scale = min(1.0, 2048 / max(width, height))
    width, height = width * scale, height * scale
    scale = min(1.0, 768 / min(width, height))
    return 85 + 170 * math.ceil(width * scale / 512) * math.ceil(height * scale / 512)


def content_chars(content: Any, image_chars: int) -> int:
    """Characters a message content counts as: its text, and ``image_chars`` for each image."""
    if isinstance(content, list):
        return sum(image_chars if _is_image(p) else len(str(p.get("text", ""))) if isinstance(p, dict) else 0
                   for p in content)
    return len(str(content or ""))


def has_images(messages: Iterable[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(_is_image(p) for p in m["content"]) for m in messages)


def join_user(messages: list[dict[str, Any]], text: str, images: list[dict[str, Any]] = ()) -> None:
    """Append a user message of ``text`` and ``images``; to a user message already last (a
    compaction summary) it is joined, since many chat templates require the roles to alternate."""
    last = messages[-1] if messages else {}
    if last.get("role") == "user" and isinstance(last.get("content"), str | list):
        before = last["content"]
        if isinstance(before, str) and not images:
            messages[-1] = {**last, "content": f"{before}\n\n{text}"}
            return
        parts = [{"type": "text", "text": before}] if isinstance(before, str) else list(before)
        messages[-1] = {**last, "content": [*parts, {"type": "text", "text": f"\n\n{text}"}, *images]}
        return
    messages.append({"role": "user", "content": [{"type": "text", "text": text}, *images] if images else text})


def keep_last_images(messages: list[dict[str, Any]], keep: int = KEPT_IMAGES) -> int:
    """Replace every image but the last ``keep`` by a line of text; how many were replaced."""
    seen = replaced = 0
    for position in range(len(messages) - 1, -1, -1):
        content = messages[position].get("content")
        if not isinstance(content, list):
            continue
        changed = list(content)
        for index in range(len(changed) - 1, -1, -1):
            if _is_image(changed[index]):
                seen += 1
                if seen > keep:
                    changed[index] = {"type": "text", "text": _DROPPED}
                    replaced += 1
        if changed != content:
            messages[position] = {**messages[position], "content": changed}
    return replaced


def strip_images(messages: list[dict[str, Any]]) -> int:
    """Every image replaced by a line of text (for an endpoint that refused them)."""
    return keep_last_images(messages, 0)
