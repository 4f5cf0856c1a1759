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
