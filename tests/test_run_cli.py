"""`agentloop run` and `agentloop models` as a user runs them, against the scripted server."""

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

from engine.agent._display import read_recording
from engine.scripted import Delay, Fail, ScriptedServer

AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def agentloop(tmp_path: Path, *args: str, url: str | None = None, timeout: float = 120,
              extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), **(extra_env or {})}
    if url:
        env["LLM_URL"] = url
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=timeout)


def test_run_prints_only_the_answer_on_stdout(tmp_path):
    (tmp_path / "notes.txt").write_text("the secret number is 1234\n")
    script = {"find the number": [
        "<run_code>\nprint(read_file('notes.txt'))\nprint(search('secret'))\n</run_code>",
        lambda body: "The number is 1234." if "1234" in body["messages"][-1]["content"] else "not found"]}
    with ScriptedServer(script) as server:
        proc = agentloop(tmp_path, "run", "find the number", "--tools", "repo", "--root", str(tmp_path),
                         "--record", str(tmp_path / "rec.jsonl"), url=server.url)
        system = server.requests[0]["messages"][0]["content"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "The number is 1234.\n"
    assert "read_file(path: str, offset: int = 1, limit: int = 200)" in system
    assert "notes.txt:1: the secret number is 1234" in server.requests[1]["messages"][-1]["content"]
    events = read_recording(tmp_path / "rec.jsonl")
    assert {"system", "sent", "replied", "launched", "finished"} <= {e["type"] for e in events}


def test_run_json(tmp_path):
    with ScriptedServer({"*": ["<run_code>\nprint(1)\n</run_code>", "one"]}) as server:
        proc = agentloop(tmp_path, "run", "count", "--json", "-q", url=server.url)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["answer"] == "one" and report["status"] == "answered"
    assert report["messages"] == 2 and report["tokens"]["in"] > 0
    assert set(report) >= {"answer", "status", "messages", "tokens", "cost", "duration_s"}


def test_run_unreachable_endpoint_says_how_to_start_one(tmp_path):
    proc = agentloop(tmp_path, "run", "hello", "-q", url="http://127.0.0.1:9/v1")
    assert proc.returncode == 1
    assert "cannot reach the model at http://127.0.0.1:9/v1" in proc.stderr
    assert "llama-server -m MODEL.gguf --port 9 --jinja" in proc.stderr and "Traceback" not in proc.stderr


def test_run_gives_up_after_max_messages(tmp_path):
    with ScriptedServer({"*": ["<run_code>\nprint(1)\n</run_code>"] * 5}) as server:
        proc = agentloop(tmp_path, "run", "loop", "-q", "--max-messages", "2", url=server.url)
    assert proc.returncode == 1
    assert "unfinished after 2 messages" in proc.stderr
    assert proc.stdout == ""


def test_models_from_toml(tmp_path):
    (tmp_path / "agentloop.toml").write_text(
        'default = "big"\n'
        '[models.flash]\nbase_url = "http://127.0.0.1:8081/v1"\nmodel = "qwen3-4b"\nprice_in = 0.1\n'
        '[models.big]\nbase_url = "http://127.0.0.1:8082/v1"\nmodel = "qwen3-coder"\ncontext_window = 32768\n')
    proc = agentloop(tmp_path, "models")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("* ") and "big" in line and "qwen3-coder" in line for line in lines)
    assert any("flash" in line and "qwen3-4b" in line for line in lines)


def test_sub_agent_model_alias_from_toml(tmp_path):
    script = {"delegate": ['<run_agent name="quick" model="flash">\nsmall job\n</run_agent>', "wait", "done"],
              "small job": ["small answer"]}
    with ScriptedServer(script) as server:
        (tmp_path / "agentloop.toml").write_text(
            f'[models.main]\nbase_url = "{server.url}"\nmodel = "big-model"\n'
            f'[models.flash]\nbase_url = "{server.url}"\nmodel = "small-model"\ncontext_window = 8000\n')
        proc = agentloop(tmp_path, "run", "delegate", "-q", "--model", "main")
        child = server.conversation("small job")
        parent = server.conversation("delegate")
    assert proc.returncode == 0, proc.stderr
    assert child[0]["model"] == "small-model" and parent[0]["model"] == "big-model"
    assert "- flash: small-model" in parent[0]["messages"][0]["content"]


def test_doctor_tells_the_truth(tmp_path):
    with ScriptedServer({"*": ["hi"]}) as server:
        proc = agentloop(tmp_path, "doctor", url=server.url, extra_env={"LLM_MODEL": "scripted"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker: starts and runs code" in proc.stdout
    assert f"model endpoint {server.url}: answers" in proc.stdout
    for layer in ("pid namespace", "network namespace", "landlock", "seccomp", "rlimits"):
        assert layer in proc.stdout
    down = agentloop(tmp_path, "doctor", url="http://127.0.0.1:9/v1")
    assert down.returncode == 1 and "does not answer" in down.stdout and "LLM_URL" in down.stdout


def test_max_subagents_bounds_the_sub_agents_of_run_and_chat(tmp_path):
    # Three sub-agents asked for at once; --max-subagents 2 starts two and tells the model why not
    # the third.  chat takes the option from the same place as run.
    tags = "\n".join(f'<run_agent name="k{i}">kid task {i}</run_agent>' for i in range(3))

    def parent(body):
        seen = "".join(m["content"] for m in body["messages"] if m["role"] == "user")
        return "done" if seen.count("<agent_result name=") >= 2 else "waiting"

    for command in (["run", "fan out"], ["chat"]):
        script = {"fan out": [tags] + [parent] * 20, "kid task": ["kid answer"]}
        with ScriptedServer(script) as server:
            proc = subprocess.run([*AGENTLOOP, *command, "-q", "--max-subagents", "2"], input="fan out\n",
                                  capture_output=True, text=True, cwd=tmp_path, timeout=120,
                                  env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"),
                                       "LLM_URL": server.url})
            second = server.conversation("fan out")[1]["messages"][-1]["content"]
        assert proc.returncode == 0, proc.stderr
        assert "<error name=k2>\nCould not start this sub-agent: this run already has 2 sub-agents working, " \
               "its limit (max_subagents=2)" in second, second
        assert "<error name=k0>" not in second and "<error name=k1>" not in second


def test_an_ended_run_says_so_in_one_plain_sentence(tmp_path):
    with ScriptedServer({"*": [Delay(30, then="late")]}) as server:
        timed = agentloop(tmp_path, "run", "slow", "-q", "--timeout", "1", url=server.url)
        sent = len(server.requests)  # (on a loaded machine the second can pass before the request)
        proc = subprocess.Popen([*AGENTLOOP, "run", "slow", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "s"),
                                                              "LLM_URL": server.url})
        try:
            assert server.wait_requests(sent + 1, timeout=60)  # this run waits on the model
            proc.send_signal(signal.SIGINT)
            _, cancelled = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert timed.returncode == 124
    assert timed.stderr.strip().splitlines()[-1] == \
        "agentloop: the run was stopped at its --timeout: no answer within 1 s.", timed.stderr
    assert proc.returncode == 130
    assert cancelled.strip().splitlines()[-1] == "agentloop: the run was cancelled.", cancelled


def test_retries_show_as_they_happen(tmp_path):
    with ScriptedServer({"*": [Fail(500, times=2), "fine"]}) as server:
        proc = agentloop(tmp_path, "run", "flaky", url=server.url)
    assert proc.returncode == 0 and proc.stdout == "fine\n", proc.stderr
    assert "↻ main: the request failed (HTTP 500); retry 1 of 4 in 0.5s" in proc.stderr
    assert "↻ main: the request failed (HTTP 500); retry 2 of 4 in 1.0s" in proc.stderr
    assert "waiting for the model" not in proc.stderr  # not a terminal: no spinner


def test_doctor_fails_on_a_refused_key_and_says_what_to_check(tmp_path):
    with ScriptedServer({"*": ["hi"]}, routes={"/v1/models": Fail(401)}) as server:
        proc = agentloop(tmp_path, "doctor", url=server.url, extra_env={"LLM_API_KEY": "wrong"})
    assert proc.returncode == 1, proc.stdout
    assert f"model endpoint {server.url}: refuses the key (HTTP 401). Check $LLM_API_KEY (is set)" in proc.stdout
    assert "wrong" not in proc.stdout + proc.stderr


def test_doctor_on_a_dead_port_names_that_port(tmp_path):
    proc = agentloop(tmp_path, "doctor", url="http://127.0.0.1:9/v1")
    assert proc.returncode == 1
    assert "llama-server -m MODEL.gguf --port 9 --jinja" in proc.stdout and "8080" not in proc.stdout


def test_models_and_doctor_say_whether_llm_url_or_the_file_wins(tmp_path):
    with ScriptedServer({"*": ["hi"]}) as server:
        (tmp_path / "agentloop.toml").write_text(f'default = "big"\n[models.big]\nbase_url = "{server.url}"\n')
        models = agentloop(tmp_path, "models", url="http://127.0.0.1:9/v1")
        doctor = agentloop(tmp_path, "doctor", url="http://127.0.0.1:9/v1")
        (tmp_path / "agentloop.toml").write_text(f'[models.big]\nbase_url = "{server.url}"\n')
        env_wins = agentloop(tmp_path, "models", url="http://127.0.0.1:9/v1")
    wins = "LLM_URL and agentloop.toml are both set: agentloop.toml wins, the default model is 'big'"
    assert wins in models.stdout and "LLM_URL is used only as the alias 'default'" in models.stdout
    assert wins in doctor.stdout, doctor.stdout
    assert "LLM_URL and agentloop.toml are both set: LLM_URL wins" in env_wins.stdout, env_wins.stdout
    plain = agentloop(tmp_path, "models")
    assert "both set" not in plain.stdout


@pytest.mark.parametrize("command", ["run", "chat"])
def test_the_answer_is_printed_once_on_a_terminal(tmp_path, command):
    script = {"*": ["<run_code>\nprint('x' + 'y')\n</run_code>", "The answer is 42."]}
    with ScriptedServer(script) as server:
        main, child = pty.openpty()
        try:
            argv = [*AGENTLOOP, "run", "term"] if command == "run" else [*AGENTLOOP, "chat"]
            stdin = subprocess.DEVNULL if command == "run" else subprocess.PIPE
            proc = subprocess.Popen(argv, stdin=stdin, stdout=child,
                                    stderr=child, cwd=tmp_path, env={**os.environ, "LLM_URL": server.url,
                                                                     "XDG_STATE_HOME": str(tmp_path / "s")})
            if command == "chat":  # one question on a pipe, then the end of input
                proc.stdin.write(b"term\n")
                proc.stdin.close()
            os.close(child)
            screen = b""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ready, _, _ = select.select([main], [], [], 1.0)
                if ready:
                    try:
                        chunk = os.read(main, 65536)
                    except OSError:  # the child closed the terminal
                        break
                    if not chunk:
                        break
                    screen += chunk
                elif proc.poll() is not None:
                    break
            assert proc.wait(timeout=10) == 0, screen
        finally:
            os.close(main)
    text = screen.decode("utf-8", "replace")
    assert text.count("The answer is 42.") == 1, text
    assert text.count("print('x' + 'y')") == 1, text  # the code once, too
