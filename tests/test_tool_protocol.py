"""Native tool calls driving the same engine; the same scenario under both protocols."""

from __future__ import annotations

import json
import re

import pytest

from engine.agent import run_task
from engine.agent._tool_protocol import embedded_calls
from engine.models import ModelConfig, ModelRegistry
from engine.scripted import ScriptedServer


def registry(url: str, protocol: str) -> ModelRegistry:
    return ModelRegistry({"default": ModelConfig(alias="default", base_url=url, model="m", protocol=protocol,
                                                 timeout=30)}, "default")


def call(tool: str, call_id: str | None = None, /, **args) -> dict:
    return {"id": call_id or f"call_{tool}", "name": tool, "arguments": json.dumps(args)}



def check_every_call_answered(requests: list[dict]) -> None:
    """Each assistant tool call has its tool answer, with the right id, before the next request."""
    for request in requests:
        messages = request["messages"]
        for i, message in enumerate(messages):
            for tool_call in message.get("tool_calls") or []:
                answered = [m for m in messages[i + 1:] if m["role"] == "tool"
                            and m["tool_call_id"] == tool_call["id"]]
                assert len(answered) == 1, (tool_call, messages[i + 1:])


def tool_answers(request: dict) -> dict[str, str]:
    return {m["tool_call_id"]: m["content"] for m in request["messages"] if m["role"] == "tool"}


async def test_parallel_calls_guards_and_host_tools(engine):
    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    script = {"tools task": [
        {"content": "", "tool_calls": [call("run_code", "a", code="v = 21\nprint(v * 2)"),
                                       call("run_code", "b", code="import time; time.sleep(0.3); print('b done')"),
                                       call("shout", "s", text="hi")]},
        {"content": "", "tool_calls": [{"id": "j", "name": "run_code", "arguments": "{oops"},
                                       {"id": "u", "name": "teleport", "arguments": "{}"},
                                       call("run_code", "w", code=["not", "a", "string"]),
                                       call("shout", "t", volume=11),
                                       call("wait", "z", timeout="10s")]},
        {"content": "", "tool_calls": [call("run_code", "p", code="print(v)")]},
        "Done: 42."]}
    with ScriptedServer(script) as server:
        result = await run_task("tools task", models=registry(server.url, "tools"), engine=engine,
                                functions={"shout": shout})
        requests = server.requests
    assert result.status == "answered" and result.answer == "Done: 42."
    check_every_call_answered(requests)
    assert [t["function"]["name"] for t in requests[0]["tools"]] == ["run_code", "run_agent", "wait", "shout"]
    assert requests[0]["tool_choice"] == "auto"
    first = tool_answers(requests[1])
    assert first["a"].startswith("<run_code_result id=a duration=") and "42" in first["a"]
    assert first["s"].startswith("HI")
    assert "b done" in first["b"] or "still running" in first["b"]
    second = tool_answers(requests[2])
    assert "not valid JSON" in second["j"]
    assert "unknown tool 'teleport' — available: run_code, run_agent, wait, shout" in second["u"]
    assert "run_code failed" in second["w"]
    assert "bad arguments for shout" in second["t"]
    assert "nothing of yours is running" in second["z"] or "b done" in second["z"]
    assert "21" in tool_answers(requests[3])["p"]  # the namespace persisted


async def test_content_tags_and_embedded_calls_still_run(engine):
    script = {"stubborn": [
        "I'll use tags.\n<run_code>\nprint('from tags')\n</run_code>",
        '<tool_call>{"name": "run_code", "arguments": {"code": "print(\'embedded\')"}}</tool_call>',
        "ok"]}
    with ScriptedServer(script) as server:
        result = await run_task("stubborn", models=registry(server.url, "tools"), engine=engine)
        texts = [r["messages"][-1]["content"] for r in server.requests]
    assert result.answer == "ok"
    assert "from tags" in texts[1]
    assert "<tool_result call=call_" in texts[2] and "embedded" in texts[2]


def test_embedded_calls_parsing():
    content, calls = embedded_calls('before <tool_call>{"name": "wait", "arguments": {"timeout": "1s"}}'
                                    '</tool_call> after')
    assert content == "before  after"
    assert calls[0]["function"] == {"name": "wait", "arguments": '{"timeout": "1s"}'}


async def test_max_turns(engine):
    script = {"forever": [{"content": "", "tool_calls": [call("run_code", code="print(1)")]}] * 5}
    with ScriptedServer(script) as server:
        result = await run_task("forever", models=registry(server.url, "tools"), engine=engine, max_messages=3)
    assert result.status == "failed"
    assert "stopped after 3 tool rounds without a final answer" in result.error


# -- one scenario, two protocols ---------------------------------------------------------------

SCENARIO_STEPS = [
    # (code blocks [(id, code, timeout)], sub-agent task or None, what its results must show)
    ([("one", "total = 40\nprint('one', total)", "10s")], None, ["one 40"]),
    ([("two", "total += 2\nprint('two', total)", "10s"),
      ("nap", "import time; time.sleep(0.2); print('nap done')", "10s")], None, ["two 42", "nap done"]),
    # Waits in the kernel with every signal blocked: no interrupt reaches it, the deadline kills.
    ([("stuck", "import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n"
                "os.read(os.pipe()[0], 1)", "1s")], None, ["id=stuck"]),
    ([], "scenario child", ["<agent_result name=kid"]),
]


def scenario_turns(protocol: str):
    """The scenario's model, written in `protocol`: the next step once the last one's results are
    all in, else "keep going" (a plain reply that lets running work go on)."""
    def step_text(blocks, child):
        if protocol == "tags":
            text = "".join(f'<run_code id="{i}" timeout="{t}">\n{c}\n</run_code>\n' for i, c, t in blocks)
            return text + (f'<run_agent name="kid">\n{child}\n</run_agent>\n' if child else "")
        calls = [call("run_code", f"c_{i}", code=c, id=i, timeout=t) for i, c, t in blocks]
        if child:
            calls.append(call("run_agent", "c_kid", task=child, name="kid"))
        return {"content": "", "tool_calls": calls}

    def pick(body):
        issued = sum(1 for m in body["messages"] if m["role"] == "assistant" and m.get("content") != "keep going")
        seen = "".join(str(m.get("content")) for m in body["messages"] if m["role"] in ("user", "tool"))
        if issued and not all(n in seen for n in SCENARIO_STEPS[issued - 1][2]):
            return "keep going"
        if issued == len(SCENARIO_STEPS):
            return "finished"
        return step_text(*SCENARIO_STEPS[issued][:2])
    return pick


async def run_scenario(engine, protocol: str) -> str:
    script = {"scenario main": [scenario_turns(protocol)] * 20,
              "scenario child": ["<run_code>\nprint('child ran')\n</run_code>" if protocol == "tags" else
                                 {"content": "", "tool_calls": [call("run_code", "cc", code="print('child ran')")]},
                                 "child answer"]}
    with ScriptedServer(script) as server:
        result = await run_task("scenario main", models=registry(server.url, protocol), engine=engine)
        seen = "".join(str(m.get("content")) for r in server.conversation("scenario main")
                       for m in r["messages"] if m["role"] in ("user", "tool"))
        if protocol == "tools":
            check_every_call_answered(server.requests)
    assert result.status == "answered" and result.answer == "finished", result
    return seen


@pytest.mark.parametrize("protocol", ["tags", "tools"])
async def test_same_scenario_same_outcomes(engine, protocol):
    seen = await run_scenario(engine, protocol)
    outcomes = {
        "persistence": "two 42" in seen,
        "concurrency": "nap done" in seen,
        "timeout": bool(re.search(r"<run_code_result id=stuck[^>]*>\n\[timed out after 1 s", seen)),
        "reset": "namespace was reset" in seen,
        "sub-agent": bool(re.search(r"<agent_result name=kid[^>]*>\nchild answer", seen)),
    }
    assert all(outcomes.values()), outcomes


# -- JSON beyond the bounds ----------------------------------------------------------------------
# A tool call whose arguments nest 100,000 arrays deep once ended ``run --protocol tools`` with
# a RecursionError traceback, and a 1,000,000-digit number the same: the model is told in words
# and the run goes on (``worker.contract.bounded_json``).

_DEEP_ARRAYS = "[" * 100_000 + "]" * 100_000
_DEEP_OBJECTS = '{"a": ' * 50_000 + "1" + "}" * 50_000
_LONG_NUMBER = '{"code": ' + "7" * 1_000_000 + "}"
_JUST_TOO_DEEP = '{"code": ' + "[" * 100 + "]" * 100 + "}"


@pytest.mark.parametrize("arguments, words", [
    (_DEEP_ARRAYS, "nested more than 100 levels deep"), (_DEEP_OBJECTS, "nested more than 100 levels deep"),
    (_LONG_NUMBER, "a number of 1000000 digits"), (_JUST_TOO_DEEP, "nested more than 100 levels deep"),
], ids=["arrays-100k-deep", "objects-50k-deep", "a-1M-digit-number", "101-deep"])
def test_arguments_beyond_the_bounds_are_said_to_the_model_and_the_run_goes_on(tmp_path, arguments, words):
    import os
    import subprocess
    import sys

    script = {"*": [{"content": "", "tool_calls": [{"id": "deep", "name": "run_code", "arguments": arguments}]},
                    {"content": "", "tool_calls": [call("run_code", "after", code="print(6 * 7)")]},
                    f'<tool_call>{{"name": "run_code", "arguments": {arguments}}}</tool_call>',
                    "Done."]}
    with ScriptedServer(script) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "OTEL_"))}
        env.update(LLM_URL=server.url, LLM_MODEL="m", XDG_STATE_HOME=str(tmp_path / "state"))
        proc = subprocess.run([sys.executable, "-m", "engine.cli", "run", "go", "--protocol", "tools", "-q",
                               "--max-tokens", "400000"],  # (the scripted server cuts at 4 characters a token)
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        requests = server.requests
    assert proc.returncode == 0 and proc.stdout.strip() == "Done.", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr
    said = tool_answers(requests[1])["deep"]
    assert "arguments were not valid JSON" in said and words in said, said[:500]
    assert len(said) < 1000  # the words, not the arguments sent back
    assert "42" in tool_answers(requests[2])["after"]
    # The same in a <tool_call> left in the content: a call of no known tool, in words.
    assert "unknown tool '?'" in requests[3]["messages"][-1]["content"]


def test_bounded_json_refuses_in_words_and_parses_what_is_within():
    from worker.contract.bounded_json import MAX_DEPTH, JSONRefused, loads
    from worker.contract.framing import FrameError, decode_json

    assert loads('{"a": [1, 2.5, {"b": null}], "n": ' + "9" * 1000 + "}")["a"] == [1, 2.5, {"b": None}]
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)  # as deep as allowed
    for text in ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), _DEEP_ARRAYS, _DEEP_OBJECTS, _LONG_NUMBER,
                 "1" + "0" * 5000 + ".5", "1e" + "9" * 2000):
        with pytest.raises(JSONRefused):
            loads(text)
    with pytest.raises(json.JSONDecodeError):
        loads("{oops")
    # A worker's (or the tool process's) JSON frame: refused as a bad frame, not a traceback.
    with pytest.raises(FrameError, match="nested more than"):
        decode_json(_DEEP_ARRAYS.encode())
