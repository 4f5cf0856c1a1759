"""The examples of README.md and docs/: every fenced block, what the comment before it says,
and how each language is checked and run (``tests/test_docs.py`` runs them; the rules are
written for readers in docs/README.md, "How the examples are tested").

A block is run by its language; ``<!-- not run: WHY -->`` right before it keeps it from running
(it is still checked) and ``<!-- file: NAME -->`` also writes it to NAME in the page's
directory, for the blocks after it.  Commands named in blocks and in the text are checked
against the real command line: ``agentloop``'s click commands, the ``scripts/`` that exist and
the options their argparse declares.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
#: The languages the harness knows, and what it does with each.
LANGUAGES = {
    "python": "run in a subprocess", "toml": "read as agentloop.toml", "json": "parsed", "jsonl": "parsed",
    "sh": "commands checked, then run", "bash": "as sh", "console": "commands checked, run, output compared",
    "xml": "a tags reply, parsed", "text": "a diagram, not run",
}

_FENCE = re.compile(r"^( *)(```+)([\w-]*)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*(not run|file):\s*(.*?)\s*-->\s*$")


def pages() -> list[Path]:
    """README.md and every page of docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@dataclass
class Block:
    """One fenced block: where it is, its language, its text (dedented) and its markers."""

    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    not_run: str | None = None
    file: str | None = None

    @property
    def where(self) -> str:
        return f"{name(self.page)}:{self.line}"


@dataclass
class Page:
    """A page split into its blocks and its prose (the lines outside blocks), and the problems
    found while reading it (a marker that is not right before a block, a fence never closed)."""

    path: Path
    blocks: list[Block] = field(default_factory=list)
    prose: str = ""
    problems: list[str] = field(default_factory=list)


def read(path: Path) -> Page:
    lines = path.read_text().split("\n")
    page = Page(path)
    prose: list[str] = []
    markers: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        fence = _FENCE.match(line)
        if marker:
            kind, value = marker.groups()
            if kind in markers:
                page.problems.append(f"{name(path)}:{i + 1}: two '{kind}' markers for one block")
            markers[kind] = value
            i += 1
            continue
        if markers and not fence:
            page.problems.append(f"{name(path)}:{i}: a marker must be on the line right before its block")
            markers = {}
        if not fence:
            prose.append(line)
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        close = re.compile(rf"^ {{0,{len(indent)}}}{ticks}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            page.problems.append(f"{name(path)}:{i + 1}: a block that is never closed")
            break
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end])
        page.blocks.append(Block(path, i + 1, lang, body + "\n", markers.get("not run"), markers.get("file")))
        if "not run" in markers and not markers["not run"]:
            page.problems.append(f"{name(path)}:{i + 1}: 'not run' must say why")
        markers = {}
        prose.append("")
        i = end + 1
    page.prose = "\n".join(prose)
    return page


# ---------------------------------------------------------------- the commands a page names

#: The characters of the shell words that end one command (``;``, ``&&``, ``|``, ``$(``, ``>``...).
_PUNCTUATION = set(";&|()<>$`")


def commands_in(text: str) -> Iterator[list[str]]:
    """Each simple command of a shell line, as words (assignments before it and ``export``
    left out), for the commands the harness checks: ``agentloop`` and ``scripts/...``."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: a fragment, not a command line
        return
    command: list[str] = []
    for word in [*words, ";"]:
        if set(word) <= _PUNCTUATION:  # `export X=$(cmd ...)` is `export`, `X=$`, `(`, `cmd`, ...
            if command:
                yield command
            command = []
        elif command or not (re.fullmatch(r"[A-Za-z_]\w*=.*", word) or word == "export"):
            command.append(word)


def _is_agentloop(word: str) -> bool:
    return word == "agentloop" or word.endswith("scripts/agentloop")


def _is_placeholder(word: str) -> bool:
    """CMD, FILE, [QUESTION]..., ...: words that stand for what the reader types."""
    stripped = word.strip("[].")
    return not stripped or stripped.isupper() or "..." in word


def _options(command: click.Command) -> dict[str, click.Parameter]:
    found: dict[str, click.Parameter] = {"--help": None, "-h": None}
    for param in command.params:
        if isinstance(param, click.Option):
            for opt in (*param.opts, *param.secondary_opts):
                found[opt] = param
    return found


def _takes_value(param: click.Parameter | None) -> int:
    if param is None or not isinstance(param, click.Option) or param.is_flag or param.count:
        return 0
    return max(1, param.nargs)


def _check_options(command: click.Command, words: list[str], what: str) -> tuple[list[str], int]:
    """The options of ``command`` among ``words`` that it lacks; and where its options end
    (the first positional word, for a command that takes no option after it)."""
    options = _options(command)
    interspersed = command.context_settings.get("allow_interspersed_args", True) and not isinstance(
        command, click.Group)
    wrong, i = [], 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return wrong, len(words)
        if word.startswith("-") and word != "-" and not re.fullmatch(r"-\d.*", word):
            opt = word.split("=", 1)[0]
            if opt not in options:
                wrong.append(f"{what}: no option {opt}")
                i += 1
                continue
            i += 1 + (0 if "=" in word else _takes_value(options[opt]))
            continue
        if not interspersed:
            return wrong, i
        i += 1
    return wrong, i


def check_agentloop(words: list[str]) -> list[str]:
    """What is wrong with ``agentloop WORDS...``: a command or an option that does not exist."""
    from engine.cli import main

    ctx = click.Context(main)
    wrong, at = _check_options(main, words[1:], "agentloop")
    rest = words[1 + at:]
    if not rest or _is_placeholder(rest[0]):
        return wrong
    command = main.get_command(ctx, rest[0]) if rest[0] in main.list_commands(ctx) else None
    if command is None:
        return [*wrong, f"agentloop: no command {rest[0]!r}"]
    return wrong + _check_options(command, rest[1:], f"agentloop {rest[0]}")[0]


def _script_options(script: str) -> set[str] | None:
    """The options a script's argparse declares (None: a script that takes anything)."""
    source = {"bench": "bench.py", "real-model": "real_model.py"}.get(script, script if script.endswith(".py") else "")
    if script == "test":
        return None
    if not source:
        return set()
    text = (ROOT / "scripts" / source).read_text()
    found = set(re.findall(r'add_argument\(\s*"(-[-\w]+)"', text))
    found |= set(re.findall(r'add_argument\(\s*"-[-\w]+",\s*"(-[-\w]+)"', text))
    return found | {"--help", "-h"}


def check_script(words: list[str]) -> list[str]:
    """What is wrong with ``scripts/NAME WORDS...``: a script that does not exist, an option
    its argparse does not declare, a test path that is not there."""
    script = words[0].split("scripts/", 1)[1]
    if _is_placeholder(script):
        return []
    if not (ROOT / "scripts" / script).is_file():
        return [f"no script scripts/{script}"]
    known = _script_options(script)
    wrong = []
    for word in words[1:]:
        if known is None:  # scripts/test: pytest's arguments; the paths must exist
            path = word.split("::", 1)[0]
            if path.startswith("tests") and not (ROOT / path).exists():
                wrong.append(f"scripts/test: no {path}")
        elif word.startswith("-") and word.split("=", 1)[0] not in known:
            wrong.append(f"scripts/{script}: no option {word.split('=', 1)[0]}")
    return wrong


def check_line(text: str) -> list[str]:
    """Every ``agentloop`` and ``scripts/...`` command of a shell line, checked."""
    wrong = []
    for words in commands_in(text):
        if _is_agentloop(words[0]):
            wrong += check_agentloop(words)
        elif words[0].startswith("scripts/"):
            wrong += check_script(words)
    return wrong


def shell_lines(block: Block) -> list[tuple[str, list[str]]]:
    """A shell block as (command, expected output lines): every line of an ``sh`` block is a
    command; a ``console`` block's commands are its ``$ `` lines, each followed by its output."""
    if block.lang in ("sh", "bash"):
        return [(line, []) for line in block.body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    out: list[tuple[str, list[str]]] = []
    for line in block.body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def matches(expected: list[str], got: list[str]) -> bool:
    """Whether output lines ``got`` are ``expected``, where a line ``...`` stands for any lines."""
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    while got and not got[-1].strip():
        got = got[:-1]
    pattern = "".join(r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n" for line in expected)
    return re.fullmatch(pattern, "".join(line.rstrip() + "\n" for line in got)) is not None


# ---------------------------------------------------------------- what the prose names

_INLINE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_PATH = re.compile(r"(?<![\w./~-])((?:engine|worker|tests|scripts)/[\w./-]*\w)")
_DOTTED = re.compile(r"(?<![\w.])((?:engine|worker)(?:\.[A-Za-z_]\w*)+)")


def inline_code(prose: str) -> list[str]:
    """The inline code spans of a page's prose, newlines inside them made spaces."""
    return [" ".join(m.group(2).replace("\\|", "|").split()) for m in _INLINE.finditer(prose)]


def paths_named(text: str) -> set[str]:
    return set(_PATH.findall(text))


def dotted_names(spans: list[str]) -> set[str]:
    """``engine.x.y`` and ``worker.x`` names (``worker.py``, a file's name, left out)."""
    return {m for span in spans for m in _DOTTED.findall(span) if not m.endswith(".py")}


def resolve(dotted: str) -> str | None:
    """Why ``engine.x.y`` names nothing public (None: it does): a module, then attributes."""
    import importlib

    parts = dotted.split(".")
    if any(p.startswith("_") for p in parts):
        return f"{dotted}: a private name; name what the package's face offers"
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{dotted}: {'.'.join(parts[:cut])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"{dotted}: no such module"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", read(page).prose, re.MULTILINE)}


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def links(prose: str) -> list[str]:
    """The relative link targets of a page (``http(s)``, ``mailto`` left out)."""
    return [t for t in _LINK.findall(prose) if not re.match(r"[a-z]+:", t)]
