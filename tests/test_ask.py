"""`agentloop ask` as a user runs it: a real process against the scripted tool-calling server,
checked by what the server received and what the user sees."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.agent import ASK_SYSTEM, AnswerStream
from engine.agent._ask import STOPPED
from engine.agent._display import read_recording
from engine.agent._tool_protocol import embedded_calls
from engine.inert import inert
from engine.models import strip_think
from engine.scripted import Delay, Fail, ScriptedServer
from engine.tools import MAX_RESULT, TOOL_SCHEMAS

from .conftest import closed_port

AGENTLOOP = [sys.executable, "-m", "engine.cli", "ask"]
REPO = Path(__file__).resolve().parent.parent
WAIT = 60.0  # generous: the machine may be loaded; every wait below is bounded by it
_OWN = ("AGENT_ROOT", "MAX_TURNS", "LLM_URL", "LLM_MODEL", "LLM_TIMEOUT", "LLM_API_KEY")


def call(tool: str, call_id: str, /, **args) -> dict:
    return {"id": call_id, "name": tool, "arguments": json.dumps(args)}


def ask(*args: str, cwd: Path, url: str | None = None, stdin: str | None = None, **env: str
        ) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in _OWN}
    environ["PYTHONPATH"] = str(REPO)
    if url:
        environ["LLM_URL"] = url
    environ.update(env)
    return subprocess.run([*AGENTLOOP, *args], input=stdin if stdin is not None else "", capture_output=True,
                          text=True, cwd=cwd, env=environ, timeout=WAIT)


def tool_answers(request: dict) -> dict[str, str]:
    return {m["tool_call_id"]: m["content"] for m in request["messages"] if m["role"] == "tool"}


def gears(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(" ⚙ ")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A small project, with a file outside it and links that lead out."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the secret\n")
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("import os\n\n\ndef answer():\n    return 42\n")
    (root / "README.md").write_text("# project\n")
    (root / "big.txt").write_text(("x" * 99 + "\n") * 200)
    os.symlink(outside / "secret.txt", root / "link_out")
    os.symlink(outside, root / "dir_out")
    return root


def test_one_shot_uses_the_three_tools_and_cites_path_line(project, tmp_path):
    def conclude(body):
        found = tool_answers(body)
        line = found["s"].split(":")[1] if found["s"].startswith("pkg/mod.py:") else "?"
        return f"<think>found it</think>\n`answer` is defined at pkg/mod.py:{line} and returns 42."

    script = [
        {"content": "", "tool_calls": [call("list_dir", "l", path="."), call("search", "s", pattern=r"def answer")]},
        {"content": "", "tool_calls": [call("read_file", "r", path="pkg/mod.py", offset=4, limit=2)]},
        conclude]
    with ScriptedServer(script) as server:
        proc = ask("where", "is", "answer", "defined?", cwd=tmp_path, url=server.url, AGENT_ROOT=str(project))
        requests = server.requests
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "`answer` is defined at pkg/mod.py:4 and returns 42.\n"
    assert gears(proc.stderr) == [' ⚙ list_dir({"path": "."})', ' ⚙ search({"pattern": "def answer"})',
                                  ' ⚙ read_file({"path": "pkg/mod.py", "offset": 4, "limit": 2})']
    assert len(requests) == 3
    for body in requests:
        assert body["tools"] == TOOL_SCHEMAS  # the seed's three, word for word; nothing that runs code
        assert body["tool_choice"] == "auto"
    system, question = requests[0]["messages"]
    assert system == {"role": "system", "content": ASK_SYSTEM.format(root=os.path.realpath(project))}
    assert str(os.path.realpath(project)) in system["content"] and "path:line" in system["content"]
    assert question == {"role": "user", "content": "where is answer defined?"}
    first = tool_answers(requests[1])
    assert "pkg/" in first["l"] and "README.md (10 bytes)" in first["l"]
    assert first["s"] == "pkg/mod.py:4: def answer():"
    assert tool_answers(requests[2])["r"].startswith("4\tdef answer():\n5\t    return 42")


def test_guards_and_escapes_are_answered_in_words(project, tmp_path):
    outside = str(tmp_path / "outside" / "secret.txt")
    script = [
        {"content": "", "tool_calls": [
            call("read_file", "dots", path="../outside/secret.txt"),
            call("read_file", "abs", path=outside),
            call("read_file", "link", path="link_out"),
            call("list_dir", "linkdir", path="dir_out"),
            call("search", "searchout", pattern="secret", path=".."),
            {"id": "json", "name": "read_file", "arguments": "{oops"},
            call("run_code", "code", code="print(1)"),
            call("read_file", "big", path="big.txt"),
            call("search", "regex", pattern="("),
            call("read_file", "nosuch", path="nope.txt"),
        ]},
        "Nothing outside the project can be read."]
    with ScriptedServer(script) as server:
        proc = ask("read", "the", "secret", cwd=project, url=server.url)
        answers = tool_answers(server.requests[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Nothing outside the project can be read.\n"
    for key, path in (("dots", "../outside/secret.txt"), ("abs", outside), ("link", "link_out"),
                      ("linkdir", "dir_out"), ("searchout", "..")):
        assert answers[key] == f"[agent] path escapes the project root: {path}", key
    assert not any("the secret" in text for text in answers.values())
    assert answers["json"].startswith("[agent] arguments were not valid JSON (")
    assert answers["code"] == "[agent] unknown tool 'run_code' — available: list_dir, read_file, search"
    assert answers["big"].startswith("1\t" + "x" * 99 + "\n2\t")
    assert len(answers["big"]) == MAX_RESULT
    assert answers["big"].endswith("narrow the request (offset/limit, tighter pattern)")
    assert answers["regex"].startswith("[agent] bad regex '(':")
    assert answers["nosuch"] == "[agent] no such file: nope.txt"
    assert len(gears(proc.stderr)) == 10


def test_gear_lines_cut_arguments_at_120_characters(project):
    pattern = "p" * 300
    with ScriptedServer([{"content": "", "tool_calls": [call("search", "s", pattern=pattern)]}, "none"]) as server:
        proc = ask("long", cwd=project, url=server.url)
    assert proc.returncode == 0, proc.stderr
    arguments = json.dumps({"pattern": pattern})
    assert gears(proc.stderr) == [f" ⚙ search({arguments[:120]})"]


def test_round_limit_answers_with_the_seed_text_and_max_turns_flag_wins(project):
    busy = {"content": "", "tool_calls": [call("list_dir", "l", path=".")]}
    with ScriptedServer([busy] * 10) as server:
        proc = ask("loop", "forever", cwd=project, url=server.url, MAX_TURNS="2")
        made = len(server.requests)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == STOPPED.format(n=2) + "\n"
    assert proc.stdout.startswith("[agent] stopped after 2 tool rounds without a final answer — ask a narrower "
                                  "question or raise MAX_TURNS")
    assert made == 2 and len(gears(proc.stderr)) == 2
    with ScriptedServer([busy] * 10) as server:
        proc = ask("--max-turns", "3", "loop", cwd=project, url=server.url, MAX_TURNS="2")
        made = len(server.requests)
    assert proc.stdout == STOPPED.format(n=3) + "\n" and made == 3


def test_root_and_model_flags_override_the_environment(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with ScriptedServer(["from env"]) as server:
        proc = ask("hi", cwd=tmp_path, url=server.url, AGENT_ROOT=str(elsewhere), LLM_MODEL="env-model")
        body = server.requests[0]
    assert proc.returncode == 0, proc.stderr
    assert body["model"] == "env-model" and f"rooted at {elsewhere.resolve()}." in body["messages"][0]["content"]
    with ScriptedServer(["from flags"]) as server:
        (tmp_path / "agentloop.toml").write_text(f'[models.other]\nbase_url = "{server.url}"\nmodel = "file-model"\n')
        proc = ask("--root", str(project), "--model", "other", "hi", cwd=tmp_path, url="http://127.0.0.1:9/v1",
                   AGENT_ROOT=str(elsewhere), LLM_MODEL="env-model")
        body = server.requests[0]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "from flags\n"
    assert body["model"] == "file-model" and f"rooted at {project.resolve()}." in body["messages"][0]["content"]


def test_interactive_over_a_pipe_keeps_the_conversation(project):
    def second(body):
        earlier = [m["content"] for m in body["messages"] if m["role"] in ("user", "assistant")]
        return f"I remember {earlier[:3]}"

    script = [{"content": "", "tool_calls": [call("list_dir", "l", path="pkg")]}, "It holds mod.py.", second]
    with ScriptedServer(script) as server:
        proc = ask(cwd=project, url=server.url, stdin="what is in pkg?\n\n   \nand before that?\n")
        requests = server.requests
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("you> ") == 5  # two questions, two blank lines, end of input
    assert "you> what is in pkg?\nIt holds mod.py.\n" in proc.stdout
    assert "you> and before that?\nI remember ['what is in pkg?', '', 'It holds mod.py.']\n" in proc.stdout
    assert len(requests) == 3
    roles = [m["role"] for m in requests[2]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert requests[2]["messages"][-1]["content"] == "and before that?"
    banner = proc.stderr.splitlines()[:2]
    assert banner[0] == f"agentloop ask — model qwen3-coder at {server.url}"
    assert banner[1].startswith(f"root {project.resolve()} (Ctrl-D to exit")
    assert gears(proc.stderr) == [' ⚙ list_dir({"path": "pkg"})']


def test_interactive_question_the_endpoint_failed_is_dropped(project):
    # The first question fails for good (its first try and the client's four retries); the
    # second is asked in a conversation that does not hold it, and the exit status says so.
    script = {"first": [Fail(500, times=5), "never"], "second": ["two"]}
    with ScriptedServer(script) as server:
        proc = ask(cwd=project, url=server.url, stdin="first\nsecond\n")
        last = server.requests[-1]
    assert proc.returncode == 1
    assert "answered HTTP 500" in proc.stderr and "the question was dropped from the conversation" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "you> first\n\nyou> second\ntwo\n" in proc.stdout
    assert [m["content"] for m in last["messages"][1:]] == ["second"]


def test_unreachable_endpoint_gives_one_line_at_once_and_exit_1(project, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    record = tmp_path / "ask.jsonl"
    proc = ask("hello", "--record", str(record), cwd=project, url=url)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"agentloop: cannot reach the model at {url} (connection refused)")
    assert "llama-server" in lines[0]
    # Nobody listening is not a transient failure: one attempt, no retries, no seconds of silence.
    events = [e["type"] for e in read_recording(record)]
    assert events.count("waiting") == 1 and "retrying" not in events, events


def test_json_and_record(project, tmp_path):
    script = [{"content": "", "tool_calls": [call("read_file", "r", path="README.md")]}, "It is a project."]
    record = tmp_path / "ask.jsonl"
    with ScriptedServer(script) as server:
        proc = ask("what", "is", "this", "--json", "--record", str(record), cwd=project, url=server.url)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["answer"] == "It is a project." and report["status"] == "answered" and report["error"] == ""
    assert report["messages"] == 2 and report["tool_calls"] == 1 and report["tokens"]["in"] > 0
    assert report["root"] == str(project.resolve())
    events = read_recording(record)
    types = [e["type"] for e in events]
    assert {"system", "sent", "replied", "delta", "tool_call", "tool_result"} <= set(types)
    tool_call = next(e for e in events if e["type"] == "tool_call")
    assert tool_call["tool"] == "read_file" and tool_call["id"] == "r"
    assert next(e for e in events if e["type"] == "tool_result")["text"] == "1\t# project\n"
    with ScriptedServer([{"content": "", "tool_calls": [call("list_dir", "l", path=".")]}] * 3) as server:
        stopped = json.loads(ask("--json", "--max-turns", "1", "loop", cwd=project, url=server.url).stdout)
    assert stopped["status"] == "stopped" and stopped["answer"] == STOPPED.format(n=1)


def test_tool_calls_written_in_the_content_are_served(project):
    embedded = '<tool_call>\n{"name": "search", "arguments": {"pattern": "return 42"}}\n</tool_call>'
    with ScriptedServer([embedded, "It returns 42 (pkg/mod.py:5)."]) as server:
        proc = ask("what", "does", "answer", "return", cwd=project, url=server.url)
        second = server.requests[1]["messages"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "It returns 42 (pkg/mod.py:5).\n"
    assert gears(proc.stderr) == [' ⚙ search({"pattern": "return 42"})']
    assert second[-2] == {"role": "assistant", "content": embedded}
    assert second[-1] == {"role": "user", "content": "<tool_response>\npkg/mod.py:5:     return 42\n</tool_response>"}


def test_usage_errors(project):
    empty = ask("", cwd=project, url="http://127.0.0.1:9/v1")
    assert empty.returncode == 2 and "the question is empty" in empty.stderr
    json_needs = ask("--json", cwd=project, url="http://127.0.0.1:9/v1")
    assert json_needs.returncode == 2 and "--json needs a QUESTION" in json_needs.stderr
    bad_root = ask("hi", cwd=project, url="http://127.0.0.1:9/v1", AGENT_ROOT=str(project / "missing"))
    assert bad_root.returncode == 2 and "does not exist" in bad_root.stderr


def test_ctrl_c_drops_the_running_question_and_returns_to_the_prompt(project):
    script = {"slow question": [Delay(WAIT, "too late")], "quick question": ["quick answer"]}
    environ = {k: v for k, v in os.environ.items() if k not in _OWN}
    with ScriptedServer(script) as server:
        proc = subprocess.Popen(AGENTLOOP, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=project, env={**environ, "LLM_URL": server.url,
                                                             "PYTHONPATH": str(REPO)})
        try:
            proc.stdin.write("slow question\n")
            proc.stdin.flush()
            assert server.wait_requests(1, timeout=WAIT)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate("quick question\n", timeout=WAIT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(WAIT)
        bodies = server.requests
    assert proc.returncode == 0, err
    assert "interrupted; the question was dropped" in err
    assert "you> quick question\nquick answer\n" in out and "too late" not in out
    assert [m["content"] for m in bodies[-1]["messages"][1:]] == ["quick question"]


# ---------------------------------------------------------------- on a terminal

def _read_terminal(fd: int, proc: subprocess.Popen) -> str:
    """Everything written to the terminal until the process closes it, within WAIT."""
    deadline = time.monotonic() + WAIT
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace")


def test_terminal_shows_the_answer_as_written_inert_and_without_reasoning(project):
    replies = [{"content": "<think>plan</think>Looking \x1b]0;owned\x07around.",
                "tool_calls": [call("list_dir", "l", path=".")]},
               "<think>the answer is in mod.py</think>\n\nIt is in \x1b[31mpkg/mod.py:4\x1b[0m.\n"]
    environ = {k: v for k, v in os.environ.items() if k not in _OWN}
    with ScriptedServer(replies, chunk_chars=3) as server:
        controller, terminal = pty.openpty()
        try:
            proc = subprocess.Popen([*AGENTLOOP, "where?"], stdin=subprocess.DEVNULL, stdout=terminal,
                                    stderr=subprocess.PIPE, cwd=project,
                                    env={**environ, "LLM_URL": server.url, "PYTHONPATH": str(REPO)})
            os.close(terminal)
            shown = _read_terminal(controller, proc)
            _, err = proc.communicate(timeout=WAIT)
        finally:
            os.close(controller)
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert shown.replace("\r\n", "\n") == "Looking around.\nIt is in pkg/mod.py:4.\n"
    assert gears(err.decode()) == [' ⚙ list_dir({"path": "."})']


@pytest.mark.parametrize("reply", [
    "plain answer",
    "  <think>a</think>\n\nanswer <b>bold</b> < 3 and <thin ice\n\n",
    "<think>never closed, all reasoning",
    "before <tool_call>{\"name\": \"x\"}</tool_call> after",
    "text\x1b[2Jwith \x07 controls\r\nand lines\n",
    "<think></think><think>two</think>answer<",
])
def test_answer_stream_shows_what_the_answer_will_read(reply):
    expected = inert(embedded_calls(strip_think(reply))[0]) if "<tool_call>" in reply else inert(strip_think(reply))
    for size in (1, 2, 3, 7, len(reply)):
        shown: list[str] = []
        stream = AnswerStream(shown.append)
        for i in range(0, len(reply), size):
            stream.feed(reply[i:i + size])
        assert stream.end() == bool(expected)
        assert "".join(shown) == (expected + "\n" if expected else ""), size


def test_answer_stream_separates_reasoning_ended_by_a_stray_close():
    shown: list[str] = []
    stream = AnswerStream(shown.append)
    for piece in ("reasoning the template opened", "</thi", "nk>\n\nthe answer"):
        stream.feed(piece)
    stream.end()
    assert "".join(shown) == "reasoning the template opened\nthe answer\n"
