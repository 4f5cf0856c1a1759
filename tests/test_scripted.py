"""The scripted model server, spoken to over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.scripted import EXHAUSTED, Delay, Fail, Script, ScriptedServer

from .conftest import alive, closed_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def ask(url: str, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json={"model": "m", "messages": messages, **extra}, timeout=10)


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]


def sse(response: httpx.Response) -> list:
    """The data payloads of an SSE body, [DONE] kept as the string."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_plain_completion_has_message_usage_and_model():
    with ScriptedServer(["hello world"]) as srv:
        reply = ask(srv.url, user("hi")).json()
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "m"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "hello world"}
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["prompt_tokens"] >= 1 and reply["usage"]["completion_tokens"] >= 1
    assert srv.requests[0]["messages"][1]["content"] == "hi"


def test_streaming_splits_content_and_ends_with_usage_then_done():
    text = "x" * 45
    with ScriptedServer([text, text], chunk_chars=20) as srv:
        response = ask(srv.url, user("hi"), stream=True, stream_options={"include_usage": True})
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
        quiet = sse(ask(srv.url, user("hi"), stream=True))
    assert events[-1] == "[DONE]"
    pieces = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e["choices"]]
    assert [p for p in pieces if p] == ["x" * 20, "x" * 20, "x" * 5]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 45 // 4
    assert not any("usage" in e for e in quiet[:-1])


def test_tool_calls_plain_and_streamed():
    turn = {"content": "", "tool_calls": [{"id": "c1", "name": "read_file", "arguments": {"path": "a" * 50}}]}
    with ScriptedServer({"*": [turn]}) as srv:
        plain = ask(srv.url, user("go")).json()["choices"][0]
        events = sse(ask(srv.url, user("go"), stream=True))
    call = plain["message"]["tool_calls"][0]
    assert plain["finish_reason"] == "tool_calls"
    assert call == {"id": "c1", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": "a" * 50})}}
    fragments = [d for e in events[:-1] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(fragments) > 2 and all(f["index"] == 0 for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == call["function"]["arguments"]


def test_routing_by_key_turn_index_fallback_and_exhaustion():
    script = {"alpha": ["a0", "a1"], "beta": ["b0"], "*": ["any"]}
    with ScriptedServer(script) as srv:
        assert ask(srv.url, user("task alpha here")).json()["choices"][0]["message"]["content"] == "a0"
        second = user("task alpha here") + [{"role": "assistant", "content": "a0"}, {"role": "user", "content": "r"}]
        assert ask(srv.url, second).json()["choices"][0]["message"]["content"] == "a1"
        third = second + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "r"}]
        assert ask(srv.url, third).json()["choices"][0]["message"]["content"] == EXHAUSTED
        assert ask(srv.url, user("beta")).json()["choices"][0]["message"]["content"] == "b0"
        assert ask(srv.url, user("something else")).json()["choices"][0]["message"]["content"] == "any"
        assert len(srv.conversation("alpha")) == 3
        assert len(srv.conversation("*")) == 1


def test_first_matching_key_in_script_order_wins_and_unmatched_is_plain_text():
    with ScriptedServer({"summary": ["s"], "alpha": ["a"]}) as srv:
        assert ask(srv.url, user("alpha, then summary")).json()["choices"][0]["message"]["content"] == "s"
        unmatched = ask(srv.url, user("nothing")).json()["choices"][0]["message"]["content"]
    assert "no scripted conversation" in unmatched and "summary, alpha" in unmatched


def test_fail_is_answered_times_then_the_turn_with_retry_after_and_body():
    with ScriptedServer([Fail(503, times=2, retry_after=1.5), Fail(400, body="no stream_options"), "ok"]) as srv:
        first, second, third = (ask(srv.url, user("x")) for _ in range(3))
        final = ask(srv.url, user("x"))
    assert [first.status_code, second.status_code, third.status_code, final.status_code] == [503, 503, 400, 200]
    assert first.headers["retry-after"] == "1.5"
    assert third.text == "no stream_options"
    assert final.json()["choices"][0]["message"]["content"] == "ok"
    assert [r.status for r in srv.received] == [503, 503, 400, 200]


def test_callable_turn_sees_the_request():
    def echo(body: dict) -> str:
        return "you said " + body["messages"][-1]["content"]

    with ScriptedServer([echo]) as srv:
        assert ask(srv.url, user("ping")).json()["choices"][0]["message"]["content"] == "you said ping"


def test_broken_callable_becomes_a_500_naming_the_error():
    def broken(body: dict) -> str:
        raise ValueError("bad script")

    with ScriptedServer([broken]) as srv:
        response = ask(srv.url, user("x"))
    assert response.status_code == 500 and "bad script" in response.text


def test_delay_waits_before_answering():
    with ScriptedServer([Delay(0.3, then="late")]) as srv:
        started = time.monotonic()
        content = ask(srv.url, user("x")).json()["choices"][0]["message"]["content"]
    assert content == "late" and time.monotonic() - started >= 0.3


def test_stop_sequences_cut_content():
    with ScriptedServer(["keep this</run_code>\ndrop this", "a STOP b"]) as srv:
        plain = ask(srv.url, user("x"), stop=["</run_code>", "drop"]).json()["choices"][0]["message"]["content"]
        events = sse(ask(srv.url, user("x") + [{"role": "assistant", "content": "."}], stream=True, stop="STOP"))
    assert plain == "keep this"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == "a "


def test_models_route_and_unknown_routes():
    with ScriptedServer([]) as srv:
        models = httpx.get(f"{srv.url}/models", timeout=10).json()
        missing = httpx.post(f"{srv.url}/embeddings", json={}, timeout=10)
        bad = httpx.post(f"{srv.url}/chat/completions", content=b"not json", timeout=10)
    assert models["data"][0]["id"] == "scripted"
    assert missing.status_code == 404 and bad.status_code == 400
    assert srv.requests == []


def test_wait_requests_and_requests_are_visible_across_threads():
    with ScriptedServer(["a"]) as srv:
        worker = threading.Thread(target=ask, args=(srv.url, user("x")))
        worker.start()
        assert srv.wait_requests(1, timeout=10)
        worker.join(10)
        assert not srv.wait_requests(2, timeout=0.05)


def test_close_is_bounded_with_a_request_in_flight_and_then_refuses():
    srv = ScriptedServer([Delay(30, then="never")]).start()
    url = srv.url
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(ask(url, user("x")))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    assert srv.wait_requests(1, timeout=10)
    started = time.monotonic()
    srv.close()
    assert time.monotonic() - started < 5
    worker.join(10)
    assert not worker.is_alive() and isinstance(outcome[0], httpx.HTTPError)
    with pytest.raises(httpx.ConnectError):
        ask(url, user("x"))


def test_script_from_json():
    script = Script.from_json({"k": ["a", {"fail": 500, "times": 2}, {"delay": 0.1, "then": "b"},
                                     {"content": "", "tool_calls": [{"name": "f", "arguments": "{}"}]}]})
    assert script.match("the k task") == "k"
    step = script.step("k", 1)
    assert step.fails == [Fail(500, 2)] and step.turn == Delay(0.1, "b")
    assert Script.from_json(["x"]).match("anything") == "*"
    with pytest.raises(ValueError):
        Script.from_json({"k": [3]})


AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state"), **extra}


def test_cli_serves_a_json_script_until_interrupted(tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"*": ["from the cli"]}))
    port = closed_port()
    proc = subprocess.Popen([*AGENTLOOP, "scripted", str(path), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path), cwd=tmp_path)
    try:
        banner: list[str] = []
        reader = threading.Thread(target=lambda: banner.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        assert banner == [f"http://127.0.0.1:{port}/v1\n"], proc.stderr.read() if proc.poll() else banner
        reply = ask(f"http://127.0.0.1:{port}/v1", user("x")).json()
        assert reply["choices"][0]["message"]["content"] == "from the cli"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
        assert f"LLM_URL=http://127.0.0.1:{port}/v1" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_cli_reports_a_bad_script(tmp_path):
    path = tmp_path / "script.json"
    path.write_text("{not json")
    done = subprocess.run([*AGENTLOOP, "scripted", str(path)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=30, env=cli_env(tmp_path))
    assert done.returncode == 125 and f"cannot load the script {path}" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_cli_in_the_background_returns_once_it_listens_and_stops_when_idle(tmp_path):
    """``export LLM_URL=$(agentloop scripted --background)``: the shell's ``$(...)`` returns
    (the server holds none of its pipes), the URL answers at once (no race), the example
    script is served by default, the model id agentloop asks for is the one listed, and an idle
    server goes away by itself."""
    shell = ('export LLM_URL=$("$@" scripted --background --idle-exit 2s) && '
             'echo "url=$LLM_URL" && curl -s "$LLM_URL/models"')
    done = subprocess.run(["bash", "-c", shell, "bash", *AGENTLOOP], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, env=cli_env(tmp_path, LLM_MODEL="my-model"))
    assert done.returncode == 0, done.stderr
    url = done.stdout.splitlines()[0].removeprefix("url=")
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), done.stdout
    assert json.loads(done.stdout.splitlines()[1])["data"][0]["id"] == "my-model"
    pid = int(done.stderr.split("(pid ", 1)[1].split(")", 1)[0])
    try:
        reply = ask(url, user("How many primes are there below 10,000?")).json()
        assert "<run_code" in reply["choices"][0]["message"]["content"]  # the tour's example script
        assert wait_until(lambda: not alive(pid), 30), "an idle server stayed"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(httpx.ConnectError):
        ask(url, user("x"))
