"""The shape of the code: engine/ and worker/ import without a circle, lazy imports included;
nothing below ``Engine`` reaches into its private members; no module uses another's private
names; no module outgrows 600 lines; every public module says what it exports (``__all__``);
every command that starts workers takes the same worker options; no callback is written onto
another object; no public class name is defined twice; frames are read by framing alone,
bubblewrap's arguments written by its one builder, and processes killed by the one kill."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
WORKER = ROOT / "worker"
PACKAGES = (ENGINE, WORKER)
MODULES = sorted(p for package in PACKAGES for p in package.rglob("*.py"))
AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every module of its package ``path`` imports: at the top, in functions, under TYPE_CHECKING."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if _is_module(f"{origin}.{a.name}") else origin for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            targets = [node.args[0].value]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == name.split(".")[0] and t != name)
    return found


def _graph(package: Path = ENGINE) -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in package.rglob("*.py")}


def _lazy_commands() -> list[str]:
    text = (ENGINE / "cli" / "__init__.py").read_text()
    return re.findall(r'"(engine\.cli\.[a-z_]+):', text)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk meets (each as the modules on it, first repeated last)."""
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, set())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt in graph and nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_engine_imports_have_no_circle():
    graph = _graph()
    # The command group loads its commands by name (importlib, from a table): edges too.
    graph["engine.cli"] |= set(_lazy_commands())
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_worker_imports_have_no_circle():
    cycles = _cycles(_graph(WORKER))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_walk_sees_lazy_imports_and_finds_circles(tmp_path):
    # What the test above relies on: an import inside a function is an edge, and a circle of
    # three is found.
    lazy = ENGINE / "observe" / "_tracing.py"
    assert "engine.observe._spans" in _imports(lazy)
    assert "engine.cli.run" in _lazy_commands()
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_nothing_below_the_engine_names_its_private_members():
    offenders = []
    for path in ENGINE.rglob("*.py"):
        if path == ENGINE / "engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                value = node.value
                holder = value.id if isinstance(value, ast.Name) else getattr(value, "attr", "")
                if holder in ("engine", "_engine"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {holder}.{node.attr}")
    assert not offenders, offenders


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("engine", "worker")


def test_no_module_uses_another_modules_private_names():
    """``from x import _name`` and ``x._name`` across our modules: a private name is its
    module's alone (a name two modules need is public, in the module that owns it).  Private
    modules (``engine.launch``) are their package's to import."""
    offenders = []
    for path in MODULES:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())

        def origin_of(node: ast.ImportFrom, package: str = package) -> str:
            if not node.level:
                return node.module or ""
            base = package.split(".")
            return ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))

        imported: dict[str, str] = {}  # local name -> the module of ours it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _ours(origin_of(node)):
                origin = origin_of(node)
                for alias in node.names:
                    full = f"{origin}.{alias.name}"
                    if _is_module(full):
                        imported[alias.asname or alias.name] = full
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {origin} import {alias.name}")
                    elif _is_module(origin):
                        imported.setdefault(alias.asname or alias.name, "")  # a class or function of ours
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _ours(alias.name):
                        imported[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or \
                            alias.name.split(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if not isinstance(value, ast.Name) or value.id not in imported:
                    continue
                base = imported[value.id]
                owner = ".".join([base, *reversed(chain[1:])]) if base else ""
                if base and _is_module(f"{owner}.{node.attr}"):
                    continue  # a private module of its package
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {value.id}."
                                 + ".".join(reversed(chain)))
    assert not offenders, "\n".join(offenders)


#: The engine's subpackages, lowest first: a module of one may import the faces of those of a
#: lower rank only (and the top-level leaves, which import no subpackage).  Equal ranks are
#: strangers: neither imports the other.
LAYERS = {
    "scripted": 1, "models": 1, "sandbox": 1, "net": 1,
    "launch": 2,
    "samples": 3, "exec": 3, "tools": 3,
    "workers": 4,
    "agent": 5,
    "observe": 6,
    "batch": 7, "integrations": 7,
    "view": 8,
    "cli": 9,
}
#: The modules at the top of engine/: shared leaves every layer may use.
LEAVES = {"__init__", "config", "durations", "environment", "errors", "extras", "inert", "lazy", "results", "secrets",
          "trees", "trust"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "engine" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return parts[1]


def test_engine_shows_its_layers():
    """``ls engine/`` is the architecture: the subpackages of ``LAYERS`` and a few shared leaves."""
    packages = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in ENGINE.glob("*.py")}
    assert packages == set(LAYERS), sorted(packages ^ set(LAYERS))
    assert modules == LEAVES, sorted(modules ^ LEAVES)


def test_subpackages_import_each_other_in_layer_order():
    offenders = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if there is None or there == here:
                if here is None and there is not None and module != "engine":
                    offenders.append(f"{module} (a shared leaf) imports {target}")
                continue
            if here is not None and LAYERS[there] >= LAYERS[here]:
                offenders.append(f"{module} ({here}, layer {LAYERS[here]}) imports {target} "
                                 f"({there}, layer {LAYERS[there]})")
    assert not offenders, "\n".join(offenders)


def test_a_subpackage_is_entered_through_its_face():
    """Another subpackage's names come from its ``__init__`` (its ``__all__``), never from its
    private modules; a module of a subpackage imports its siblings directly, never its own face
    (the face imports them: that would be a circle)."""
    offenders = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if there is None:
                continue
            face = f"engine.{there}"
            inner = target[len(face) + 1:].split(".") if target != face else []
            if there != here and any(part.startswith("_") for part in inner):
                offenders.append(f"{module} reaches into {target} (use {face})")
            elif there == here and target == face and module not in (face, f"{face}.__main__"):
                offenders.append(f"{module} imports its own face {face}")
    assert not offenders, "\n".join(offenders)


def test_every_face_exports_what_it_lists():
    """A face's ``__all__``, its lazy table and its TYPE_CHECKING imports name the same things,
    each defined where the table says."""
    import importlib
    for package in sorted(LAYERS):
        face = importlib.import_module(f"engine.{package}")
        where = getattr(face, "_WHERE", None)
        if where is None:
            continue  # (cli, integrations, view: commands and servers, no lazy face)
        assert sorted(where) == sorted(face.__all__), package
        for name, module in where.items():
            assert hasattr(importlib.import_module(f"engine.{package}.{module}"), name), f"engine.{package}.{name}"


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target.value if isinstance(target, ast.Starred) else target)
    return flat


def _callbacks_set_on_others(tree: ast.AST) -> list[tuple[int, str]]:
    """``x.on_event = ...`` (or ``setattr(x, "on_event", ...)``) where ``x`` is not ``self``."""
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr.startswith("on_") \
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self"):
                found.append((node.lineno, f"{ast.unparse(target)} = ..."))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("on_"):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_callback_is_written_onto_another_object():
    """An object's owner is given when it is made (a constructor argument, an ``Owner``), or
    once through a method that refuses a second (``Worker.adopt``): a callback written onto
    another object's attribute lets the last writer silently take the first one's events."""
    offenders = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in MODULES
                 for line, what in _callbacks_set_on_others(ast.parse(path.read_text()))]
    assert not offenders, "\n".join(offenders)


def test_the_callback_check_sees_what_it_forbids():
    code = ("worker.on_call = f\nself.on_call = f\na.b.on_stop, x = g, 1\nsetattr(s, 'on_lost', h)\n"
            "self.x.on_spare = k\non_free = f\n")
    assert sorted(line for line, _ in _callbacks_set_on_others(ast.parse(code))) == [1, 3, 4, 5]


def _public_classes(tree: ast.AST) -> set[str]:
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and not node.name.startswith("_")}


def test_no_public_class_name_is_defined_twice():
    """One name per idea: a public class name means one class across engine/ and worker/ (the
    contract's messages, one catalogue per channel, may share a name across channels)."""
    contract = WORKER / "contract"
    where: dict[str, list[str]] = {}
    for path in MODULES:
        if contract not in path.parents:
            for name in _public_classes(ast.parse(path.read_text())):
                where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, "\n".join(f"{name}: {', '.join(paths)}" for name, paths in sorted(twice.items()))


def _call_name(node: ast.Call) -> str:
    """``os.kill`` for ``os.kill(...)``, ``.send_signal`` for ``proc.send_signal(...)``."""
    func = node.func
    if isinstance(func, ast.Attribute):
        return f"{func.value.id}.{func.attr}" if isinstance(func.value, ast.Name) and func.value.id in (
            "os", "struct", "signal", "int") else f".{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


#: A frame's length prefix as ``struct`` spells it: one integer.
_LENGTH_FORMAT = re.compile(r"[!<>=@]?[HhIiLlQq]")


def _hand_read_frames(tree: ast.AST) -> list[tuple[int, str]]:
    """Length prefixes read or written outside ``framing``: ``struct`` with a one-integer
    format, a read of exactly 4 bytes (``read(4)``, ``recv(4)``, ``readexactly(4)``,
    ``os.read(fd, 4)``), ``int.from_bytes`` of the first 4 bytes of something."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = _call_name(node), node.args
        first = args[0] if args else None
        if name in ("struct.Struct", "struct.unpack", "struct.unpack_from", "struct.pack", "struct.iter_unpack") \
                and isinstance(first, ast.Constant) and isinstance(first.value, str) \
                and _LENGTH_FORMAT.fullmatch(first.value):
            found.append((node.lineno, ast.unparse(node)))
        elif name in (".read", ".recv", ".readexactly", ".recv_into", "os.read", "_read_exact") and any(
                isinstance(a, ast.Constant) and a.value == 4 for a in args[-1:]):
            found.append((node.lineno, ast.unparse(node)))
        elif name == "int.from_bytes" and isinstance(first, ast.Subscript) and isinstance(first.slice, ast.Slice) \
                and isinstance(first.slice.upper, ast.Constant) and first.slice.upper.value == 4:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_frames_are_read_by_framing_alone():
    """Every byte stream across the boundary has one framing, read and written by
    ``worker/contract/framing.py`` alone: nothing else spells a length prefix."""
    framing = WORKER / "contract" / "framing.py"
    offenders = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in MODULES if path != framing
                 for line, what in _hand_read_frames(ast.parse(path.read_text()))]
    assert not offenders, "\n".join(offenders)
    assert _hand_read_frames(ast.parse(framing.read_text())), "the check no longer sees framing's own header"
    code = "n, = struct.unpack('>I', sock.recv(4))\nos.read(fd, 4)\nint.from_bytes(b[:4], 'big')\nstruct.pack('HHHH', 0)\n"
    assert sorted(line for line, _ in _hand_read_frames(ast.parse(code))) == [1, 1, 2, 3]


#: bubblewrap's options, each of which only the one argv builder writes.
#: (Its generic ones — ``--dir``, ``--file``, ``--size``, ``--uid`` — a command of ours may take too.)
_BWRAP_OPTIONS = re.compile(r"--(?:bind|ro-bind|dev-bind|bind-try|ro-bind-try|dev-bind-try|unshare-[a-z-]+|share-net|"
                            r"tmpfs|proc|dev|symlink|remount-ro|die-with-parent|as-pid-1|hostname|new-session|"
                            r"cap-add|cap-drop|chdir|setenv|unsetenv|seccomp|userns|pidns)")


def test_bubblewraps_arguments_are_written_in_one_module():
    """One argv builder (``engine/sandbox/_bwrap.py``), pure and tested argument for argument:
    no other module of engine/ writes a bubblewrap option, or edits an argv after it."""
    builder = ENGINE / "sandbox" / "_bwrap.py"
    offenders = []
    for path in ENGINE.rglob("*.py"):
        if path == builder:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _BWRAP_OPTIONS.fullmatch(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "\n".join(offenders)
    written = {n.value for n in ast.walk(ast.parse(builder.read_text()))
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and _BWRAP_OPTIONS.fullmatch(n.value)}
    assert {"--ro-bind", "--bind", "--unshare-pid", "--die-with-parent"} <= written, sorted(written)


def test_one_kill():
    """A process is killed by ``kill_tree`` (``engine/launch/_process.py``: the whole tree, always
    reaped) and nothing else: no other module of engine/ signals a process itself (a process
    may signal itself, as exec does to stop or end as its script did)."""
    killer = ENGINE / "launch" / "_process.py"
    offenders = []
    for path in ENGINE.rglob("*.py"):
        if path == killer:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            own = bool(node.args) and ast.unparse(node.args[0]) == "os.getpid()"
            if name in ("os.kill", "os.killpg", "signal.pthread_kill", "signal.pidfd_send_signal", ".send_signal",
                        ".terminate") and not own:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def _exception_bases(paths: list[Path]) -> dict[str, tuple[str, set[str]]]:
    """Each class of ``paths``: its module and the names of its bases (their last part)."""
    classes: dict[str, tuple[str, set[str]]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
                classes[f"{path.relative_to(ROOT)}:{node.name}"] = (node.name, bases)
    return classes


def test_every_public_exception_of_the_engine_is_in_its_tree():
    """One exception tree (``engine/errors.py``, drawn in its docstring): every public exception
    class of engine/ derives from ``AgentloopError``, so ``except AgentloopError`` catches
    whatever agentloop raises.  (worker/ has its own: it imports nothing of the engine.)"""
    import builtins
    classes = _exception_bases([*ENGINE.rglob("*.py"), *(WORKER / "contract").glob("*.py")])
    by_name = {name: bases for name, bases in classes.values()}

    def reaches(name: str, target: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == target:
            return True
        return name not in seen and any(reaches(b, target, seen | {name}) for b in by_name.get(name, ()))

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        return name not in seen and any(is_exception(b, seen | {name}) for b in by_name.get(name, ()))

    outside = [where for where, (name, _) in classes.items()
               if where.startswith("engine/") and not name.startswith("_") and is_exception(name)
               and not reaches(name, "AgentloopError")]
    assert not outside, "exceptions outside engine.errors' tree: " + ", ".join(sorted(outside))
    assert is_exception("ToolTimeout") and reaches("ToolTimeout", "AgentloopError")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_600_lines(path):
    assert len(path.read_text().splitlines()) <= 600, f"{path.relative_to(ROOT)}: split it by what it holds"


@pytest.mark.parametrize("path", [p for p in MODULES if not p.name.startswith("_") or p.name == "__init__.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_public_module_says_what_it_exports(path):
    tree = ast.parse(path.read_text())
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
             for t in ([node.target] if not isinstance(node, ast.Assign) else node.targets) if isinstance(t, ast.Name)}
    assert "__all__" in names, f"{path.relative_to(ROOT)} has no __all__"


def _options(command: str) -> set[str]:
    out = subprocess.run([*AGENTLOOP, command, "--help"], capture_output=True, text=True, timeout=60,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z-]*(?:\s*/\s*--[a-z-]+)?)", out.stdout, re.M))


WORKER_COMMANDS = ["run", "chat", "exec", "batch", "demo", "doctor", "mcp"]


def test_every_command_that_starts_workers_takes_the_same_worker_options():
    expected = {"--sandbox", "--network", "--workspace", "--preload", "--memory", "--cpu-time",
                "--max-processes", "--max-open-files", "--max-file-size", "--tmp-size",
                "--share-cwd / --no-share-cwd"}
    for command in WORKER_COMMANDS:
        missing = expected - _options(command)
        assert not missing, f"agentloop {command} --help lacks {sorted(missing)}"
