"""Repository tools: confinement, windowing, caps and messages; the tool-call guard; schemas from callables."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

from engine.errors import ConfigError, ToolError
from engine.tools import MAX_RESULT, TOOL_SCHEMAS, RepoTools, schema_for
from engine.tools._repo import SKIP_DIRS, execute_tool_call, truncate

NOTE = "narrow the request (offset/limit, tighter pattern)"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A project tree with the awkward cases: links in and out, binary, big, skipped dirs."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("needle outside\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.txt").write_text("alpha\nbeta needle\ngamma\n")
    (root / "empty.txt").write_text("")
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "sub" / "b.py").write_text("x = 1\nneedle = 2\n")
    (root / "sub" / "deep" / "c.txt").write_text("needle deep\n")
    (root / "emptydir").mkdir()
    (root / "bin.dat").write_bytes(b"needle\0\x01\x02needle\n")
    (root / "big.txt").write_text("needle\n" + "x" * 2_000_001)
    for skipped in SKIP_DIRS:
        (root / skipped).mkdir()
        (root / skipped / "hidden.txt").write_text("needle hidden\n")
    os.symlink(outside / "secret.txt", root / "link_out")
    os.symlink(outside, root / "link_dir_out")
    os.symlink(root / "a.txt", root / "link_in")
    os.symlink(root / "nowhere", root / "dangling")
    return root


@pytest.fixture
def tools(tree: Path) -> RepoTools:
    return RepoTools(tree)


def call(name: str, args: object) -> dict:
    return {"id": "c1", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


# ---------------------------------------------------------------- the root


def test_root_is_realpathed(tree: Path, tmp_path: Path):
    os.symlink(tree, tmp_path / "alias")
    assert RepoTools(tmp_path / "alias").root == tree.resolve()
    assert RepoTools(str(tmp_path / "alias")).list_dir() == RepoTools(tree).list_dir()


def test_root_must_be_a_directory(tree: Path):
    with pytest.raises(ConfigError, match="not a directory"):
        RepoTools(tree / "a.txt")
    with pytest.raises(ConfigError):
        RepoTools(tree / "missing")


# ---------------------------------------------------------------- confinement


@pytest.mark.parametrize("method, args", [
    ("list_dir", ()), ("read_file", ()), ("search", ("needle",)),
])
@pytest.mark.parametrize("path", ["..", "../outside", "../outside/secret.txt", "sub/../../outside", "/etc",
                                  "link_out", "link_dir_out", "link_dir_out/secret.txt"])
def test_every_tool_refuses_paths_outside_the_root(tools: RepoTools, method: str, args: tuple, path: str):
    with pytest.raises(ToolError) as info:
        getattr(tools, method)(*args, path=path)
    assert str(info.value) == f"path escapes the project root: {path}"


def test_paths_inside_the_root_are_fine_however_spelled(tools: RepoTools, tree: Path):
    assert tools.read_file("sub/../a.txt") == tools.read_file("a.txt")
    assert tools.read_file(str(tree / "a.txt")) == tools.read_file("a.txt")
    assert tools.read_file("link_in") == tools.read_file("a.txt")
    assert tools.list_dir("sub/..") == tools.list_dir(".") == tools.list_dir()


def test_nul_byte_in_a_path_is_refused_in_words(tools: RepoTools):
    with pytest.raises(ToolError, match="bad path"):
        tools.read_file("a\0b")


# ---------------------------------------------------------------- list_dir


def test_list_dir_lists_sorted_with_slashes_and_sizes(tools: RepoTools):
    rows = tools.list_dir(".").splitlines()
    assert rows == sorted(rows)
    assert "a.txt (24 bytes)" in rows
    assert "empty.txt (0 bytes)" in rows
    assert "sub/" in rows and ".git/" in rows and "emptydir/" in rows
    assert "link_in (24 bytes)" in rows  # a link reads as what it points to
    assert "dangling (unreadable)" in rows  # a dangling link does not hide the rest


def test_list_dir_subdir_and_empty(tools: RepoTools):
    assert tools.list_dir("sub") == "b.py (17 bytes)\ndeep/"
    assert tools.list_dir("emptydir") == "(empty directory)"


@pytest.mark.parametrize("path", ["a.txt", "missing"])
def test_list_dir_needs_a_directory(tools: RepoTools, path: str):
    with pytest.raises(ToolError) as info:
        tools.list_dir(path)
    assert str(info.value) == f"not a directory: {path}"


# ---------------------------------------------------------------- read_file


def test_read_file_numbers_lines(tools: RepoTools):
    assert tools.read_file("a.txt") == "1\talpha\n2\tbeta needle\n3\tgamma\n"


def test_read_file_windows_and_says_how_to_page(tools: RepoTools, tree: Path):
    (tree / "long.txt").write_text("".join(f"line {i}\n" for i in range(1, 1501)))
    first = tools.read_file("long.txt")
    assert first.splitlines()[0] == "1\tline 1"
    assert first.endswith("\n[agent] showing lines 1-200 of 1500 — call again with offset=201 for more")
    page = tools.read_file("long.txt", offset=1495, limit=3)
    assert page == ("1495\tline 1495\n1496\tline 1496\n1497\tline 1497\n"
                    "\n[agent] showing lines 1495-1497 of 1500 — call again with offset=1498 for more")
    assert tools.read_file("long.txt", offset=1499) == "1499\tline 1499\n1500\tline 1500\n"  # no note at the end


def test_read_file_clamps_offset_and_limit(tools: RepoTools, tree: Path):
    (tree / "long.txt").write_text("".join(f"{i}\n" for i in range(1, 1501)))
    assert tools.read_file("long.txt", offset=0, limit=1).startswith("1\t1\n\n[agent] showing lines 1-1 ")
    assert tools.read_file("long.txt", offset=-5, limit=0).startswith("1\t1\n\n[agent] showing lines 1-1 ")
    big = RepoTools(tree, max_result=10**9).read_file("long.txt", limit=5000)
    assert big.endswith("[agent] showing lines 1-1000 of 1500 — call again with offset=1001 for more")
    assert tools.read_file("long.txt", offset="3", limit=1.0).startswith("3\t3\n")


def test_read_file_past_the_end(tools: RepoTools):
    with pytest.raises(ToolError) as info:
        tools.read_file("a.txt", offset=4)
    assert str(info.value) == "a.txt has only 3 lines; offset 4 is past the end"


def test_read_file_refusals(tools: RepoTools):
    assert tools.read_file("empty.txt") == "(empty file)"
    with pytest.raises(ToolError) as info:
        tools.read_file("sub")
    assert str(info.value) == "sub is a directory — use list_dir"
    with pytest.raises(ToolError) as info:
        tools.read_file("nope.txt")
    assert str(info.value) == "no such file: nope.txt"
    with pytest.raises(ToolError) as info:
        tools.read_file("dangling")
    assert str(info.value) == "no such file: dangling"
    with pytest.raises(ToolError) as info:
        tools.read_file("a.txt", offset="ten")
    assert str(info.value) == "offset must be an integer, got 'ten'"


def test_read_file_refuses_a_fifo_instead_of_blocking(tools: RepoTools, tree: Path):
    os.mkfifo(tree / "pipe")
    with pytest.raises(ToolError, match="not a regular file: pipe"):
        tools.read_file("pipe")
    assert "needle" in tools.search("needle")  # search steps over it too


# ---------------------------------------------------------------- search


def test_search_finds_text_files_only(tools: RepoTools):
    assert tools.search("needle").splitlines() == [
        "a.txt:2: beta needle",
        "sub/b.py:2: needle = 2",
        "sub/deep/c.txt:1: needle deep",
    ]  # not binary, not > 2 MB, not in SKIP_DIRS, not through links


def test_search_narrows_to_a_path(tools: RepoTools):
    assert tools.search("needle", "sub/deep") == "sub/deep/c.txt:1: needle deep"
    assert tools.search("needle", path="sub/b.py") == "sub/b.py:2: needle = 2"
    with pytest.raises(ToolError) as info:
        tools.search("needle", "nowhere")
    assert str(info.value) == "not a directory: nowhere"


def test_search_no_matches_and_bad_regex(tools: RepoTools):
    assert tools.search("zebra") == "no matches for 'zebra' under ."
    assert tools.search("zebra", "sub") == "no matches for 'zebra' under sub"
    with pytest.raises(ToolError) as info:
        tools.search("(unclosed")
    assert str(info.value).startswith("bad regex '(unclosed': missing ), unterminated subpattern")


def test_search_caps_matches_and_line_length(tools: RepoTools, tree: Path):
    (tree / "many").mkdir()
    (tree / "many" / "m.txt").write_text("hit " + "y" * 300 + "\n" + "hit\n" * 149)
    rows = tools.search("hit", "many").splitlines()
    assert len(rows) == 101
    assert rows[-1] == "[agent] 100-match cap hit — tighten the pattern or narrow the path"
    assert rows[0] == "many/m.txt:1: " + ("hit " + "y" * 300)[:200]
    assert rows[99] == "many/m.txt:100: hit"


def test_search_skips_binary_and_big_files_even_when_named(tools: RepoTools, tree: Path):
    # Only descent into SKIP_DIRS is pruned: a skipped directory named outright is searched.
    assert tools.search("needle", ".git") == ".git/hidden.txt:1: needle hidden"
    assert tools.search("hidden", ".") == "no matches for 'hidden' under ."
    assert tools.search("needle", "bin.dat").startswith("no matches")
    assert tools.search("needle", "big.txt").startswith("no matches")


# ---------------------------------------------------------------- truncation


def test_output_is_capped_with_the_note(tools: RepoTools, tree: Path):
    (tree / "wide.txt").write_text(("z" * 99 + "\n") * 150)
    full = RepoTools(tree, max_result=10**9).read_file("wide.txt")
    assert len(full) > MAX_RESULT
    out = tools.read_file("wide.txt")
    assert len(out) <= MAX_RESULT
    assert out.endswith(f"\n[agent] truncated — {len(full)} chars total; {NOTE}")
    assert full.startswith(out[:out.index("\n[agent] truncated")])
    # A result capped by the tool passes the call guard unchanged: the cap is idempotent.
    assert execute_tool_call(call("read_file", {"path": "wide.txt"}), tools.functions()) == out


def test_truncate_is_a_no_op_under_the_limit():
    assert truncate("short", 10) == "short"
    cut = truncate("x" * 500, 100)
    assert len(cut) == 100 and cut.startswith("x") and "500 chars total" in cut
    assert truncate(cut, 100) == cut


# ---------------------------------------------------------------- host functions


def test_functions_are_plain_and_show_what_the_model_reads(tools: RepoTools):
    fns = tools.functions()
    assert list(fns) == ["list_dir", "read_file", "search"]
    for name, fn in fns.items():
        assert inspect.isfunction(fn) and not inspect.ismethod(fn)
        assert fn.__name__ == name
        assert "relative to the project root" in inspect.getdoc(fn)
    assert str(inspect.signature(fns["list_dir"])) == "(path: str = '.') -> str"
    assert str(inspect.signature(fns["read_file"])) == "(path: str, offset: int = 1, limit: int = 200) -> str"
    assert str(inspect.signature(fns["search"])) == "(pattern: str, path: str = '.') -> str"
    assert inspect.getdoc(fns["read_file"]).startswith("Read a text file with line numbers.")


def test_functions_work_and_raise_the_seed_text(tools: RepoTools):
    fns = tools.functions()
    assert fns["read_file"]("a.txt", 2, 1) == tools.read_file("a.txt", offset=2, limit=1)
    assert fns["search"]("needle", path="sub/deep") == "sub/deep/c.txt:1: needle deep"
    with pytest.raises(ToolError, match="^path escapes the project root: ../x$"):
        fns["list_dir"]("../x")


# ---------------------------------------------------------------- execute_tool_call


def test_execute_runs_a_call(tools: RepoTools):
    assert execute_tool_call(call("read_file", {"path": "a.txt", "offset": 3}), tools.functions()) == "3\tgamma\n"
    # Some servers send arguments already parsed; empty arguments mean none.
    parsed = {"function": {"name": "list_dir", "arguments": {"path": "sub"}}}
    assert execute_tool_call(parsed, tools.functions()) == "b.py (17 bytes)\ndeep/"
    assert execute_tool_call(call("list_dir", ""), tools.functions()) == tools.list_dir()


def test_execute_guards(tools: RepoTools):
    fns = tools.functions()
    assert (execute_tool_call(call("write_file", {}), fns)
            == "[agent] unknown tool 'write_file' — available: list_dir, read_file, search")
    assert execute_tool_call({}, fns) == "[agent] unknown tool '' — available: list_dir, read_file, search"
    assert execute_tool_call({"function": "junk"}, fns).startswith("[agent] unknown tool ''")
    assert execute_tool_call(call("x", {}), {}) == "[agent] unknown tool 'x' — available: (none)"
    broken = execute_tool_call(call("read_file", '{"path": "a.txt"'), fns)
    assert broken.startswith("[agent] arguments were not valid JSON (")
    assert broken.endswith(") — resend the call with corrected JSON")
    assert execute_tool_call(call("read_file", '["a.txt"]'), fns) == "[agent] arguments must be a JSON object"
    assert execute_tool_call(call("read_file", '"a.txt"'), fns) == "[agent] arguments must be a JSON object"


def test_execute_reports_bad_argument_names(tools: RepoTools):
    fns = tools.functions()
    wrong = execute_tool_call(call("read_file", {"paht": "a.txt"}), fns)
    assert wrong.startswith("[agent] bad arguments for read_file: ")
    assert "paht" in wrong or "path" in wrong
    missing = execute_tool_call(call("search", {}), fns)
    assert missing == "[agent] bad arguments for search: missing a required argument: 'pattern'"
    extra = execute_tool_call(call("list_dir", {"path": ".", "depth": 2}), fns)
    assert extra == "[agent] bad arguments for list_dir: got an unexpected keyword argument 'depth'"


def test_execute_reports_tool_refusals(tools: RepoTools):
    fns = tools.functions()
    assert execute_tool_call(call("read_file", {"path": "nope"}), fns) == "[agent] no such file: nope"
    assert (execute_tool_call(call("list_dir", {"path": "../x"}), fns)
            == "[agent] path escapes the project root: ../x")
    assert execute_tool_call(call("search", {"pattern": "("}), fns).startswith("[agent] bad regex '(': ")


def test_execute_never_raises_whatever_a_tool_does():
    def broken_io(path: str) -> str:
        raise PermissionError(13, "Permission denied", path)

    def buggy() -> str:
        return None + 1  # a TypeError inside the body is the tool's failure, not bad arguments

    def crashing() -> str:
        raise RuntimeError("boom")

    def counting(n: int) -> int:
        return n * 2

    impls = {"broken_io": broken_io, "buggy": buggy, "crashing": crashing, "counting": counting}
    assert (execute_tool_call(call("broken_io", {"path": "p"}), impls)
            == "[agent] broken_io failed: [Errno 13] Permission denied: 'p'")
    assert execute_tool_call(call("buggy", {}), impls).startswith("[agent] buggy failed: unsupported operand")
    assert execute_tool_call(call("crashing", {}), impls) == "[agent] crashing failed: boom"
    assert execute_tool_call(call("counting", {"n": 21}), impls) == "42"


def test_execute_truncates_with_the_seed_note():
    def loud() -> str:
        return "w" * 20_000

    out = execute_tool_call(call("loud", {}), {"loud": loud})
    assert len(out) == MAX_RESULT
    assert out.endswith(f"\n[agent] truncated — 20000 chars total; {NOTE}")
    assert len(execute_tool_call(call("loud", {}), {"loud": loud}, max_result=500)) == 500


# ---------------------------------------------------------------- schemas


def _params(schema: dict) -> tuple[list[str], list[str]]:
    p = schema["function"]["parameters"]
    return list(p["properties"]), p["required"]


@pytest.mark.parametrize("seed", TOOL_SCHEMAS, ids=lambda s: s["function"]["name"])
def test_schema_for_the_three_tools_matches_the_seed(tools: RepoTools, seed: dict):
    name = seed["function"]["name"]
    made = schema_for(name, tools.functions()[name])
    assert made["function"]["description"] == seed["function"]["description"]
    names, required = _params(made)
    seed_names, seed_required = _params(seed)
    assert names == seed_names
    if name == "list_dir":
        # The seed's schema asks for path; the function defaults it to ".", so it is optional here.
        assert seed_required == ["path"] and required == []
        assert {**made, "function": {**made["function"], "parameters": {
            **made["function"]["parameters"], "required": ["path"]}}} == seed
    else:
        assert required == seed_required
        assert made == seed  # word for word, types and descriptions included


def test_schema_for_maps_types_and_defaults():
    class Custom:
        pass

    def fn(a: str, b: int, c: float, d: bool, e: list, f: dict, g: list[str], h: dict[str, int],
           i: int | None = None, j: Custom | None = None, k=3, m: str | int = "x", *rest: int, **extra: str):
        pass

    props = schema_for("fn", fn)["function"]["parameters"]
    assert props["required"] == ["a", "b", "c", "d", "e", "f", "g", "h"]
    types = {name: p.get("type") for name, p in props["properties"].items()}
    assert types == {"a": "string", "b": "integer", "c": "number", "d": "boolean", "e": "array",
                     "f": "object", "g": "array", "h": "object", "i": "integer", "j": None, "k": None,
                     "m": None}  # *rest and **extra cannot be named in a call: left out
    assert "description" not in schema_for("fn", fn)["function"]


def test_schema_for_reads_the_docstring():
    def fetch(url: str, retries: int = 2, timeout: float = 1.5) -> str:
        """Fetch a page.

        Follows redirects.

        Args:
            url (str): where to go; must be
                http or https
            retries: how many times to try again
        Returns:
            body: the page text
        """

    fn = schema_for("fetch", fetch)["function"]
    assert fn["description"] == "Fetch a page.\n\nFollows redirects."
    assert fn["parameters"]["properties"] == {
        "url": {"type": "string", "description": "where to go; must be http or https"},
        "retries": {"type": "integer", "description": "how many times to try again"},
        "timeout": {"type": "number"},
    }
    assert fn["parameters"]["required"] == ["url"]


def test_schema_for_keeps_unresolvable_annotations_untyped():
    ns: dict = {}
    exec("from __future__ import annotations\n"
         "def f(a: Missing, b: int, c: 'list') -> None:\n    'Do f.'\n", ns)
    props = schema_for("f", ns["f"])["function"]["parameters"]["properties"]
    assert props == {"a": {}, "b": {"type": "integer"}, "c": {"type": "array"}}


def test_schema_for_refuses_what_cannot_be_called_by_name():
    def positional(a: int, /, b: int) -> None:
        pass

    with pytest.raises(ConfigError, match="positional-only"):
        schema_for("positional", positional)
    with pytest.raises(ConfigError, match="tool name"):
        schema_for("has space", lambda: None)
    with pytest.raises(ConfigError, match="tool name"):
        schema_for("x" * 65, lambda: None)
