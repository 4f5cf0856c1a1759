"""smolagents' CodeAgent on agentloop's executor: a scripted model (no network), real workers.

The model object is smolagents' own ``Model`` interface answered from a list, so everything
after the model's reply is the real thing: CodeAgent parses the code, the executor runs it in a
sandboxed worker, tools run in this process, and the agent's memory gets what it reports.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("smolagents", reason="the smolagents extra is not installed (scripts/test installs it)")

from smolagents import CodeAgent, tool  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402

from engine.errors import CodeFailed  # noqa: E402
from engine.integrations.smolagents import AgentloopExecutor, with_last_value  # noqa: E402

from .conftest import wait_until  # noqa: E402


class ScriptedModel(Model):
    """Answers each request with the next reply of a script, and keeps what it was sent."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)
        self.requests: list[str] = []

    def generate(self, messages, stop_sequences=None, **kwargs) -> ChatMessage:
        self.requests.append("\n".join(_text(m) for m in messages))
        if not self.replies:
            raise AssertionError("the agent asked for more replies than the script has")
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


def _text(message) -> str:
    content = message.content if hasattr(message, "content") else message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def step(code: str) -> str:
    return f"Thought: next.\n<code>\n{code}\n</code>"


@pytest.fixture
def executor(tmp_path: Path):
    made: list[AgentloopExecutor] = []

    def make(**kwargs) -> AgentloopExecutor:
        ex = AgentloopExecutor(workspace=tmp_path / "files", cwd=tmp_path, state_dir=tmp_path / "state",
                               **kwargs)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.cleanup()


calls: list[tuple[int, int, int]] = []


@tool
def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    calls.append((a, b, os.getpid()))
    return a + b


def test_tools_variables_and_the_final_answer(executor):
    calls.clear()
    model = ScriptedModel([
        step("total = add(2, 3)\nprint('total is', total, 'of', numbers)\ntotal * 10"),
        step("final_answer({'total': total, 'numbers': numbers})\nprint('never printed')"),
    ])
    with CodeAgent(tools=[add], model=model, executor=executor(timeout="20s"), max_steps=4) as agent:
        answer = agent.run("Add 2 and 3.", additional_args={"numbers": [1, 2, 3]})
    assert answer == {"total": 5, "numbers": [1, 2, 3]}
    assert calls == [(2, 3, os.getpid())]  # the tool ran here, in the coordinator
    first, second = agent.memory.steps[1], agent.memory.steps[2]
    assert "total is 5 of [1, 2, 3]" in first.observations
    assert "Last output from code snippet:\n50" in first.observations  # the last expression's repr
    assert second.is_final_answer and "never printed" not in (second.observations or "")


def test_an_error_reaches_the_model_as_other_executors_report_it(executor):
    model = ScriptedModel([
        step("print('before the error')\nresult = undefined_name + 1"),
        step("final_answer('recovered')"),
    ])
    with CodeAgent(tools=[], model=model, executor=executor(timeout="20s"), max_steps=4) as agent:
        assert agent.run("Try.") == "recovered"
    error = str(agent.memory.steps[1].error)
    assert "before the error" in error
    assert "Executing code yielded an error:" in error
    assert "NameError: name 'undefined_name' is not defined" in error
    assert "result = undefined_name + 1" in error  # the line as the model wrote it
    assert "NameError" in model.requests[1]  # and the model was told


def test_the_last_expression_is_reported_without_changing_what_the_model_reads(executor):
    ex = executor(timeout="20s")
    out = ex("x = [1, 2]\nx + [3]")
    assert (out.output, out.logs, out.is_final_answer) == ("[1, 2, 3]", "", False)
    assert ex("print('hi')").output is None
    with pytest.raises(CodeFailed) as failed:
        ex("y = 1\n1 / 0")
    assert "    1 / 0\n" in str(failed.value) and "_agentloop" not in str(failed.value)
    assert with_last_value("a = 1") == "a = 1"
    assert with_last_value("print(1)") == "print(1)"
    assert with_last_value("é = 1; é").splitlines()[0].startswith(
        "é = 1; _agentloop_last_value(repr((_agentloop_value := (é)))")


def test_images_come_back_as_agent_images(executor):
    pytest.importorskip("PIL")
    from smolagents.agent_types import AgentImage

    ex = executor(timeout="60s")
    out = ex("from PIL import Image\nImage.new('RGB', (6, 4), (0, 128, 255))")
    assert isinstance(out.output, AgentImage) and out.is_final_answer is False, out
    assert out.output.to_raw().size == (6, 4) and out.output.to_raw().getpixel((0, 0)) == (0, 128, 255)
    assert "[image 6×4 PNG: " in out.logs and ex.images[0].to_string() == out.output.to_string()
    # A figure shown along the way is one of the step's images, beside a plain last value.
    out = ex("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\n21 * 2")
    assert out.output == "42" and len(ex.images) == 1 and ex.images[0].to_raw().size[0] > 100, out


#: A step that swallows the cancellation at its deadline: only the kill after the grace ends it.
STUBBORN = "import time\nwhile True:\n    try:\n        time.sleep(60)\n    except BaseException:\n        pass"


def test_a_deadline_is_enforced_by_a_kill_and_says_what_was_lost(executor):
    calls.clear()
    model = ScriptedModel([
        step("kept = 41"),
        step(STUBBORN),
        step("final_answer(add(1, 1) if 'kept' not in globals() else kept)"),
    ])
    with CodeAgent(tools=[add], model=model, executor=executor(timeout="1s"), max_steps=5) as agent:
        started = time.monotonic()
        answer = agent.run("Wait.")
        elapsed = time.monotonic() - started
    assert answer == 2  # the namespace was reset, and the tools were bound again to its replacement
    error = str(agent.memory.steps[2].error)
    assert "timed out after 1 s" in error and "killed" in error and "lost variables: kept" in error
    assert elapsed < 15, elapsed  # one 1 s deadline, a kill and a fresh worker, not 60 s
    assert calls and calls[-1][:2] == (1, 1)


def test_cleanup_stops_the_worker(executor):
    ex = executor(timeout="20s")
    ex("import os")
    pid = ex.worker.pid
    assert pid is not None and os.path.exists(f"/proc/{pid}")
    ex.cleanup()
    ex.cleanup()  # idempotent
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 10), f"worker {pid} still runs"
    with pytest.raises(Exception, match="cleaned up"):
        ex("1")


def test_an_executor_dropped_without_cleanup_stops_its_worker(tmp_path):
    ex = AgentloopExecutor(workspace=tmp_path / "files", cwd=tmp_path, state_dir=tmp_path / "state")
    ex.send_tools({"add": add})
    ex("import os")
    pid = ex.worker.pid
    del ex
    gc.collect()
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 10), f"worker {pid} still runs"
