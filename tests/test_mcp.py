"""``agentloop mcp`` driven by the official MCP client SDK over stdio (and once over HTTP).

Every test starts the real server as ``python -m engine.cli mcp`` with the SDK's own
``stdio_client``; the server starts real sandboxed workers.  Every wait is bounded
(``anyio.fail_after``, ``wait_until``); the one timing assertion (two sessions at once) has a
loose bound that sequential runs cannot meet.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed (scripts/test installs it)")

import anyio  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

from engine.sandbox import host_support  # noqa: E402
from worker.contract.display import png_size  # noqa: E402

from .conftest import read_line, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CALL = 60  # seconds any one request may take, at most
GONE = 15  # seconds for processes to disappear after the server stops


@dataclass
class Server:
    client: ClientSession
    pid: int
    workspace: Path
    log: Path

    async def run(self, code: str, session: str = "default", timeout: str = "30s", **kwargs):
        with anyio.fail_after(CALL):
            return await self.client.call_tool("run_python", {"code": code, "session": session,
                                                              "timeout": timeout}, **kwargs)

    async def call(self, tool: str, arguments: dict | None = None):
        with anyio.fail_after(CALL):
            return await self.client.call_tool(tool, arguments or {})


def text(result) -> str:
    return "".join(part.text for part in result.content if part.type == "text")


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children[int(fields[1])].append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(pid)
        except OSError:
            continue
    return out


def server_pid(token: str) -> int:
    """The pid of the ``engine.cli mcp`` process whose command line holds ``token``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"engine.cli" in argv and b"mcp" in argv and token.encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no server process with {token} in its command line")


def server_args(workspace: Path, *options: str) -> list[str]:
    return ["-m", "engine.cli", "-v", "mcp", "--workspace", str(workspace), *options]


def server_env(tmp_path: Path) -> dict[str, str]:
    return {"XDG_STATE_HOME": str(tmp_path / "state"), "XDG_RUNTIME_DIR": "",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, *options: str, cwd: Path | None = None) -> AsyncIterator[Server]:
    """``agentloop mcp`` started by the SDK's stdio client, initialized, and closed after;
    started in ``cwd`` (default: a project directory of the test's own)."""
    workspace = tmp_path / "ws"
    if cwd is None:
        cwd = tmp_path / "cwd"
        cwd.mkdir(exist_ok=True)
    log = tmp_path / "server.log"
    params = StdioServerParameters(command=sys.executable, args=server_args(workspace, *options),
                                   env=server_env(tmp_path), cwd=str(cwd))
    with open(log, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as client:
                with anyio.fail_after(CALL):
                    await client.initialize()
                yield Server(client, server_pid(str(workspace)), workspace, log)


def needs_namespaces() -> None:
    support = host_support()
    if support.bwrap is None:
        pytest.skip(reason=f"no PID namespace here, so a kill may leave children: {support.bwrap_problem}")


# -- the tools ------------------------------------------------------------------------------------

async def test_tools_listed_and_the_namespace_persists(tmp_path):
    async with serving(tmp_path) as server:
        with anyio.fail_after(CALL):
            tools = {t.name: t for t in (await server.client.list_tools()).tools}
        assert sorted(tools) == ["fork_session", "list_sessions", "reset_session", "run_python"]
        assert tools["run_python"].input_schema["required"] == ["code"]

        first = await server.run("import math\nr = 2\nprint('set')")
        assert not first.is_error, text(first)
        assert "set\n" in text(first) and "status: ok" in text(first)
        assert f"its files go in {server.workspace / 'default'}" in text(first)  # said once, when it starts

        second = await server.run("print(math.pi * r ** 2)")
        assert not second.is_error and text(second).startswith("12.566370614359172\n"), text(second)
        assert "started" not in text(second)
        assert second.structured_content["status"] == "ok"

        error = await server.run("1 / 0")
        assert error.is_error and "ZeroDivisionError: division by zero" in text(error)
        assert "status: error" in text(error)

        listed = await server.call("list_sessions")
        assert listed.structured_content["sessions"][0]["session"] == "default"
        assert "r" in listed.structured_content["sessions"][0]["variables"]


async def test_started_from_root_the_operators_notes_go_to_stderr_once_and_the_model_reads_its_own(tmp_path):
    """As desktop clients start servers: from /.  That the current directory is not shown is for
    the operator (stderr, once), not for every session's result; a refused write tells the
    model where it may write, as ``exec`` tells its user."""
    async with serving(tmp_path, cwd=Path("/")) as server:
        first = await server.run("print('hi')")
        other = await server.run("print('there')", session="other")
        refused = await server.run("open('/usr/planted.txt', 'w')")
        for result in (first, other):
            assert not result.is_error, text(result)
            assert "share-cwd" not in text(result) and "not shown" not in text(result), text(result)
        assert "its files go in" in text(first)
        assert refused.is_error and "[note: in this sandbox code writes only to the workspace " \
            f"({server.workspace / 'default'}) and $TMPDIR; the rest is read-only]" in text(refused), text(refused)
        assert wait_until(lambda: "share-cwd" in server.log.read_text(), 10)
    said = [line for line in server.log.read_text().splitlines() if "share-cwd" in line]
    assert len(said) == 1 and said[0].startswith("agentloop: sandbox: the current directory / is not shown"), said


async def test_the_manuals_client_entry_works_from_root(tmp_path):
    """The entry for an MCP client in docs/commands/mcp.md, its paths made this checkout's and
    the test's, started as desktop clients start servers: from /."""
    section = (ROOT / "docs" / "commands" / "mcp.md").read_text()
    entry = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])["mcpServers"]["agentloop"]
    files = tmp_path / "agentloop-files"
    command = entry["command"].replace("/path/to/agentloop", str(ROOT))
    args = [a.replace("/home/you/agentloop-files", str(files)) for a in entry["args"]]
    params = StdioServerParameters(command=command, args=args, cwd="/",
                                   env={**entry["env"], "XDG_STATE_HOME": str(tmp_path / "state")})
    with open(tmp_path / "server.log", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as client:
                with anyio.fail_after(CALL):
                    await client.initialize()
                    result = await client.call_tool("run_python", {"code": "open('made.txt', 'w').write('x')"})
    assert not result.is_error, text(result)
    assert (files / "default" / "made.txt").read_text() == "x"


async def test_two_sessions_run_at_once_each_with_its_namespace(tmp_path):
    async with serving(tmp_path) as server:
        for name in ("a", "b"):  # started first: what is timed below is the running
            assert not (await server.run(f"import time\nmine = {name!r}", session=name)).is_error
        results: dict[str, object] = {}

        async def run(name: str) -> None:
            results[name] = await server.run("time.sleep(1.5)\nprint(mine)", session=name)

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(run, "a")
            group.start_soon(run, "b")
        elapsed = time.monotonic() - started
        assert text(results["a"]).startswith("a\n") and text(results["b"]).startswith("b\n")
        assert elapsed < 2.9, f"{elapsed:.2f} s: the sessions ran one after the other"


#: A block that swallows the cancellation at its deadline: only the kill after the grace ends it.
STUBBORN = "import time\nwhile True:\n    try:\n        time.sleep(60)\n    except BaseException:\n        pass"


async def test_a_timeout_kills_and_says_what_was_lost(tmp_path):
    async with serving(tmp_path) as server:
        await server.run("x = 1\ny = 'kept?'")
        started = time.monotonic()
        result = await server.run(STUBBORN, timeout="1s")
        elapsed = time.monotonic() - started
        assert result.is_error
        words = text(result)
        assert "status: timeout" in words and "timed out after 1 s" in words, words
        assert "the worker was killed" in words and "lost variables: x, y" in words, words
        assert result.structured_content["lost_vars"] == ["x", "y"]
        assert elapsed < 10, elapsed
        gone = await server.run("print(x)")
        assert gone.is_error and "NameError" in text(gone)  # a fresh namespace
        assert not (await server.run("print('again')")).is_error


async def test_a_request_the_client_cancels_stops_its_block(tmp_path):
    async with serving(tmp_path) as server:
        await server.run("kept = 1")
        pid = (await server.call("list_sessions")).structured_content["sessions"][0]["pid"]
        running = anyio.Event()

        async def progress(done: float, total: float | None, message: str | None) -> None:
            running.set()

        async with anyio.create_task_group() as group:
            async def call() -> None:
                await server.run("print('running', flush=True)\n" + STUBBORN, timeout="10m",
                                 progress_callback=progress)

            group.start_soon(call)
            with anyio.fail_after(CALL):
                await running.wait()
            group.cancel_scope.cancel()  # the SDK sends notifications/cancelled for the request
        with anyio.fail_after(CALL):  # the block ignores the cancel: the worker is killed after the grace
            while (await server.call("list_sessions")).structured_content["sessions"][0]["pid"] == pid:
                await anyio.sleep(0.05)
        gone = await server.run("print(kept)")
        assert gone.is_error and "NameError" in text(gone), text(gone)


async def test_output_streams_as_progress_while_the_block_runs(tmp_path):
    async with serving(tmp_path) as server:
        go = server.workspace / "stream" / "go"
        seen: list[str] = []

        async def progress(done: float, total: float | None, message: str | None) -> None:
            seen.append(message or "")
            if "waiting for go" in (message or ""):
                go.write_text("go")  # the block finishes only once this was seen

        code = ("import os, time\nprint('waiting for go', flush=True)\ndeadline = time.monotonic() + 30\n"
                f"while not os.path.exists({str(go)!r}):\n"
                "    assert time.monotonic() < deadline, 'no progress notification reached the client'\n"
                "    time.sleep(0.01)\nprint('went')")
        await server.run("pass", session="stream")  # the workspace exists from here on
        result = await server.run(code, session="stream", progress_callback=progress)
        assert not result.is_error, text(result)
        assert text(result).startswith("waiting for go\nwent\n")
        assert any("waiting for go" in m for m in seen), seen


async def test_hostile_blocks_are_contained_while_the_server_keeps_serving(tmp_path):
    needs_namespaces()
    bomb = ("import os\nprint('forking', flush=True)\nwhile True:\n    try:\n        os.fork()\n"
            "    except BaseException:\n        pass\n")
    async with serving(tmp_path, "--memory", "256M", "--max-processes", "64") as server:
        assert not (await server.run("print('up')", session="calm")).is_error
        outcomes: dict[str, object] = {}

        async def hostile(name: str, code: str) -> None:
            outcomes[name] = await server.run(code, session=name, timeout="4s")

        async with anyio.create_task_group() as group:
            group.start_soon(hostile, "forks", bomb)
            group.start_soon(hostile, "memory", "hog = bytearray(1024 ** 3)\nprint('survived')")
            calm = await server.run("print('still serving')", session="calm")  # while they run
        assert not calm.is_error and text(calm).startswith("still serving")
        forks, memory = text(outcomes["forks"]), text(outcomes["memory"])
        assert outcomes["forks"].is_error and "status: timeout" in forks and "killed" in forks, forks
        assert outcomes["memory"].is_error and "memory" in memory.lower() and "survived" not in memory, memory
        assert wait_until(lambda: len(descendants(server.pid)) < 30, GONE), len(descendants(server.pid))
        for name in ("forks", "memory", "calm"):  # every session serves again
            again = await server.run("print(6 * 7)", session=name)
            assert not again.is_error and text(again).startswith("42"), text(again)


async def test_bad_requests_are_tool_errors_not_crashes(tmp_path):
    async with serving(tmp_path) as server:
        for tool, arguments, words in [
            ("run_python", {}, "needs `code`"),
            ("run_python", {"code": "1", "session": "../etc"}, "a session name is"),
            ("run_python", {"code": "1", "timeout": "soon"}, "timeout:"),
            ("no_such_tool", {}, "no tool named 'no_such_tool'"),
        ]:
            result = await server.call(tool, arguments)
            assert result.is_error and words in text(result), (tool, arguments, text(result))
        assert not (await server.run("print('fine')")).is_error


async def test_max_sessions_is_refused_in_words_and_reset_frees_one(tmp_path):
    async with serving(tmp_path, "--max-sessions", "2") as server:
        for name in ("a", "b"):
            assert not (await server.run("v = 1", session=name)).is_error
        refused = await server.run("v = 1", session="c")
        assert refused.is_error and "2 sessions are open on this server" in text(refused) and "yours: a, b." in text(refused), text(refused)
        reset = await server.call("reset_session", {"session": "a"})
        assert not reset.is_error and "variables lost: v" in text(reset), text(reset)
        assert not (await server.run("print('c runs')", session="c")).is_error
        listed = await server.call("list_sessions")
        assert [s["session"] for s in listed.structured_content["sessions"]] == ["b", "c"]
        again = await server.run("print('v' in globals())", session="a")  # a fresh start, refused now
        assert again.is_error and "yours: b, c." in text(again)


async def test_a_forked_session_holds_a_copy_and_closes_with_its_source(tmp_path):
    async with serving(tmp_path) as server:
        assert not (await server.run("data = list(range(1000))\nname = 'first'", session="a")).is_error
        forked = await server.call("fork_session", {"session": "a", "new_session": "b"})
        assert not forked.is_error and "variables: data, name" in text(forked), text(forked)
        assert forked.structured_content["forked_from"] == "a"
        assert text(await server.run("name = 'second'; print(len(data), name)", session="b")).startswith("1000 second")
        assert text(await server.run("print(name)", session="a")).startswith("first")
        again = await server.call("fork_session", {"session": "a", "new_session": "b"})
        assert again.is_error and "open already" in text(again)
        missing = await server.call("fork_session", {"session": "nope", "new_session": "c"})
        assert missing.is_error and "'nope' is not open" in text(missing)
        reset = await server.call("reset_session", {"session": "a"})
        assert not reset.is_error
        listed = await server.call("list_sessions")
        assert listed.structured_content["sessions"] == [], listed.structured_content


async def test_idle_sessions_are_closed(tmp_path):
    async with serving(tmp_path, "--idle-timeout", "300ms") as server:
        assert not (await server.run("v = 1", session="brief")).is_error
        with anyio.fail_after(CALL):
            while (await server.call("list_sessions")).structured_content["sessions"]:
                await anyio.sleep(0.05)  # polled: the 300 ms timer is the server's
        fresh = await server.run("print('v' in globals())", session="brief")
        assert text(fresh).startswith("False"), text(fresh)


async def test_workspace_files_are_resources_and_links_are_not_followed(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the client")
    code = ("import os\nos.makedirs('out', exist_ok=True)\nopen('out/data.csv', 'w').write('a,b\\n1,2\\n')\n"
            "open('bytes.bin', 'wb').write(bytes(range(256)))\n"
            f"os.symlink({str(secret)!r}, 'link.txt')\nos.mkfifo('pipe')\nprint(sorted(os.listdir('.')))")
    async with serving(tmp_path) as server:
        (server.workspace / "notes").mkdir(parents=True)  # the user's, beside the sessions: nobody's resource
        (server.workspace / "notes" / "todo.txt").write_text("the user's")
        made = await server.run(f"import os\nos.chdir({str(server.workspace / 'files')!r})\n" + code,
                                session="files")
        assert not made.is_error, text(made)
        with anyio.fail_after(CALL):
            listed = {str(r.uri): r for r in (await server.client.list_resources()).resources}
            assert sorted(listed) == ["agentloop://files/bytes.bin", "agentloop://files/out/data.csv"]
            assert listed["agentloop://files/out/data.csv"].size == 8
            csv = (await server.client.read_resource("agentloop://files/out/data.csv")).contents[0]
            assert csv.text == "a,b\n1,2\n" and csv.mime_type == "text/csv"
            blob = (await server.client.read_resource("agentloop://files/bytes.bin")).contents[0]
            assert base64.b64decode(blob.blob) == bytes(range(256))
            for uri, words in [("agentloop://files/link.txt", "link"), ("agentloop://files/pipe", "regular"),
                               ("agentloop://files/../secret.txt", "not a file path"),
                               ("agentloop://files/none.txt", "no such file"),
                               ("agentloop://notes/todo.txt", "no session 'notes' of yours"),
                               ("file:///etc/passwd", "not an agentloop")]:
                with pytest.raises(MCPError, match=words):
                    await server.client.read_resource(uri)


# -- ending ----------------------------------------------------------------------------------------

DAEMON = ("import subprocess\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\n"
          "print('daemon started')")


async def test_a_client_that_closes_leaves_no_process(tmp_path):
    needs_namespaces()
    async with serving(tmp_path) as server:
        for name in ("one", "two"):
            assert "daemon started" in text(await server.run(DAEMON, session=name))
        below = descendants(server.pid)
        assert len(below) >= 4, below  # workers, their namespaces, the daemons
        pid, log = server.pid, server.log
    assert wait_until(lambda: not alive(below | {pid}), GONE), f"left behind: {alive(below | {pid})}"
    assert "mcp server stopped (the client closed the connection); 2 sessions closed" in log.read_text()


async def test_sigterm_leaves_no_process(tmp_path):
    needs_namespaces()
    async with serving(tmp_path) as server:
        assert "daemon started" in text(await server.run(DAEMON))
        running = anyio.Event()

        async def progress(done: float, total: float | None, message: str | None) -> None:
            running.set()

        async def stuck() -> None:  # a call still running when the signal comes
            with contextlib.suppress(Exception):
                await server.run("import time\nprint('sleeping', flush=True)\ntime.sleep(300)", session="busy",
                                 timeout="10m", progress_callback=progress)

        async with anyio.create_task_group() as group:
            group.start_soon(stuck)
            with anyio.fail_after(CALL):
                await running.wait()
            below = descendants(server.pid)
            os.kill(server.pid, signal.SIGTERM)
            gone = await anyio.to_thread.run_sync(wait_until, lambda: not alive(below | {server.pid}), GONE)
            assert gone, f"left behind: {alive(below | {server.pid})}"
            group.cancel_scope.cancel()
    assert "mcp server stopped (stopped by a signal); 2 sessions closed" in server.log.read_text()


async def test_streamable_http(tmp_path):
    workspace = tmp_path / "ws"
    (tmp_path / "cwd").mkdir()
    proc = subprocess.Popen([sys.executable, *server_args(workspace, "--http", "127.0.0.1:0")],
                            cwd=tmp_path / "cwd", env={**os.environ, **server_env(tmp_path)},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + CALL
        line = ""
        while "serving MCP at" not in line and time.monotonic() < deadline:  # after -v's log lines
            line = read_line(proc.stderr, deadline - time.monotonic())
            assert line, "the server said nothing more before it served"
        assert "serving MCP at http://127.0.0.1:" in line, line
        url = line.split(" at ", 1)[1].split()[0]
        assert "only to requests that carry its token" in line, line
        async with streamable_http_client(url) as (read, write), ClientSession(read, write) as client:
            with anyio.fail_after(CALL):
                await client.initialize()
                await client.call_tool("run_python", {"code": "n = 20"})
                result = await client.call_tool("run_python", {"code": "print(n + 22)"})
        assert not result.is_error and text(result).startswith("42\n"), text(result)
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(GONE) == 0
        assert wait_until(lambda: not alive(below), GONE), f"left behind: {alive(below)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(GONE)
        proc.stderr.close()


# -- images -------------------------------------------------------------------------------------

async def test_run_python_returns_the_images_a_block_displays_as_image_content(tmp_path):
    pytest.importorskip("matplotlib")
    code = ("import matplotlib.pyplot as plt\nfrom PIL import Image\nplt.plot([1, 3, 2])\nplt.show()\n"
            "display(Image.new('RGB', (4, 3), (255, 0, 0)))\nprint('drawn')")
    async with serving(tmp_path) as server:
        result = await server.run(code, timeout="60s")
    assert not result.is_error, text(result)
    images = [part for part in result.content if part.type == "image"]
    assert [part.mime_type for part in images] == ["image/png", "image/png"], result.content
    pngs = [base64.b64decode(part.data) for part in images]
    assert png_size(pngs[1]) == (4, 3) and png_size(pngs[0])[0] > 100
    assert "drawn" in text(result) and text(result).count("PNG: ") == 2, text(result)
    assert [d["width"] for d in result.structured_content["displays"]] == [png_size(pngs[0])[0], 4]
