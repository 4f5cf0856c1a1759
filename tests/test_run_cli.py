"""`agentloop run` and `agentloop models` as a user runs them, against the scripted server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.display import read_recording
from engine.scripted import ScriptedServer

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
    assert "llama-server" in proc.stderr and "Traceback" not in proc.stderr


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
