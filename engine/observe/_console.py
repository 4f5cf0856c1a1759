"""A console renderer for agent events: plain lines on stderr, one per thing that happened.

Streamed reply text is prefixed by the agent's name, code blocks and their output are indented under
it, sub-agents are indented by depth. Everything is printed as rich Text (never markup), so brackets
in a reply are shown as written, and every string from an event is made inert first (engine.inert):
no escape sequence or control character of a model or a program reaches the terminal, not even one
split across streamed pieces, since replies and output streams are filtered incrementally. Program
colours are removed too; the console colours stderr lines itself. Without a terminal rich writes
no colour codes.

What the model is held to is what is shown: a reply the engine cut where the model wrote a
result tag itself (``tags.cut_hallucinated``) is shown up to the cut, which is marked, and
``<error>`` notes the model is sent are shown, one line each.  Code the streamed reply already
showed is not repeated under its block.  Retries are shown as they happen; on a terminal, a
request whose first token has not arrived shows a spinner with the seconds waited (a transient
line, gone once the reply starts), and nothing extra elsewhere.

A model's reasoning streams dimmed, after a ``∴`` instead of the ``›`` of its reply, and is
collapsed: the first ``reasoning_lines`` lines of each reply's reasoning are shown, the rest
counted in one line (all of it with ``verbose``, and always in a recording).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from engine.agent import HALLUCINATION_STOPS, DispatchDisplay, cut_hallucinated, find_tags
from engine.durations import format_duration
from engine.inert import InertText, inert

__all__ = ["ConsoleDisplay"]

_SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_NOTE_CHARS = 200  # characters of an <error> note shown on its one line


def _held_back(text: str) -> int:
    """How many characters at the end of a streamed reply could be the start of a result tag the
    model writes itself: they wait for the next piece, so a cut reply never shows the tag."""
    start = text.rfind("<")
    tail = text[start:] if start >= 0 else ""
    return len(tail) if tail and any(stop.startswith(tail) or tail == stop for stop in HALLUCINATION_STOPS) else 0


_OPEN = re.compile(r"^<run_(?:code|agent)(?=[ >])", re.MULTILINE)
_CLOSE = re.compile(r"^</run_(?:code|agent)", re.MULTILINE)


def _inside_open_block(text: str) -> bool:
    """Whether ``text`` ends inside a ``<run_code>``/``<run_agent>`` block not closed yet."""
    opens = [m.start() for m in _OPEN.finditer(text)]
    closes = [m.start() for m in _CLOSE.finditer(text)]
    return bool(opens) and (not closes or opens[-1] > closes[-1])


class _Waiting:
    """The transient lines of the requests still waiting for their first token."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.since: dict[str, tuple[str, float]] = {}  # agent -> (indent, when its request went out)

    def lines(self) -> list[str]:
        now = self.clock()
        return [f"{indent}{_SPINNER[int((now - since) * 10) % len(_SPINNER)]} {name} waiting for the model · "
                f"{max(0.0, now - since):.0f}s" for name, (indent, since) in list(self.since.items())]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n".join(self.lines()), style="dim")


def _clean(text: Any) -> str:
    return inert(text if isinstance(text, str) else str(text))


_PARTIAL_CAP = 16 * 1024  # characters of an unterminated output line the display keeps


def _terminal_line(line: str) -> str:
    """What a terminal would leave visible of a line rewritten with carriage returns (progress bars)."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def _seconds(value: Any, fmt: str = "{:.1f}s") -> str:
    try:
        return fmt.format(float(value))
    except (TypeError, ValueError):
        return "?"


@dataclass
class _Thought:
    """The reasoning of one reply as it is shown: lines shown, lines collapsed."""

    filter: InertText = field(default_factory=InertText)
    lines: int = 0
    hidden: int = 0
    hidden_tail: bool = False  # the last collapsed line has not ended yet


@dataclass
class _ShownBlock:
    live: bool = False  # output arrives as `output` chunks; cumulative `progress` output is then ignored
    shown_chars: int = 0  # how much of the cumulative progress output has been shown
    partial: dict[str, str] = field(default_factory=dict)  # unterminated line per stream
    # Per stream: output arrives in chunks that may split an escape sequence. Carriage returns pass
    # to _terminal_line, which keeps a rewritten line's last state; none is ever printed.
    filters: dict[str, InertText] = field(default_factory=dict)
    lines: int = 0
    hidden: int = 0


class ConsoleDisplay(DispatchDisplay):
    """Renders events to a rich Console (stderr by default). `verbose` also shows system prompts, sent
    messages, whole code blocks and all output lines; otherwise code shows its first `code_lines` lines
    and each block at most `output_lines` lines of output. Handlers never raise on missing fields."""

    def __init__(self, console: Console | None = None, verbose: bool = False, *,
                 code_lines: int = 4, output_lines: int = 40, reasoning_lines: int = 6,
                 clock: Callable[[], float] = time.monotonic):
        self.console = console or Console(stderr=True, highlight=False)
        self.verbose = verbose
        self.code_lines = code_lines
        self.output_lines = output_lines
        self.reasoning_lines = reasoning_lines
        self._depth: dict[str, int] = {}
        self._open_line: str | None = None  # agent whose streamed reply line is not yet terminated
        self._open_kind = "reply"  # what that line is: "reply" or "reasoning"
        self._thoughts: dict[str, _Thought] = {}  # per agent: the reasoning of its current reply
        self._streamed: set[str] = set()  # agents whose current reply arrived as deltas
        self._replies: dict[str, InertText] = {}  # per agent: its streamed reply, filtered as it arrives
        self._blocks: dict[tuple[str, str], _ShownBlock] = {}
        self._raw: dict[str, str] = {}  # per agent: its streamed reply so far, unfiltered
        self._shown: dict[str, int] = {}  # per agent: how much of it went to the screen
        self._cut: set[str] = set()  # agents whose current reply was cut at an invented result
        self._said: dict[str, str] = {}  # per agent: its last reply, whose code blocks need no repeat
        self._waiting = _Waiting(clock)
        self._live: Live | None = None
        self._lock = threading.RLock()

    def event(self, type: str, **fields: Any) -> None:
        with self._lock:
            super().event(type, **fields)

    def close(self) -> None:
        """Take the waiting spinner off the screen (the run is over)."""
        with self._lock:
            self._waiting.since.clear()
            self._spin()

    # ------------------------------------------------------------ waiting and retries

    def _spin(self) -> None:
        """Show the spinner while a request waits, on a terminal only; stop it when none does."""
        if self._waiting.since and self._live is None and self._open_line is None and self.console.is_terminal:
            self._live = Live(self._waiting, console=self.console, transient=True, refresh_per_second=5,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        elif not self._waiting.since and self._live is not None:
            live, self._live = self._live, None
            live.stop()

    def _first_token(self, name: str) -> None:
        if self._waiting.since.pop(name, None) is not None:
            self._spin()

    def waiting(self, name: str = "?", attempt: Any = None) -> None:
        self._waiting.since[name] = (self._indent(name), self._waiting.clock())
        self._spin()

    def waited(self, name: str = "?", seconds: Any = None) -> None:
        self._first_token(name)

    def retrying(self, name: str = "?", attempt: Any = None, of: Any = None, wait: Any = None,
                 reason: Any = "", status: Any = None) -> None:
        self._first_token(name)
        self._line(name, ("↻ ", "yellow"), (f"{name}: the request failed ({_clean(reason)}); retry {attempt} of {of} "
                                             f"in {_seconds(wait)}", "yellow"))

    # ------------------------------------------------------------ writing

    def _indent(self, name: str) -> str:
        return "  " * self._depth.get(name, 0)

    def _write(self, text: Text, end: str = "") -> None:
        if not end and self._live is not None:
            # A spinner redraws below the last line: it would split a line still being
            # streamed, so it pauses until that line ends.
            live, self._live = self._live, None
            live.stop()
        self.console.print(text, end=end, soft_wrap=True, highlight=False)

    def _close_stream(self) -> None:
        if self._open_line is not None:
            self._write(Text(""), end="\n")
            self._open_line = None
            self._spin()

    def _line(self, name: str, *parts: str | Text | tuple[str, str]) -> None:
        """One whole line for agent `name`, indented by its depth; ends any open streamed line first.
        String parts are cleaned of control characters here, so callers need not."""
        self._close_stream()
        cleaned = [(_clean(part[0]), part[1]) if isinstance(part, tuple) else
                   _clean(part) if isinstance(part, str) else part for part in parts]
        self._write(Text.assemble(self._indent(name), *cleaned), end="\n")
        self._spin()

    def _prefix(self, name: str) -> Text:
        return Text(f"{_clean(name)} › ", style="bold cyan")

    def _text_lines(self, name: str, text: str) -> None:
        for line in _clean(text).split("\n"):
            self._line(name, self._prefix(name), line)

    # ------------------------------------------------------------ the model's side

    def system(self, name: str = "?", prompt: str = "") -> None:
        if self.verbose:
            self._line(name, (f"{name} system prompt:", "dim"))
            for line in _clean(prompt).split("\n"):
                self._line(name, ("  " + line, "dim"))

    def sent(self, name: str = "?", message: str = "", count: Any = None) -> None:
        if self.verbose:
            self._line(name, (f"→ {name} message {count if count is not None else ''}".rstrip(), "dim"))
            for line in _clean(message).split("\n"):
                self._line(name, ("  " + line, "dim"))
            return
        for attrs, body in find_tags(message if isinstance(message, str) else str(message), "error"):
            words = " ".join(_clean(body).split())
            words = words if len(words) <= _NOTE_CHARS else words[:_NOTE_CHARS] + "…"
            about = " ".join(f"{k}={_clean(v)}" for k, v in attrs.items())
            self._line(name, ("  ⚠ ", "yellow"), (f"{name} is told{f' ({about})' if about else ''}: {words}", "yellow"))

    def delta(self, name: str = "?", text: str = "") -> None:
        self._first_token(name)
        if name in self._cut:
            return  # the rest of a reply cut at an invented result: the model is not held to it
        raw = self._raw.get(name, "") + (text if isinstance(text, str) else str(text))
        self._raw[name] = raw
        ready = raw[:len(raw) - _held_back(raw)]
        kept, cut = cut_hallucinated(ready)
        if cut and _inside_open_block(kept):
            # A tag inside a block still being written is the model's code, once the block
            # closes: nothing is shown past it until then, and nothing is cut.
            cut, ready = False, kept
        upto = len(kept) if cut else len(ready)
        piece, self._shown[name] = raw[self._shown.get(name, 0):upto], max(upto, self._shown.get(name, 0))
        self._stream(name, piece)
        if cut:
            self._cut.add(name)
            self._mark_cut(name)

    def _mark_cut(self, name: str) -> None:
        self._close_stream()
        self._line(name, ("  ✂ ", "yellow"), (f"{name}: the reply is cut here, where the model wrote a result "
                                             "itself; it is held to the text above", "yellow"))

    def _stream(self, name: str, text: str) -> None:
        if name not in self._replies:
            self._replies[name] = InertText()
        text = self._replies[name].feed(text)
        if not text:
            return
        self._streamed.add(name)
        self._collapsed(name)
        if self._open_line != name or self._open_kind != "reply":
            self._close_stream()
        for piece in text.splitlines(keepends=True):
            if self._open_line is None:
                self._write(Text.assemble(self._indent(name), self._prefix(name)))
                self._open_line, self._open_kind = name, "reply"
            self._write(Text(piece.rstrip("\n")))
            if piece.endswith("\n"):
                self._write(Text(""), end="\n")
                self._open_line = None
        self._spin()  # resumes a spinner paused for the line, once it has ended

    def reasoning(self, name: str = "?", text: str = "") -> None:
        self._first_token(name)
        thought = self._thoughts.setdefault(name, _Thought())
        text = thought.filter.feed(text if isinstance(text, str) else str(text))
        for piece in text.splitlines(keepends=True):
            if not self.verbose and thought.lines >= self.reasoning_lines:
                thought.hidden += piece.count("\n")
                thought.hidden_tail = not piece.endswith("\n")
                continue
            if self._open_line != name or self._open_kind != "reasoning":
                self._close_stream()
                self._write(Text.assemble(self._indent(name), (f"{_clean(name)} ∴ ", "dim cyan")))
                self._open_line, self._open_kind = name, "reasoning"
            self._write(Text(piece.rstrip("\n"), style="dim"))
            if piece.endswith("\n"):
                self._write(Text(""), end="\n")
                self._open_line = None
                thought.lines += 1
        self._spin()

    def _collapsed(self, name: str) -> None:
        """Where reasoning gives way to the reply: one line counting the reasoning not shown."""
        thought = self._thoughts.get(name)
        if self._open_line == name and self._open_kind == "reasoning":
            self._close_stream()
        if thought is not None and (thought.hidden or thought.hidden_tail):
            more = thought.hidden + thought.hidden_tail
            self._line(name, (f"  ∴ … {more} more line{'s' if more != 1 else ''} of reasoning not shown", "dim"))
            thought.hidden, thought.hidden_tail = 0, False

    def replied(self, name: str = "?", message: str = "", stats: Any = None, latency: Any = None) -> None:
        # The reply's filter ends with it: a sequence it was cut in the middle of is dropped, and a last
        # lone \r would only have ended the line, which closing the stream does.
        self._first_token(name)
        message = message if isinstance(message, str) else str(message)
        raw, shown, was_cut = self._raw.pop(name, ""), self._shown.pop(name, 0), name in self._cut
        self._cut.discard(name)
        if name in self._streamed and not was_cut:
            kept, cut = cut_hallucinated(raw)  # the tail held back in case it began a result tag
            self._stream(name, kept[shown:])
            if cut:
                self._mark_cut(name)
        self._replies.pop(name, None)
        self._collapsed(name)
        self._thoughts.pop(name, None)
        kept, cut = cut_hallucinated(message)
        self._said[name] = kept
        if name in self._streamed:
            self._streamed.discard(name)
            if self._open_line == name:
                self._close_stream()
        elif kept:
            self._text_lines(name, kept)
            if cut:
                self._mark_cut(name)
        parts = [name]
        if latency is not None:
            parts.append(_seconds(latency))
        parts.extend(_format_stats(stats))
        if len(parts) > 1:
            self._line(name, ("  " + " · ".join(parts), "dim"))

    # ------------------------------------------------------------ code blocks

    def _block(self, name: str, id: Any) -> _ShownBlock:
        return self._blocks.setdefault((name, str(id)), _ShownBlock())

    def launched(self, name: str = "?", id: Any = "?", timeout: Any = None, heartbeat: Any = None,
                 code: str = "") -> None:
        self._blocks[(name, str(id))] = _ShownBlock()
        limits = []
        if isinstance(timeout, (int, float)):
            limits.append(f"timeout {format_duration(timeout)}")
        if isinstance(heartbeat, (int, float)) and heartbeat:
            limits.append(f"heartbeat {format_duration(heartbeat)}")
        self._line(name, "  ▸ ", (f"{name}/{id}", "bold"), (f"  {', '.join(limits)}" if limits else "", "dim"))
        if isinstance(code, str) and code.strip() and code.strip() in self._said.get(name, ""):
            return  # the reply shown just above holds it: once is enough
        lines = _clean(code).strip("\n").split("\n") if code else []
        shown = lines if self.verbose else lines[:self.code_lines]
        for line in shown:
            self._line(name, ("    ┆ " + line, "dim"))
        if len(lines) > len(shown):
            self._line(name, (f"    ┆ … {len(lines) - len(shown)} more lines", "dim"))

    def _feed(self, name: str, id: Any, block: _ShownBlock, stream: str, text: str) -> None:
        if stream not in block.filters:
            block.filters[stream] = InertText(carriage_returns=True)
        text = block.partial.pop(stream, "") + block.filters[stream].feed(str(text))
        *complete, rest = text.split("\n")
        if rest:
            # A line that never ends (150 MiB without a newline) must not grow without bound:
            # keep what a terminal would still show of it, the part after its last \r, capped.
            block.partial[stream] = _terminal_line(rest)[:_PARTIAL_CAP]
        for line in complete:
            self._output_line(name, id, block, stream, _terminal_line(line))

    def _output_line(self, name: str, id: Any, block: _ShownBlock, stream: str, line: str) -> None:
        if not self.verbose and block.lines >= self.output_lines:
            block.hidden += 1
            return
        block.lines += 1
        self._line(name, (f"    {name}/{id} │ ", "dim"), (line, "red" if stream == "stderr" else ""))

    def output(self, name: str = "?", id: Any = "?", stream: str = "stdout", text: str = "") -> None:
        block = self._block(name, id)
        block.live = True
        self._feed(name, id, block, stream, text)

    def display(self, name: str = "?", id: Any = "?", index: Any = None, line: Any = "", text: Any = "") -> None:
        """One line for what a block displayed: an image's size and file, or its text's first line."""
        shown = line if isinstance(line, str) and line else (
            f"[display: {_clean(text).strip().splitlines()[0][:200]}]" if isinstance(text, str) and text.strip()
            else "[display]")
        self._line(name, (f"    {name}/{id} ", "dim"), (_clean(shown), "cyan"))

    def progress(self, name: str = "?", id: Any = "?", current: Any = None, output: Any = None) -> None:
        block = self._block(name, id)
        if not block.live and isinstance(output, str) and len(output) > block.shown_chars:
            self._feed(name, id, block, "stdout", output[block.shown_chars:])
            block.shown_chars = len(output)
        else:
            self._line(name, (f"    {name}/{id} … running {_seconds(current, '{:.0f}s')}", "dim"))

    def finished(self, name: str = "?", id: Any = "?", duration: Any = None, cancelled: Any = False,
                 output: Any = None, status: str | None = None) -> None:
        block = self._blocks.pop((name, str(id)), None) or _ShownBlock()
        if not block.live and isinstance(output, str):
            self._feed(name, id, block, "stdout", output[block.shown_chars:])
        for stream, rest in list(block.partial.items()):
            self._output_line(name, id, block, stream, _terminal_line(rest))
        if block.hidden:
            self._line(name, (f"    {name}/{id} │ … {block.hidden} more lines not shown", "dim"))
        if status is None:
            if isinstance(output, str) and output.endswith("[timed out]"):
                status = "timed out"
            else:
                status = "cancelled" if cancelled else "done"
        mark, style = _STATUS_STYLE.get(status, ("✗", "red"))
        self._line(name, ("  " + mark + " ", style), (f"{name}/{id}", "bold"),
                   (f" {status}", style), f" in {_seconds(duration, '{:.2f}s')}")

    # ------------------------------------------------------------ agents and notices

    def agent_started(self, name: str = "?", parent: str | None = None, model: Any = None, task: str = "",
                      forked: Any = False) -> None:
        self._depth[name] = self._depth.get(parent, 0) + 1 if parent else 0
        lines = _clean(task).strip().split("\n")
        first = lines[0] if self.verbose or len(lines[0]) <= 100 else lines[0][:100] + "…"
        fork = f" (fork of {_clean(str(parent))})" if forked is True and parent else ""
        self._line(name, ("▶ ", "bold"), (name, "bold cyan"), (f" ({model})" if model else "", "dim"),
                   (fork, "dim"), f" {first}")
        if self.verbose:
            for line in lines[1:]:
                self._line(name, "  " + line)
        elif len(lines) > 1:
            self._line(name, (f"  … {len(lines) - 1} more lines", "dim"))

    def agent_finished(self, name: str = "?", status: str = "done", duration: Any = None, reason: Any = "") -> None:
        mark, style = _STATUS_STYLE.get(status, ("✗", "red"))
        took = f" in {_seconds(duration, '{:.0f}s')}" if duration is not None else ""
        why = " ".join(_clean(reason).split()) if reason else ""
        self._line(name, (mark + " ", style), (name, "bold cyan"), (f" {status}", style), took,
                   (f": {why}" if why else "", style))

    def cancelled(self, name: str = "?", label: str = "") -> None:
        self._line(name, ("✗ ", "yellow"), (name, "bold"), (f" cancelled: {_clean(label)}", "yellow"))

    def failed(self, name: str = "?", message: str = "") -> None:
        self._line(name, ("! ", "bold red"), (name, "bold"), (f" {_clean(message)}", "red"))

    def note(self, name: str = "?", message: str = "") -> None:
        self._line(name, ("• ", "yellow"), (f"{name}: {_clean(message)}", "yellow"))

    def connection(self, name: str = "?", host: Any = "", port: Any = 0, verdict: Any = "", words: Any = "") -> None:
        """A connection its code made through its way out (``--allow-net``): one line for each
        refused or failed one (those allowed are in the recording and the traces)."""
        if verdict != "allowed":
            self._line(name, ("⊘ ", "yellow"), (f"{name}: network {verdict}: {_clean(host)}:{_clean(port)}"
                                                 f"{' (' + _clean(words) + ')' if words else ''}", "yellow"))


_STATUS_STYLE = {
    "done": ("✓", "green"),
    "ok": ("✓", "green"),
    "answered": ("✓", "green"),
    "error": ("✗", "red"),
    "died": ("✗", "red"),
    "killed": ("✗", "red"),
    "failed": ("✗", "red"),
    "cancelled": ("✗", "yellow"),
    "timed out": ("✗", "red"),
    "timeout": ("✗", "red"),
}


def _format_stats(stats: Any) -> list[str]:
    """Tokens and cost from a stats mapping; keys it does not know are left out."""
    if stats is None:
        return []
    if not isinstance(stats, Mapping):
        return [_clean(stats)]
    def number(*keys: str) -> float | None:
        for key in keys:
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
        return None

    parts = []
    for keys, label in ((("context",), "ctx"), (("prompt_tokens",), "in"), (("generated", "completion_tokens"), "out")):
        value = number(*keys)
        if value is not None:
            parts.append(f"{value:,.0f} {label}")
    cost = number("cost")
    if cost is not None:
        parts.append(f"${cost:.4f}")
    return parts
