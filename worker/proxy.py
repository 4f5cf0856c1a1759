"""Stand-ins in the worker for things that live in the coordinator.

Host functions (tools given to ``make_agent(functions=...)``) appear as stubs with the same
name, signature and docstring; calling one runs the real function in the coordinator and
returns its value or raises ``HostError`` with its message.  ``self`` is a stub of the agent
with the seed's API.  Handing objects to a sub-agent happens here too: plain data goes by
value, host stubs by name, anything else is pickled with cloudpickle inside this worker —
the coordinator only relays the bytes.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .capture import current_block
from .contract.framing import encode
from .contract.limits import MAX_FRAME
from .contract.wire import HostFunction, Item

__all__ = ["AgentHandle", "AgentSelf", "Call", "HOST_ATTR", "export", "host_stub", "inject"]

Call = Callable[[str, list, dict, "str | None"], Future]

HOST_ATTR = "__agentloop_host__"
_PLAIN = (type(None), bool, int, float, str, bytes)


def _wait(future: Future) -> Any:
    # Short waits in a loop, so a cancellation raised into this thread lands promptly.
    while True:
        try:
            return future.result(0.1)
        except FutureTimeout:
            continue


def _signature(text: str) -> inspect.Signature | None:
    scope: dict[str, Any] = {}
    try:
        exec(compile(f"from __future__ import annotations\ndef _f{text}: pass", "<sig>", "exec"), scope)
        return inspect.signature(scope["_f"])
    except Exception:  # noqa: BLE001 - a signature we cannot rebuild is shown as (...)
        return None


def host_stub(call: Call, spec: HostFunction) -> Callable:
    """A callable that forwards to host function ``spec.name``."""
    name = spec.name
    if spec.is_async:
        async def stub(*args, **kwargs):
            return await asyncio.wrap_future(call(name, list(args), kwargs, current_block.get()))
    else:
        def stub(*args, **kwargs):
            return _wait(call(name, list(args), kwargs, current_block.get()))
    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = spec.doc or None
    stub.__module__ = "agentloop.host"
    signature = _signature(spec.signature or "(*args, **kwargs)")
    if signature is not None:
        stub.__signature__ = signature  # type: ignore[attr-defined]
    setattr(stub, HOST_ATTR, name)
    return stub


def _is_plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if depth > 20:
        return False
    if type(value) in (list, tuple):
        return all(_is_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def export(namespace: dict, names: list[str]) -> tuple[dict, dict]:
    """(items, errors) for handing ``names`` to a sub-agent; errors name what cannot go."""
    items: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for name in names:
        if name not in namespace:
            errors[name] = f"no object named {name!r} in your namespace"
            continue
        value = namespace[name]
        host = getattr(value, HOST_ATTR, None)
        if isinstance(host, str):
            items[name] = {"kind": "host", "name": host}
        elif _is_plain(value):
            items[name] = {"kind": "value", "value": value}
        else:
            try:
                import cloudpickle

                items[name] = {"kind": "pickle", "data": cloudpickle.dumps(value)}
            except Exception as exc:  # noqa: BLE001 - anything pickling raises is the model's to know
                errors[name] = f"{name!r} ({type(value).__name__}) cannot be handed over: {exc}"
    size = len(encode(items)) if items else 0
    if size > MAX_FRAME // 2:
        errors["*"] = f"the objects to hand over take {size >> 20} MiB; pass less or write a file"
    return items, errors


def inject(namespace: dict, items: dict[str, Item]) -> list[str]:
    """Put handed-over objects into ``namespace`` (plain data and pickles: a host function is
    bound, not injected); returns their names."""
    for name, item in items.items():
        if item.kind == "value":
            namespace[name] = item.value
        elif item.kind == "pickle":
            import cloudpickle

            namespace[name] = cloudpickle.loads(item.data)
    return list(items)


class AgentHandle:
    """A sub-agent started with ``self.run_agent``: ``done()``, ``result()``, ``cancel()``,
    ``new_task()``, ``cost()``, ``status()``; ``await handle`` waits for its answer."""

    def __init__(self, call: Call, name: str) -> None:
        self._call = call
        self.name = name

    def _host(self, op: str, *args: Any) -> Any:
        return _wait(self._call(f"self.{op}", [self.name, *args], {}, current_block.get()))

    def done(self) -> bool:
        """True once the sub-agent has finished (answered, failed or was cancelled)."""
        return bool(self._host("agent_done"))

    def result(self) -> str:
        """Its final answer; raises if it is still working (await the handle instead)."""
        return self._host("agent_result")

    def cancel(self) -> None:
        """Cancels this sub-agent."""
        self._host("agent_cancel")

    def new_task(self, task: str) -> AgentHandle:
        """Asks a follow-up that continues this sub-agent's existing context and namespace."""
        self._host("agent_new_task", task)
        return self

    def cost(self) -> dict:
        """Its resource use so far: {context, generated, cost, seconds}."""
        return self._host("agent_cost")

    def status(self) -> str:
        return self._host("agent_status")

    def __await__(self):
        future = self._call("self.agent_wait", [self.name], {}, current_block.get())
        return asyncio.wrap_future(future).__await__()

    def __repr__(self) -> str:
        return f"<sub-agent {self.name!r}>"


class AgentSelf:
    """The agent running this code.  Its methods act on the conversation in the coordinator."""

    def __init__(self, call: Call, namespace: dict) -> None:
        self._call = call
        self._namespace = namespace

    def _host(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return _wait(self._call(f"self.{op}", list(args), kwargs, current_block.get()))

    def compact_knowledge(self, summary: str) -> None:
        """Replaces your whole working context with `summary`, keeping what you learned but dropping the raw
        history to free context. Put every fact, decision and next step you still need into it — the rest is lost."""
        self._host("compact_knowledge", str(summary))

    def cancel_subagents(self) -> None:
        """Cancels every sub-agent you spawned that is still running."""
        self._host("cancel_subagents")

    def run_agent(self, task: str, name: str = "sub", context: str = "", namespace: dict | None = None,
                  heartbeat: str = "", model: str = "", fork: bool = False) -> AgentHandle:
        """Starts task in a fresh background sub-agent (its own context) and returns its handle instantly — never
        await it. Its final answer arrives by itself as <agent_result name=...>; heartbeat="30s" streams
        <agent_status> heartbeats while it works. namespace={...} gives it the tools/objects its code needs;
        fork=True instead starts it in a copy of your worker, which holds your whole namespace as it is now;
        context="..." seeds it with what an earlier agent learned so it doesn't start from scratch;
        model="flash"/"gpt"/... runs it on a different model (default: your own)."""
        items, errors = export(dict(namespace or {}), list(namespace or {})) if not fork else ({}, {})
        if errors:
            raise ValueError("; ".join(errors.values()))
        actual = self._host("run_agent", str(task), name=str(name), context=str(context), items=items,
                            heartbeat=str(heartbeat), model=str(model), fork=bool(fork))
        return AgentHandle(self._call, actual)

    def cost(self) -> dict:
        """Resource use so far: {context, generated, cost, seconds}. Works on yourself (self.cost()) or a handle."""
        return self._host("cost")

    def status(self) -> str:
        return self._host("status")

    def __repr__(self) -> str:
        return "<agent self>"
