"""The agent: the seed's code-block conversation loop, with every block in a worker.

``Agent.run`` keeps the seed's semantics exactly: send, launch every ``<run_code>`` and
``<run_agent>`` of the reply, wait for the first event, send back the inbox plus the results
that finished, until the model replies in plain text with nothing running.  What changes is
where things run: each agent owns a worker (its persistent namespace); each sub-agent gets a
fresh context and a worker of its own.  Host functions run here, in the coordinator; code in
the worker reaches them, and ``self``, through stubs.

Cancellation (trio's rule, kept by hand): a block or sub-agent cancelled *by the model*
(``cancel_subagents``, ``handle.cancel()``) still reports, as ``[cancelled]``; only the end of
the whole run cancels tasks outright, and then nobody reads their results.

What the model's code asks for is bounded, so no reply can flood the coordinator or the model:
heartbeats come at most every ``HEARTBEAT_FLOOR`` and are coalesced (one pending report per
block or sub-agent, all of them in one message, and never more than one message per floor
interval caused by heartbeats); one run has at most ``max_subagents`` sub-agents working at
once, and the model is told so in words beyond that, and starts ``subagents.MAX_STARTED`` at
most, named in ``MAX_AGENT_NAME`` characters (the run keeps them all); and the live display
gets each output line cut to ``DISPLAY_LINE_BYTES``, so a line of any length costs nothing.

A reply the server cut at the length cap (``finish_reason: "length"``) is never taken as the
answer: what it completed runs, the model is told where it was cut and continues; so with an
empty reply (``reply_guard``).

While the worker starts, the model's endpoint is asked what it serves (``model_server``): a
context window the configuration leaves out is taken from the server, and the connection the
first request uses is opened then.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace
from typing import Any

from engine.agent import _tags as tags
from engine.agent._code_task import (
    HEARTBEAT_FLOOR,
    BlockHost,
    CodeTask,
    heartbeat_interval,
    host_spec,
    task_text,
    words,
)
from engine.agent._display import AgentDisplay
from engine.agent._pictures import Pictures
from engine.agent._reply_guard import ReplyGuard
from engine.agent._self_api import self_call
from engine.agent._subagents import SubagentBudget, subagent_limit
from engine.errors import AgentError, ConfigError
from engine.models import Chat, ClientPool, ModelConfig, ModelRegistry, ServerInfo, connect
from engine.workers import Engine, Worker
from worker.contract import wire

__all__ = ["Agent", "DEFAULT_REMIND_AT", "MAX_AGENT_NAME", "STOP_SEQUENCES"]

#: Characters of a sub-agent's name, at most.
MAX_AGENT_NAME = 64

#: Stop sequences: a model starting a result tag on a new line is inventing output.
#: Only at a line start, so code that merely mentions a tag is not cut by the server.
STOP_SEQUENCES = [f"\n{tag}" for tag in tags.HALLUCINATION_STOPS]
#: Compaction reminder threshold when the model's context window is unknown.
DEFAULT_REMIND_AT = 16_000


class Agent:
    """Conversation loop, block runtime and the API exposed (as ``self``) to code the model writes."""

    def __init__(self, *, engine: Engine, models: ModelRegistry, model: ModelConfig | str | None = None,
                 functions: Mapping[str, Callable] | None = None, display: AgentDisplay | None = None,
                 depth: int = 0, max_depth: int = 3, name: str = "main", context: str = "",
                 max_messages: int = 200, handed: Mapping[str, wire.Item] | None = None,
                 chat_factory: Callable[..., Chat] | None = None, protocol: str | None = None,
                 max_subagents: int | None = None, subagent_budget: SubagentBudget | None = None,
                 agent_factory: Callable[..., Agent] | None = None, forked_from: Agent | None = None) -> None:
        self.engine = engine
        self.models = models
        self.model = model if isinstance(model, ModelConfig) else models.get(model)
        self.functions = dict(functions or {})
        self.display = display or AgentDisplay()
        self.depth = depth
        self.max_depth = max_depth
        self.name = name
        self.context = context
        self.max_messages = max_messages
        self.intro = (f"Context handed to you by your caller — use it, do not re-derive it:\n{context}\n\n"
                      if context else "")
        self._handed = dict(handed or {})
        self._chat_factory = chat_factory or Chat
        # How sub-agents are made (``engine.agent.make_agent`` picks the class by protocol);
        # handed in, so this module never imports the protocols built on it.
        self._agent_factory = agent_factory or type(self)
        self._protocol_override = protocol  # --protocol: applies to sub-agents too
        self.protocol = protocol or self.model.protocol
        self.worker: Worker | None = None
        #: The agent whose worker this one's is a fork of (``<run_agent fork>``), if any.
        self.forked_from = forked_from
        self.chat: Chat | None = None
        self.blocks: list[CodeTask] = []
        self.sub_agents: list[Agent] = []
        self.children: dict[str, Agent] = {}
        self.inbox: list[str] = []
        #: Heartbeat reports not delivered yet, by source: a newer one replaces the older.
        self._reports: dict[Hashable, str | Callable[[], str]] = {}
        self._last_message = time.monotonic()  # when the last message to the model was made
        #: Shared with every sub-agent below: the run's limit on sub-agents working at once.
        self.subagent_budget = subagent_budget or SubagentBudget(
            subagent_limit.get() if max_subagents is None else max_subagents)
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self._inner: asyncio.Task | None = None
        self.start_time: float | None = None
        self.heartbeat_interval: float | None = None
        self._parent_on_heartbeat: Callable[[str], None] | None = None
        self.supervisor: Agent | None = None
        self.result_value: str | None = None
        self.released = False  # its worker was closed to make room for newer sub-agents
        self.messages_sent = 0
        self.replies = ReplyGuard()  # cut and empty replies in a row
        self.server = ServerInfo()  # what the endpoint said about itself, once started
        self._block_ids = itertools.count(1)
        self.pictures = Pictures()  # what finished blocks displayed, for the next message

    # -- set-up -------------------------------------------------------------------------------
    def _event(self, type: str, **fields: Any) -> None:
        self.display.event(type, name=self.name, **fields)

    async def start(self) -> None:
        """Start this agent's worker, give it its tools and ``self``, write the system prompt."""
        if self.chat is not None:
            return
        # The client is made and the endpoint asked about itself while the worker starts: both
        # cost tens of milliseconds that would otherwise delay the first request.
        endpoint = asyncio.ensure_future(connect(self.model))
        try:
            names: tuple[str, ...] = ()
            if self.worker is not None:  # a fork's copy: bound as its parent's, holding its namespace
                names = tuple(self.worker.vars)
            else:
                self.worker = await self.engine.start_worker(self.name, on_call=self._on_call)
                for note in self.worker.notes:
                    self._event("note", message=note)
                await self.worker.request(wire.Bind(tuple(host_spec(n, f) for n, f in self.functions.items()),
                                                    agent=True), keep=True)
                if self._handed:
                    names = (await self.worker.request(wire.Inject(self._handed), keep=True)).names
            env = await self.worker.request(wire.Env())
            descriptions = [tags.describe_object(n, f) for n, f in self.functions.items()]
            if names:
                descriptions += (await self.worker.request(wire.Describe(names))).entries
            client, self.server = await endpoint
        except BaseException:
            endpoint.cancel()
            await asyncio.wait([endpoint])
            if not endpoint.cancelled() and endpoint.exception() is None:
                await ClientPool.release(endpoint.result()[0])
            raise
        self.adapt(self.server)
        system = tags.build_system(
            model_alias=self.model.alias, model=self.model.model,
            available_models=self.models.describe({self.model.alias: self.model}),
            python=env.python, os=env.os, cpu=env.cpu, ram=env.ram, packages=list(env.packages),
            namespace_block=tags.describe_namespace(descriptions),
            minimal=os.environ.get("AGENT_MINIMAL_SYSTEM") == "1", guide=self.guide,
            files=self.writable_places())
        self.chat = self._chat_factory(system, self.model, display=self.display, name=self.name,
                                       stop=STOP_SEQUENCES, client=client)

    def writable_places(self) -> str:
        """Where this agent's code may write, in one line (the system prompt's ``Files:``)."""
        engine = self.engine
        return tags.writable_places(str(engine.cwd), str(engine.workspace), engine.settings.sandbox.mode != "none")

    def adapt(self, server: ServerInfo) -> None:
        """Take in what the endpoint reported: its context window where the configuration sets
        none, and a note when the model id is not one it serves.  Says what it learned in an
        ``endpoint`` event."""
        if server.context_window and not self.model.context_window:
            self.model = replace(self.model, context_window=server.context_window)
        if server.vision is not None and self.model.vision is None:
            self.model = replace(self.model, vision=server.vision)
        served, words = server.check_id(self.model.model)
        if words and (not served or server.single_model) and self.first_on_endpoint():
            self._event("note", message=words)
        if server.answered:
            self._event("endpoint", model=self.model.alias, kind=server.kind, context_window=server.context_window,
                        context_source=server.context_source, supports_tools=server.supports_tools,
                        model_ids=list(server.model_ids or ()), vision=self.model.vision)

    def first_on_endpoint(self) -> bool:
        """Whether this agent is the first of its run on its model: notes about the endpoint are
        said once, not again by every sub-agent that uses it."""
        parent = self.supervisor
        return parent is None or (parent.model.base_url, parent.model.model) != (self.model.base_url,
                                                                                 self.model.model)

    async def close(self) -> None:
        """Stop everything of this agent and its sub-agents; close their workers and clients."""
        self.shutdown()
        tasks = [t for t in [self.task, *(b.task for b in self.blocks)] if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(child.close() for child in self.children.values()), return_exceptions=True)
        if self.worker is not None:
            await self.worker.close()
        if self.chat is not None:
            await self.chat.aclose()

    #: The format guide at the top of the system prompt.
    guide: str = tags.SYSTEM

    # -- the seed's loop -------------------------------------------------------------------------
    def on_heartbeat(self, report: str | Callable[[], str], key: Hashable | None = None) -> None:
        """Queue a heartbeat report (text, or a function that writes it at delivery; "" means
        nothing to say any more).  A report of the same ``key`` not yet delivered is replaced."""
        self._reports[key if key is not None else object()] = report
        self.wake.set()

    def steer(self, text: str) -> None:
        """Deliver a note from the user to the model with the next message."""
        self.inbox.append(tags.format_steer(text))
        self.wake.set()

    async def process_llm_response(self, reply: str) -> None:
        """Launch everything the reply asks for; queue words for what cannot run.  Never raises."""
        parsed = tags.parse_reply(reply)
        self.inbox.extend(parsed.errors)
        # Forks first: they copy the namespace as the reply found it, before its blocks run.
        for request in [r for r in parsed.agents if r.fork]:
            await self._start_requested(request)
        for request in parsed.code:
            self.start_block(request)
        for request in [r for r in parsed.agents if not r.fork]:
            await self._start_requested(request)

    async def _start_requested(self, request: tags.AgentRequest) -> None:
        """Start the sub-agent of one ``<run_agent>``; words in the inbox if it cannot start."""
        try:
            await self.start_agent(request.task, name=request.name, context=request.context,
                                   namespace_names=request.namespace, heartbeat=request.heartbeat,
                                   model=request.model, fork=request.fork)
        except Exception as error:  # noqa: BLE001 - the model reads why, the loop goes on
            self._event("failed", message=f"sub-agent {request.name}: {error}")
            self.inbox.append(tags.format_agent_start_failed(request.name, error))

    def start_block(self, request: tags.CodeRequest) -> None:
        block_id = request.id or f"b{next(self._block_ids)}"
        if any(b.id == block_id and b.is_running() for b in self.blocks):
            self._event("failed", message=f"id={block_id} already running, not restarted")
            self.inbox.append(tags.format_already_running(block_id))
            return
        host = BlockHost(self.worker, self._event, lambda report, key: self.on_heartbeat(report, key=key),
                         self.writable_places, self.engine.settings.sandbox, self.engine.workspace)
        block = CodeTask(host, request, block_id)
        self._event("launched", id=block_id, timeout=request.timeout, heartbeat=block.interval,
                    code=request.code)
        self.blocks.append(block)

    def next_message(self) -> str:
        """Everything to send back this turn: the inbox, the heartbeat reports, then results of
        what just finished."""
        done = [w for w in [*self.blocks, *self.sub_agents] if w.task.done()]
        for work in done:
            self.pictures.collect(work)
        self.blocks = [b for b in self.blocks if not b.task.done()]
        self.sub_agents = [a for a in self.sub_agents if not a.task.done()]
        events, self.inbox = self.inbox, []
        reports, self._reports = self._reports, {}
        self._last_message = time.monotonic()
        events += [report() if callable(report) else report for report in reports.values()]
        return "".join(events + [task_text(w.task) for w in done])

    def take_images(self) -> list[dict[str, Any]]:
        """The images for the next message: the PNGs finished blocks displayed (``Pictures``)."""
        return self.pictures.take(self.model, self.chat)

    def is_completed(self) -> bool:
        return not self.blocks and not self.sub_agents and not self.inbox

    async def wait_first_event(self) -> None:
        await self.until_event([w.task for w in [*self.blocks, *self.sub_agents]])

    async def until_event(self, tasks: list[asyncio.Future], inbox_seen: int = 0) -> None:
        """Wait until one of ``tasks`` is done, the inbox holds more than ``inbox_seen`` notes,
        or heartbeat reports are due: they wait until ``HEARTBEAT_FLOOR`` has passed since the
        last message, so heartbeats alone never cause more than one message per interval."""
        while tasks and len(self.inbox) <= inbox_seen and not any(t.done() for t in tasks):
            due = None
            if self._reports:
                due = self._last_message + HEARTBEAT_FLOOR - time.monotonic()
                if due <= 0:
                    return
            self.wake.clear()
            waker = asyncio.ensure_future(self.wake.wait())
            try:
                await asyncio.wait([*tasks, waker], timeout=due, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waker.cancel()

    def check_length(self, reply: str, *, invented: bool = False) -> None:
        """After a reply: when the server cut it at the length cap, the model is told (the run
        cannot end on it); see ``ReplyGuard.after_cut``."""
        assert self.chat is not None
        told = self.replies.after_cut(self.chat.last_finish_reason, self.chat.last_max_tokens, reply,
                                      invented=invented)
        if told is not None:
            self._event("note", message=f"the reply was cut at the length cap ({self.chat.last_max_tokens} "
                                        "tokens); the model is told")
            self.inbox.append(told)

    def empty_reply(self, reply: str, *, calls: bool = False) -> bool:
        """After each reply: True when it would end the run but is empty, and the model was told
        so (``ReplyGuard.after_empty``); the loop goes on."""
        told = self.replies.after_empty(reply, calls=calls, would_end=self.is_completed())
        if told is None:
            return False
        self._event("note", message="the reply was empty; the model is told")
        self.inbox.append(told)
        return True

    def context_note(self) -> str:
        chat = self.chat
        assert chat is not None and self.worker is not None
        note = tags.format_status(chat.context, chat.cost, chat.last_latency, self.worker.var_notes)
        window = self.model.context_window
        remind_at = min(DEFAULT_REMIND_AT, window // 2) if window else DEFAULT_REMIND_AT
        if chat.context > remind_at:
            note += tags.compaction_reminder()
        return note

    async def run(self, task: str, max_messages: int | None = None) -> str:
        """The conversation loop: until the model answers in plain text with nothing running."""
        await self.start()
        assert self.chat is not None
        try:
            message = self.intro + task
            for _ in range(max_messages or self.max_messages):
                self.messages_sent += 1
                self._last_message = time.monotonic()
                reply = await self.chat.send(message, self.take_images())
                reply, cut = tags.cut_hallucinated(reply)
                if cut:
                    self.chat.messages[-1]["content"] = reply  # the transcript keeps what was acted on
                await self.process_llm_response(reply)
                self.check_length(reply, invented=cut)
                if self.empty_reply(reply):
                    message = self.next_message() + self.context_note()
                    continue
                if self.is_completed():
                    return reply
                await self.wait_first_event()
                await asyncio.sleep(0)
                message = self.next_message() + self.context_note()
            raise AgentError(f"Task unfinished after {max_messages or self.max_messages} messages")
        finally:
            await self.settle()

    def shutdown(self) -> None:
        """Cancel every running block and sub-agent (their results are not wanted any more)."""
        for block in self.blocks:
            block.task.cancel()
        for agent in self.sub_agents:
            if agent.task is not None and not agent.task.done():
                agent.task.cancel()

    async def settle(self) -> None:
        """``shutdown()`` and wait until all of it has stopped; the next ``run()`` starts clean."""
        self.shutdown()
        tasks = [w.task for w in [*self.blocks, *self.sub_agents] if w.task is not None]
        if tasks:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        self.blocks, self.sub_agents, self.inbox, self._reports = [], [], [], {}

    # -- sub-agents ------------------------------------------------------------------------------
    def _unique_name(self, base: str) -> str:
        name, suffix = base, 2
        while name in self.children:
            name = f"{base}{suffix}"
            suffix += 1
        return name

    async def start_agent(self, task: str, *, name: str = "sub", context: str = "",
                          namespace_names: list[str] | None = None, items: Mapping[str, wire.Item] | None = None,
                          heartbeat: float | None = None, model: str = "", fork: bool = False,
                          caller: str | None = None) -> Agent:
        """Start a sub-agent in a fresh context and a worker of its own; returns once its worker
        exists.  ``fork``: that worker is a fork of this agent's (``Worker.fork``), holding the
        whole namespace, instead of a new one handed ``namespace_names``/``items``; ``caller``: the
        block asking, through ``self.run_agent``, which may be running."""
        if self.depth >= self.max_depth:
            raise AgentError(f"max delegation depth {self.max_depth} reached — do this part yourself "
                             "instead of delegating")
        name = name or "sub"
        if not isinstance(name, str) or len(name) > MAX_AGENT_NAME:
            raise AgentError(f"a sub-agent's name is a string of at most {MAX_AGENT_NAME} characters")
        self.subagent_budget.check()  # before any work for it; start_task takes the slot
        self.subagent_budget.count_start()
        await self.subagent_budget.make_room()
        if fork:
            namespace_names, items = None, None  # (the copy holds them all)
        if namespace_names:
            assert self.worker is not None
            exported = await self.worker.request(wire.Export(tuple(namespace_names)))
            if exported.errors:
                raise AgentError("; ".join(exported.errors.values()))
            items = exported.items
        functions: dict[str, Callable] = dict(self.functions) if fork else {}
        handed: dict[str, wire.Item] = {}
        for key, item in (items or {}).items():
            if item.kind == "host":
                fn = self.functions.get(item.name)  # type: ignore[arg-type]
                if fn is None:
                    raise AgentError(f"{key!r} is not a host function of this agent")
                functions[key] = fn
            else:
                handed[key] = item
        try:
            config = self.models.get(model) if model else self.model
        except ConfigError as exc:
            raise AgentError(str(exc)) from exc
        child = self._agent_factory(engine=self.engine, models=self.models, model=config, functions=functions,
                           display=self.display, depth=self.depth + 1, max_depth=self.max_depth,
                           name=self._unique_name(name), context=context,
                           max_messages=self.max_messages, handed=handed, chat_factory=self._chat_factory,
                           protocol=self._protocol_override, subagent_budget=self.subagent_budget,
                           agent_factory=self._agent_factory, forked_from=self if fork else None)
        if fork:
            assert self.worker is not None
            (child.worker,) = await self.worker.fork(1, caller=caller, on_call=child._on_call)
        child.start_task(task, heartbeat, self.on_heartbeat, supervisor=self)
        self.children[child.name] = child
        self.display.event("agent_started", name=child.name, parent=self.name, model=config.alias, task=task,
                           **({"forked": True} if fork else {}))
        self.sub_agents.append(child)
        return child

    def start_task(self, task: str, heartbeat: float | None, on_heartbeat: Callable[..., None],
                   supervisor: Agent | None = None) -> Agent:
        """Run this agent in the background as a sub-agent; returns self as the handle.  Raises
        AgentError when its run already has as many sub-agents working as it may."""
        self.subagent_budget.check()
        self.supervisor = supervisor or self.supervisor
        self.start_time = time.monotonic()
        self.heartbeat_interval = heartbeat_interval(heartbeat)
        self._parent_on_heartbeat = on_heartbeat
        self.result_value = None
        self.task = asyncio.ensure_future(self.run_as_subagent(task, self.heartbeat_interval, on_heartbeat))
        self.subagent_budget.take(self, self.task)
        return self

    async def run_as_subagent(self, task: str, heartbeat: float | None,
                              on_heartbeat: Callable[..., None]) -> str:
        self._inner = asyncio.ensure_future(self.run(task))
        started = self.start_time or time.monotonic()
        try:
            while not self._inner.done():
                await asyncio.wait([self._inner], timeout=heartbeat)
                if not self._inner.done() and heartbeat:
                    on_heartbeat(self._status_report, key=("agent", self.name))
        except asyncio.CancelledError:
            self._inner.cancel()
            await asyncio.wait([self._inner])
            raise
        reason, error_type = "", ""
        if self._inner.cancelled():
            body, status = "[cancelled]", "cancelled"
        elif self._inner.exception() is not None:
            reason, error_type = words(self._inner.exception()), type(self._inner.exception()).__name__
            body, status = f"[failed] {reason}", "failed"
        else:
            self.result_value = self._inner.result()
            body, status = self.result_value, "answered"
        duration = time.monotonic() - started
        self._event("agent_finished", status=status, duration=duration, reason=reason, error_type=error_type)
        return tags.format_agent_result(self.name, duration, body)

    def _status_report(self) -> str:
        """This sub-agent's heartbeat, written when it is delivered; nothing once it has ended."""
        if self._inner is None or self._inner.done():
            return ""
        return tags.format_agent_status(self.name, time.monotonic() - (self.start_time or 0.0), self.status())

    def done(self) -> bool:
        return self.task is None or self.task.done()

    def cancel(self) -> None:
        """Cancels this sub-agent; its result still reaches the parent, as [cancelled]."""
        self._event("cancelled", label="cancelled by caller")
        if self._inner is not None and not self._inner.done():
            self._inner.cancel()
        elif self.task is not None and not self.task.done():
            self.task.cancel()

    def new_task(self, task: str) -> Agent:
        """A follow-up that continues this sub-agent's context and namespace."""
        if self.task is not None and not self.task.done():
            raise AgentError(f"sub-agent '{self.name}' is still working; wait for its result before new_task")
        if self.released:
            raise AgentError(f"sub-agent '{self.name}' was closed to make room for newer ones (a run keeps "
                             f"at most {self.subagent_budget.limit}); start a new sub-agent with what it needs")
        assert self._parent_on_heartbeat is not None and self.supervisor is not None
        supervisor = self.supervisor
        if self in supervisor.sub_agents and self.task is not None:
            # The last task's result is not delivered yet, and the parent finds results through
            # the agent, whose task is about to be the new one: it is queued now, ahead of the
            # new task's, so each answer reaches the parent once and in order.
            supervisor.sub_agents.remove(self)
            supervisor.inbox.append(task_text(self.task))
            supervisor.wake.set()
        self.start_task(task, self.heartbeat_interval, self._parent_on_heartbeat)
        supervisor.sub_agents.append(self)
        return self

    async def release(self) -> None:
        """Close the worker of this finished sub-agent (its namespace goes with it); its answer,
        cost and status stay readable, a follow-up is refused."""
        self.released = True
        if self.worker is not None:
            await self.worker.close()

    def cancel_subagents(self) -> int:
        alive = [a for a in self.sub_agents if not a.done()]
        self._event("cancelled", label=f"cancel_subagents ({len(alive)} running)")
        for agent in alive:
            agent.cancel()
        return len(alive)

    # -- accounting ------------------------------------------------------------------------------
    def cost(self) -> dict:
        """{context, generated, cost, seconds} of this agent's conversation."""
        return dict(self.chat.stats) if self.chat else {"context": 0, "generated": 0, "cost": 0.0, "seconds": 0.0}

    def status(self) -> str:
        stats = self.cost()
        return (f"[{self.name} - context {stats.get('context', 0)} tokens, generated {stats.get('generated', 0)}, "
                f"${stats.get('cost', 0.0):.4f}, {stats.get('seconds', 0.0):.1f}s]")

    def totals(self) -> dict:
        """Tokens and cost of this agent and every sub-agent it started, recursively."""
        own = self.chat.stats if self.chat else {}
        out = {"tokens_in": own.get("tokens_in", 0), "tokens_out": own.get("tokens_out", 0),
               "cost": own.get("cost", 0.0), "messages": self.messages_sent}
        for child in self.children.values():
            sub = child.totals()
            for key in out:
                out[key] += sub[key]
        return out

    # -- calls from code in the worker -----------------------------------------------------------
    async def _on_call(self, name: str, args: list, kwargs: dict, block: str | None) -> Any:
        if name.startswith("self."):
            return await self_call(self, name[5:], args, kwargs, block)
        fn = self.functions.get(name)
        if fn is None:
            raise AgentError(f"no host function {name!r}; available: {', '.join(self.functions) or 'none'}")
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    def child(self, name: Any) -> Agent:
        """The sub-agent this agent started as ``name``; AgentError, in words, if none."""
        found = self.children.get(str(name))
        if found is None:
            raise AgentError(f"no sub-agent named {name!r}")
        return found
