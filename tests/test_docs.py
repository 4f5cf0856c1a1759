"""Every example of README.md and docs/ runs as written, and the text names only what exists.

Each page's fenced blocks run in order in a directory of the page's own, against one scripted
model server for the whole module (its URL is every example's ``LLM_URL``); how each language is
run, and the two comments that change it, are in ``tests/docs_examples.py`` and, for readers,
docs/README.md ("How the examples are tested").  Besides: every command and option the text
names exists, every link leads to a page and a heading that exist, every path and dotted name
is in the code, the README stays a README, and the pages that describe a piece of the code
(worker options, agentloop.toml, the layer diagram, the command table) name all of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

import click
import pytest

from engine.agent import find_tags
from engine.config import MODEL_KEYS, TOP_KEYS, read_config
from engine.models import DEFAULT_MODEL_ID, load_models
from engine.scripted import Script, ScriptedServer

from . import docs_examples as docs
from .test_layers import _graph

ROOT = docs.ROOT
PAGES = docs.pages()
RUN_TIMEOUT = 120  # seconds for one example (a sandboxed run takes one or two)

#: The replies the examples need beyond the tour's script, first so that they win.
DOCS_SCRIPT = {
    "2**100": [
        "<run_code id=\"power\">\nprint(2**100)\n</run_code>",
        "2**100 is 1267650600228229401496703205376.",
        "<run_code id=\"digits\">\nprint(sum(int(d) for d in str(2**100)))\n</run_code>",
        "The sum of its digits is 115.",
    ],
    "100th prime": [  # smolagents' CodeAgent speaks in <code> blocks
        "Thought: list primes until there are 100.\n<code>\nprimes = [n for n in range(2, 1000) "
        "if all(n % d for d in range(2, int(n ** 0.5) + 1))]\nfinal_answer(primes[99])\n</code>",
    ],
}

#: Modules of the optional extras: an example that needs a missing one is skipped, saying so.
EXTRAS = {"smolagents": "smolagents", "mcp": "mcp", "ray": "ray", "opentelemetry": "otel"}


@pytest.fixture(scope="module")
def model_url():
    example = json.loads((ROOT / "engine" / "examples" / "scripted-model.json").read_text())
    script = Script.from_json({**DOCS_SCRIPT, **example})
    with ScriptedServer(script, model_id=DEFAULT_MODEL_ID) as server:
        yield server.url


def _environment(tmp: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "AGENT_", "OTEL_", "VIRTUAL_ENV"))}
    home = tmp / "home"  # beside the page's directory: exec refuses to write a directory above a home
    home.mkdir(exist_ok=True)
    env.update(LLM_URL=url, HOME=str(home), PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
               COLUMNS="100", NO_COLOR="1")
    return env


def _missing_extra(text: str, lang: str) -> str | None:
    wanted = set()
    if lang == "python":
        wanted = {m for m in EXTRAS if re.search(rf"^\s*(?:from|import) {m}\b", text, re.MULTILINE)}
    elif lang in ("sh", "bash", "console"):
        wanted = {"opentelemetry"} if re.search(r"--trace|OTEL_TRACES_EXPORTER=(?:console|otlp)", text) else set()
        wanted |= {"mcp"} if re.search(r"agentloop mcp\b", text) else set()
    for module in sorted(wanted):
        if importlib.util.find_spec(module) is None:
            return f"the {EXTRAS[module]} extra is not installed (scripts/test installs it)"
    return None


def _stop_background_servers(stderr: str) -> None:
    """``agentloop scripted --background`` said its pid: stop what the example left serving."""
    pids = set(map(int, re.findall(r"scripted model at \S+ \(pid (\d+)\)", stderr)))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _alive(pid)}
        time.sleep(0.05)
    assert not pids, f"a scripted server the example started did not stop: {pids}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_shell(block: docs.Block, work: Path, env: dict[str, str]) -> None:
    steps = docs.shell_lines(block)
    mark = "@@agentloop-docs-step@@"
    # Each line must end with status 0 (a line's last command: `exec f.py; echo $?` is fine).
    script = "".join(f"printf '\\n{mark}\\n'\n{_here(command)}\n"
                     "status=$?; [ $status = 0 ] || { echo \"the line above exited $status\" >&2; exit $status; }\n"
                     for command, _ in steps)
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    _stop_background_servers(done.stderr)
    assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    outputs = done.stdout.split(f"\n{mark}\n")[1:]
    for (command, expected), got in zip(steps, outputs, strict=True):
        if block.lang == "console":
            assert docs.matches(expected, got.splitlines()), \
                f"{block.where}: $ {command}\nexpected:\n" + "\n".join(expected) + f"\ngot:\n{got}\n{done.stderr}"


def _here(command: str) -> str:
    """A command as run from the page's directory: ``scripts/X`` is this checkout's."""
    return re.sub(r"(?<![\w./~-])scripts/", f"{ROOT}/scripts/", command)


def _run_python(block: docs.Block, work: Path, env: dict[str, str]) -> None:
    source = work / f"example_{block.page.stem}_{block.line}.py"
    source.write_text(block.body)
    done = subprocess.run([sys.executable, source.name], cwd=work, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"


def _check_toml(block: docs.Block, work: Path) -> None:
    where = work / f"toml-{block.line}"
    where.mkdir()
    (where / "agentloop.toml").write_text(block.body)
    read_config(where / "agentloop.toml")  # every key the reader refuses fails here
    load_models(where / "agentloop.toml", env={})  # and what names another alias, here


def _check_json(block: docs.Block) -> None:
    values = [json.loads(line) for line in block.body.splitlines() if line.strip()] if block.lang == "jsonl" \
        else [json.loads(block.body)]
    for value in values:
        for server in (value.get("mcpServers", {}) if isinstance(value, dict) else {}).values():
            if docs._is_agentloop(server["command"]):
                assert docs.check_agentloop(["agentloop", *server["args"]]) == [], block.where


def _check(block: docs.Block) -> list[str]:
    """What can be checked without running: the commands of a shell block, a python block's syntax."""
    if block.lang in ("sh", "bash", "console"):
        return [f"{block.where}: {w}" for command, _ in docs.shell_lines(block) for w in docs.check_line(command)]
    if block.lang == "python":
        try:
            compile(block.body, block.where, "exec")
        except SyntaxError as exc:
            return [f"{block.where}: {exc}"]
    return []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES, ids=docs.name)
def test_the_examples_of_the_page_run_as_written(page, tmp_path, model_url):
    blocks = docs.read(page).blocks
    work = tmp_path / "work"
    work.mkdir()
    env = _environment(tmp_path, model_url)
    assert [w for block in blocks for w in _check(block)] == []
    for block in blocks:
        if block.file:
            (work / block.file).write_text(block.body)
        if block.lang in ("json", "jsonl"):
            _check_json(block)
        elif block.lang == "toml":
            _check_toml(block, work)
        elif block.lang == "xml":
            found = [t for tag in ("run_code", "run_agent") for t in find_tags(block.body, tag)]
            assert found, f"{block.where}: no <run_code> or <run_agent> block the parser finds"
        if block.not_run is not None or block.lang not in ("python", "sh", "bash", "console"):
            continue
        if why := _missing_extra(block.body, block.lang):
            pytest.skip(f"{block.where}: {why}")
        if block.lang == "python":
            _run_python(block, work, env)
        else:
            _run_shell(block, work, env)


def test_every_block_is_run_or_says_why_it_is_not():
    tally: Counter[str] = Counter()
    problems = []
    for page in map(docs.read, PAGES):
        problems += page.problems
        for block in page.blocks:
            if block.lang not in docs.LANGUAGES:
                problems.append(f"{block.where}: a block in {block.lang or 'no language'!r}: name one of "
                                f"{', '.join(docs.LANGUAGES)} (or say it is text)")
            tally["not run" if block.not_run is not None else block.lang] += 1
    assert problems == []
    print("examples:", ", ".join(f"{n} {kind}" for kind, n in sorted(tally.items())))
    assert tally["python"] and tally["sh"] + tally["console"] and tally["toml"]


def test_every_command_the_text_names_exists():
    wrong = []
    for page in map(docs.read, PAGES):
        for span in docs.inline_code(page.prose):
            if re.match(r"(?:[A-Z_]+=\S+ )*(?:scripts/|agentloop )", span):
                wrong += [f"{docs.name(page.path)}: `{span}`: {w}" for w in docs.check_line(span)]
    assert wrong == []


def test_every_link_leads_to_a_page_and_a_heading_that_exist():
    wrong = []
    for page in map(docs.read, PAGES):
        for target in docs.links(page.prose):
            file, _, anchor = target.partition("#")
            path = (page.path.parent / file).resolve() if file else page.path
            if not path.exists():
                wrong.append(f"{docs.name(page.path)}: {target}: no such file")
            elif anchor and (path.suffix != ".md" or anchor not in docs.anchors(path)):
                wrong.append(f"{docs.name(page.path)}: {target}: no such heading")
    assert wrong == []


def test_every_path_and_name_the_text_gives_is_in_the_code():
    wrong = []
    for page in map(docs.read, PAGES):
        text = page.path.read_text()
        wrong += [f"{docs.name(page.path)}: {p}: no such path" for p in sorted(docs.paths_named(text))
                  if not (ROOT / p).exists()]
        wrong += [f"{docs.name(page.path)}: {why}" for dotted in sorted(docs.dotted_names(docs.inline_code(page.prose)))
                  if (why := docs.resolve(dotted))]
    assert wrong == []


def test_each_page_says_what_it_holds_and_links_back_to_the_index():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t).resolve() for t in docs.links(docs.read(index).prose)}
    for page in PAGES[1:]:
        lines = page.read_text().split("\n")
        back = os.path.relpath(index, page.parent)
        assert lines[0].startswith("# ") and lines[1] == "", docs.name(page)
        assert lines[2] and lines[2].endswith(f"([manual]({back}))"), f"{docs.name(page)}: {lines[2]!r}"
        assert page == index or page.resolve() in listed, f"{docs.name(page)} is not in docs/README.md"


def test_the_readme_is_short_and_its_table_has_every_command():
    from engine.cli import main

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    rows = re.findall(r"^\| \[`agentloop (\w+)[^`]*`\]\(([^)]+)\)", text, re.MULTILINE)
    assert {command for command, _ in rows} == set(main.list_commands(click.Context(main)))
    assert all((ROOT / target).is_file() for _, target in rows), rows


def test_the_worker_options_page_names_every_worker_option():
    from engine.cli.options import worker_options, write_options

    command = write_options(True)(worker_options(click.command("probe")(lambda: None)))
    text = (ROOT / "docs" / "worker-options.md").read_text()
    missing = [opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if f"`{opt}" not in text]
    assert missing == []


def test_the_toml_examples_name_every_key_the_reader_knows():
    keys: set[str] = set()
    model_keys: set[str] = set()
    for page in map(docs.read, PAGES):
        for block in (b for b in page.blocks if b.lang == "toml"):
            data = tomllib.loads(block.body)
            keys |= set(data)
            model_keys |= {k for table in data.get("models", {}).values() for k in table}
    assert keys == set(TOP_KEYS)
    assert model_keys == set(MODEL_KEYS)


def test_the_layer_diagram_is_the_order_of_the_imports():
    """Each subpackage in architecture.md's diagram imports only those drawn below it, and every
    subpackage of engine/ is drawn."""
    [diagram, *_] = [b.body for b in docs.read(ROOT / "docs" / "architecture.md").blocks if b.lang == "text"]
    drawn = re.findall(r"^engine/(\w+)/", diagram, re.MULTILINE)
    packages = sorted(p.parent.name for p in (ROOT / "engine").glob("*/__init__.py"))
    assert sorted(drawn) == packages
    below: dict[str, set[str]] = {}
    for module, imports in _graph().items():
        here = module.split(".")[1] if module.count(".") else ""
        below.setdefault(here, set()).update(i.split(".")[1] for i in imports if i.count("."))
    wrong = [f"engine/{a}/ imports engine/{b}/, drawn above it" for i, a in enumerate(drawn)
             for b in drawn[:i] if b in below.get(a, ())]
    assert wrong == []
