"""The fold from display events to timed pieces (``engine.observe``), on event sequences the
engine emits, including the awkward ones: a reply that arrives after its request ended, a
sub-agent's follow-up task, a run that stops without saying so."""

from __future__ import annotations

from engine.observe import Activity, Piece


class Listener:
    """Keeps what the fold says."""

    def __init__(self) -> None:
        self.opened_pieces: list[Piece] = []
        self.closed_pieces: list[Piece] = []
        self.marks: list[tuple[str | None, str]] = []

    def opened(self, piece: Piece) -> None:
        self.opened_pieces.append(piece)

    def marked(self, piece: Piece | None, mark: str, at: float, fields: dict) -> None:
        self.marks.append((piece.key if piece is not None else None, mark))

    def closed(self, piece: Piece) -> None:
        self.closed_pieces.append(piece)


def fold(events: list[tuple]) -> Listener:
    log = Listener()
    activity = Activity(log)
    for at, type, fields in events:
        activity.feed(type, fields, at)
    activity.close()
    return log


def test_a_request_ends_when_answered_and_keeps_its_reply() -> None:
    log = fold([
        (0.0, "run_started", {"name": "main", "task": "t", "model": "m"}),
        (1.0, "sent", {"name": "main", "message": "hello"}),
        (1.0, "waiting", {"name": "main", "attempt": 1}),
        (1.5, "retrying", {"name": "main", "attempt": 1, "of": 4, "wait": 0.5, "reason": "HTTP 500", "status": 500}),
        (2.0, "waiting", {"name": "main", "attempt": 2}),
        (2.2, "delta", {"name": "main", "text": "hi"}),
        (3.0, "waited", {"name": "main", "seconds": 2.0, "tokens_in": 5, "tokens_out": 2, "finish_reason": "stop"}),
        (3.1, "replied", {"name": "main", "message": "hi there"}),
        (4.0, "run_finished", {"name": "main", "status": "answered", "tokens_in": 5, "tokens_out": 2, "cost": 0.0}),
    ])
    request = next(p for p in log.closed_pieces if p.kind == "request")
    attempts = [p for p in log.closed_pieces if p.kind == "attempt"]
    assert (request.start, request.end, request.outcome) == (1.0, 3.0, "ok")
    assert request.facts["reply"] == "hi there" and request.facts["message"] == "hello"
    assert request.facts["first_token"] == 2.2 and request.facts["tokens_out"] == 2
    assert [(a.start, a.end, a.outcome, a.error_type) for a in attempts] == [(1.0, 1.5, "error", "500"),
                                                                             (2.0, 3.0, "ok", "")]
    main = log.closed_pieces[-1]
    assert main.kind == "agent" and main.outcome == "ok" and main.facts["model"] == "m"


def test_a_follow_up_task_reopens_the_sub_agent_under_its_parent() -> None:
    log = fold([
        (0.0, "run_started", {"name": "main"}),
        (1.0, "agent_started", {"name": "sub", "parent": "main", "model": "flash", "task": "one"}),
        (2.0, "agent_finished", {"name": "sub", "status": "answered"}),
        (3.0, "sent", {"name": "sub", "message": "two"}),  # new_task: no agent_started
        (4.0, "agent_finished", {"name": "sub", "status": "failed", "error_type": "AgentError", "reason": "no"}),
        (5.0, "run_finished", {"name": "main", "status": "answered"}),
    ])
    subs = [p for p in log.opened_pieces if p.name == "sub"]
    assert len(subs) == 2 and all(s.parent is log.opened_pieces[0] for s in subs)
    assert subs[1].facts["model"] == "flash"
    assert (subs[1].outcome, subs[1].error_type) == ("error", "AgentError")


def test_what_a_stopped_run_left_open_ends_at_its_last_event_unfinished() -> None:
    log = fold([
        (0.0, "run_started", {"name": "main"}),
        (1.0, "launched", {"name": "main", "id": "b1", "timeout": 10, "code": "x"}),
        (1.5, "output", {"name": "main", "id": "b1", "stream": "stdout", "text": "1"}),
        (2.0, "progress", {"name": "main", "id": "b1", "current": 1.0}),
        (2.5, "note", {"name": "batch", "message": "not an agent"}),
    ])
    block = next(p for p in log.closed_pieces if p.kind == "block")
    main = next(p for p in log.closed_pieces if p.kind == "agent")
    assert (block.end, block.outcome) == (2.5, "cancelled") and main.facts["unfinished"] is True
    assert ("b1", "output") in log.marks and ("b1", "progress") in log.marks and (None, "note") in log.marks
    assert [p.name for p in log.opened_pieces if p.kind == "agent"] == ["main"]  # a note opens no agent


def test_block_outcomes() -> None:
    def outcome(status: str, killed: bool = False) -> tuple[str, str]:
        log = fold([(0.0, "launched", {"name": "a", "id": "b"}),
                    (1.0, "finished", {"name": "a", "id": "b", "status": status, "killed": killed})])
        block = next(p for p in log.closed_pieces if p.kind == "block")
        return block.outcome, block.error_type

    assert outcome("ok") == ("ok", "")
    assert outcome("error") == ("error", "error")
    assert outcome("timeout") == ("interrupted", "timeout")
    assert outcome("timeout", killed=True) == ("killed", "timeout")
    assert outcome("cancelled") == ("interrupted", "")
    assert outcome("killed", killed=True) == ("killed", "killed")
    assert outcome("died") == ("died", "died")


def odd_events() -> list[dict]:
    """Every event type with fields of every JSON type, in a plausible order of times."""
    import itertools

    values = [None, 0, -1.5, "x", "", [], ["a", 1], {}, {"k": [1]}, True]
    types = ["run_started", "agent_started", "system", "sent", "waiting", "retrying", "delta", "waited", "replied",
             "launched", "output", "progress", "finished", "tool_call", "tool_result", "agent_finished",
             "run_finished", "note", "cancelled", "failed", "endpoint", "unknown"]
    fields = ["id", "status", "message", "timeout", "lost", "timings", "error", "parent", "model", "attempt",
              "text", "output", "tokens_in", "killed", "stats", "prompt", "task", "current", "label"]
    events = []
    for n, (kind, value) in enumerate(itertools.product(types, values)):
        event = {"t": 1000.0 + n / 10, "type": kind, "name": ["main", "sub", 7][n % 3]}
        event.update({field: value for field in fields[n % 5::3]})
        events.append(event)
    return events


def test_events_of_any_shape_are_folded() -> None:
    log = Listener()
    activity = Activity(log)
    for event in odd_events():
        activity.feed(event["type"], {k: v for k, v in event.items() if k not in ("t", "type")}, event["t"])
    activity.close()
    assert len(log.opened_pieces) == len(log.closed_pieces) > 0


def test_a_request_cancelled_is_not_an_error() -> None:
    log = fold([(0.0, "waiting", {"name": "main", "attempt": 1}),
                (1.0, "waited", {"name": "main", "seconds": 1.0, "error": "CancelledError"})])
    request = next(p for p in log.closed_pieces if p.kind == "request")
    assert (request.outcome, request.error_type) == ("cancelled", "")
