"""Replies that cannot end a run: one the server cut at the length cap, or an empty one.

Neither is ever taken as the answer.  The model is told what happened and the loop goes on;
a model that keeps doing it (a base model, a loop, a broken server) ends the run in words
after a few in a row, instead of spending its whole message budget that way.
"""

from __future__ import annotations

from engine.agent import _tags as tags
from engine.errors import AgentError

__all__ = ["EMPTY_REPLY_NOTE", "MAX_CUT_REPLIES", "MAX_EMPTY_REPLIES", "ReplyGuard"]

#: Replies cut at the length cap in a row after which a run gives up.
MAX_CUT_REPLIES = 3
#: Empty replies in a row that end a run: the first is answered with ``EMPTY_REPLY_NOTE``.
MAX_EMPTY_REPLIES = 2
EMPTY_REPLY_NOTE = ("your reply was empty: no text, no code, no tool call. Reply with your final answer in "
                    "plain text, or with the code or sub-agents you want run.")


class ReplyGuard:
    """One agent's count of cut and empty replies in a row, and what the model is told of each."""

    def __init__(self) -> None:
        self.cut = 0
        self.empty = 0

    def after_cut(self, finish_reason: str | None, max_tokens: int | None, reply: str, *,
                  invented: bool = False) -> str | None:
        """The message for the model when the reply was cut at the length cap, else None.
        AgentError once ``MAX_CUT_REPLIES`` replies in a row were cut.  A reply already cut
        where the model invented a result does not count: what came after was never used."""
        if finish_reason != "length" or invented:
            self.cut = 0
            return None
        self.cut += 1
        if self.cut >= MAX_CUT_REPLIES:
            raise AgentError(f"the model's last {self.cut} replies were all cut at the length cap "
                             f"(max_tokens={max_tokens}) without finishing: raise it (--max-tokens, max_tokens "
                             "in agentloop.toml) or ask for something shorter")
        return tags.format_reply_cut(max_tokens, reply)

    def after_empty(self, reply: str, *, calls: bool, would_end: bool) -> str | None:
        """The message for the model when the reply is empty (no text, no tool call) and would
        have ended the run, else None; AgentError at the ``MAX_EMPTY_REPLIES``-th in a row.  An
        empty reply while work runs only means "keep going"."""
        if reply.strip() or calls:
            self.empty = 0
            return None
        if not would_end:
            return None
        self.empty += 1
        if self.empty >= MAX_EMPTY_REPLIES:
            raise AgentError(f"the model's reply was empty {self.empty} times in a row (no text, no "
                             "code, no tool call), even after it was told")
        return tags.format_error(" reason=empty", EMPTY_REPLY_NOTE)
