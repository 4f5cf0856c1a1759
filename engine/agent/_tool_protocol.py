"""The first seed's protocol on the same engine: native tool calls instead of text tags.

The model gets function tools: ``run_code`` and ``run_agent`` (the tags' attributes as
arguments), ``wait``, and every host function as a tool of its own.  What runs is the same as
with tags — the same workers, namespaces, concurrency, heartbeats, hard kills and sub-agents.

How concurrency maps onto a protocol that demands an answer for every call before the next
request: after launching a reply's calls the agent waits for the *first event* (a block or
sub-agent finishing, or a heartbeat), exactly as with tags.  Then every call is answered:
with its result when it has finished, else with its status so far (the ``<running>`` text).
What finishes later reaches the model in the next message as the same ``<run_code_result>`` /
``<agent_result>`` text the tags protocol uses, carrying the id the call's answer named (the
block id defaults to the call's id), or as the answer of a ``wait`` call.  A reply with no
tool call while things run means "keep going", as a plain-text reply does with tags.

Models that ignore the tools: ``<run_code>``/``<run_agent>`` tags in the content are run as
with the tags protocol; ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks in
the content (some local servers leave them there) are run as calls and answered in the next
user message, since they have no call id to answer.

An endpoint that says it cannot take tools (llama-server's ``/props`` for a chat template
without tool support, Ollama's ``/api/show`` capabilities) would drop the definitions without
an error and get prose back; the agent says so in one line and speaks the tags protocol
instead.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from typing import Any

from engine.agent import _tags as tags
from engine.agent._code_task import CodeTask, task_text
from engine.agent._loop import Agent
from engine.durations import DEFAULT_BLOCK_TIMEOUT, parse_duration
from engine.errors import AgentError, ConfigError, WorkerError
from engine.models import ServerInfo, strip_think
from engine.tools import MAX_RESULT, execute_tool_call_async, parse_arguments, schema_for
from worker.contract.bounded_json import loads as bounded_loads

__all__ = ["ENGINE_TOOLS", "GUIDE", "ToolAgent", "embedded_calls"]

GUIDE = """You are an AI agent that solves tasks by running Python code and starting sub-agents through your tools.
- run_code(code, id?, timeout?, heartbeat?) runs Python in your persistent namespace (variables, imports and functions persist). What you print comes back, and what you display: display(obj), plt.show() and figures still open at the end come back as images. Several run_code calls in one reply run concurrently. Top-level await works. timeout defaults to 10s; past it the code is killed.
- A call still running when you are answered returns its status so far (<running id=...>); its final <run_code_result id=...> arrives later by itself. Call wait() to block until something finishes, or reply in plain text to let things keep going.
- run_agent(task, name?, namespace?, model?, context?, heartbeat?, fork?) starts a sub-agent in a fresh context and returns at once; its answer arrives as <agent_result name=...>. namespace lists objects of yours to hand over ("a,b"); fork=true starts it in a copy of your worker instead, holding your whole namespace.
- self.compact_knowledge("...") in code replaces your whole history with that text; self.run_agent(...) starts a sub-agent from code.
- Prefer your provided tools over reimplementing them. Work in small steps.
- When the task is solved and nothing of yours is running, reply in plain text without tool calls. That is your final answer."""

_DURATION = {"type": "string", "description": "a duration like 250ms, 30s, 5m"}
ENGINE_TOOLS = [
    {"type": "function", "function": {
        "name": "run_code",
        "description": "Run Python code in your persistent namespace; returns what it printed.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the Python code"},
            "id": {"type": "string", "description": "name for this block, echoed on its result"},
            "timeout": {**_DURATION, "description": "deadline (default 10s); the code is killed past it"},
            "heartbeat": {**_DURATION, "description": "stream partial output this often while it runs"},
        }, "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "run_agent",
        "description": "Start a sub-agent on a task in a fresh context; returns at once, its answer arrives later.",
        "parameters": {"type": "object", "properties": {
            "task": {"type": "string", "description": "what the sub-agent should do"},
            "name": {"type": "string", "description": "its name (default sub)"},
            "namespace": {"type": "string", "description": "comma-separated names of your objects to hand over"},
            "model": {"type": "string", "description": "model alias for it (default: yours)"},
            "context": {"type": "string", "description": "what you already know that it should use"},
            "heartbeat": {**_DURATION, "description": "send its status this often while it works"},
            "fork": {"type": "boolean", "description": "start it in a copy of your worker, holding your whole "
                                                       "namespace (only while none of your code runs)"},
        }, "required": ["task"]}}},
    {"type": "function", "function": {
        "name": "wait",
        "description": "Wait until something you started finishes or reports; returns what arrived.",
        "parameters": {"type": "object", "properties": {
            "timeout": {**_DURATION, "description": "longest wait (default 30s)"},
        }}}},
]

_EMBEDDED_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def embedded_calls(content: str) -> tuple[str, list[dict]]:
    """Tool calls a server left in the content as ``<tool_call>{json}</tool_call>``: the content
    without them, and the calls in OpenAI shape (ids made up here)."""
    calls = []
    for match in _EMBEDDED_CALL.finditer(content):
        try:
            data = bounded_loads(match.group(1))
        except ValueError:  # not JSON, or beyond the bounds: the call's words say it
            data = {"name": "?", "arguments": match.group(1)}
        if not isinstance(data, dict):
            continue
        arguments = data.get("arguments", data.get("parameters", {}))
        calls.append({"id": f"call_{secrets.token_hex(4)}", "type": "function", "function": {
            "name": str(data.get("name", "")),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    return _EMBEDDED_CALL.sub("", content).strip(), calls


def _answer_the_rest(messages: list[dict]) -> None:
    """Answer the calls of the last assistant message that have no answer yet (a run ended while
    they were being answered: Ctrl-C in ``chat``), so the transcript stays one a strict server
    takes for the next question."""
    for position in range(len(messages) - 1, 0, -1):
        message = messages[position]
        if message.get("role") == "tool":
            continue
        if message.get("role") == "assistant" and message.get("tool_calls"):
            answered = {m.get("tool_call_id") for m in messages[position + 1:]}
            for call in message["tool_calls"]:
                if call.get("id") not in answered:
                    messages.append({"role": "tool", "tool_call_id": call.get("id"),
                                     "content": "[cancelled: the run ended before this call was answered]"})
        return


class _Pending:
    """A tool call whose answer depends on something still running."""

    def __init__(self, call_id: str, work: Any) -> None:
        self.call_id = call_id
        self.work = work  # a CodeTask or a sub-agent


class ToolAgent(Agent):
    """An agent driven through OpenAI tool calls; everything else is the tags agent's."""

    guide = GUIDE

    def _tool_schemas(self) -> list[dict]:
        return [*ENGINE_TOOLS, *(schema_for(name, fn) for name, fn in self.functions.items())]

    def adapt(self, server: ServerInfo) -> None:
        """As the tags agent's, and fall back to the tags protocol (its guide in the system
        prompt, its loop) when the endpoint says it cannot take tools."""
        super().adapt(server)
        if server.supports_tools is False and self.protocol == "tools":
            self.protocol = "tags"
            self.guide = tags.SYSTEM
            if self.first_on_endpoint():
                self._event("note", message=f"the endpoint cannot take tools ({server.tools_source} is "
                                            "false): using the tags protocol instead of tools")

    async def run(self, task: str, max_messages: int | None = None) -> str:
        await self.start()
        if self.protocol != "tools":  # the endpoint cannot take tools (see adapt)
            return await super().run(task, max_messages)
        chat = self.chat
        assert chat is not None
        tools = self._tool_schemas()
        limit = max_messages or self.max_messages
        try:
            pending_user = self.intro + task
            images: list[dict[str, Any]] = []
            for _ in range(limit):
                self.messages_sent += 1
                self._last_message = time.monotonic()
                if pending_user:
                    # (a joined user message: many chat templates require the roles to alternate)
                    chat.add_user(pending_user, images)
                images = []
                self._event("sent", message=pending_user, count=len(chat.messages))
                reply = await chat.request(chat.messages, tools=tools, tool_choice="auto")
                compactions = chat.compactions  # code still running may compact from here on
                content, cut = tags.cut_hallucinated(strip_think(reply.get("content") or ""))
                calls = [c for c in reply.get("tool_calls") or [] if isinstance(c, dict)]
                content, loose = embedded_calls(content) if not calls else (content, [])
                assistant: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    for call in calls:
                        call.setdefault("id", f"call_{secrets.token_hex(4)}")
                    assistant["tool_calls"] = calls
                chat.messages.append(assistant)
                self._event("replied", message=content, stats=chat.stats, latency=chat.last_latency,
                            finish_reason=chat.last_finish_reason, reasoning=chat.last_reasoning)
                await self.process_llm_response(content)  # tags in the content still run
                self.check_length(content, invented=cut)
                answers = await self._answer_calls(calls)
                loose_answers = await self._answer_calls(loose)
                if chat.compactions != compactions:
                    # The code of a call replaced the history (compact_knowledge): the calls it
                    # answers are gone with it, so a tool message now would answer nothing.  Their
                    # answers reach the model as text, as calls without an id do.
                    loose_answers, answers, calls = answers + loose_answers, [], []
                for call_id, text in answers:
                    chat.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
                if self.empty_reply(content, calls=bool(calls or loose_answers)):
                    pending_user = self.next_message() + self.context_note()
                    images = self.take_images()
                    continue
                if not calls and not loose_answers and self.is_completed():
                    return content
                if not calls and not loose_answers:
                    await self.wait_first_event()
                    await asyncio.sleep(0)
                extra = "".join(f"<tool_result call={cid}>\n{text}\n</tool_result>\n" for cid, text in loose_answers)
                pending_user = extra + self.next_message()
                # Images of results answered in tool messages go in the user message after them
                # (OpenAI refuses images in a tool message).
                images = self.take_images()
                if images and not pending_user:
                    pending_user = "The images the results above displayed, in order:\n"
                if calls and not pending_user:
                    # Nothing to add: the status note rides on the last tool answer.
                    chat.messages[-1]["content"] += "\n" + self.context_note()
                else:
                    pending_user += self.context_note()
            raise AgentError(f"stopped after {limit} tool rounds without a final answer — ask a narrower "
                             "question or raise --max-messages")
        finally:
            _answer_the_rest(chat.messages)
            await self.settle()

    async def _answer_calls(self, calls: list[dict]) -> list[tuple[str, str]]:
        """Start every call, wait for the first event if something runs, then answer each."""
        pending: list[_Pending] = []
        answers: dict[str, str] = {}
        waits: list[tuple[str, float]] = []
        for call in calls:
            call_id = call["id"]
            fn = call.get("function") or {}
            name = fn.get("name", "")
            if name in ("run_code", "run_agent", "wait"):
                args = parse_arguments(fn.get("arguments"))
                if isinstance(args, str):
                    answers[call_id] = args
                    continue
                try:
                    if name == "run_code":
                        pending.append(_Pending(call_id, self._launch_code(call_id, args)))
                    elif name == "run_agent":
                        pending.append(_Pending(call_id, await self._launch_agent(args)))
                    else:
                        waits.append((call_id, parse_duration(args.get("timeout") or None, 30.0)))
                except (ConfigError, AgentError, WorkerError, KeyError, TypeError, ValueError) as exc:
                    answers[call_id] = f"[agent] {name} failed: {exc}"
            elif name in self.functions:
                answers[call_id] = await execute_tool_call_async(call, self.functions, MAX_RESULT)
            else:
                known = ", ".join([*(t["function"]["name"] for t in ENGINE_TOOLS), *self.functions])
                answers[call_id] = f"[agent] unknown tool {name!r} — available: {known}"
        if pending:
            await self._first_event([p.work for p in pending])
            for p in pending:
                answers[p.call_id] = self._status_or_result(p.work)
        for call_id, timeout in waits:
            answers[call_id] = await self._wait_tool(timeout)
        return [(call["id"], answers[call["id"]]) for call in calls]

    def _launch_code(self, call_id: str, args: dict) -> CodeTask:
        code = args["code"]
        if not isinstance(code, str):
            raise TypeError("code must be a string")
        request = tags.CodeRequest(id=str(args.get("id") or call_id), code=code,
                                   timeout=parse_duration(args.get("timeout") or None, DEFAULT_BLOCK_TIMEOUT),
                                   heartbeat=parse_duration(args.get("heartbeat") or None), attrs=args)
        if any(b.id == request.id and b.is_running() for b in self.blocks):
            raise AgentError(f"id={request.id} already running, not restarted")
        self.start_block(request)
        return self.blocks[-1]

    async def _launch_agent(self, args: dict) -> Agent:
        names = args.get("namespace") or []
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        return await self.start_agent(str(args["task"]), name=str(args.get("name") or "sub"),
                                      context=str(args.get("context") or ""), namespace_names=list(names),
                                      heartbeat=parse_duration(args.get("heartbeat") or None),
                                      model=str(args.get("model") or ""), fork=args.get("fork") is True)

    async def _first_event(self, works: list[Any]) -> None:
        tasks = [w.task for w in works if w.task is not None]
        if all(t.done() for t in tasks):
            return
        await self.until_event(tasks, inbox_seen=len(self.inbox))  # heartbeats: at the floor's pace
        await asyncio.sleep(0)

    def _status_or_result(self, work: Any) -> str:
        """The call's answer: the finished result (taken out of what is still owed), or the status."""
        if work.task.done():
            self.pictures.collect(work)
            if work in self.blocks:
                self.blocks.remove(work)
            if work in self.sub_agents:
                self.sub_agents.remove(work)
            return task_text(work.task)  # the same words the tags protocol sends
        if isinstance(work, CodeTask):
            return (work.heartbeat() + f"(still running; its <run_code_result id={work.id}> will arrive later — "
                    "call wait() for it or reply in plain text to keep going)")
        return (f"(sub-agent {work.name} started and working; its <agent_result name={work.name}> will arrive "
                "later — call wait() for it)")

    async def _wait_tool(self, timeout: float) -> str:
        if not self.blocks and not self.sub_agents and not self.inbox:
            return "nothing of yours is running"
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.wait_first_event(), timeout)
        except TimeoutError:
            pass
        return self.next_message() or f"nothing arrived within {time.monotonic() - started:.0f}s"
