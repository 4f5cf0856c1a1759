"""The tag protocol the model speaks: what it writes and what it reads back.

The model writes ``<run_code>`` and ``<run_agent>`` blocks; it reads ``<run_code_result>``,
``<running>``, ``<agent_result>``, ``<agent_status>``, ``<error>``, ``<steer>``, ``<status>`` and
``<reminder>``. Everything here is text in, text out: no I/O, no clocks (callers pass times in).

A reply is acted on in three steps, in this order::

    reply = strip_think(raw)                 # drop the reasoning scratchpad
    reply, cut = cut_hallucinated(reply)     # drop results the model invented
    parsed = parse_reply(reply)              # the blocks to run, or the words to send back

Parsing never raises at the model: a malformed attribute or an unclosed block becomes an
``<error>`` text in ``ParsedReply.errors``.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from engine.durations import DEFAULT_BLOCK_TIMEOUT, parse_duration
from engine.errors import ConfigError
from worker.contract.describe import describe_object  # noqa: F401 - re-exported: one implementation

__all__ = [
    "ATTR_RE", "AgentRequest", "CodeRequest", "ENVIRONMENT", "HALLUCINATION_STOPS", "ParsedReply",
    "SYSTEM", "build_system", "compaction_reminder", "cut_hallucinated", "describe_namespace", "find_tags",
    "format_agent_result", "format_agent_start_failed", "format_agent_status", "format_already_running",
    "format_code_result", "format_error", "format_reply_cut", "format_running", "format_status",
    "format_steer", "format_vars", "parse_attrs", "parse_reply", "wrap", "writable_places"
]

ATTR_RE = re.compile(r'(\w+)\s*=\s*(?:"([^"]*)"|([^\s>]+))')


_FLAG_RE = re.compile(r"(?<![\w=\"'])([A-Za-z_]\w*)(?![\w=])")


def parse_attrs(text: str) -> dict[str, str]:
    """Attributes of a tag as a dict: ``name="quoted value"`` or ``name=bare``, and a bare
    ``name`` (a flag, as ``fork``) as ``""``; anything else is skipped."""
    found = {name: quoted or bare for name, quoted, bare in ATTR_RE.findall(text)}
    for flag in _FLAG_RE.findall(ATTR_RE.sub(" ", text)):
        found.setdefault(flag, "")
    return found


def _is_set(attrs: dict[str, str], name: str) -> bool:
    """Whether flag ``name`` is given (bare, or with a value other than false/no/0)."""
    return name in attrs and attrs[name].strip().lower() not in ("false", "no", "0")


def _find_blocks(message: str, tag: str) -> Iterator[tuple[dict[str, str], str, int, int]]:
    """(attrs, body, start, end) of every complete block; start/end span the open tag to the close tag."""
    for match in re.finditer(rf"^[ \t]*<{tag}(?=[ >])(?P<attrs>[^>]*)>", message, re.MULTILINE):
        attrs = parse_attrs(match.group("attrs"))
        boundary = attrs.get("boundary")
        close = f'</{tag} boundary="{boundary}">' if boundary else f"</{tag}>"
        found = re.search(rf"^[ \t]*{re.escape(close)}", message[match.end():], re.MULTILINE)
        if found is None and tag == "run_agent":
            # The system prompt shows <run_agent ...>task</run_agent> on one line; accept that
            # form too when no close starts a line (a reply the seed would have refused).
            found = re.match(rf"[^\n]*?({re.escape(close)})", message[match.end():])
            if found:
                body = message[match.end():match.end() + found.start(1)]
                yield attrs, body, match.start(), match.end() + found.end()
                continue
        if found:
            body = message[match.end():match.end() + found.start()]
            yield attrs, body, match.start(), match.end() + found.end()


def find_tags(message: str, tag: str) -> Iterator[tuple[dict[str, str], str]]:
    """Yield (attrs, body) for every ``<tag ...>...</tag>`` whose open tag starts a line.

    The close only counts when it too starts a line, so a ``</tag>`` mid-line inside the body (in a
    string, a comment) is inert. A ``boundary="x"`` attribute additionally protects a ``</tag>`` at
    the start of a line inside the body: the block then ends only at ``</tag boundary="x">``. The
    ``(?=[ >])`` guard keeps ``run_code`` from also matching ``run_code_result``. An open tag with
    no close is skipped (see ``ParsedReply.attempted``).
    """
    for attrs, body, _start, _end in _find_blocks(message, tag):
        yield attrs, body


def wrap(tag: str, attrs: str, body: str) -> str:
    """``<tag attrs>\\nbody\\n</tag>\\n``; `attrs` is pre-rendered with a leading space, or "".

    If `body` holds the closing tag at the start of a line (the only thing a reader could take for
    the real close), both delimiters get a ``boundary="x"`` with a short random token absent from
    the body, like a multipart boundary, so the true end stays findable.
    """
    if re.search(rf"^[ \t]*</{tag}>", body, re.MULTILINE):
        boundary = secrets.token_hex(3)
        while boundary in body:
            boundary = secrets.token_hex(3)
        return f'<{tag}{attrs} boundary="{boundary}">\n{body}\n</{tag} boundary="{boundary}">\n'
    return f"<{tag}{attrs}>\n{body}\n</{tag}>\n"


# ---------------------------------------------------------------- cleaning a reply

HALLUCINATION_STOPS = ["<run_code_result", "<running", "<agent_result", "<agent_status"]

# Result tags only the engine writes. `(?!\w)` so `<running_total` in prose is not a tag.
_HALLUCINATION_RE = re.compile(r"<(?:run_code_result|running|agent_result|agent_status)(?!\w)")


def cut_hallucinated(reply: str) -> tuple[str, bool]:
    """(reply cut before the first result tag the model wrote itself, whether it was cut).

    A model that writes ``<run_code_result``, ``<running``, ``<agent_result`` or ``<agent_status``
    is inventing output it has not seen: everything from that tag on is cut before the reply is
    acted on. The tag counts anywhere, at a line start or mid-line, except inside a complete
    ``<run_code>``/``<run_agent>`` block, where it is the model's code or task text (a string
    literal, a parser) and must run as written.
    """
    protected = [(start, end) for tag in ("run_code", "run_agent")
                 for _attrs, _body, start, end in _find_blocks(reply, tag)]
    for match in _HALLUCINATION_RE.finditer(reply):
        if not any(start <= match.start() < end for start, end in protected):
            return reply[:match.start()], True
    return reply, False


# ---------------------------------------------------------------- parsing a reply

@dataclass
class CodeRequest:
    """One ``<run_code>`` block. `id` is the model's, or None for the caller to number (b1, b2, ...)."""

    id: str | None
    code: str
    timeout: float
    heartbeat: float | None
    attrs: dict[str, str]


@dataclass
class AgentRequest:
    """One ``<run_agent>`` block: a sub-agent to start with `task` in a fresh context."""

    name: str
    task: str
    namespace: list[str]
    model: str
    heartbeat: float | None
    context: str
    attrs: dict[str, str]
    fork: bool = False  # started in a fork of the calling agent's worker


@dataclass
class ParsedReply:
    """What a reply asks for. `errors` are ready-to-send ``<error>`` texts; `attempted` is true when
    the reply opens a ``<run_code>``/``<run_agent>`` tag at a line start, closed or not."""

    code: list[CodeRequest] = field(default_factory=list)
    agents: list[AgentRequest] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    attempted: bool = False


_ATTEMPT_RE = re.compile(r"^[ \t]*<run_(?:code|agent)(?=[ >])", re.MULTILINE)


def _duration_attr(attrs: dict[str, str], name: str, default: float | None = None) -> float | None:
    try:
        return parse_duration(attrs.get(name), default)
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from error


def parse_reply(reply: str, default_timeout: float = DEFAULT_BLOCK_TIMEOUT) -> ParsedReply:
    """The code blocks and sub-agents `reply` asks for, or the errors to tell the model.

    One malformed attribute (a bad timeout or heartbeat) voids the whole reply: nothing runs and one
    error says so, as a half-run reply would leave the model guessing what happened. A reply that
    opens a block but closes none was cut off; that error is sent only when nothing else was wrong.
    """
    parsed = ParsedReply(attempted=bool(_ATTEMPT_RE.search(reply)))
    try:
        for attrs, code in find_tags(reply, "run_code"):
            parsed.code.append(CodeRequest(
                id=attrs.get("id") or None,
                code=code,
                timeout=_duration_attr(attrs, "timeout", default_timeout),
                heartbeat=_duration_attr(attrs, "heartbeat"),
                attrs=attrs,
            ))
        for attrs, task in find_tags(reply, "run_agent"):
            parsed.agents.append(AgentRequest(
                name=attrs.get("name") or "sub",
                task=task.strip(),
                namespace=[name.strip() for name in attrs.get("namespace", "").split(",") if name.strip()],
                model=attrs.get("model", ""),
                heartbeat=_duration_attr(attrs, "heartbeat"),
                context=attrs.get("context", ""),
                attrs=attrs,
                fork=_is_set(attrs, "fork"),
            ))
    except ConfigError as error:
        parsed.code, parsed.agents = [], []
        parsed.errors.append(format_error("", f"Could not parse the attributes of your <run_code>/<run_agent> tags: "
                                              f"{error}. Fix the malformed attribute and resend; nothing was run."))
        return parsed
    if parsed.attempted and not parsed.code and not parsed.agents:
        parsed.errors.append(format_error("", "Your reply was cut off: it opens a <run_code>/<run_agent> tag but "
                                              "never closes it, so nothing ran. Resend a complete, closed block."))
    return parsed


# ---------------------------------------------------------------- what the model reads back

def format_code_result(id: str, duration_s: float, output: str) -> str:
    """The final result of a block: ``<run_code_result id=b1 duration=0.12s>``."""
    return wrap("run_code_result", f" id={id} duration={duration_s:.2f}s", output)


def format_running(id: str, elapsed_s: float, now: datetime, deadline: datetime, output: str) -> str:
    """A heartbeat of a running block, with its output so far and wall-clock times."""
    return wrap("running", f" id={id} current={elapsed_s:.0f}s now={now:%H:%M:%S} deadline={deadline:%H:%M:%S}",
                output)


def format_agent_result(name: str, duration_s: float, body: str) -> str:
    """A sub-agent's final answer (or ``[cancelled]`` / ``[failed] ...``)."""
    return wrap("agent_result", f" name={name} duration={duration_s:.0f}s", body)


def format_agent_status(name: str, elapsed_s: float, body: str) -> str:
    """A heartbeat of a working sub-agent."""
    return wrap("agent_status", f" name={name} elapsed={elapsed_s:.0f}s", body)


def format_error(attrs: str, body: str) -> str:
    """An ``<error>`` for the model; `attrs` is pre-rendered (`` id=b1``) or ""."""
    return wrap("error", attrs, body)


def format_already_running(id: str) -> str:
    """The error for a block whose id is still running: it is not started again."""
    return format_error(f" id={id}", "already running, not restarted; reply in plain text to wait for it")


def format_agent_start_failed(name: str, error: object) -> str:
    """The error for a sub-agent that could not be started (depth limit, unknown model, ...)."""
    return format_error(f" name={name}", f"Could not start this sub-agent: {error}")


def format_reply_cut(max_tokens: int | None, reply: str) -> str:
    """The note for a reply the server cut at the reply-length cap: nothing after the cut arrived."""
    limit = f" of {max_tokens} tokens" if max_tokens else ""
    ran = ("Complete <run_code>/<run_agent> blocks in it ran; an unclosed one did not. "
           if "<run_" in reply else "")
    return format_error(" reason=length", (
        f"Your previous reply reached the reply-length limit{limit} and was cut off where it ends. {ran}"
        "Continue from there in a shorter reply: resend an unfinished block whole, or split the work. "
        "If it was your final answer, send the whole answer again, shorter."))


def format_steer(text: str) -> str:
    """A note from the user, delivered between turns."""
    return wrap("steer", "", text)


def format_vars(items: Sequence[str]) -> str:
    """`` vars=[a:int, s:str(3)]`` from ``name:type`` items, at most 25; "" for none."""
    return f" vars=[{', '.join(items[:25])}]" if items else ""


def format_status(context_tokens: int, spent: float, last_reply: float, vars_note: str | Sequence[str] = "") -> str:
    """The status line appended to every message: context size, money spent, last latency, variables.

    `vars_note` is either rendered (``" vars=[...]"`` or "") or the ``name:type`` items for format_vars.
    """
    if not isinstance(vars_note, str):
        vars_note = format_vars(list(vars_note))
    return f"<status context_tokens={context_tokens} spent=${spent:.4f} last_reply={last_reply:.1f}s{vars_note}/>\n"


def compaction_reminder() -> str:
    """The nudge sent with the status once the context grows large."""
    return ('<reminder>Your context is growing and every turn now costs more. Call '
            'self.compact_knowledge("...") NOW, before your next action — pass a SELF-CONTAINED summary that '
            'keeps every exact URL, file path you created, value/credential/deduction found, the item you are '
            'on and the next step. Everything you leave out is GONE. Do it this turn, not in a few turns.</reminder>\n')


# ---------------------------------------------------------------- the system prompt

SYSTEM = """You are an AI agent that solves tasks by writing and running Python code and starting sub-agents.
Each reply is one or more <run_code>/<run_agent> blocks, or plain text to wait while running blocks and sub-agents keep working. Run code like this:
<run_code id="x" timeout="30s" heartbeat="5s">
print("result")
</run_code>
What you print comes back, and what you display: display(obj) (a Pillow image, a figure, anything with _repr_png_/_repr_html_), plt.show() and figures still open when the block ends come back as images. Attributes: id (echoed on the result), timeout (default 10s), heartbeat (how often partial output streams while it runs).
A finished block returns <run_code_result id=... duration=...>output</run_code_result>. With a heartbeat it also streams <running id=... current=...>partial output</running> as it runs. That is only a status. Reply in plain text to let it keep going. Left alone it runs to its deadline, then is killed.
Boundaries: a closing tag ends a block only at the start of a line, so </run_code> mid-line (in a string or comment) is inert.
Rules:
- Work in small steps. Each block makes a little progress.
- Blocks share one persistent namespace and run concurrently. Variables, imports and functions persist.
- Your code runs in an asyncio loop. Use top-level await directly.
- Prefer your provided tools over reimplementing them.
- self.compact_knowledge("...") replaces your whole history with that text. Keep every fact, path, value and next step you still need. Drop the rest.
- When the task is solved and nothing of yours is running, reply in plain text. That is your final answer.
Sub-agents run in a fresh context. Start one with <run_agent name="sub" namespace="a,b" model="flash" heartbeat="30s">task</run_agent>. It returns instantly. Its answer arrives as <agent_result name=...>...</agent_result>, and heartbeat streams <agent_status name=...> while it works. namespace lists objects to pass from your namespace. model picks its model; send bulk or simple work to a fast one. Delegate any subtask whose main cost is reading a lot (pages, big files, logs): the sub-agent returns only the result and keeps your context small.
Add fork (<run_agent name="try-a" fork>task</run_agent>, or self.run_agent(..., fork=True)) to start it in a copy of your worker instead: it sees your whole namespace at once (variables, imports, loaded data), in milliseconds, and the variables it changes stay its own (files it writes, in the workspace or /tmp, you both see). Fork only while none of your other blocks runs.
"""

ENVIRONMENT = """You are running on the '{model_alias}' model ({model}). When you spawn a sub-agent you can give it a different model with the model="alias" attribute on <run_agent> (or the model= argument of self.run_agent): pick a cheap fast model for simple or bulk work and a stronger model for hard reasoning. Omit it to reuse your own model. Available models:
{available_models}
Environment:
Runtime: Python {python} on {os}
CPU cores: {cpu}{ram}{files}
Top-level installed packages: {packages}{namespace}"""


def build_system(*, model_alias: str, model: str, available_models: str, python: str, os: str, cpu: int | None,
                 ram: str, packages: Sequence[str], namespace_block: str, minimal: bool = False,
                 guide: str | None = None, files: str = "") -> str:
    """The system prompt: the format guide (SYSTEM) then the filled ENVIRONMENT.

    `ram` is ``"12 GB available of 16 GB"`` or "" when unknown; `files` the one line saying where
    code may write (``writable_places``); `namespace_block` comes from
    describe_namespace. `minimal` (AGENT_MINIMAL_SYSTEM=1) drops the guide, for models fine-tuned to
    know the format. `guide` replaces SYSTEM (the tool-calling protocol has its own).
    """
    intro = "" if minimal else (guide or SYSTEM) + "\n"
    return intro + ENVIRONMENT.format(
        model_alias=model_alias,
        model=model,
        available_models=available_models,
        python=python,
        os=os,
        cpu=cpu,
        ram=f"\nRAM: {ram}" if ram else "",
        files=f"\nFiles: {files}" if files else "",
        packages=", ".join(packages),
        namespace=namespace_block,
    )


def writable_places(cwd: str, workspace: str, sandboxed: bool) -> str:
    """Where code may write, in one line for the model (and for a write refused elsewhere)."""
    if not sandboxed:
        return f"no sandbox; keep your files in the workspace {workspace}"
    if cwd == workspace:
        files = "; ./files is there too" if os.path.isdir(os.path.join(workspace, "files")) else ""
        return (f"write in the current directory {workspace} (the workspace{files}) "
                "and $TMPDIR; everything else is read-only")
    if workspace == cwd.rstrip("/") + "/files":
        return f"the current directory {cwd} is read-only; write in ./files ({workspace}) and $TMPDIR"
    return f"write in the workspace {workspace} and $TMPDIR; everything else, the current directory {cwd} included, is read-only"


def describe_namespace(descriptions: Sequence[str]) -> str:
    """The namespace block of the system prompt from describe_object entries (rendered here or in a
    worker); "" when there are none."""
    if not descriptions:
        return ""
    tools = "\n".join(f"- {description}" for description in descriptions)
    return f"\nThese objects are already available by name in your code (no import needed):\n{tools}"
