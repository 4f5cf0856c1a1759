"""Displays: event routing, fan-out, JSONL recording and replay, and the console renderer."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from engine.agent import AgentDisplay, DispatchDisplay, FanoutDisplay, JsonlRecorder
from engine.agent._display import accepted_kwargs, read_recording, replay
from engine.errors import ConfigError
from engine.observe import ConsoleDisplay

EVENT_TYPES = ["system", "sent", "replied", "delta", "launched", "output", "progress", "finished",
               "cancelled", "failed", "agent_started", "agent_finished", "note", "waiting", "waited", "retrying"]


class _Collect(AgentDisplay):
    def __init__(self):
        self.events = []

    def event(self, type, **fields):
        self.events.append((type, fields))


class _Launches(DispatchDisplay):
    def __init__(self):
        self.calls = []

    def launched(self, name, id):
        self.calls.append(("launched", name, id))

    def note(self, **fields):
        self.calls.append(("note", fields))


def test_base_display_ignores_everything():
    AgentDisplay().event("launched", name="main", id="b1", anything=object())


def test_dispatch_routes_by_type_and_drops_undeclared_fields():
    display = _Launches()
    display.event("launched", name="main", id="b1", timeout=10.0, code="x", model="flash")
    display.event("progress", name="main", id="b1", current=1.0, output="")
    display.event("note", name="main", message="hi", extra=1)
    assert display.calls == [("launched", "main", "b1"), ("note", {"name": "main", "message": "hi", "extra": 1})]


def test_accepted_kwargs():
    def handler(name, id=None):
        pass

    assert accepted_kwargs(handler, {"name": "a", "id": 1, "other": 2}) == {"name": "a", "id": 1}
    assert accepted_kwargs(lambda **kw: None, {"x": 1}) == {"x": 1}


def test_fanout_sends_every_event_to_each_display():
    first, second = _Collect(), _Collect()
    fanout = FanoutDisplay([first, second])
    fanout.event("failed", name="main", message="boom")
    fanout.event("note", name="sub", message="ok")
    assert first.events == second.events == [("failed", {"name": "main", "message": "boom"}),
                                             ("note", {"name": "sub", "message": "ok"})]


# ---------------------------------------------------------------- recording

class _Opaque:
    def __repr__(self):
        return "<opaque>"


def test_jsonl_round_trip_with_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    big = "x" * 200_000 + "\n</run_code>\n"
    with JsonlRecorder(path) as recorder:
        recorder.event("replied", name="main", message=big, stats={"context": 10, 3: "int key"}, latency=0.5)
        recorder.event("launched", name="main", id="b1", timeout=10.0, heartbeat=None, code="print('é')",
                       extra=(1, 2), handle=_Opaque(), names={"a"})
    with open(path, "a", encoding="utf-8") as file:
        file.write('{"t": 1.0, "type": "note", "name": "ma')  # the writer died here

    events = read_recording(path)
    assert [event["type"] for event in events] == ["replied", "launched"]
    assert all(isinstance(event["t"], float) for event in events)
    assert events[0]["message"] == big
    assert events[0]["stats"] == {"context": 10, "3": "int key"}
    assert events[1]["code"] == "print('é')" and events[1]["heartbeat"] is None
    assert events[1]["extra"] == [1, 2] and events[1]["handle"] == "<opaque>" and events[1]["names"] == "{'a'}"

    collected = _Collect()
    assert replay(path, collected) == 2
    assert collected.events[1] == ("launched", {k: v for k, v in events[1].items() if k not in ("t", "type")})


def test_recorder_flushes_each_event_and_appends(tmp_path):
    path = tmp_path / "events.jsonl"
    recorder = JsonlRecorder(path)
    recorder.event("note", name="main", message="one")
    assert [e["message"] for e in read_recording(path)] == ["one"]  # visible before close
    recorder.close()
    recorder.event("note", name="main", message="after close")  # dropped, not raised
    with JsonlRecorder(path) as again:
        again.event("note", name="main", message="two")
    assert [e["message"] for e in read_recording(path)] == ["one", "two"]
    lines = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0])["type"] == "note"


def test_damaged_middle_line_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1, "type": "note"}\nnot json\n{"t": 2, "type": "note"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=":2: not a recorded event"):
        read_recording(path)


# ---------------------------------------------------------------- console

def _console(verbose=False, **kwargs):
    buffer = io.StringIO()
    return ConsoleDisplay(Console(file=buffer, width=100), verbose=verbose, **kwargs), buffer


def _session(display):
    display.event("agent_started", name="main", parent=None, model="flash", task="Count [bold]files[/bold]")
    display.event("delta", name="main", text="Let me look ")
    display.event("delta", name="main", text="[at] it.\n<run_code id=b1>\nprint(len(x))\n")
    display.event("delta", name="main", text="</run_code>")
    display.event("replied", name="main", message="(whole reply)", latency=1.5,
                  stats={"context": 1234, "generated": 56, "cost": 0.0012, "unknown": "x"})
    display.event("launched", name="main", id="b1", timeout=30.0, heartbeat=5.0,
                  code="import os\nx = os.listdir('.')\nprint(len(x))\na = 1\nb = 2\nc = 3\n")
    display.event("output", name="main", id="b1", stream="stdout", text="12\npart")
    display.event("output", name="main", id="b1", stream="stderr", text="warning: \x1b[31mred\x1b[0m\n")
    display.event("progress", name="main", id="b1", current=5.2, output="12\npart")
    display.event("output", name="main", id="b1", stream="stdout", text="ial\n")
    display.event("finished", name="main", id="b1", duration=1.234, cancelled=False, output="12\npartial\n")
    display.event("agent_started", name="reader", parent="main", model="gpt", task="Read the logs")
    display.event("launched", name="reader", id="b1", timeout=10.0, heartbeat=None, code="while True: pass")
    display.event("progress", name="reader", id="b1", current=5.0, output="tick\n")
    display.event("finished", name="reader", id="b1", duration=10.02, cancelled=True, output="tick\ntock[timed out]")
    display.event("note", name="reader", message="sandbox: bubblewrap unavailable")
    display.event("cancelled", name="reader", label="cancelled by caller")
    display.event("agent_finished", name="reader", status="cancelled", duration=12.0)
    display.event("replied", name="main", message="The answer is [42].\nDone.", stats=None, latency=0.4)


def test_console_renders_a_session():
    display, buffer = _console()
    _session(display)
    text = buffer.getvalue()
    lines = text.splitlines()
    assert "\x1b[" not in text  # not a terminal: no colour codes, and none passed through from output
    assert lines[0] == "▶ main (flash) Count [bold]files[/bold]"
    assert lines[1:5] == ["main › Let me look [at] it.", "main › <run_code id=b1>", "main › print(len(x))",
                          "main › </run_code>"]
    assert "  main · 1.5s · 1,234 ctx · 56 out · $0.0012" in lines
    assert "(whole reply)" not in text  # already streamed
    assert "  ▸ main/b1  timeout 30s, heartbeat 5s" in lines
    assert "    ┆ import os" in lines and "    ┆ … 2 more lines" in lines and "    ┆ b = 2" not in lines
    assert "    main/b1 │ 12" in lines and "    main/b1 │ partial" in lines
    assert "    main/b1 │ warning: red" in lines
    assert "  ✓ main/b1 done in 1.23s" in lines
    assert "  ▶ reader (gpt) Read the logs" in lines
    assert "    ▸ reader/b1  timeout 10s" in lines
    assert "      reader/b1 │ tick" in lines and "      reader/b1 │ tock[timed out]" in lines
    assert "    ✗ reader/b1 timed out in 10.02s" in lines
    assert "  • reader: sandbox: bubblewrap unavailable" in lines
    assert "  ✗ reader cancelled: cancelled by caller" in lines
    assert "  ✗ reader cancelled in 12s" in lines
    assert lines[-3:] == ["main › The answer is [42].", "main › Done.", "  main · 0.4s"]


def test_console_interleaves_streams_by_line():
    display, buffer = _console()
    display.event("agent_started", name="a", parent=None)
    display.event("agent_started", name="b", parent="a")
    display.event("delta", name="a", text="one ")
    display.event("delta", name="b", text="two\n")
    display.event("delta", name="a", text="three")
    display.event("replied", name="a")
    assert buffer.getvalue().splitlines()[2:] == ["a › one ", "  b › two", "a › three"]


def test_console_caps_output_unless_verbose():
    lines_out = "".join(f"line {i}\n" for i in range(50))
    display, buffer = _console(output_lines=40)
    display.event("launched", name="main", id="b1", timeout=10, code="x")
    display.event("finished", name="main", id="b1", duration=0.1, cancelled=False, output=lines_out)
    text = buffer.getvalue()
    assert "main/b1 │ line 39" in text and "line 40" not in text
    assert "main/b1 │ … 10 more lines not shown" in text

    display, buffer = _console(verbose=True)
    display.event("system", name="main", prompt="You are an agent.")
    display.event("sent", name="main", message="do it", count=1)
    display.event("finished", name="main", id="b1", duration=0.1, cancelled=False, output=lines_out)
    text = buffer.getvalue()
    assert "main system prompt:" in text and "  You are an agent." in text
    assert "→ main message 1" in text and "line 49" in text


def test_console_progress_without_new_output_shows_elapsed():
    display, buffer = _console()
    display.event("progress", name="main", id="b3", current=7.6, output="")
    assert buffer.getvalue() == "    main/b3 … running 8s\n"


def test_console_never_raises_on_missing_or_odd_fields():
    display, buffer = _console(verbose=True)
    for event_type in EVENT_TYPES:
        display.event(event_type)
    display.event("launched", name="main", id=3, timeout="soon", heartbeat="x", code=None)
    display.event("replied", name="main", message="", stats="12 tokens", latency="fast")
    display.event("finished", name="main", id=3, duration=None, cancelled=None, output=None, status="error")
    display.event("something_new", name="main", payload=1)
    assert "✗ main/3 error in ?" in buffer.getvalue()


def test_replay_into_console(tmp_path):
    path = tmp_path / "events.jsonl"
    with JsonlRecorder(path) as recorder:
        _session(recorder)
    live, live_buffer = _console()
    _session(live)
    replayed, replay_buffer = _console()
    replay(path, replayed)
    assert replay_buffer.getvalue() == live_buffer.getvalue()


def test_console_shows_retries_notes_to_the_model_and_why_a_sub_agent_failed():
    display, buffer = _console()
    display.event("retrying", name="main", attempt=1, of=4, wait=0.5, reason="HTTP 500", status=500)
    display.event("sent", name="main", count=3, message=(
        "<run_code_result id=b1 duration=0.01s>\nok\n</run_code_result>\n"
        "<error reason=length>\nYour previous reply reached the\nreply-length limit.\n</error>\n"
        "<error name=k2>\nCould not start this sub-agent: \x1b[31mlimit\n</error>\n<status context_tokens=1/>"))
    display.event("agent_started", name="f", parent="main")
    display.event("agent_finished", name="f", status="failed", duration=0.2, reason="unknown model 'x'\nsecond")
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "↻ main: the request failed (HTTP 500); retry 1 of 4 in 0.5s"
    assert lines[1:3] == ["  ⚠ main is told (reason=length): Your previous reply reached the reply-length limit.",
                          "  ⚠ main is told (name=k2): Could not start this sub-agent: limit"]
    assert lines[-1] == "  ✗ f failed in 0s: unknown model 'x' second"


def test_console_shows_what_the_model_is_held_to_when_an_invented_result_is_cut():
    display, buffer = _console()
    display.event("delta", name="main", text="Let me check.\n<run_code>\nprint(1)\n</run_code>\n<run_co")
    display.event("delta", name="main", text="de_result id=b1>\n1\n</run_code_result>\nSo it is 1.")
    display.event("replied", name="main", message="(whole)")
    text = buffer.getvalue()
    assert "main › Let me check." in text and "main › </run_code>" in text
    assert "<run_co" not in text.replace("<run_code>", "") and "So it is 1" not in text, text
    assert "✂ main: the reply is cut here, where the model wrote a result itself" in text
    # A tail held back because it might have begun a tag is shown once the reply ends.
    display, buffer = _console()
    display.event("delta", name="main", text="Answer: x <running")
    assert "<running" not in buffer.getvalue()
    display.event("delta", name="main", text="_total> is 3")
    display.event("replied", name="main", message="Answer: x <running_total> is 3")
    assert "main › Answer: x <running_total> is 3" in buffer.getvalue() and "✂" not in buffer.getvalue()
    # A tag inside a block being written is code: shown once the block is complete, never cut.
    display, buffer = _console()
    display.event("delta", name="main", text='<run_code>\nprint("<running")\n')
    display.event("delta", name="main", text="</run_code>\n")
    display.event("replied", name="main", message='<run_code>\nprint("<running")\n</run_code>\n')
    assert 'main › print("<running")' in buffer.getvalue() and "✂" not in buffer.getvalue()
    # Not streamed: the reply is shown as cut.
    display, buffer = _console()
    display.event("replied", name="main", message="Done.\n<agent_result name=x>\ninvented\n</agent_result>")
    assert "main › Done." in buffer.getvalue() and "invented" not in buffer.getvalue()
    assert "✂" in buffer.getvalue()


def test_console_shows_code_once():
    code = "x = 1\nprint(x)"
    display, buffer = _console()
    display.event("delta", name="main", text=f"<run_code>\n{code}\n</run_code>\n")
    display.event("replied", name="main", message=f"<run_code>\n{code}\n</run_code>\n")
    display.event("launched", name="main", id="b1", timeout=10.0, code=code)
    assert buffer.getvalue().count("print(x)") == 1
    # A tool call's code is in no reply text: it is shown under its block.
    display, buffer = _console()
    display.event("replied", name="main", message="")
    display.event("launched", name="main", id="c1", timeout=10.0, code=code)
    assert "    ┆ print(x)" in buffer.getvalue().splitlines()


def test_waiting_for_the_first_token_is_shown_on_a_terminal_only():
    now = [100.0]
    display, buffer = _console(clock=lambda: now[0])
    display.event("waiting", name="main", attempt=1)
    assert display._live is None and buffer.getvalue() == ""  # not a terminal: nothing extra

    terminal = io.StringIO()
    display = ConsoleDisplay(Console(file=terminal, width=80, force_terminal=True), clock=lambda: now[0])
    display.event("agent_started", name="main", parent=None)
    display.event("waiting", name="main", attempt=1)
    assert display._live is not None
    now[0] += 3.2
    assert display._waiting.lines() == ["⠹ main waiting for the model · 3s"]
    display.event("delta", name="main", text="hi")  # the first token ends the wait
    assert display._live is None and display._waiting.lines() == []
    display.event("waiting", name="main", attempt=1)
    display.event("retrying", name="main", attempt=1, of=4, wait=1.0, reason="HTTP 503", status=503)
    assert display._live is None
    display.event("waiting", name="main", attempt=2)
    display.close()
    assert display._live is None


def test_the_spinner_pauses_while_another_agent_streams_a_line():
    terminal = io.StringIO()
    display = ConsoleDisplay(Console(file=terminal, width=80, force_terminal=True), clock=lambda: 5.0)
    display.event("waiting", name="sub", attempt=1)
    assert display._live is not None
    display.event("delta", name="main", text="half a li")
    assert display._live is None  # a partial line is never split by the spinner
    display.event("delta", name="main", text="ne\n")
    display.event("replied", name="main", message="half a line\n")
    assert display._live is not None  # sub still waits
    display.close()
    assert display._live is None
