"""What an agent was promised survives a worker replacement: after a kill at a deadline the
next block still has ``self``, every host function, ``asyncio`` and, in a sub-agent, the objects
it was handed — under both protocols.  Only what the code defined is lost, and the result and
the status line say exactly that."""

from __future__ import annotations

import json
import re

import pytest

from engine.agent import run_task
from engine.models import ModelConfig, ModelRegistry
from engine.scripted import ScriptedServer

#: A block no interrupt can reach (it waits in the kernel with every signal blocked), so the
#: deadline ends in a kill.
STUCK = "import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\nos.read(os.pipe()[0], 1)"
PARENT_AFTER = "print(double(21), self.cost() is not None, 'asyncio' in globals(), 'data' in globals())"
SUB_AFTER = "print(self.cost() is not None, 'asyncio' in globals(), data['k'], 'mine' in globals())"


def registry(url: str, protocol: str) -> ModelRegistry:
    return ModelRegistry({"default": ModelConfig(alias="default", base_url=url, model="m",
                                                 protocol=protocol, timeout=30)}, "default")


def code_reply(protocol: str, block_id: str, code: str, timeout: str = "30s") -> str | dict:
    if protocol == "tags":
        return f'<run_code id="{block_id}" timeout="{timeout}">\n{code}\n</run_code>'
    args = json.dumps({"code": code, "id": block_id, "timeout": timeout})
    return {"content": "", "tool_calls": [{"id": f"c_{block_id}", "name": "run_code", "arguments": args}]}


def agent_reply(protocol: str) -> str | dict:
    if protocol == "tags":
        return '<run_agent name="sub" namespace="data">sub task</run_agent>'
    args = json.dumps({"task": "sub task", "name": "sub", "namespace": "data"})
    return {"content": "", "tool_calls": [{"id": "c_sub", "name": "run_agent", "arguments": args}]}


def texts(request: dict) -> str:
    return "\n".join(m["content"] or "" for m in request["messages"] if m["role"] in ("user", "tool"))


@pytest.mark.parametrize("protocol", ["tags", "tools"])
async def test_a_replacement_worker_is_bound_as_the_first_was(engine, protocol: str):
    def double(n: int) -> int:
        """Twice n."""
        return 2 * n

    script = {
        "parent task": [code_reply(protocol, "p1", "data = {'k': 5}"), agent_reply(protocol),
                        code_reply(protocol, "p2", STUCK, timeout="1s"), code_reply(protocol, "p3", PARENT_AFTER),
                        "parent done"],
        "sub task": [code_reply(protocol, "s0", "mine = 1"), code_reply(protocol, "s1", STUCK, timeout="1s"),
                     code_reply(protocol, "s2", SUB_AFTER), "sub done"],
    }
    with ScriptedServer(script) as server:
        result = await run_task("parent task", models=registry(server.url, protocol), engine=engine,
                                functions={"double": double}, timeout=120)
        requests = server.requests
    assert result.status == "answered", result
    sub = [r for r in requests if "sub task" in json.dumps(r["messages"][:2])]
    parent = [r for r in requests if r not in sub]
    seen, parent_seen = "\n".join(texts(r) for r in sub), "\n".join(texts(r) for r in parent)
    # A kill names what the code defined, and only that (not the handed `data`) ...
    assert re.search(r"lost variables: mine\)", seen), seen
    assert re.search(r"lost variables: data\)", parent_seen), parent_seen  # the parent defined it
    # ... and the replacement has its host function, self, asyncio and the handed object.
    assert "42 True True False" in parent_seen, parent_seen
    assert "True True 5 False" in seen, seen
    # The status line lists what exists after the kill: no longer `mine`.
    after_kill = next(texts(r) for r in sub if "lost variables" in texts(r))
    status = re.findall(r"<status [^>]*>", after_kill)[-1]
    assert "mine" not in status, status
