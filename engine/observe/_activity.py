"""What ran, as intervals: the display events of a run folded into a tree of timed pieces.

A run is an agent; inside it come model requests (each made of one or more HTTP attempts, the
retried ones among them), code blocks and tool calls, and sub-agents, which hold the same
again.  ``Activity`` reads the events an agent emits (``engine.agent.AgentDisplay``), live or
from a recording, and tells a listener when a piece opens, when something happens to it
(output, a heartbeat, a retry, a note) and when it closes.  The trace exporter
(``engine.observe``) and the timeline page (``engine.view``) are two such listeners, so a span
tree and a timeline always agree on what ran.

It holds only what is open: a closed piece is the listener's to keep or drop, so a chat of a
thousand blocks costs the fold nothing once they ended.  Events it does not know are ignored;
fields it does not know are kept out.  Whatever a model or a worker wrote stays a plain string
here: the listeners decide what to keep and how to show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

#: Kinds of pieces.
AGENT, REQUEST, ATTEMPT, BLOCK, TOOL = "agent", "request", "attempt", "block", "tool"


@dataclass(eq=False)
class Piece:
    """One timed piece of a run.  ``facts`` grow while it is open (see each event's fields in
    ``AgentDisplay``); ``outcome`` is set when it closes: ``ok``, ``error``, ``cancelled``, or
    for blocks ``interrupted``/``killed``/``died`` (see ``block_outcome``)."""

    kind: str
    name: str  # the agent's name; for a block, request or tool, its agent's
    key: str  # the block's or tool call's id; the agent's name for an agent
    parent: Piece | None
    start: float
    end: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    outcome: str = ""
    error_type: str = ""


class Listener(Protocol):
    def opened(self, piece: Piece) -> None: ...

    def marked(self, piece: Piece | None, mark: str, at: float, fields: dict[str, Any]) -> None:
        """Something happened to ``piece`` (None: a note of no running agent, as a batch's)."""

    def closed(self, piece: Piece) -> None: ...


def block_outcome(status: str, killed: bool) -> str:
    """How a block ended, in the words of traces and the timeline: ``ok`` (done), ``error``
    (raised or exited non-zero), ``interrupted`` (its deadline or a cancel stopped it, the
    namespace kept), ``killed`` (its worker was killed: the deadline's grace ran out, or
    another block's kill took it along), ``died`` (the worker crashed on its own)."""
    if status in ("ok", "error", "died"):
        return status
    if status == "killed" or killed:
        return "killed"
    return "interrupted"  # timeout or cancelled, stopped by the interrupt


class Activity:
    """The fold: ``feed(type, fields, at)`` for each event, ``close(at)`` at the end.  ``at`` is
    seconds since the epoch (a recording's ``t``; ``time.time()`` live)."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.agents: dict[str, Piece] = {}  # open agents by name
        self._parents: dict[str, str | None] = {}  # every agent's parent, by name (follow-ups reopen)
        self._known: dict[str, dict[str, Any]] = {}  # every agent's model and task, by name
        self._requests: dict[str, Piece] = {}  # the open request of each agent
        self._attempts: dict[str, Piece] = {}  # the open attempt of each agent's request
        self._answered: dict[str, Piece] = {}  # requests that got their answer, closed by the next event
        self._blocks: dict[tuple[str, str], Piece] = {}
        self._tools: dict[tuple[str, str], Piece] = {}
        self._unasked: dict[str, str] = {}  # the last message each agent sent, for its next request
        self.last = 0.0

    # -- the pieces ------------------------------------------------------------------------------
    def _open(self, kind: str, name: str, key: str, parent: Piece | None, at: float, **facts: Any) -> Piece:
        piece = Piece(kind, name, key, parent, at, facts={k: v for k, v in facts.items() if v is not None})
        self.listener.opened(piece)
        return piece

    def _close(self, piece: Piece, at: float, outcome: str = "ok", error_type: str = "") -> None:
        if piece.end is not None:
            return
        piece.end, piece.outcome, piece.error_type = max(at, piece.start), outcome, error_type
        self.listener.closed(piece)

    def agent(self, name: str, at: float, *, parent: str | None = None, **facts: Any) -> Piece:
        """The open agent ``name``, opened now if it is not (a top agent's first event, or a
        sub-agent's follow-up task, which comes without an ``agent_started``)."""
        piece = self.agents.get(name)
        if piece is None:
            if parent is None:
                parent = self._parents.get(name)
            self._parents[name] = parent
            above = self.agents.get(parent) if parent is not None else None
            piece = self.agents[name] = self._open(AGENT, name, name, above, at,
                                                   **{**self._known.get(name, {}), **facts})
        return piece

    def _settle(self, name: str) -> None:
        """Close the request of ``name`` that got its answer: at the answer's time, after the
        event that followed it had its chance to add to it (``replied`` adds the reply)."""
        request = self._answered.pop(name, None)
        if request is not None:
            self._close(request, request.facts.pop("_answered_at"))

    def _close_agent(self, name: str, at: float, outcome: str, error_type: str = "", **facts: Any) -> None:
        piece = self.agents.pop(name, None)
        if piece is None:
            return
        self._settle(name)
        self._close_under(piece, at)
        piece.facts.update({k: v for k, v in facts.items() if v not in (None, "")})
        self._close(piece, at, outcome, error_type)

    def _close_under(self, agent: Piece, at: float) -> None:
        """End what an ending agent left open: its request, blocks, tools and sub-agents (a run
        that ended cancels them without a word)."""
        name = agent.name
        if (attempt := self._attempts.pop(name, None)) is not None:
            self._close(attempt, at, "cancelled")
        if (request := self._requests.pop(name, None)) is not None:
            self._close(request, at, "cancelled")
        for table in (self._blocks, self._tools):
            for key in [k for k in table if k[0] == name]:
                self._close(table.pop(key), at, "cancelled")
        for child in [n for n, p in self.agents.items() if p.parent is agent]:
            self._close_agent(child, at, "cancelled")

    # -- events ----------------------------------------------------------------------------------
    def feed(self, type: str, fields: dict[str, Any], at: float) -> None:
        """One event.  Never raises for an event of unknown type or shape."""
        self.last = max(self.last, at)
        name = fields.get("name")
        if not isinstance(name, str):
            return
        if type == "run_finished":
            status = _text(fields.get("status"))
            self._close_agent(name, at, _run_outcome(status), _error_type(status, fields.get("error_type")),
                              status=status, error=fields.get("error"),
                              tokens_in=fields.get("tokens_in"), tokens_out=fields.get("tokens_out"),
                              cost=fields.get("cost"))
            return
        if type == "agent_finished":
            status = _text(fields.get("status"))
            self._close_agent(name, at, _run_outcome(status), _error_type(status, fields.get("error_type")),
                              status=status, error=fields.get("reason"))
            return
        if type in ("agent_started", "run_started"):
            parent = fields.get("parent") if type == "agent_started" else None
            facts = {k: fields[k] for k in ("model", "task") if fields.get(k) is not None}
            if fields.get("forked") is True:  # its worker is a fork of its parent's (a branch of it)
                facts["forked"] = True
            self._known[name] = {**self._known.get(name, {}), **facts}
            self.agent(name, at, parent=parent if isinstance(parent, str) else None).facts.update(facts)
            return
        handler = _HANDLERS.get(type)
        if handler is None:
            if type in _MARKS:  # about an agent, if one of that name runs; never the start of one
                self._settle(name)
                self.listener.marked(self.agents.get(name), type, at, fields)
            return
        agent = self.agent(name, at)
        if type != "replied":
            self._settle(name)
        handler(self, agent, fields, at)
        if type == "replied":
            self._settle(name)

    def _system(self, agent: Piece, fields: dict, at: float) -> None:
        agent.facts["system"] = _text(fields.get("prompt"))
        if fields.get("model") is not None:
            agent.facts.setdefault("model", fields["model"])

    def _sent(self, agent: Piece, fields: dict, at: float) -> None:
        self._unasked[agent.name] = _text(fields.get("message"))

    def _waiting(self, agent: Piece, fields: dict, at: float) -> None:
        name = agent.name
        request = self._requests.get(name)
        if request is None:
            request = self._requests[name] = self._open(REQUEST, name, name, agent, at,
                                                        message=self._unasked.pop(name, None))
        if (attempt := self._attempts.pop(name, None)) is not None:  # asked again (streaming refused)
            self._close(attempt, at)
        self._attempts[name] = self._open(ATTEMPT, name, name, request, at, attempt=fields.get("attempt"))

    def _retrying(self, agent: Piece, fields: dict, at: float) -> None:
        attempt = self._attempts.pop(agent.name, None)
        if attempt is not None:
            attempt.facts.update(reason=fields.get("reason"), status=fields.get("status"))
            status = fields.get("status")
            self._close(attempt, at, "error", str(status) if status else _text(fields.get("reason")) or "_OTHER")
        if (request := self._requests.get(agent.name)) is not None:
            self.listener.marked(request, "retrying", at, fields)

    def _delta(self, agent: Piece, fields: dict, at: float) -> None:
        request = self._requests.get(agent.name)
        if request is not None and "first_token" not in request.facts:
            request.facts["first_token"] = at

    def _waited(self, agent: Piece, fields: dict, at: float) -> None:
        name = agent.name
        attempt, request = self._attempts.pop(name, None), self._requests.pop(name, None)
        if request is None:
            return
        facts = {k: fields.get(k) for k in ("model", "max_tokens", "tokens_in", "tokens_out", "finish_reason",
                                            "timings") if fields.get(k) is not None}
        request.facts.update(facts)
        error, status = fields.get("error"), fields.get("status")
        if error:  # a request cancelled (its run ended, its deadline passed) is not an error of its own
            outcome = "cancelled" if error == "CancelledError" else "error"
            kind = "" if outcome == "cancelled" else str(status) if status else _text(error)
            if attempt is not None:
                attempt.facts["status"] = status
                self._close(attempt, at, outcome, kind)
            self._close(request, at, outcome, kind)
            return
        if attempt is not None:
            self._close(attempt, at)
        request.facts["_answered_at"] = at
        self._answered[name] = request

    def _replied(self, agent: Piece, fields: dict, at: float) -> None:
        request = self._answered.get(agent.name)
        if request is not None:
            request.facts["reply"] = _text(fields.get("message"))

    def _launched(self, agent: Piece, fields: dict, at: float) -> None:
        key = (agent.name, _text(fields.get("id")))
        if key in self._blocks:  # an id used twice: the earlier piece ends here
            self._close(self._blocks.pop(key), at, "cancelled")
        self._blocks[key] = self._open(BLOCK, agent.name, key[1], agent, at, timeout=fields.get("timeout"),
                                       heartbeat=fields.get("heartbeat"), code=fields.get("code"))

    def _block_mark(self, agent: Piece, fields: dict, at: float, mark: str) -> None:
        block = self._blocks.get((agent.name, _text(fields.get("id"))))
        if block is not None:
            self.listener.marked(block, mark, at, fields)

    def _finished(self, agent: Piece, fields: dict, at: float) -> None:
        block = self._blocks.pop((agent.name, _text(fields.get("id"))), None)
        if block is None:
            return
        status = _text(fields.get("status")) or ("cancelled" if fields.get("cancelled") else "ok")
        killed = bool(fields.get("killed"))
        block.facts.update({k: fields.get(k) for k in ("duration", "output", "output_bytes", "lost", "message")
                            if fields.get(k) is not None}, status=status, killed=killed)
        self._close(block, at, block_outcome(status, killed), "" if status in ("ok", "cancelled") else status)

    def _tool_call(self, agent: Piece, fields: dict, at: float) -> None:
        key = (agent.name, _text(fields.get("id")))
        if key in self._tools:  # an id used twice: the earlier call ends here
            self._close(self._tools.pop(key), at, "cancelled")
        self._tools[key] = self._open(TOOL, agent.name, key[1], agent, at, tool=fields.get("tool"),
                                      arguments=fields.get("arguments"))

    def _tool_result(self, agent: Piece, fields: dict, at: float) -> None:
        tool = self._tools.pop((agent.name, _text(fields.get("id"))), None)
        if tool is not None:
            tool.facts["result"] = _text(fields.get("text"))
            self._close(tool, at)

    def close(self, at: float | None = None) -> None:
        """End everything still open (the run stopped without saying so: a recording cut short,
        a command that ended): at ``at``, else at the last event seen."""
        at = self.last if at is None else at
        for name in list(self.agents):
            if name in self.agents and self.agents[name].parent is None:
                self._close_agent(name, at, "cancelled", unfinished=True)
        for name in list(self.agents):  # orphans: a parent that was never seen
            self._close_agent(name, at, "cancelled", unfinished=True)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _error_type(status: Any, given: Any) -> str:
    """The error type of an agent that ended with ``status``: the exception's type when it failed on
    one, ``timeout`` at its deadline, nothing when it answered or was cancelled."""
    if status == "timed_out":
        return "timeout"
    if status == "failed":
        return _text(given) or "_OTHER"
    return ""


def _run_outcome(status: Any) -> str:
    return {"answered": "ok", "cancelled": "cancelled"}.get(status, "error") if status else "ok"


#: Events that mark an agent without opening one.
_MARKS = frozenset({"note", "cancelled", "failed", "endpoint"})
_HANDLERS = {
    "system": Activity._system, "sent": Activity._sent, "waiting": Activity._waiting,
    "retrying": Activity._retrying, "delta": Activity._delta, "reasoning": Activity._delta,
    "waited": Activity._waited,
    "replied": Activity._replied, "launched": Activity._launched,
    "output": lambda self, agent, fields, at: self._block_mark(agent, fields, at, "output"),
    "progress": lambda self, agent, fields, at: self._block_mark(agent, fields, at, "progress"),
    "display": lambda self, agent, fields, at: self._block_mark(agent, fields, at, "display"),
    "connection": lambda self, agent, fields, at: self._block_mark(agent, fields, at, "connection"),
    "finished": Activity._finished, "tool_call": Activity._tool_call, "tool_result": Activity._tool_result,
}

__all__ = ["AGENT", "ATTEMPT", "BLOCK", "REQUEST", "TOOL", "Activity", "Listener", "Piece", "block_outcome"]
