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
once, and the model is told so in words beyond that; and the live display gets each output
line cut to ``DISPLAY_LINE_BYTES``, so a line of any length costs the coordinator no memory.

A reply the server cut at the length cap (``finish_reason: "length"``) is never taken as the
answer: what it completed runs, the model is told where it was cut and continues, and after
``MAX_CUT_REPLIES`` cut replies in a row the run fails saying so.

While the worker starts, the model's endpoint is asked what it serves (``model_server``): a
context window the configuration leaves out is taken from the server, and the connection the
first request uses is opened then.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import os
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from . import tags
from .display import AgentDisplay
from .durations import parse_duration
from .engine import Engine
from .errors import AgentError, AgentloopError, ConfigError, ModelError
from .llm import Chat
from .model_server import ServerInfo, connect
from .models import ModelConfig, ModelRegistry
from .results import BlockResult, OutputChunk
from .sandbox import workspace_excess
from .worker import Worker

#: Stop sequences: a model starting a result tag on a new line is inventing output.
#: Only at a line start, so code that merely mentions a tag is not cut by the server.
STOP_SEQUENCES = [f"\n{tag}" for tag in tags.HALLUCINATION_STOPS]
#: Bytes of a block's output the model sees in one result (head and tail, the rest counted).
OUTPUT_BUDGET = 16_000
#: Compaction reminder threshold when the model's context window is unknown.
DEFAULT_REMIND_AT = 16_000
#: Shortest heartbeat interval; also the shortest time between two messages that heartbeat
#: reports alone cause (``heartbeat="1ms"`` would otherwise be a request flood).
HEARTBEAT_FLOOR = 1.0
#: Sub-agents one run may have working at once, unless ``max_subagents`` says otherwise.
MAX_SUBAGENTS = 8
#: Bytes of one output line the live display is shown; the rest of the line is counted only
#: in the block's result.  Displays split and join lines (a console keeps an unterminated line
#: until its newline), so an endless line must never reach them whole.
DISPLAY_LINE_BYTES = 16 * 1024
_DISPLAY_CUT = b" [... the rest of this line is not shown live]"
#: Replies cut at the length cap in a row after which a run gives up: a model that never ends
#: its turn (a base model, a loop) would otherwise spend its whole message budget that way.
MAX_CUT_REPLIES = 3
#: Empty replies in a row that end a run: the first is answered with ``EMPTY_REPLY_NOTE``.
MAX_EMPTY_REPLIES = 2
EMPTY_REPLY_NOTE = ("your reply was empty: no text, no code, no tool call. Reply with your final answer in "
                    "plain text, or with the code or sub-agents you want run.")

#: The sub-agent limit of runs whose agent is made without ``max_subagents``: the command line
#: sets it for the command it runs (``--max-subagents``), others get ``MAX_SUBAGENTS``.
subagent_limit: contextvars.ContextVar[int] = contextvars.ContextVar("agentloop_max_subagents",
                                                                     default=MAX_SUBAGENTS)


def heartbeat_interval(seconds: float | None) -> float | None:
    """The interval heartbeats really come at: none stays none, and nothing is shorter than
    ``HEARTBEAT_FLOOR``."""
    return max(seconds, HEARTBEAT_FLOOR) if seconds else None


class SubagentSlots:
    """The sub-agents of one run: the agent a run starts and every agent below it share one, so
    the limit holds for the whole tree.  At most ``limit`` work at once, and at most ``limit``
    hold a worker, working or finished: a finished one keeps its worker (and namespace) for a
    follow-up until a newer sub-agent needs the room, so processes stay bounded too."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: set[Agent] = set()
        self.idle: list[Agent] = []  # finished, still holding a worker; the oldest first

    def check(self) -> None:
        """Raise AgentError, in words for the model, when no other sub-agent may start now."""
        if len(self.live) >= self.limit:
            raise AgentError(
                f"this run already has {len(self.live)} sub-agents working, its limit (max_subagents="
                f"{self.limit}): wait for one to finish (its <agent_result> arrives by itself) or cancel "
                "some (self.cancel_subagents(), handle.cancel()) before starting another, or do this part "
                "yourself")

    def take(self, agent: Agent, task: asyncio.Future) -> None:
        """Count ``agent`` as working until ``task`` ends (``check`` first: this does not)."""
        if agent in self.idle:
            self.idle.remove(agent)
        self.live.add(agent)
        task.add_done_callback(lambda _: self._finished(agent))

    def _finished(self, agent: Agent) -> None:
        self.live.discard(agent)
        if agent.worker is not None and not agent.released:
            self.idle.append(agent)

    async def make_room(self) -> None:
        """Close the workers of finished sub-agents, the oldest first, until one more fits."""
        while self.idle and len(self.live) + len(self.idle) >= self.limit:
            await self.idle.pop(0).release()


class _LineCut:
    """Output for the live display, every line cut to ``limit`` bytes (per stream, across
    chunks); the first cut of a line says so."""

    def __init__(self, limit: int = DISPLAY_LINE_BYTES) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}  # bytes of the unterminated line so far, per stream

    def __call__(self, stream: str, data: bytes) -> bytes:
        used = self._open.get(stream, 0)
        parts = data.split(b"\n")
        if used + len(parts[0]) <= self.limit and max(map(len, parts)) <= self.limit:  # the usual case
            self._open[stream] = used + len(parts[0]) if len(parts) == 1 else len(parts[-1])
            return data
        shown = []
        for i, part in enumerate(parts):
            if i:
                used = 0
            room = self.limit - used
            shown.append(part if len(part) <= room else part[:room] + _DISPLAY_CUT if room >= 0 else b"")
            used += len(part)
        self._open[stream] = used
        return b"\n".join(shown)


def host_spec(name: str, fn: Callable) -> dict:
    """What a worker needs to build a stub for host function ``fn``."""
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(*args, **kwargs)"
    return {"name": name, "signature": signature, "doc": inspect.getdoc(fn) or "",
            "is_async": inspect.iscoroutinefunction(fn)}


class _CodeTask:
    """One ``<run_code>`` block running in the agent's worker, with its heartbeats."""

    def __init__(self, agent: Agent, request: tags.CodeRequest, block_id: str) -> None:
        self.agent = agent
        self.request = request
        self.id = block_id
        self.started = time.monotonic()
        self.started_at = datetime.now()
        self.interval = heartbeat_interval(request.heartbeat)
        self._fresh = bytearray()  # output since the last heartbeat (bounded)
        self._fresh_skipped = 0
        self._reported = 0  # bytes already shown in earlier heartbeats
        self._shown = _LineCut()
        self._work: asyncio.Future[BlockResult] | None = None
        self.task = asyncio.ensure_future(self._run())

    def _on_output(self, chunk: OutputChunk) -> None:
        data = chunk.data
        if len(data) >= OUTPUT_BUDGET:  # replaces what is fresh: never grow by a big chunk
            self._fresh_skipped += len(self._fresh) + len(data) - OUTPUT_BUDGET
            self._fresh = bytearray(data[-OUTPUT_BUDGET:])
        else:
            self._fresh += data
            if len(self._fresh) > 2 * OUTPUT_BUDGET:
                cut = len(self._fresh) - OUTPUT_BUDGET
                self._fresh_skipped += cut
                del self._fresh[:cut]
        shown = self._shown(chunk.stream, data)
        if shown:
            self.agent._event("output", id=self.id, stream=chunk.stream,
                              text=shown.decode("utf-8", "replace"))

    def is_running(self) -> bool:
        return not self.task.done()

    async def _run(self) -> str:
        agent, req = self.agent, self.request
        self._work = asyncio.ensure_future(agent.worker.run(
            req.code, timeout=req.timeout, block_id=self.id, on_output=self._on_output, budget=OUTPUT_BUDGET))
        try:
            while not self._work.done():
                await asyncio.wait([self._work], timeout=self.interval)
                if not self._work.done() and self.interval:
                    agent._event("progress", id=self.id, current=time.monotonic() - self.started,
                                 output=bytes(self._fresh).decode("utf-8", "replace"))
                    agent.on_heartbeat(self._report, key=("run_code", self.id))
        except asyncio.CancelledError:
            self._work.cancel()
            await asyncio.wait([self._work])
            raise
        try:
            result = self._work.result()
            body = result.text()
            status = result.status
        except asyncio.CancelledError:
            body, status = "[cancelled]", "cancelled"
        except AgentloopError as exc:  # the worker could not even be started again
            body, status = f"[failed] {exc}", "error"
        # The workspace is a bind mount that no quota caps: its size is checked between blocks.
        engine = agent.engine
        excess = await asyncio.to_thread(workspace_excess, engine.sandbox, engine.workspace)
        if excess:
            body += f"[{excess}]"
        duration = time.monotonic() - self.started
        agent._event("finished", id=self.id, duration=duration, cancelled=status != "ok" and status != "error",
                     output=body, status=status)
        return tags.format_code_result(self.id, duration, body)

    def _report(self) -> str:
        """The heartbeat as it is delivered: written then, so it holds all output since the last
        one delivered; nothing once the block has ended (its result says it all)."""
        return "" if self._work is None or self._work.done() else self.heartbeat()

    def heartbeat(self) -> str:
        """A ``<running>`` note with the output that is new since the last one."""
        fresh = bytes(self._fresh)
        skipped = self._fresh_skipped
        self._fresh.clear()
        self._fresh_skipped = 0
        before = self._reported
        self._reported += len(fresh) + skipped
        note = ""
        if before:
            note += f"[{before} bytes of output shown before]\n"
        if skipped:
            note += f"[... {skipped} bytes skipped ...]\n"
        elapsed = time.monotonic() - self.started
        deadline = self.started_at + timedelta(seconds=self.request.timeout)
        return tags.format_running(self.id, elapsed, datetime.now(), deadline,
                                   note + fresh.decode("utf-8", "replace"))


@dataclass
class RunResult:
    """How one agent run ended, for the CLI and batch jobs."""

    answer: str | None
    status: str  # answered | failed | timed_out | cancelled
    error: str = ""
    messages: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost: float = 0.0
    duration_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"answer": self.answer, "status": self.status, "error": self.error,
                "messages": self.messages, "tokens": {"in": self.tokens_in, "out": self.tokens_out},
                "cost": round(self.cost, 6), "duration_s": round(self.duration_s, 3)}


class Agent:
    """Conversation loop, block runtime and the API exposed (as ``self``) to code the model writes."""

    def __init__(self, *, engine: Engine, models: ModelRegistry, model: ModelConfig | str | None = None,
                 functions: Mapping[str, Callable] | None = None, display: AgentDisplay | None = None,
                 depth: int = 0, max_depth: int = 3, name: str = "main", context: str = "",
                 max_messages: int = 200, handed: dict | None = None,
                 chat_factory: Callable[..., Chat] | None = None, protocol: str | None = None,
                 max_subagents: int | None = None, subagent_slots: SubagentSlots | None = None) -> None:
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
        self._protocol_override = protocol  # --protocol: applies to sub-agents too
        self.protocol = protocol or self.model.protocol
        self.worker: Worker | None = None
        self.chat: Chat | None = None
        self.blocks: list[_CodeTask] = []
        self.sub_agents: list[Agent] = []
        self.children: dict[str, Agent] = {}
        self.inbox: list[str] = []
        #: Heartbeat reports not delivered yet, by source: a newer one replaces the older.
        self._reports: dict[Hashable, str | Callable[[], str]] = {}
        self._last_message = time.monotonic()  # when the last message to the model was made
        #: Shared with every sub-agent below: the run's limit on sub-agents working at once.
        self.subagent_slots = subagent_slots or SubagentSlots(
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
        self._cut_replies = 0  # replies cut at the length cap in a row
        self._empty_replies = 0  # empty replies in a row that would have ended the run
        self.server = ServerInfo()  # what the endpoint said about itself, once started
        self._block_ids = itertools.count(1)

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
            self.worker = await self.engine.start_worker(self.name)
            self.worker.on_call = self._on_call
            for note in self.worker.notes:
                self._event("note", message=note)
            await self.worker.request("bind", {"host": [host_spec(n, f) for n, f in self.functions.items()],
                                               "self": True}, keep=True)
            names: list[str] = []
            if self._handed:
                names = await self.worker.request("inject", {"items": self._handed}, keep=True)
            env = await self.worker.request("env")
            descriptions = [tags.describe_object(n, f) for n, f in self.functions.items()]
            if names:
                descriptions += await self.worker.request("describe", {"names": names})
            client, self.server = await endpoint
        except BaseException:
            endpoint.cancel()
            await asyncio.wait([endpoint])
            if not endpoint.cancelled() and endpoint.exception() is None:
                await endpoint.result()[0].aclose()
            raise
        self.adapt(self.server)
        system = tags.build_system(
            model_alias=self.model.alias, model=self.model.model,
            available_models=self.models.describe({self.model.alias: self.model}),
            python=env["python"], os=env["os"], cpu=env["cpu"], ram=env["ram"], packages=env["packages"],
            namespace_block=tags.describe_namespace(descriptions),
            minimal=os.environ.get("AGENT_MINIMAL_SYSTEM") == "1", guide=self.guide)
        self.chat = self._chat_factory(system, self.model, display=self.display, name=self.name,
                                       stop=STOP_SEQUENCES, client=client)

    def adapt(self, server: ServerInfo) -> None:
        """Take in what the endpoint reported: its context window where the configuration sets
        none, and a note when the model id is not one it serves.  Says what it learned in an
        ``endpoint`` event."""
        if server.context_window and not self.model.context_window:
            self.model = replace(self.model, context_window=server.context_window)
        served, words = server.check_id(self.model.model)
        if words and (not served or server.single_model) and self.first_on_endpoint():
            self._event("note", message=words)
        if server.answered:
            self._event("endpoint", model=self.model.alias, kind=server.kind, context_window=server.context_window,
                        context_source=server.context_source, supports_tools=server.supports_tools,
                        model_ids=list(server.model_ids or ()))

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
        for request in parsed.code:
            self.start_block(request)
        for request in parsed.agents:
            try:
                await self.start_agent(request.task, name=request.name, context=request.context,
                                       namespace_names=request.namespace, heartbeat=request.heartbeat,
                                       model=request.model)
            except Exception as error:  # noqa: BLE001 - the model reads why, the loop goes on
                self._event("failed", message=f"sub-agent {request.name}: {error}")
                self.inbox.append(tags.format_agent_start_failed(request.name, error))

    def start_block(self, request: tags.CodeRequest) -> None:
        block_id = request.id or f"b{next(self._block_ids)}"
        if any(b.id == block_id and b.is_running() for b in self.blocks):
            self._event("failed", message=f"id={block_id} already running, not restarted")
            self.inbox.append(tags.format_already_running(block_id))
            return
        block = _CodeTask(self, request, block_id)
        self._event("launched", id=block_id, timeout=request.timeout, heartbeat=block.interval,
                    code=request.code)
        self.blocks.append(block)

    def next_message(self) -> str:
        """Everything to send back this turn: the inbox, the heartbeat reports, then results of
        what just finished."""
        done = [w for w in [*self.blocks, *self.sub_agents] if w.task.done()]
        self.blocks = [b for b in self.blocks if not b.task.done()]
        self.sub_agents = [a for a in self.sub_agents if not a.task.done()]
        events, self.inbox = self.inbox, []
        reports, self._reports = self._reports, {}
        self._last_message = time.monotonic()
        events += [report() if callable(report) else report for report in reports.values()]
        return "".join(events + [_task_text(w.task) for w in done])

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
        """After a reply: if the server cut it at the length cap, queue the words that tell the
        model so (the run cannot end on it) and count it; raise AgentError once ``MAX_CUT_REPLIES``
        replies in a row were cut.  A reply already cut where the model invented a result is
        not: what came after that was never going to be used."""
        assert self.chat is not None
        if self.chat.last_finish_reason != "length" or invented:
            self._cut_replies = 0
            return
        self._cut_replies += 1
        cap = self.chat.last_max_tokens
        self._event("note", message=f"the reply was cut at the length cap ({cap} tokens); the model is told")
        if self._cut_replies >= MAX_CUT_REPLIES:
            raise AgentError(f"the model's last {self._cut_replies} replies were all cut at the length cap "
                             f"(max_tokens={cap}) without finishing: raise it (--max-tokens, max_tokens in "
                             "agentloop.toml) or ask for something shorter")
        self.inbox.append(tags.format_reply_cut(cap, reply))

    def empty_reply(self, reply: str, *, calls: bool = False) -> bool:
        """After each reply: True when it would end the run but is empty (no text, no code, no
        tool call) — the model is then told so, once, and the loop goes on.  A second such
        reply in a row raises AgentError.  An empty answer is a fault of the model or the
        server, never an answer; an empty reply while work runs only means "keep going"."""
        if reply.strip() or calls:
            self._empty_replies = 0
            return False
        if not self.is_completed():
            return False
        self._empty_replies += 1
        if self._empty_replies >= MAX_EMPTY_REPLIES:
            raise AgentError(f"the model's reply was empty {self._empty_replies} times in a row (no text, no "
                             "code, no tool call), even after it was told")
        self._event("note", message="the reply was empty; the model is told")
        self.inbox.append(tags.format_error(" reason=empty", EMPTY_REPLY_NOTE))
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
                reply = await self.chat.send(message)
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
                          namespace_names: list[str] | None = None, items: dict | None = None,
                          heartbeat: float | None = None, model: str = "") -> Agent:
        """Start a sub-agent in a fresh context and a worker of its own; returns at once."""
        if self.depth >= self.max_depth:
            raise AgentError(f"max delegation depth {self.max_depth} reached — do this part yourself "
                             "instead of delegating")
        self.subagent_slots.check()  # before any work for it; start_task takes the slot
        await self.subagent_slots.make_room()
        if namespace_names:
            assert self.worker is not None
            exported = await self.worker.request("export", {"names": namespace_names})
            if exported["errors"]:
                raise AgentError("; ".join(exported["errors"].values()))
            items = exported["items"]
        functions: dict[str, Callable] = {}
        handed: dict = {}
        for key, item in (items or {}).items():
            if item.get("kind") == "host":
                fn = self.functions.get(item.get("name"))
                if fn is None:
                    raise AgentError(f"{key!r} is not a host function of this agent")
                functions[key] = fn
            else:
                handed[key] = item
        try:
            config = self.models.get(model) if model else self.model
        except ConfigError as exc:
            raise AgentError(str(exc)) from exc
        child = make_agent(engine=self.engine, models=self.models, model=config, functions=functions,
                           display=self.display, depth=self.depth + 1, max_depth=self.max_depth,
                           name=self._unique_name(name or "sub"), context=context,
                           max_messages=self.max_messages, handed=handed, chat_factory=self._chat_factory,
                           protocol=self._protocol_override, subagent_slots=self.subagent_slots)
        child.start_task(task, heartbeat, self.on_heartbeat, supervisor=self)
        self.children[child.name] = child
        self.display.event("agent_started", name=child.name, parent=self.name, model=config.alias, task=task)
        self.sub_agents.append(child)
        return child

    def start_task(self, task: str, heartbeat: float | None, on_heartbeat: Callable[..., None],
                   supervisor: Agent | None = None) -> Agent:
        """Run this agent in the background as a sub-agent; returns self as the handle.  Raises
        AgentError when its run already has as many sub-agents working as it may."""
        self.subagent_slots.check()
        self.supervisor = supervisor or self.supervisor
        self.start_time = time.monotonic()
        self.heartbeat_interval = heartbeat_interval(heartbeat)
        self._parent_on_heartbeat = on_heartbeat
        self.result_value = None
        self.task = asyncio.ensure_future(self.run_as_subagent(task, self.heartbeat_interval, on_heartbeat))
        self.subagent_slots.take(self, self.task)
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
        reason = ""
        if self._inner.cancelled():
            body, status = "[cancelled]", "cancelled"
        elif self._inner.exception() is not None:
            reason = _words(self._inner.exception())
            body, status = f"[failed] {reason}", "failed"
        else:
            self.result_value = self._inner.result()
            body, status = self.result_value, "answered"
        duration = time.monotonic() - started
        self._event("agent_finished", status=status, duration=duration, reason=reason)
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
                             f"at most {self.subagent_slots.limit}); start a new sub-agent with what it needs")
        assert self._parent_on_heartbeat is not None and self.supervisor is not None
        supervisor = self.supervisor
        if self in supervisor.sub_agents and self.task is not None:
            # The last task's result is not delivered yet, and the parent finds results through
            # the agent, whose task is about to be the new one: it is queued now, ahead of the
            # new task's, so each answer reaches the parent once and in order.
            supervisor.sub_agents.remove(self)
            supervisor.inbox.append(_task_text(self.task))
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
            return await self._self_call(name[5:], args, kwargs)
        fn = self.functions.get(name)
        if fn is None:
            raise AgentError(f"no host function {name!r}; available: {', '.join(self.functions) or 'none'}")
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    def _child(self, name: Any) -> Agent:
        child = self.children.get(str(name))
        if child is None:
            raise AgentError(f"no sub-agent named {name!r}")
        return child

    async def _self_call(self, op: str, args: list, kwargs: dict) -> Any:
        if op == "compact_knowledge":
            assert self.chat is not None
            self.chat.compact(str(args[0] if args else kwargs.get("summary", "")))
            return None
        if op == "cancel_subagents":
            self.cancel_subagents()
            return None
        if op == "cost":
            return self.cost()
        if op == "status":
            return self.status()
        if op == "run_agent":
            heartbeat = parse_duration(kwargs.get("heartbeat") or None)
            child = await self.start_agent(str(args[0]), name=kwargs.get("name") or "sub",
                                           context=kwargs.get("context", ""), items=kwargs.get("items") or {},
                                           heartbeat=heartbeat, model=kwargs.get("model", ""))
            return child.name
        child = self._child(args[0] if args else None)
        if op == "agent_done":
            return child.done()
        if op == "agent_result":
            if not child.done():
                raise AgentError(f"sub-agent '{child.name}' is still working; await the handle or wait for "
                                 "its <agent_result>")
            return child.result_value
        if op == "agent_cancel":
            child.cancel()
            return None
        if op == "agent_new_task":
            child.new_task(str(args[1]))
            return None
        if op == "agent_cost":
            return child.cost()
        if op == "agent_status":
            return child.status()
        if op == "agent_wait":
            if child.task is not None:
                await asyncio.wait([child.task])
            return child.result_value
        raise AgentError(f"self has no method {op!r}")


def _words(exc: BaseException) -> str:
    if isinstance(exc, AgentloopError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _task_text(task: asyncio.Task) -> str:
    if task.cancelled():
        return ""
    exc = task.exception()
    if exc is not None:
        return tags.format_error("", f"internal error: {_words(exc)}")
    return task.result()


def make_agent(*, model: ModelConfig | str | None = None, models: ModelRegistry, protocol: str | None = None,
               **kwargs: Any) -> Agent:
    """An agent speaking ``protocol`` (default: its model's, from agentloop.toml; else tags)."""
    config = model if isinstance(model, ModelConfig) else models.get(model)
    chosen = protocol or config.protocol
    if chosen == "tools":
        from .tool_protocol import ToolAgent

        return ToolAgent(model=config, models=models, protocol=protocol, **kwargs)
    if chosen not in ("tags", None):
        raise ConfigError(f"unknown protocol {chosen!r}: use 'tags' or 'tools'")
    return Agent(model=config, models=models, protocol=protocol, **kwargs)


async def run_task(task: str, *, models: ModelRegistry, model: str | None = None, engine: Engine | None = None,
                   functions: Mapping[str, Callable] | None = None, display: AgentDisplay | None = None,
                   max_messages: int = 200, timeout: float | None = None,
                   chat_factory: Callable[..., Chat] | None = None, protocol: str | None = None,
                   max_subagents: int | None = None) -> RunResult:
    """Run one task to its end and say how it went.  Never raises for the model's or the
    endpoint's failures: they are the result's ``status`` and ``error``.  ``max_subagents``:
    sub-agents working at once (default: ``subagent_limit``)."""
    started = time.monotonic()
    own_engine = engine is None
    engine = engine or Engine()
    agent: Agent | None = None
    answer: str | None = None
    status, error = "answered", ""
    extra: dict = {}
    try:
        if own_engine:
            engine.open()
        agent = make_agent(engine=engine, models=models, model=model, functions=functions, display=display,
                           max_messages=max_messages, chat_factory=chat_factory, protocol=protocol,
                           max_subagents=max_subagents)
        answer = await asyncio.wait_for(agent.run(task), timeout)
    except TimeoutError:
        status, error = "timed_out", f"no answer within {timeout:g} s"
    except asyncio.CancelledError:
        status, error = "cancelled", "cancelled"
    except (AgentloopError, ModelError) as exc:
        status, error = "failed", str(exc)
        extra["error_type"] = type(exc).__name__  # lets batch jobs tell infrastructure from the model
        if getattr(exc, "status", None) is not None:
            extra["http_status"] = exc.status
    finally:
        totals = agent.totals() if agent else {"tokens_in": 0, "tokens_out": 0, "cost": 0.0, "messages": 0}
        if agent is not None:
            await asyncio.shield(agent.close())
        if own_engine:
            await asyncio.shield(engine.shutdown())
    return RunResult(answer=answer, status=status, error=error, messages=totals["messages"],
                     tokens_in=totals["tokens_in"], tokens_out=totals["tokens_out"], cost=totals["cost"],
                     duration_s=time.monotonic() - started, extra=extra)
