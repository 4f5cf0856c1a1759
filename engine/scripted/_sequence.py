"""The rules a strict OpenAI-compatible server holds a request's messages to, and the
invalid requests the scripted servers of this process received (tests fail on any)."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["record_invalid", "sequence_problems", "take_invalid"]


def sequence_problems(messages: Any) -> list[str]:
    """What makes ``messages`` a sequence a strict server refuses, in words; empty when valid.

    The rules: each ``tool_calls`` entry of an assistant message is answered by exactly one
    ``tool`` message carrying its id, in the run of ``tool`` messages right after it, and no
    ``tool`` message stands without its call; an image (an ``image_url`` part) is in a ``user``
    message, never a tool's or an assistant's.  (OpenAI and vLLM answer HTTP 400 otherwise.)"""
    if not isinstance(messages, list):
        return ["messages is not a list"]
    problems: list[str] = []
    owed: dict[str, int] | None = None  # call ids of the last assistant message, not yet answered
    owed_at = 0
    for position, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role != "user" and isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            problems.append(f"message {position}: an image in a {role!r} message (images go in user messages)")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if owed is None:
                problems.append(f"message {position}: a tool message ({call_id!r}) without a preceding call")
            elif call_id not in owed:
                problems.append(f"message {position}: tool message answers {call_id!r}, which message "
                                f"{owed_at} did not call (its calls: {', '.join(map(str, owed)) or 'none'})")
            elif owed[call_id]:
                problems.append(f"message {position}: call {call_id!r} of message {owed_at} answered twice")
            else:
                owed[call_id] = 1
            continue
        if owed is not None:
            missing = [call_id for call_id, answered in owed.items() if not answered]
            if missing:
                problems.append(f"message {owed_at}: calls {', '.join(map(str, missing))} have no tool "
                                "message before the next message")
            owed = None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if role == "assistant" and calls:
            ids = [call.get("id") if isinstance(call, dict) else None for call in calls]
            if len(set(ids)) != len(ids) or None in ids:
                problems.append(f"message {position}: tool call ids missing or repeated: {ids}")
            owed, owed_at = {call_id: 0 for call_id in ids}, position
    if owed is not None and not all(owed.values()):
        missing = [call_id for call_id, answered in owed.items() if not answered]
        problems.append(f"message {owed_at}: calls {', '.join(map(str, missing))} are not answered")
    return problems


_invalid_lock = threading.Lock()
_invalid: list[str] = []


def record_invalid(words: str) -> None:
    """Keep ``words`` (an invalid request a server received) for the next ``take_invalid()``."""
    with _invalid_lock:
        _invalid.append(words)


def take_invalid() -> list[str]:
    """Every invalid request any server of this process received since the last call, in words
    (which server, which turn, what is wrong), and forget them."""
    with _invalid_lock:
        taken = list(_invalid)
        _invalid.clear()
    return taken
