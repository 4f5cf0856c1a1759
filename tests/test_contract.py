"""The contract across the sandbox boundary (``worker.contract``): every channel's messages
round-trip through their parsers, a malformed one is refused (an unknown key at any level of
the messages it holds too), each module's docstring lists exactly what its catalogues hold,
and the coordinator depends on nothing else of ``worker``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.contract import confiner, fork, output, sample, start, tools, wire
from worker.contract.confinement import CONFINEMENT, Confinement, Landlock, Seccomp
from worker.contract.framing import FrameBuffer, FrameError, decode, decode_json, encode, encode_json, frame
from worker.contract.limits import MAX_CHUNK, MAX_ERROR, MAX_NOTE, MAX_VAR_NAME, MAX_VARS, HeadTail
from worker.contract.schema import ContractError, Message, is_any
from worker.contract.start import StartSpec

ROOT = Path(__file__).resolve().parent.parent

#: One example of every message of every channel (a new message needs one here).
EXAMPLES: dict[type[Message], Message] = {
    wire.Welcome: wire.Welcome(),
    wire.Run: wire.Run("b1", "print(1)", wire.ScriptSpec("/w/x.py", ("x.py", "a"), True)),
    wire.Stdin: wire.Stdin("b1", b"line\n", False),
    wire.Cancel: wire.Cancel("b1", "timeout", 10.0, 0.5),
    wire.Reply: wire.Reply(3, True, {"a": [1, 2.5, None, b"x"]}),
    wire.Bind: wire.Bind((wire.HostFunction("lookup", "(key: str) -> int", "Look it up.", True),
                          wire.HostFunction("plain")), True, 4),
    wire.Export: wire.Export(("x", "data"), 5),
    wire.Inject: wire.Inject({"x": wire.Item("value", {"a": [1, None, b"b"]}), "f": wire.Item("pickle", data=b"\x80")}, 6),
    wire.Describe: wire.Describe(("x",), 7),
    wire.Env: wire.Env(8),
    wire.Fork: wire.Fork((wire.ForkChild("ipc:///r/w1/f2", "b" * 32), wire.ForkChild("ipc:///r/w1/f3", "c" * 32)),
                         "b1", 10),
    wire.Forked: wire.Forked(10, (41, 42)),
    wire.Shutdown: wire.Shutdown(),
    wire.Hello: wire.Hello("a" * 32, 123),
    wire.Out: wire.Out("b1", ((1, b"out"), (2, b"err"))),
    wire.Done: wire.Done("b1", "exit", "", ("x:int",), 3, "a note"),
    wire.Call: wire.Call(5, "lookup", (1, "two"), {"k": 3}, "b1"),
    wire.Bound: wire.Bound(4, ("lookup", "plain", "self")),
    wire.Exported: wire.Exported(5, {"x": wire.Item("value", 3), "f": wire.Item("host", name="lookup")},
                                 {"data": "no object named 'data' in your namespace"}),
    wire.Injected: wire.Injected(6, ("x", "f")),
    wire.Described: wire.Described(7, ("x: int = 3",)),
    wire.Environment: wire.Environment(8, "3.11.7", "Linux 6.1", 2, "1 GB available of 2 GB", ("numpy", "pyzmq")),
    wire.Refused: wire.Refused(9, "KeyError: 'x'"),
    wire.Display: wire.Display("b1", {"image/png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x02\x00\x00\x00\x03",
                                      "text/plain": "<Figure size 2x3>"}),
    wire.Stuck: wire.Stuck("b1", "signals blocked"),
    wire.Stopping: wire.Stopping("b1", "it caught the TimeoutError"),
    wire.Bye: wire.Bye(),
    fork.Spawn: fork.Spawn(1, "ipc:///r/w1/sock", {"PATH": "/usr/bin"}, "/w", True, 1 << 29, "/w/ws",
                           ("/usr/bin/python3", "-c", "pass"), ("/r",), (("/r/ws", False),), "/r/w1/stderr"),
    fork.Ready: fork.Ready(7),
    fork.Spare: fork.Spare(8),
    fork.Forked: fork.Forked(1, 9),
    fork.Spawned: fork.Spawned(1, 9),
    fork.Failed: fork.Failed(1, "no memory"),
    fork.Exited: fork.Exited(1, 9, 137),
    fork.Init: fork.Init(9),
    fork.Child: fork.Child(2),
    sample.RunSample: sample.RunSample(1, "print(1)", "sample.py", ("sample.py", "-v"), "input\n",
                                       (("data/a.txt", b"abc", 0o644),), {"TZ": "UTC"}, 5.0, 8192),
    sample.Hello: sample.Hello("t" * 32, 2),
    sample.Failed: sample.Failed("could not import numpy"),
    sample.Result: sample.Result(1, 256, False, False, (b"head", b"tail", 100), (b"", b"", 0), 20480, 0.01, ""),
    tools.Init: tools.Init("/repo", (("/repo", ".git"),), 0, Confinement(drop_caps=True, landlock=Landlock(ro=("/repo",)))),
    tools.Request: tools.Request("read_file", {"path": "a.py", "offset": 1, "limit": 10}, 8000),
    tools.Ready: tools.Ready(("rlimits", "caps")),
    tools.Fatal: tools.Fatal("Landlock: no"),
    tools.Ok: tools.Ok("1: text"),
    tools.Refused: tools.Refused("outside the root"),
    tools.Failed: tools.Failed("no such file"),
    confiner.Setup: confiner.Setup(Confinement(drop_caps=True, seccomp=Seccomp((1,))), 4, 5, 6, 0, (1, 15), 0, "C.UTF-8"),
    confiner.Signal: confiner.Signal("group", 20),
    confiner.Exited: confiner.Exited(3),
    confiner.Killed: confiner.Killed(15),
    confiner.Stopped: confiner.Stopped(20),
    confiner.Continued: confiner.Continued(),
    confiner.Failed: confiner.Failed("cannot run /usr/bin/python3: No such file or directory"),
    StartSpec: StartSpec("t0k", Confinement(rlimits=(("NPROC", 64, 64),), uid=(1000, 1000),
                                            landlock=Landlock(ro=("/",), rw=("/w",))),
                         7, "/s/w1", "1,2:24x80", sample.SlotSettings("/w", 1 << 20, 0.5, "/s/w1", False, ("numpy",)),
                         ("numpy",), "a b c"),
}

CHANNELS = [(wire, [wire.TO_WORKER, wire.TO_COORDINATOR], encode, decode),
            (fork, [fork.TO_SERVER, fork.TO_COORDINATOR], encode, decode),
            (fork, [fork.REPORTS], encode_json, decode_json),
            (sample, [sample.TO_SLOT, sample.TO_COORDINATOR], encode, decode),
            (tools, [tools.TO_TOOLS, tools.TO_COORDINATOR], encode_json, decode_json),
            (confiner, [confiner.TO_CONFINER, confiner.TO_COORDINATOR], encode_json, decode_json),
            (start, [start.START], encode_json, decode_json)]
MESSAGES = [(module, catalogue, cls, enc, dec) for module, catalogues, enc, dec in CHANNELS
            for catalogue in catalogues for cls in catalogue.by_kind.values()]
_IDS = [f"{m.__name__.rsplit('.', 1)[1]}.{cls.kind}" for m, _, cls, _, _ in MESSAGES]


def _nested(msg: Message, path: tuple = ()) -> list[tuple]:
    """The paths (keys and indexes into its wire form) of every message ``msg`` holds, at any
    depth: each is a map of its own there."""
    found = []
    for name, _, _ in type(msg).fields():
        value = getattr(msg, name)
        inside = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, tuple)
                  else [(None, value)])
        for key, item in inside:
            if isinstance(item, Message):
                where = (*path, name) if key is None else (*path, name, key)
                found += [where, *_nested(item, where)]
    return found


def _at(form: dict, path: tuple) -> dict:
    for key in path:
        form = form[key]
    return form


@pytest.mark.parametrize(("module", "catalogue", "cls", "enc", "dec"), MESSAGES, ids=_IDS)
def test_every_message_round_trips_through_its_parser(module, catalogue, cls, enc, dec):
    msg = EXAMPLES[cls]
    assert catalogue.parse(dec(enc(msg))) == msg


@pytest.mark.parametrize(("module", "catalogue", "cls", "enc", "dec"), MESSAGES, ids=_IDS)
def test_a_malformed_message_is_refused(module, catalogue, cls, enc, dec):
    good = dec(enc(EXAMPLES[cls]))
    for name, check, required in cls.fields():
        if check is is_any or name not in good:
            continue
        bad = dict(good)
        bad[name] = "x" if isinstance(good[name], dict) else {"\x00": 1}
        with pytest.raises(ContractError, match=name):
            catalogue.parse(bad)
        if required:
            del bad[name]
            with pytest.raises(ContractError, match=f"{name} is missing"):
                catalogue.parse(bad)
    with pytest.raises(ContractError, match="unknown field"):
        catalogue.parse({**good, "extra": 1})
    with pytest.raises(ContractError, match="not a message of this channel"):
        catalogue.parse({**good, "t": "nonsense"})
    with pytest.raises(ContractError):
        catalogue.parse([good])


@pytest.mark.parametrize(("module", "catalogue", "cls", "enc", "dec"), MESSAGES, ids=_IDS)
def test_an_unknown_key_is_refused_in_every_message_a_message_holds(module, catalogue, cls, enc, dec):
    msg = EXAMPLES[cls]
    for path in _nested(msg):
        bad = dec(enc(msg))
        _at(bad, path)["extra"] = 1
        with pytest.raises(ContractError, match="unknown field 'extra'"):
            catalogue.parse(bad)
        bad = dec(enc(msg))
        _at(bad, path)["t"] = "x"  # (only the outermost map names its kind)
        with pytest.raises(ContractError, match="unknown field 't'"):
            catalogue.parse(bad)


def test_every_kind_of_nested_message_is_in_an_example():
    held = {type(_at_message(EXAMPLES[cls], path)) for cls in EXAMPLES for path in _nested(EXAMPLES[cls])}
    assert held >= {wire.ScriptSpec, wire.HostFunction, wire.Item, Confinement, Landlock, Seccomp, sample.SlotSettings}


def _at_message(msg: Message, path: tuple) -> Message:
    for key in path:
        msg = msg[key] if isinstance(msg, (tuple, dict)) else getattr(msg, key)
    return msg


def _listed(doc: str) -> dict[str, str]:
    """``kind {fields}`` of each message a docstring lists (its braces may hold braces)."""
    listed = {}
    for m in re.finditer(r"^    (\w+) +\{", doc, re.M):
        depth, end = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(doc[end], 0)
            end += 1
        listed[m.group(1)] = doc[m.end():end - 1]
    return listed


_MODULES = {m: [c for n, cs, _, _ in CHANNELS if n is m for c in cs] for m, _, _, _ in CHANNELS}


@pytest.mark.parametrize(("module", "catalogues"), list(_MODULES.items()), ids=[m.__name__ for m in _MODULES])
def test_each_channel_docstring_lists_exactly_its_messages_and_their_fields(module, catalogues):
    listed = _listed(module.__doc__)
    kinds = [kind for c in catalogues for kind in c.kinds]
    assert sorted(listed) == sorted(kinds)
    for catalogue in catalogues:
        for kind, cls in catalogue.by_kind.items():
            fields = listed[kind]
            while re.search(r"[\[{]", fields):  # (nested lists and maps: innermost first)
                fields = re.sub(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}", "", fields)
            documented = {part.split(":")[0].strip().rstrip("?") for part in re.split(r",\s*", fields)} - {"", "..."}
            assert documented == {name for name, _, _ in cls.fields()}, kind


def test_the_bounds_a_worker_must_keep_are_refused_beyond():
    parse = wire.TO_COORDINATOR.parse
    with pytest.raises(ContractError, match="o"):
        parse({"t": "out", "id": "b", "o": [[1, b"x" * (MAX_CHUNK + 1)]]})
    with pytest.raises(ContractError, match="o"):
        parse({"t": "out", "id": "b", "o": [[3, b"x"]]})
    with pytest.raises(ContractError, match="error"):
        parse({"t": "done", "id": "b", "status": "ok", "error": "e" * (MAX_ERROR + 1)})
    with pytest.raises(ContractError, match="vars"):
        parse({"t": "done", "id": "b", "status": "ok", "vars": ["v"] * (MAX_VARS + 1)})
    with pytest.raises(ContractError, match="status"):
        parse({"t": "done", "id": "b", "status": "fine"})
    with pytest.raises(ContractError, match="code"):
        parse({"t": "done", "id": "b", "status": "exit", "code": True})  # a bool is not an int
    # ... and the worker's builder keeps within them whatever it is given.
    built = wire.done("b", "error", "x" * (3 * MAX_ERROR), ["v" * (MAX_VAR_NAME + 1), "ok:int"] * 500, 300, "n" * 5000)
    assert parse(decode(encode(built))) == built
    assert built.vars[0] == "ok:int" and len(built.vars) == MAX_VARS and built.code == 300 & 0xFF


def test_a_sample_result_holds_no_more_output_than_asked():
    result = sample.Result(1, 0, out=(b"x" * 100, b"", 100))
    assert result.within(100) is result
    with pytest.raises(ContractError, match="more than"):
        result.within(99)
    with pytest.raises(ContractError, match="out"):  # a total smaller than what it carries
        sample.TO_COORDINATOR.parse({"t": "result", "id": 1, "status": 0, "out": [b"abc", b"", 2]})


def test_frames_are_checked_before_their_body_is_kept():
    buf = FrameBuffer(16)
    buf.feed(frame(b"abc") + frame(b"de")[:3])
    assert buf.next() == b"abc" and buf.next() is None
    buf.feed(frame(b"de")[3:])
    assert buf.next() == b"de"
    buf.feed(b"\x00\x00\x01\x00")  # 256 bytes announced: refused before they come
    with pytest.raises(FrameError, match="256"):
        buf.next()
    with pytest.raises(FrameError):
        decode(b"\xc1")
    with pytest.raises(FrameError):
        decode(encode({"t": "x"}) + b"\x00")  # trailing bytes
    with pytest.raises(FrameError, match="exceeds"):
        decode(b"\x90" * 10, max_size=5)


def test_the_output_pipe_carries_only_output():
    reader = output.OutputReader()
    reader.feed(output.out_frame(wire.Out("b", ((1, b"hi"),))) + output.moved("b", 2, 3) + b"abc")
    assert reader.next() == wire.Out("b", ((1, b"hi"),))
    assert reader.next() == wire.Out("b", ((2, b"abc"),))
    assert reader.next() is None
    # A moved chunk that comes in pieces is given piece by piece, and frames follow it.
    reader.feed(output.moved("b", 1, 5) + b"ab")
    assert reader.next() == wire.Out("b", ((1, b"ab"),)) and reader.next() is None
    reader.feed(b"cde" + output.out_frame(wire.Out("b", ((2, b"after"),))))
    assert reader.next() == wire.Out("b", ((1, b"cde"),))
    assert reader.next() == wire.Out("b", ((2, b"after"),))
    reader.feed(frame(encode(wire.Done("b", "ok"))))
    with pytest.raises(ContractError, match="'done' message to its output pipe"):
        reader.next()
    for bad in (b"\x00\x00\x00\x00", b"\xff\xff\xff\xff"):  # an empty frame; one over the bound
        reader = output.OutputReader()
        reader.feed(bad)
        with pytest.raises(FrameError):
            reader.next()


def test_the_confinement_spec_round_trips_and_refuses_what_it_does_not_know():
    spec = Confinement(rlimits=(("DATA", 1 << 30, 1 << 30), ("NPROC", 256, 256)), drop_caps=True,
                       no_new_privs=True, uid=(1234, 1234), umask=0o002,
                       landlock=Landlock(ro=("/",), rw=("/w", "/tmp"), dev=("/dev/null",), deny_tcp=True),
                       seccomp=Seccomp(socket_families=(1, 16), lock_session=False, shared_memory=False))
    assert Confinement.from_json(spec.to_json()) == spec
    assert CONFINEMENT.parse(json.loads(spec.to_json())) == spec
    assert not Confinement.from_json("") and Confinement.from_json("") == Confinement()
    assert spec and spec.limit("NPROC") == (256, 256) and spec.limit("AS") is None
    assert spec.replace(uid=None).uid is None and spec.uid == (1234, 1234)  # (a copy: messages never change)
    raw = json.loads(spec.to_json())
    for bad in ({**raw, "keep_caps": True}, {**raw, "rlimits": [["NOPE", 1, 1]]}, {**raw, "uid": [1]},
                {**raw, "rlimits": [["DATA", 1]]}, {**raw, "landlock": {**raw["landlock"], "ro": "/"}},
                {**raw, "landlock": {**raw["landlock"], "net": True}},
                {**raw, "seccomp": {**raw["seccomp"], "allow": ["ptrace"]}},
                {**raw, "seccomp": {**raw["seccomp"], "socket_families": [65]}}, {**raw, "drop_caps": 1},
                {k: v for k, v in raw.items() if k != "t"}, {**raw, "t": "start"}, [raw]):
        with pytest.raises(ContractError):
            Confinement.from_json(json.dumps(bad))
    with pytest.raises(ContractError, match="not JSON"):
        Confinement.from_json("{not json")


def test_the_start_environment_is_taken_whole_and_removed():
    spec = EXAMPLES[StartSpec]
    env = {"PATH": "/usr/bin", **spec.to_env()}
    assert list(env) == ["PATH", *start.NAMES]
    assert StartSpec.take(env) == spec
    assert env == {"PATH": "/usr/bin"}
    assert StartSpec().to_env() == {} and StartSpec.take({}) == StartSpec()
    raw = json.loads(spec.to_env()["AGENTLOOP_START"])
    for bad in ("{not json", json.dumps({**raw, "confine": {**raw["confine"], "caps": []}}),
                json.dumps({**raw, "slot": {**raw["slot"], "home": "/"}}),
                json.dumps({**raw, "confine": {**raw["confine"], "landlock": {**raw["confine"]["landlock"], "x": 1}}}),
                json.dumps({**raw, "parent": -1}), json.dumps({**raw, "t": "confinement"}),
                json.dumps({**raw, "pad": "x" * start.MAX_START})):
        env = {"AGENTLOOP_START": bad}
        with pytest.raises(ContractError):
            StartSpec.take(env)
        assert env == {}  # (taken, even when refused: the process does not start)


def test_a_control_request_and_its_reply_hold_only_their_shapes():
    parse = wire.TO_COORDINATOR.parse
    assert set(wire.REPLIES) == set(wire.REQUESTS)
    # An item carries the fields of its kind and no other.
    for item in ({"kind": "value", "data": b"x"}, {"kind": "pickle"}, {"kind": "pickle", "data": b"x", "value": 1},
                 {"kind": "host"}, {"kind": "host", "name": "f", "value": 1}, {"kind": "code", "value": 1}):
        with pytest.raises(ContractError, match="item"):
            parse({"t": "exported", "rid": 1, "items": {"x": item}})
    # Plain data by value: no deeper than the bound (a recursion on the way), keys strings.
    deep: list = []
    for _ in range(wire.PLAIN_DEPTH):
        deep = [deep]
    with pytest.raises(ContractError, match="nested"):
        parse({"t": "exported", "rid": 1, "items": {"x": {"kind": "value", "value": deep}}})
    assert parse({"t": "exported", "rid": 1, "items": {"x": {"kind": "value", "value": deep[0]}}})
    with pytest.raises(ContractError, match="key"):
        parse({"t": "exported", "rid": 1, "items": {"x": {"kind": "value", "value": {b"k": 1}}}})
    # A host function is bound, never injected.
    with pytest.raises(ContractError, match="bound, not injected"):
        wire.TO_WORKER.parse({"t": "inject", "rid": 1, "items": {"f": {"kind": "host", "name": "f"}}})
    # Bounds a worker's reply must keep; the worker's builders keep them whatever they are given.
    with pytest.raises(ContractError, match="entries"):
        parse({"t": "described", "rid": 1, "entries": ["x" * (wire.MAX_ENTRY + 1)]})
    with pytest.raises(ContractError, match="errors"):
        parse({"t": "exported", "rid": 1, "errors": {"x": "e" * (MAX_NOTE + 1)}})
    with pytest.raises(ContractError, match="cpu"):
        parse({"t": "environment", "rid": 1, "cpu": "2"})
    with pytest.raises(ContractError, match="rid"):
        parse({"t": "bound", "rid": -1, "names": []})
    built = [wire.described(1, ["x" * (3 * wire.MAX_ENTRY)]), wire.refused(2, "e" * (3 * MAX_ERROR)),
             wire.exported(3, {"v": {"kind": "value", "value": [1, (2, 3)]}}, {"y": "why " * 1000}),
             wire.environment(4, {"python": "3.11", "os": "Linux", "cpu": None, "ram": "", "packages": ["p" * 300, "q"]}),
             wire.Bind((wire.host_function("f", "(" + "x, " * 40_000 + ")", "d" * (3 * wire.MAX_DOC)),))]
    for msg in built:
        catalogue = wire.TO_WORKER if isinstance(msg, wire.Bind) else wire.TO_COORDINATOR
        assert catalogue.parse(decode(encode(msg))).kind == msg.kind
    assert built[3].packages == ("q",) and built[4].host[0].signature == "(*args, **kwargs)"
    assert wire.handed_items({"x": {"kind": "value", "value": 1}}) == {"x": wire.Item("value", 1)}
    with pytest.raises(ContractError):
        wire.handed_items({"x": {"kind": "value", "value": 1, "spec": {}}})


def test_the_report_pipe_of_a_fork_server_carries_its_reports_framed():
    frames = FrameBuffer(fork.MAX_INSIDE)
    frames.feed(frame(encode_json(fork.Init(2**31))) + frame(encode_json(fork.Child(1))))
    assert fork.REPORTS.parse(decode_json(frames.next())) == fork.Init(2**31)
    assert fork.REPORTS.parse(decode_json(frames.next())) == fork.Child(1)
    assert len(frame(encode_json(fork.Init(2**31)))) <= fork.MAX_INSIDE < 512  # one write, never torn (PIPE_BUF)
    with pytest.raises(ContractError):
        fork.REPORTS.parse({"t": "spawned", "id": 1, "pid": 2})


def test_head_and_tail_keep_the_ends_and_count_the_middle():
    kept = HeadTail(4)
    for piece in (b"abc", b"defgh", b"ijklmnop"):
        kept.add(piece)
    assert kept.parts() == (b"abcd", b"mnop", 16)
    assert HeadTail.of(kept.parts(), 4).text() == ("abcd\n[... 8 bytes cut ...]\nmnop", 8)


def test_the_coordinator_imports_only_the_contract_of_the_sandbox_side():
    """No module of ``engine`` imports a ``worker`` module but ``worker.contract``'s, and
    importing the coordinator loads nothing else of the sandbox side."""
    offenders = []
    for path in (ROOT / "engine").rglob("*.py"):
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(?:from|import) (worker(?:\.\w+)*)", line)
            if m and not (m.group(1) + ".").startswith("worker.contract."):
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert offenders == []
    code = ("import sys, engine, engine.cli, engine.workers._pool, engine.agent._task, engine.batch.run\n"
            "print(sorted(m for m in sys.modules if m.startswith('worker') and not m.startswith('worker.contract')"
            " and m != 'worker'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_message_class_has_an_example():
    assert {cls for _, _, cls, _, _ in MESSAGES} == set(EXAMPLES)


def test_every_entry_point_names_a_function_of_the_runtime():
    """The runtime's entry points live in one table (``contract.start.ENTRIES``), each a function
    its module defines: a process started with a misspelt one would fail only when started."""
    import ast
    import importlib.util

    from worker.contract.start import ENTRIES

    for entry in ENTRIES:
        module, _, function = entry.partition(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, entry
        tree = ast.parse(open(spec.origin).read())
        assert any(isinstance(node, ast.FunctionDef) and node.name == function for node in tree.body), entry
