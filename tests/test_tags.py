"""The tag protocol: parsing replies, cleaning them, and the exact texts the model reads back."""

from __future__ import annotations

import math
from datetime import datetime

import pytest

from engine.agent import HALLUCINATION_STOPS, SYSTEM, cut_hallucinated, find_tags
from engine.agent._tags import (
    compaction_reminder,
    describe_namespace,
    describe_object,
    format_agent_result,
    format_agent_start_failed,
    format_agent_status,
    format_already_running,
    format_code_result,
    format_error,
    format_running,
    format_status,
    format_steer,
    format_vars,
    parse_attrs,
    parse_reply,
    wrap,
)
from engine.durations import format_duration, parse_duration
from engine.errors import ConfigError
from engine.models import strip_think

MALFORMED = ("<error>\nCould not parse the attributes of your <run_code>/<run_agent> tags: {}. "
             "Fix the malformed attribute and resend; nothing was run.\n</error>\n")
CUT_OFF = ("<error>\nYour reply was cut off: it opens a <run_code>/<run_agent> tag but never closes it, "
           "so nothing ran. Resend a complete, closed block.\n</error>\n")


# ---------------------------------------------------------------- find_tags / parse_attrs / wrap

def test_find_tags_simple_block_keeps_body_verbatim():
    assert list(find_tags("<run_code>\nprint(1)\n</run_code>\n", "run_code")) == [({}, "\nprint(1)\n")]


def test_close_tag_mid_line_is_inert():
    reply = '<run_code>\nprint("</run_code>")  # </run_code>\nx = 1\n</run_code>\n'
    assert list(find_tags(reply, "run_code")) == [({}, '\nprint("</run_code>")  # </run_code>\nx = 1\n')]


def test_close_tag_at_line_start_ends_block_without_boundary():
    reply = '<run_code>\ns = """\n</run_code>\n"""\n</run_code>\n'
    assert list(find_tags(reply, "run_code")) == [({}, '\ns = """\n')]


def test_boundary_protects_close_tag_at_line_start():
    reply = '<run_code boundary="ab12">\ns = """\n</run_code>\n"""\n</run_code boundary="ab12">\n'
    assert list(find_tags(reply, "run_code")) == [({"boundary": "ab12"}, '\ns = """\n</run_code>\n"""\n')]


def test_boundary_block_without_its_own_close_is_not_complete():
    reply = '<run_code boundary="ab12">\nprint(1)\n</run_code>\n'
    assert list(find_tags(reply, "run_code")) == []


def test_run_code_does_not_match_run_code_result():
    reply = "<run_code_result id=b1 duration=0.10s>\n1\n</run_code_result>\n"
    assert list(find_tags(reply, "run_code")) == []
    assert list(find_tags(reply, "run_code_result")) == [({"id": "b1", "duration": "0.10s"}, "\n1\n")]


def test_open_tag_must_start_a_line_but_may_be_indented():
    assert list(find_tags("see <run_code>\nx\n</run_code>\n", "run_code")) == []
    reply = "  <run_code id=a>\nx\n\t</run_code>\n"
    assert list(find_tags(reply, "run_code")) == [({"id": "a"}, "\nx\n")]


def test_open_and_close_on_one_line():
    assert list(find_tags("<run_code>print(1)\n</run_code>", "run_code")) == [({}, "print(1)\n")]


def test_multiple_blocks_in_order():
    reply = ("First.\n<run_code id=a>\n1\n</run_code>\nThen:\n"
             '<run_code id="b" timeout=5s>\n2\n</run_code>\n')
    assert list(find_tags(reply, "run_code")) == [({"id": "a"}, "\n1\n"), ({"id": "b", "timeout": "5s"}, "\n2\n")]


def test_parse_attrs_quoted_bare_and_spaced():
    attrs = parse_attrs(' id="x y" timeout=30s heartbeat = "5s" flag name=""')
    assert attrs == {"id": "x y", "timeout": "30s", "heartbeat": "5s", "name": "", "flag": ""}  # (a bare flag: fork)


def test_wrap_plain_is_exact():
    assert wrap("run_code_result", " id=b1", "out") == "<run_code_result id=b1>\nout\n</run_code_result>\n"
    assert wrap("steer", "", "x") == "<steer>\nx\n</steer>\n"


def test_wrap_close_mid_line_needs_no_boundary():
    assert wrap("error", "", "a </error> b") == "<error>\na </error> b\n</error>\n"


@pytest.mark.parametrize("body", [
    "</run_code_result>",
    "line\n</run_code_result>\nmore",
    "  </run_code_result> indented",
    "\t</run_code_result>",
])
def test_wrap_adds_boundary_and_round_trips(body):
    text = wrap("run_code_result", " id=b1", body)
    [(attrs, found)] = list(find_tags(text, "run_code_result"))
    assert found == "\n" + body + "\n"
    boundary = attrs["boundary"]
    assert attrs["id"] == "b1"
    assert boundary not in body
    assert text == (f'<run_code_result id=b1 boundary="{boundary}">\n{body}\n'
                    f'</run_code_result boundary="{boundary}">\n')


# ---------------------------------------------------------------- parse_reply

def test_parse_reply_code_defaults():
    parsed = parse_reply("<run_code>\nprint(1)\n</run_code>\n")
    assert parsed.errors == [] and parsed.agents == [] and parsed.attempted
    [block] = parsed.code
    assert (block.id, block.code, block.timeout, block.heartbeat) == (None, "\nprint(1)\n", 10.0, None)


def test_parse_reply_code_attributes():
    parsed = parse_reply('<run_code id="x" timeout="30s" heartbeat="5s">\nprint(1)\n</run_code>\n',
                         default_timeout=3)
    [block] = parsed.code
    assert (block.id, block.timeout, block.heartbeat) == ("x", 30.0, 5.0)
    assert block.attrs == {"id": "x", "timeout": "30s", "heartbeat": "5s"}


def test_parse_reply_agents():
    reply = ('<run_agent name="reader" namespace="a, b,,c" model="flash" heartbeat="30s" context="k">\n'
             "  read it\n</run_agent>\n<run_agent>\nsecond\n</run_agent>\n")
    parsed = parse_reply(reply)
    first, second = parsed.agents
    assert (first.name, first.task, first.namespace, first.model, first.heartbeat, first.context) == \
        ("reader", "read it", ["a", "b", "c"], "flash", 30.0, "k")
    assert (second.name, second.task, second.namespace, second.model, second.heartbeat, second.context) == \
        ("sub", "second", [], "", None, "")
    assert parsed.errors == [] and parsed.code == []


def test_parse_reply_code_and_agents_together():
    parsed = parse_reply("<run_agent name=s>\nt\n</run_agent>\n<run_code id=a>\n1\n</run_code>\n")
    assert [b.id for b in parsed.code] == ["a"] and [a.name for a in parsed.agents] == ["s"]


def test_parse_reply_malformed_duration_is_an_error_and_nothing_runs():
    parsed = parse_reply('<run_code id=a>\n1\n</run_code>\n<run_code timeout="abc">\n2\n</run_code>\n')
    assert parsed.code == [] and parsed.agents == []
    assert parsed.errors == [MALFORMED.format(
        "timeout: expected a duration like 250ms, 30s, 5m, 1h or plain seconds, got 'abc'")]


def test_parse_reply_bad_agent_heartbeat_is_an_error():
    parsed = parse_reply('<run_agent heartbeat="soon">\nt\n</run_agent>\n')
    assert parsed.agents == []
    [error] = parsed.errors
    assert error.startswith("<error>\nCould not parse the attributes") and "heartbeat: " in error


def test_parse_reply_zero_timeout_is_an_error():
    [error] = parse_reply('<run_code timeout="0s">\n1\n</run_code>\n').errors
    assert "greater than zero" in error


def test_parse_reply_unclosed_block_is_cut_off():
    parsed = parse_reply("Running it:\n<run_code>\nprint(1)\n")
    assert parsed.attempted and parsed.code == [] and parsed.errors == [CUT_OFF]


def test_parse_reply_plain_text_is_not_an_attempt():
    parsed = parse_reply("The answer is 42. Tags like <run_code> mid-line do nothing.")
    assert not parsed.attempted and parsed.errors == [] and parsed.code == []


# ---------------------------------------------------------------- strip_think / cut_hallucinated

@pytest.mark.parametrize("raw, clean", [
    ("<think>hmm</think>\nanswer", "answer"),
    ("<think>a\nb</think>x<think>c</think>y", "xy"),
    ("reasoning from the template\n</think>\n\nanswer", "answer"),
    ("answer\n<think>unfinished <run_code>\nprint(1)\n", "answer"),
    ("  plain  \n", "plain"),
])
def test_strip_think(raw, clean):
    assert strip_think(raw) == clean


@pytest.mark.parametrize("tag", ["<run_code_result id=b1 duration=0.1s>", "<running id=b1 current=3s>",
                                 "<agent_result name=sub duration=2s>", "<agent_status name=sub>"])
def test_cut_hallucinated_at_each_tag(tag):
    reply = f"<run_code id=b1>\nprint(1)\n</run_code>\n{tag}\n1\n"
    assert cut_hallucinated(reply) == ("<run_code id=b1>\nprint(1)\n</run_code>\n", True)


def test_cut_hallucinated_mid_line_and_drops_later_blocks():
    reply = "Done. Output: <running>\nfake\n</running>\n<run_code>\nx\n</run_code>\n"
    assert cut_hallucinated(reply) == ("Done. Output: ", True)


def test_cut_hallucinated_leaves_tags_inside_blocks():
    reply = ('<run_code>\nif "<running" in text or "<run_code_result" in text:\n    pass\n</run_code>\n'
             "<run_agent>\nResults arrive as <agent_result name=x>.\n</run_agent>\nWaiting.\n")
    assert cut_hallucinated(reply) == (reply, False)


def test_cut_hallucinated_after_the_blocks_it_protects():
    reply = '<run_code>\ns = "<running"\n</run_code>\n<running id=b1>\n'
    assert cut_hallucinated(reply) == ('<run_code>\ns = "<running"\n</run_code>\n', True)


def test_cut_hallucinated_inside_unclosed_block_cuts():
    assert cut_hallucinated("<run_code>\nx = 1\n<run_code_result id=b1>\n") == ("<run_code>\nx = 1\n", True)


def test_cut_hallucinated_ignores_other_words_and_closing_tags():
    reply = "The <running_total> field and </running> stay.\n<runningman>"
    assert cut_hallucinated(reply) == (reply, False)


def test_hallucination_stops():
    assert HALLUCINATION_STOPS == ["<run_code_result", "<running", "<agent_result", "<agent_status"]


# ---------------------------------------------------------------- texts the model reads

def test_format_results_are_exact():
    assert format_code_result("b1", 0.123, "hi") == "<run_code_result id=b1 duration=0.12s>\nhi\n</run_code_result>\n"
    assert format_running("b2", 12.4, datetime(2024, 5, 1, 9, 3, 7), datetime(2024, 5, 1, 9, 4, 0), "part") == \
        "<running id=b2 current=12s now=09:03:07 deadline=09:04:00>\npart\n</running>\n"
    assert format_agent_result("sub", 61.6, "answer") == "<agent_result name=sub duration=62s>\nanswer\n</agent_result>\n"
    assert format_agent_status("sub", 30.2, "[sub - 12 tokens]") == \
        "<agent_status name=sub elapsed=30s>\n[sub - 12 tokens]\n</agent_status>\n"
    assert format_error(" id=b1", "boom") == "<error id=b1>\nboom\n</error>\n"
    assert format_steer("stop that") == "<steer>\nstop that\n</steer>\n"
    assert format_already_running("b1") == \
        "<error id=b1>\nalready running, not restarted; reply in plain text to wait for it\n</error>\n"
    assert format_agent_start_failed("sub", "max delegation depth 3 reached") == \
        "<error name=sub>\nCould not start this sub-agent: max delegation depth 3 reached\n</error>\n"


def test_format_result_protects_output_with_close_tag():
    text = format_code_result("b1", 1.0, "</run_code_result>")
    [(attrs, body)] = list(find_tags(text, "run_code_result"))
    assert body == "\n</run_code_result>\n" and attrs["duration"] == "1.00s"


def test_format_status():
    assert format_status(1234, 0.5, 2.04, " vars=[a:int]") == \
        "<status context_tokens=1234 spent=$0.5000 last_reply=2.0s vars=[a:int]/>\n"
    assert format_status(10, 0, 0) == "<status context_tokens=10 spent=$0.0000 last_reply=0.0s/>\n"
    assert format_status(10, 0.00012, 1.0, ["s:str(3)", "n:int"]) == \
        "<status context_tokens=10 spent=$0.0001 last_reply=1.0s vars=[s:str(3), n:int]/>\n"
    assert format_vars([f"v{i}:int" for i in range(30)]).count(":int") == 25


def test_compaction_reminder_text():
    assert compaction_reminder() == (
        '<reminder>Your context is growing and every turn now costs more. Call self.compact_knowledge("...") NOW, '
        "before your next action — pass a SELF-CONTAINED summary that keeps every exact URL, file path you "
        "created, value/credential/deduction found, the item you are on and the next step. Everything you leave "
        "out is GONE. Do it this turn, not in a few turns.</reminder>\n")


# ---------------------------------------------------------------- system prompt

def _system(minimal, ram="", namespace_block=""):
    from engine.agent._tags import build_system
    return build_system(model_alias="flash", model="vendor/flash-1", available_models="- flash\n- gpt",
                        python="3.11.9", os="Linux 6.1", cpu=8, ram=ram, packages=["numpy", "httpx"],
                        namespace_block=namespace_block, minimal=minimal)


def test_build_system_minimal_is_the_environment_only():
    assert _system(True) == (
        "You are running on the 'flash' model (vendor/flash-1). When you spawn a sub-agent you can give it a "
        'different model with the model="alias" attribute on <run_agent> (or the model= argument of '
        "self.run_agent): pick a cheap fast model for simple or bulk work and a stronger model for hard reasoning. "
        "Omit it to reuse your own model. Available models:\n- flash\n- gpt\nEnvironment:\n"
        "Runtime: Python 3.11.9 on Linux 6.1\nCPU cores: 8\nTop-level installed packages: numpy, httpx")


def test_build_system_full_has_guide_ram_and_namespace():
    block = describe_namespace(["x: int = 1"])
    text = _system(False, ram="12 GB available of 16 GB", namespace_block=block)
    assert text.startswith(SYSTEM + "\nYou are running on the 'flash' model")
    assert "CPU cores: 8\nRAM: 12 GB available of 16 GB\nTop-level installed packages: numpy, httpx\n" in text
    assert text.endswith("\nThese objects are already available by name in your code (no import needed):\n"
                         "- x: int = 1")


def test_describe_namespace_empty():
    assert describe_namespace([]) == ""


async def _fetch(url: str, retries: int = 2) -> str:
    """Fetch a page."""
    return url


class _Tools:
    """Repository tools.

    More text."""

    def read(self, path: str) -> str:
        """Read a file."""
        return path

    async def search(self, query):
        return query


def test_describe_object_forms():
    assert describe_object("fetch", _fetch) == "async fetch(url: str, retries: int = 2) -> str: Fetch a page."
    assert describe_object("tools", _Tools()) == (
        "tools: _Tools — Repository tools.\n"
        " tools.read(path: str) -> str: Read a file.\n"
        " async tools.search(query): ")
    assert describe_object("n", 42) == "n: int = 42"
    assert describe_object("s", "x" * 100) == f"s: str = '{'x' * 79}…"
    assert describe_object("print", print).startswith("print(")


# ---------------------------------------------------------------- durations

@pytest.mark.parametrize("text, seconds", [
    ("250ms", 0.25), ("30s", 30), ("5m", 300), ("1h", 3600), ("1.5s", 1.5), ("1m30s", 90),
    ("1h30m", 5400), ("2s500ms", 2.5), ("1h 2m 3s", 3723), ("12", 12), ("0.5", 0.5), (".5", 0.5),
    (" 30S ", 30), (7, 7.0), (2.5, 2.5),
])
def test_parse_duration_forms(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "-5s", "5 minutes", "30s5m", "1d", "s", "1..5s", "ms"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError) as caught:
        parse_duration(text)
    assert str(caught.value) == f"expected a duration like 250ms, 30s, 5m, 1h or plain seconds, got {text!r}"


@pytest.mark.parametrize("value", [-1, math.inf, math.nan, True])
def test_parse_duration_rejects_numbers(value):
    with pytest.raises(ConfigError):
        parse_duration(value)


def test_parse_duration_zero_and_default():
    with pytest.raises(ConfigError, match="greater than zero"):
        parse_duration("0s")
    assert parse_duration("0", allow_zero=True) == 0
    assert parse_duration(None, 10.0) == 10.0
    assert parse_duration("  ", 3) == 3
    assert parse_duration("") is None


@pytest.mark.parametrize("seconds, text", [
    (0.25, "250ms"), (30, "30s"), (300, "5m"), (3600, "1h"), (5400, "1h30m"), (1.5, "1.5s"),
    (90, "1m30s"), (3723.25, "1h2m3.25s"), (0, "0s"), (0.0004, "0s"), (-2, "-2s"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
    if seconds > 0.001:
        assert parse_duration(text) == pytest.approx(seconds)
