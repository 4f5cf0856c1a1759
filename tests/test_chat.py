"""`agentloop chat` driven as a user would: a real process, a pipe (or a terminal) for stdin,
a scripted model server in the test process, real workers."""

from __future__ import annotations

import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.scripted import Fail, ScriptedServer

from .conftest import processes_with, wait_until

AGENTLOOP = [sys.executable, "-m", "engine.cli"]
WAIT = 60.0  # generous: a loaded two-core machine starts sandboxed workers slowly


class _Output:
    """Everything a pipe delivers, collected by a thread; wait for text to appear in it."""

    def __init__(self, pipe) -> None:
        self.text = ""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            with self._cond:
                self.text += chunk.decode("utf-8", "replace")
                self._cond.notify_all()

    def wait_for(self, pattern: str, start: int = 0, timeout: float = WAIT) -> re.Match:
        """The first match of regex ``pattern`` at or after ``start``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = re.compile(pattern).search(self.text, start)
                if found:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"no {pattern!r} within {timeout:g} s; got:\n{self.text}")
                self._cond.wait(left)

    def count(self, text: str) -> int:
        with self._cond:
            return self.text.count(text)

    def join(self, timeout: float = WAIT) -> None:
        self._thread.join(timeout)


class _Chat:
    """One ``agentloop chat`` process with its own workspace and socket directory.

    Its workers are the processes whose command line names either: they are counted to prove
    that none outlives the chat."""

    def __init__(self, tmp_path: Path, url: str, *args: str, terminal: bool = False) -> None:
        self.workspace = tmp_path / "ws"
        self.workspace.mkdir()
        # Short on purpose: the engine puts sockets under XDG_RUNTIME_DIR only when its path is short.
        self.runtime = tempfile.mkdtemp(prefix="alc-", dir="/tmp")
        env = {**os.environ, "LLM_URL": url, "XDG_STATE_HOME": str(tmp_path / "state"),
               "XDG_RUNTIME_DIR": self.runtime}
        self._terminal = None
        stdin = subprocess.PIPE
        if terminal:
            self._terminal, slave = pty.openpty()
            stdin = slave
        self.proc = subprocess.Popen([*AGENTLOOP, "chat", "--workspace", str(self.workspace), *args],
                                     stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=tmp_path, env=env)
        if terminal:
            os.close(slave)
        self.out = _Output(self.proc.stdout)
        self.err = _Output(self.proc.stderr)

    def send(self, line: str) -> None:
        if self._terminal is not None:
            os.write(self._terminal, (line + "\n").encode())
        else:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()

    def end_input(self) -> int:
        """Ctrl-D: close stdin (a terminal's end-of-file); the exit status."""
        if self._terminal is not None:
            os.write(self._terminal, b"\x04")
        else:
            self.proc.stdin.close()
        code = self.proc.wait(WAIT)
        self.out.join()
        self.err.join()
        return code

    def workers(self) -> list[int]:
        return sorted(set(processes_with(self.runtime)) | set(processes_with(str(self.workspace))))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)
        if self._terminal is not None:
            os.close(self._terminal)
            self._terminal = None
        shutil.rmtree(self.runtime, ignore_errors=True)


@pytest.fixture
def start_chat(tmp_path: Path):
    chats: list[_Chat] = []

    def start(url: str, *args: str, terminal: bool = False) -> _Chat:
        chat = _Chat(tmp_path, url, *args, terminal=terminal)
        chats.append(chat)
        return chat

    yield start
    for chat in chats:
        chat.close()


def _last_user(body: dict) -> str:
    return [m["content"] for m in body["messages"] if m["role"] == "user"][-1]


def _result_of(block_id: str):
    """A turn quoting the output of block ``block_id`` from the message it answers."""
    def turn(body: dict) -> str:
        found = re.search(rf"<run_code_result id={block_id} [^>]*>\n(.*?)\n</run_code_result>",
                          _last_user(body), re.DOTALL)
        return f"{block_id} printed {found.group(1).strip() if found else '(nothing)'}"
    return turn


def test_namespace_and_transcript_persist_across_questions(start_chat):
    script = {"Compute the answer": [
        '<run_code id="calc">\nanswer = 6 * 7\nprint(answer)\n</run_code>',
        _result_of("calc"),
        '<run_code id="twice">\nprint(answer * 2)\n</run_code>',  # `answer` from the first question
        _result_of("twice"),
    ]}
    with ScriptedServer(script) as server:
        chat = start_chat(server.url)
        chat.send("Compute the answer")
        chat.out.wait_for(r"calc printed 42\n")
        assert chat.workers(), "the chat's worker should be running"
        chat.send("Now double it")
        chat.out.wait_for(r"twice printed 84\n")

        second = server.requests[2]  # the first request of the second question
        contents = [m["content"] for m in second["messages"]]
        assert any("Compute the answer" in c for c in contents)
        assert "calc printed 42" in contents  # the first answer, in the transcript
        assert contents[-1].endswith("Now double it")

        assert chat.end_input() == 0
    assert chat.out.text.startswith("you> Compute the answer\n")
    assert chat.out.text.endswith("you> \n")
    assert "agentloop chat — model default" in chat.err.text
    assert wait_until(lambda: not chat.workers(), 10), "a worker outlived the chat"


def test_piped_questions_are_answered_in_order_then_end_of_input_exits(start_chat):
    with ScriptedServer({"First question": ["First answer.", "Second answer."]}) as server:
        chat = start_chat(server.url)
        chat.send("First question")
        chat.send("Second question")  # arrives while the first is being answered: it waits its turn
        assert chat.end_input() == 0
        assert len(server.requests) == 2
    assert chat.out.text == ("you> First question\nFirst answer.\n\n"
                             "you> Second question\nSecond answer.\n\nyou> \n")


def _flag_script(flag: Path) -> dict:
    """A block that waits for ``flag`` (in the workspace, which workers may see), then a wait
    reply, then the block's output quoted."""
    return {"Wait for the flag": [
        f'<run_code id="wait" timeout="2m">\nimport os, time\nprint("waiting", flush=True)\n'
        f'while not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\nprint("flag seen")\n</run_code>',
        "Noted; still waiting for the flag.",
        _result_of("wait"),
    ]}


@pytest.mark.parametrize("terminal, line, steer", [
    (False, "/steer prefer the fast path", "prefer the fast path"),  # piped: only /steer steers
    (True, "hurry up", "hurry up"),  # a terminal: any line typed during a turn steers
])
def test_a_line_during_a_turn_steers_the_model(start_chat, tmp_path, terminal, line, steer):
    flag = tmp_path / "ws" / "flag"
    with ScriptedServer(_flag_script(flag)) as server:
        chat = start_chat(server.url, terminal=terminal)
        chat.send("Wait for the flag")
        chat.err.wait_for(r"main/wait │ waiting")
        chat.send(line)
        assert server.wait_requests(2, WAIT)
        assert f"<steer>\n{steer}\n</steer>" in _last_user(server.requests[1])
        flag.write_text("")
        chat.out.wait_for(r"wait printed waiting\nflag seen\n")
        assert chat.end_input() == 0
    if terminal:
        assert "a line typed while it works steers it" in chat.err.text


def test_ctrl_c_cancels_the_turn_not_the_chat(start_chat):
    script = {"Sleep for a long time": [
        '<run_code id="nap" timeout="10m">\nimport time\nprint("sleeping", flush=True)\ntime.sleep(600)\n</run_code>',
        lambda body: "Still here. " + ("I saw the interruption." if "interrupted" in _last_user(body) else ""),
    ]}
    with ScriptedServer(script) as server:
        chat = start_chat(server.url)
        chat.send("Sleep for a long time")
        chat.err.wait_for(r"main/nap │ sleeping")
        prompts = chat.out.count("you> ")
        chat.proc.send_signal(signal.SIGINT)
        chat.err.wait_for(r"agentloop: turn cancelled")
        assert wait_until(lambda: chat.out.count("you> ") > prompts, WAIT), chat.out.text
        assert chat.proc.poll() is None

        chat.send("Are you there?")
        chat.out.wait_for(r"Still here\. I saw the interruption\.\n")
        assert chat.end_input() == 0
    assert wait_until(lambda: not chat.workers(), 10), "a worker outlived the chat"


def test_ctrl_c_at_the_prompt_prompts_again_and_twice_leaves(start_chat):
    with ScriptedServer({"*": ["unused"]}) as server:
        chat = start_chat(server.url)
        chat.out.wait_for(r"you> ")
        chat.proc.send_signal(signal.SIGINT)
        chat.err.wait_for(r"Ctrl-C again to leave")
        chat.out.wait_for(r"you> \nyou> ")
        assert chat.proc.poll() is None
        chat.proc.send_signal(signal.SIGINT)
        assert chat.proc.wait(WAIT) == 128 + signal.SIGINT
    assert wait_until(lambda: not chat.workers(), 10), "a worker outlived the chat"


def test_an_endpoint_failure_is_one_line_and_the_chat_goes_on(start_chat):
    script = {"first question": [Fail(404)], "second question": ["The second answer."]}
    with ScriptedServer(script) as server:
        chat = start_chat(server.url)
        chat.send("first question")
        failure = chat.err.wait_for(r"agentloop: [^\n]*HTTP 404[^\n]*\n")
        chat.send("second question")
        chat.out.wait_for(r"The second answer\.\n")
        assert chat.end_input() == 1  # stdin is not a terminal and a question went unanswered
    assert chat.err.text.count(failure.group(0)) == 1
    assert "Traceback" not in chat.err.text


