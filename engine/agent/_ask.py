"""``agentloop ask``: the first seed's read-only repository assistant, on agentloop's parts.

The seed's contract, kept: ``LLM_URL``, ``LLM_MODEL``, ``LLM_TIMEOUT``, ``AGENT_ROOT`` (default
the current directory) and ``MAX_TURNS`` (default 20), with ``--root``, ``--max-turns`` and
``--model``/``--models`` overriding them; exactly the three read-only tools with the seed's
schemas (``repo_tools.TOOL_SCHEMAS``) and ``tool_choice: "auto"``; the seed's system prompt,
rooted at the real root; every failure of a call answered to the model in words, results
capped at 8,000 characters with the seed's note; ``<think>`` removed; one `` ⚙ name(args)``
line on stderr per call; at the round limit the seed's ``[agent] stopped after N tool rounds``
text is the answer (exit 0, as the seed).  Words after ``ask`` are joined into one question;
without words it is the seed's prompt loop.  Nothing runs code: no worker is started.

Beyond the seed, and why:

- On a terminal the answer is shown as it is written (the text of replies that go on to call
  tools too, as the model's commentary); piped, stdout holds the plain answer alone.  What a
  model wrote reaches a terminal inert (``engine.inert``), streamed or not.
- Requests stream, and are retried as ``run``'s are (``engine.models.Chat``); an endpoint that
  stays down ends the command with one line on stderr, exit 1.  Retry notices are shown only
  when stderr is a terminal (they are for a person waiting), and always recorded.  An answer
  the server cut at its reply length limit is given as it is, with a notice on stderr.
- ``<tool_call>{json}</tool_call>`` left in a reply's content (servers that do not parse the
  model's calls) is run like a native call.  Such a call has no id to answer, so its result
  comes back in the next user message as ``<tool_response>`` blocks, the format the models
  that write these calls are trained on; the reply keeps the calls as written.
- ``--json`` (one-shot only) prints one object: ``answer``, ``status`` (``answered``,
  ``stopped`` at the round limit, ``failed``), ``error``, ``messages`` (requests made),
  ``tokens``, ``cost``, ``duration_s``, ``tool_calls``, ``root``.  ``--record FILE`` writes the
  events as JSONL: the client's (``system``, ``delta``, ``retrying``), plus ``sent``,
  ``replied``, ``tool_call(name, id, tool, arguments)`` and ``tool_result(name, id, text)``.
- The prompt loop: the banner goes to stderr (stdout holds prompts and answers); with stdin not
  a terminal each question is echoed after its prompt; a question the endpoint could not
  answer is dropped from the conversation (it can be asked again) and, with stdin not a
  terminal, makes the exit status 1.  Ctrl-C during a question abandons it the same way and
  returns to the prompt; at the prompt a Ctrl-C gives a new prompt and a second one in a row
  leaves (status 130); Ctrl-D leaves.
- The tools run in ``RepoTools``' own process, confined to reading the root (Landlock, seccomp
  without sockets, no capabilities, rlimits where the kernel has them) and killed at its
  deadline; ``-v`` logs the layers in force, and a note says so when Landlock is missing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.agent._tool_protocol import embedded_calls
from engine.errors import EXIT_ERROR
from engine.inert import InertText
from engine.models import Chat, strip_think
from engine.tools import MAX_RESULT, TOOL_SCHEMAS, RepoTools, execute_tool_call_async

__all__ = [
    "ARGS_SHOWN", "Answer", "AnswerStream", "Assistant", "ClientEvents", "EXIT_FAILED", "PROMPT",
    "STOPPED", "ASK_SYSTEM"
]

log = logging.getLogger("agentloop.ask")

#: The seed's system prompt, word for word; ``{root}`` is the resolved root.
ASK_SYSTEM = ("You are a code assistant working inside the project rooted at {root}. "
          "Use the tools to look at real files before answering; never invent "
          "file contents or paths. When you have enough evidence, answer "
          "concisely and cite locations as path:line.")
#: The seed's answer when the rounds run out.
STOPPED = ("[agent] stopped after {n} tool rounds without a final answer — "
           "ask a narrower question or raise MAX_TURNS")
PROMPT = "you> "
#: Characters of a call's arguments shown on its ⚙ line (the seed's cut).
ARGS_SHOWN = 120
EXIT_FAILED = EXIT_ERROR

_HIDDEN = {"<think>": "</think>", "<tool_call>": "</tool_call>"}
_STRAY_CLOSE = "</think>"


class AnswerStream:
    """Shows one reply at a time as it streams in, as the final answer will read.

    ``feed`` pieces, then ``end`` once per reply.  What ``strip_think`` and ``embedded_calls``
    would remove is never shown: ``<think>…</think>`` and ``<tool_call>…</tool_call>`` (an
    unclosed one hides the rest of the reply), and a tag split across pieces is held back
    until it is known.  Leading and trailing whitespace is not shown, and everything shown is
    inert.  A stray ``</think>`` (the server opened the block in the prompt) means what came
    before it was reasoning; that text has been shown by then, so a line break separates it
    from the answer.  State is bounded by the longest tag, not by the reply.
    """

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._reset()

    def _reset(self) -> None:
        self._pending = ""  # raw text that may be the start of a tag
        self._closer: str | None = None  # inside a hidden block: the tag that ends it
        self._space = ""  # whitespace shown only if something follows it
        self._shown = False  # something of this reply was written
        self._line_start = True  # the reply's visible text starts (again): drop leading space
        self._inert = InertText()

    def feed(self, piece: str) -> None:
        buf = self._pending + piece
        while buf:
            if self._closer is not None:
                end = buf.find(self._closer)
                if end == -1:
                    buf = buf[len(buf) - _partial(buf, (self._closer,)):]
                    break
                buf, self._closer = buf[end + len(self._closer):], None
                continue
            found = [(i, tag) for tag in (*_HIDDEN, _STRAY_CLOSE) if (i := buf.find(tag)) != -1]
            if not found:
                keep = _partial(buf, (*_HIDDEN, _STRAY_CLOSE))
                self._visible(buf[:len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            at, tag = min(found)
            self._visible(buf[:at])
            buf = buf[at + len(tag):]
            if tag == _STRAY_CLOSE:
                if self._shown:
                    self._emit("\n")
                self._space, self._line_start = "", True
            else:
                self._closer = _HIDDEN[tag]
        self._pending = buf

    def end(self) -> bool:
        """The reply is complete (or abandoned): show what was held back but a tag's start,
        and end the line when anything of the reply was shown (then True).  The stream is then
        ready for the next reply."""
        if self._closer is None:
            self._visible(self._pending)
        self._visible(self._inert.flush(), filtered=True)
        shown = self._shown
        if shown:
            self._write("\n")
        self._reset()
        return shown

    def _visible(self, text: str, *, filtered: bool = False) -> None:
        text = text if filtered else self._inert.feed(text)
        if not text:
            return
        if self._line_start:
            text = text.lstrip()
            if not text:
                return
            self._line_start = False
        body = text.rstrip()
        if body:
            self._emit(self._space + body)
            self._space = ""
        self._space += text[len(body):]

    def _emit(self, text: str) -> None:
        self._shown = True
        self._write(text)


def _partial(buf: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``buf`` may begin one of ``tags``."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:k]):
                best = k
                break
    return best


@dataclass
class Answer:
    """How one question ended: the answer's text, whether the rounds ran out, and whether the
    text was already shown as it streamed."""

    text: str
    stopped: bool = False
    streamed: bool = False


class ClientEvents:
    """The client's events: recorded, deltas streamed, retries noted on a terminal."""

    def __init__(self, recorder: Any, stream: AnswerStream | None, note: Callable[[str], None] | None) -> None:
        self.recorder = recorder
        self.stream = stream
        self.note = note

    def event(self, type: str, **fields: Any) -> None:
        if self.recorder is not None:
            self.recorder.event(type, **fields)
        if type == "delta" and self.stream is not None:
            self.stream.feed(str(fields.get("text") or ""))
        elif type == "retrying":
            if self.stream is not None:
                self.stream.end()  # the reply starts again, from its first word
            if self.note is not None:
                self.note(f"the model did not answer ({fields.get('reason')}); retry {fields.get('attempt')}"
                          f"/{fields.get('of')} in {float(fields.get('wait') or 0):.1f} s")


class Assistant:
    """The seed's loop: one conversation about one repository, the transcript its only state.

    ``ask(question)`` adds the question, asks the model with the three tools until it answers
    without calling one (at most ``max_turns`` requests) and returns the answer.  When a
    question fails (the endpoint, Ctrl-C) the transcript is left as it was before it.
    """

    def __init__(self, chat: Chat, tools: RepoTools, *, max_turns: int,
                 stream: AnswerStream | None = None, gear: Callable[[str], None] | None = None) -> None:
        self.chat = chat
        self.tools = tools
        self.impls = tools.functions()
        self.max_turns = max_turns
        self.stream = stream
        self.gear = gear or (lambda line: None)
        self.tool_calls = 0
        self._noted_layers = False

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.chat.messages

    async def ask(self, question: str) -> Answer:
        saved = len(self.messages)
        self.messages.append({"role": "user", "content": question})
        self._event("sent", message=question, count=len(self.messages))
        try:
            for _ in range(self.max_turns):
                reply = await self.chat.request(self.messages, tools=TOOL_SCHEMAS, tool_choice="auto")
                streamed = self.stream.end() if self.stream is not None else False
                content = strip_think(reply.get("content") or "")
                calls = [c for c in reply.get("tool_calls") or [] if isinstance(c, dict)]
                loose: list[dict] = []
                if not calls:
                    _, loose = embedded_calls(content)  # the reply keeps them as written
                    if not loose:
                        if self.chat.last_finish_reason == "length":
                            log.warning("the answer was cut at the model's reply length limit; it is incomplete")
                        self.messages.append({"role": "assistant", "content": content})
                        self._event("replied", message=content, stats=self.chat.stats,
                                    latency=self.chat.last_latency)
                        return Answer(content, streamed=streamed)
                assistant: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    assistant["tool_calls"] = calls
                self.messages.append(assistant)
                self._event("replied", message=content, stats=self.chat.stats, latency=self.chat.last_latency)
                results = [(call, await self._run(call)) for call in calls or loose]
                if calls:
                    self.messages.extend({"role": "tool", "tool_call_id": call.get("id", ""), "content": text}
                                         for call, text in results)
                else:
                    self.messages.append({"role": "user", "content": "\n".join(
                        f"<tool_response>\n{text}\n</tool_response>" for _, text in results)})
            return Answer(STOPPED.format(n=self.max_turns), stopped=True)
        except BaseException:
            if self.stream is not None:
                self.stream.end()
            del self.messages[saved:]
            raise

    async def _run(self, call: dict[str, Any]) -> str:
        """One call: its ⚙ line, then its result in words (never an exception)."""
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        name = str(fn.get("name") or "?")
        arguments = fn.get("arguments") or ""
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        self.gear(f" ⚙ {name}({arguments[:ARGS_SHOWN]})")
        self._event("tool_call", id=call.get("id", ""), tool=name, arguments=arguments)
        self.tool_calls += 1
        text = await execute_tool_call_async(call, self.impls, MAX_RESULT)
        self._event("tool_result", id=call.get("id", ""), text=text)
        self._note_layers()
        return text

    def _note_layers(self) -> None:
        layers = self.tools.confinement
        if self._noted_layers or not layers:
            return
        self._noted_layers = True
        log.info("repository tools confined by: %s", ", ".join(layers))
        if not any(layer.startswith("landlock") for layer in layers):
            log.warning("this kernel has no Landlock: the repository tools are confined to %s by their "
                        "own path checks only", self.tools.root)

    def _event(self, type: str, **fields: Any) -> None:
        display = self.chat.display
        if display is not None:
            display.event(type, name=self.chat.name, **fields)
