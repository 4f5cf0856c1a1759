"""What the model and the user are told is true: a follow-up task's answers each arrive once and
in order, a compaction from a tool call leaves a sequence a strict server takes, an empty reply
is never an answer, and a failed sub-agent says why.  Real workers, the scripted server."""

from __future__ import annotations

import json

import pytest

from engine.agent import AgentDisplay, run_task
from engine.agent._reply_guard import EMPTY_REPLY_NOTE
from engine.models import ModelConfig, ModelRegistry
from engine.scripted import ScriptedServer
from engine.scripted._sequence import sequence_problems


def registry(url: str, protocol: str = "tags") -> ModelRegistry:
    return ModelRegistry({"default": ModelConfig(alias="default", base_url=url, model="m",
                                                 protocol=protocol, timeout=30)}, "default")


class Recorder(AgentDisplay):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, type, **fields):
        self.events.append((type, fields))


def code_reply(protocol: str, code: str, block_id: str = "b") -> str | dict:
    if protocol == "tags":
        return f'<run_code id="{block_id}" timeout="30s">\n{code}\n</run_code>'
    return {"content": "", "tool_calls": [{"id": f"c_{block_id}", "name": "run_code",
                                           "arguments": json.dumps({"code": code, "id": block_id})}]}


def seen(request: dict) -> str:
    return "\n".join(m["content"] or "" for m in request["messages"] if m["role"] in ("user", "tool"))


async def test_new_task_before_the_first_result_was_delivered_delivers_each_answer_once_in_order(engine):
    # The block awaits the first task and asks the follow-up at once: the first answer has not
    # reached the parent yet when the agent starts on the second.
    code = "h = self.run_agent('first job', name='w')\nawait h\nh.new_task('second job')\nprint('asked')"

    def parent(body: dict) -> str:
        return "done" if "answer two" in seen(body) else "waiting"

    script = {"first job": ["answer one", "answer two"], "parent task": [code_reply("tags", code)] + [parent] * 10}
    with ScriptedServer(script) as server:
        result = await run_task("parent task", models=registry(server.url), engine=engine, timeout=60)
        last = server.conversation("parent task")[-1]
    assert result.status == "answered", result
    text = seen(last)
    assert text.count("answer one") == 1 and text.count("answer two") == 1, text
    assert text.index("answer one") < text.index("answer two")


async def test_compact_knowledge_from_a_tool_call_leaves_a_valid_sequence(engine):
    def first(body: dict):  # a compacted history has no assistant message: turn 0 again
        if "SUMMARY" in body["messages"][1]["content"]:
            return code_reply("tools", "print('after')", "a")
        return code_reply("tools", "self.compact_knowledge('SUMMARY of the compact task: x is 5')\n"
                                   "print('compacted')", "k")

    script = {"compact task": [first, "final"]}
    with ScriptedServer(script) as server:
        result = await run_task("compact task", models=registry(server.url, "tools"), engine=engine, timeout=60)
        requests = server.requests
        violations = server.violations
    assert result.status == "answered" and result.answer == "final", result
    assert not violations, [v.problems for v in violations]
    after = requests[1]["messages"]
    assert [m["role"] for m in after] == ["system", "user"], after
    # The call's answer is not lost: it arrives as text after the summary.
    assert after[1]["content"].startswith("SUMMARY of the compact task") and "compacted" in after[1]["content"]


def test_the_sequence_rules():
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}, {"id": "b"}]}
    answer = lambda i: {"role": "tool", "tool_call_id": i, "content": "x"}  # noqa: E731
    user, system = {"role": "user", "content": "q"}, {"role": "system", "content": "s"}
    assert sequence_problems([system, user, call, answer("b"), answer("a"), user]) == []
    assert "without a preceding call" in sequence_problems([system, user, answer("a")])[0]
    assert "no tool message" in sequence_problems([system, user, call, answer("a"), user])[0]
    assert "answered twice" in sequence_problems([system, call, answer("a"), answer("a"), answer("b")])[0]
    assert "did not call" in sequence_problems([system, call, answer("a"), answer("b"), answer("c")])[0]
    assert "not answered" in sequence_problems([system, user, call])[0]
    assert "without a preceding call" in sequence_problems([system, call, answer("a"), answer("b"), user,
                                                            answer("a")])[0]


@pytest.mark.parametrize("protocol", ["tags", "tools"])
async def test_an_empty_reply_is_nudged_once_then_fails_the_run(engine, protocol: str):
    script = {"empty then answer": ["", "the answer"], "always empty": ["", "  ", "never"]}
    with ScriptedServer(script) as server:
        nudged = await run_task("empty then answer", models=registry(server.url, protocol), engine=engine,
                                timeout=60)
        failed = await run_task("always empty", models=registry(server.url, protocol), engine=engine,
                                timeout=60)
        second = server.conversation("empty then answer")[1]
    assert nudged.status == "answered" and nudged.answer == "the answer", nudged
    assert EMPTY_REPLY_NOTE in seen(second)
    assert failed.status == "failed" and failed.answer is None, failed
    assert "reply was empty 2 times in a row" in failed.error


async def test_a_failed_sub_agent_says_why(engine):
    display = Recorder()
    script = {"parent task": ['<run_code>\nh = self.run_agent("sub job", name="g")\n</run_code>', "waiting",
                              "done"],
              "sub job": [""] * 3}
    with ScriptedServer(script) as server:
        result = await run_task("parent task", models=registry(server.url), engine=engine, display=display,
                                timeout=60)
    assert result.status == "answered", result
    finished = [f for t, f in display.events if t == "agent_finished" and f["name"] == "g"]
    assert finished and finished[0]["status"] == "failed"
    assert "reply was empty" in finished[0]["reason"], finished
