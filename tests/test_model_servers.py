"""Real model servers as they are: what they report about themselves, and agentloop acting on it.

The scripted servers here answer in llama-server's, vLLM's and Ollama's shapes (``like_*`` in
engine.scripted); the agent runs against them over real HTTP with real workers, and the
command-line checks run ``agentloop`` in processes of their own.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from engine.agent import AgentDisplay, run_task
from engine.agent._display import read_recording
from engine.models import Chat, ModelConfig, ModelRegistry, ServerInfo, probe
from engine.models import _server as model_server
from engine.models._reasoning import ThinkSplitter
from engine.observe import ConsoleDisplay
from engine.scripted import ScriptedServer
from engine.scripted._flavours import like_llama_server, like_ollama, like_vllm

AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def registry(url: str, model: str = "m", **extra) -> ModelRegistry:
    config = ModelConfig(alias="default", base_url=url, model=model, timeout=30, **extra)
    return ModelRegistry({"default": config}, "default")


class Recorder(AgentDisplay):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.at: dict[str, float] = {}

    def event(self, type, **fields):
        self.events.append((type, fields))
        self.at.setdefault(type, time.monotonic())

    def of(self, type: str) -> list[dict]:
        return [fields for kind, fields in self.events if kind == type]


def agentloop(tmp_path: Path, *args: str, url: str, model: str | None = None, stdin: str | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "LLM_URL": url}
    if model:
        env["LLM_MODEL"] = model
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=timeout, input=stdin)


def last_user(request: dict) -> str:
    return request["messages"][-1]["content"]


# ------------------------------------------------------------------ the scripted servers' shapes

def _stream(url: str, body: dict) -> tuple[list[dict], bytes]:
    """The events of a streamed completion over a raw connection, and its bytes; returns only
    once the server has closed the connection (a bounded wait: 10 s)."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"], raw


def test_llama_server_shape_streams_usage_and_timings_last_then_closes_the_connection():
    asked = {"model": "x", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with like_llama_server(["hello there", "again"]) as srv:
        with_usage, raw = _stream(srv.url, {**asked, "stream_options": {"include_usage": True}})
        without, _ = _stream(srv.url, asked)
        props = httpx.get(f"{srv.url[:-3]}/props").json()
        show = httpx.post(f"{srv.url[:-3]}/api/show", json={"model": "x"})
    assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the stream ended, then the connection did
    final = with_usage[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] > 0
    assert "predicted_per_second" in final["timings"]
    assert with_usage[-2]["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in without[-1] and "timings" in without[-1]  # no usage asked: timings ride the finish
    assert without[-1]["choices"][0]["finish_reason"] == "stop"
    assert props["default_generation_settings"]["n_ctx"] == 4096 and props["chat_template_caps"]["supports_tools"]
    assert show.status_code == 404


def test_scripted_server_honours_max_tokens_and_says_length():
    with ScriptedServer(["x" * 100]) as srv:
        reply = httpx.post(f"{srv.url}/chat/completions", json={
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "go"}]}).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"]["content"] == "x" * 20 and reply["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------ probing (items 2, 3, 4)

def config(url: str, model: str = "m", **extra) -> ModelConfig:
    return ModelConfig(alias="default", base_url=url, model=model, **extra)


async def test_llama_server_reports_its_slot_window_and_its_template_tool_support():
    with like_llama_server([], n_ctx=2048, supports_tools=False) as srv:
        info = await probe(config(srv.url))
    assert (info.kind, info.context_window, info.context_source) == ("llama.cpp", 2048, "/props n_ctx")
    assert info.supports_tools is False and info.tools_source == "/props chat_template_caps.supports_tools"
    assert info.model_ids == ("/models/SmolLM2-135M-Instruct.Q4_1.gguf",) and info.single_model


async def test_llama_server_tools_come_from_props_not_from_an_ollama_route():
    # Where llama-server answers Ollama's /api/show, it lists no "tools" whatever its template
    # does: /props is what counts for it.
    with like_llama_server([], supports_tools=True, routes={"/api/show": {"capabilities": ["completion"]}}) as srv:
        info = await probe(config(srv.url))
    assert info.supports_tools is True


async def test_vllm_reports_max_model_len_and_its_ids():
    with like_vllm([], model="org/coder", max_model_len=32768) as srv:
        info = await probe(config(srv.url, "org/coder"))
    assert (info.kind, info.context_window, info.context_source) == ("vllm", 32768, "/v1/models max_model_len")
    assert info.supports_tools is None and not info.single_model
    assert info.check_id("org/coder") == (True, "model id 'org/coder' is served")
    ok, words = info.check_id("no-such-model")
    assert not ok and words == "model id 'no-such-model' is not among the server's models: org/coder"


async def test_ollama_reports_capabilities_and_a_modelfile_num_ctx():
    with like_ollama([], capabilities=("completion",), num_ctx=8192) as srv:
        info = await probe(config(srv.url, "qwen3:4b"))
    assert (info.kind, info.supports_tools, info.context_window) == ("ollama", False, 8192)
    with like_ollama([], model="qwen3:latest") as srv:
        info = await probe(config(srv.url, "qwen3"))
    assert info.supports_tools is True and info.context_window is None
    assert info.check_id("qwen3")[0]


async def test_a_plain_server_is_described_by_its_ids_only():
    with ScriptedServer([]) as srv:
        info = await probe(config(srv.url))
    assert info.answered and info.model_ids == ("scripted",)
    assert (info.kind, info.context_window, info.supports_tools) == (None, None, None)


async def test_a_server_that_does_not_answer_is_not_described_within_the_bound(monkeypatch):
    monkeypatch.setattr(model_server, "PROBE_TIMEOUT", 0.3)
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        started = time.monotonic()
        info = await probe(config(url))
        took = time.monotonic() - started
    assert info == ServerInfo(models_error="no answer within 0.3s")
    assert 0.25 < took < 2.0
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    info = await probe(config(f"http://127.0.0.1:{port}/v1"))
    assert not info.answered and info.models_error == "connection refused" and info.no_server


async def test_probes_are_cached_per_endpoint_and_shared_while_running():
    with like_llama_server([]) as srv:
        first = await asyncio.gather(*(probe(config(srv.url)) for _ in range(5)))
        again = await probe(config(srv.url))
        other_id = await probe(config(srv.url, "another"))
        props = [r for r in srv.received if r.path == "/props"]
    assert all(info is first[0] for info in first) and again is first[0]
    assert other_id is not first[0] and len(props) == 2  # one per (endpoint, model id)


# ------------------------------------------------------------------ item 1: the reply-length cap

async def test_a_cut_reply_is_not_the_answer_and_the_model_is_told(engine):
    script = {"cut": [{"content": "The answer is 4", "finish_reason": "length"}, "The answer is 42."]}
    display = Recorder()
    with ScriptedServer(script) as srv:
        result = await run_task("cut task", models=registry(srv.url, max_tokens=64), engine=engine, display=display)
        requests = srv.requests
    assert result.status == "answered" and result.answer == "The answer is 42."
    assert [r["max_tokens"] for r in requests] == [64, 64]
    told = last_user(requests[1])
    assert '<error reason=length>' in told and "reply-length limit of 64 tokens" in told
    assert [e["finish_reason"] for e in display.of("replied")] == ["length", "stop"]
    assert any("cut at the length cap (64 tokens)" in e["message"] for e in display.of("note"))


async def test_replies_cut_again_and_again_fail_the_run_saying_so(engine):
    with ScriptedServer({"never ends": ["word " * 200] * 5}) as srv:
        result = await run_task("never ends", models=registry(srv.url, max_tokens=10), engine=engine)
        requests = srv.requests
    assert result.status == "failed" and result.answer is None
    assert "last 3 replies were all cut at the length cap (max_tokens=10)" in result.error
    assert len(requests) == 3 and all(r["max_tokens"] == 10 for r in requests)


async def test_a_cut_tool_reply_is_not_the_answer_either(engine):
    script = {"tools cut": [{"content": "Half an ans", "finish_reason": "length"}, "Whole answer."]}
    with ScriptedServer(script) as srv:
        result = await run_task("tools cut", models=registry(srv.url, protocol="tools"), engine=engine)
        requests = srv.requests
    assert result.answer == "Whole answer."
    assert "reply-length limit" in last_user(requests[1])


def test_run_max_tokens_flag_caps_every_request_and_a_cut_run_exits_1(tmp_path):
    with ScriptedServer({"*": ["a reply far longer than five tokens, which the server cuts"] * 4}) as srv:
        proc = agentloop(tmp_path, "run", "anything", "-q", "--max-tokens", "5", url=srv.url, model="scripted")
        caps = [r["max_tokens"] for r in srv.requests]
    assert proc.returncode == 1 and proc.stdout == ""
    assert "replies were all cut at the length cap (max_tokens=5)" in proc.stderr
    assert caps == [5, 5, 5]


def test_batch_and_agentloop_toml_carry_the_cap(tmp_path):
    with ScriptedServer({"*": ["fine"]}) as srv:
        (tmp_path / "agentloop.toml").write_text(
            f'[models.small]\nbase_url = "{srv.url}"\nmodel = "scripted"\nmax_tokens = 321\n')
        (tmp_path / "tasks.jsonl").write_text('{"id": 1, "task": "one"}\n')
        run = agentloop(tmp_path, "run", "one", "-q", "--model", "small", url=srv.url)
        batch = agentloop(tmp_path, "batch", "tasks.jsonl", "-o", "out.jsonl", "--progress", "none",
                          "--max-tokens", "77", url=srv.url)
        caps = [r["max_tokens"] for r in srv.requests]
    assert run.returncode == 0 and batch.returncode == 0, run.stderr + batch.stderr
    assert caps == [321, 77]


# ------------------------------------------------------------------ item 2: tools the endpoint cannot take

@pytest.mark.parametrize("server", ["llama.cpp", "ollama"])
async def test_tools_fall_back_to_tags_when_the_endpoint_cannot_take_them(engine, server):
    script = {"fallback": ["<run_code>\nprint(6 * 7)\n</run_code>", "It is 42."]}
    make = {"llama.cpp": lambda: like_llama_server(script, supports_tools=False),
            "ollama": lambda: like_ollama(script, capabilities=("completion",))}[server]
    display = Recorder()
    with make() as srv:
        result = await run_task("fallback", models=registry(srv.url, model=srv.model_id), engine=engine,
                                display=display, protocol="tools")
        requests = srv.requests
    assert result.status == "answered" and result.answer == "It is 42."
    assert all("tools" not in r for r in requests)
    assert "<run_code id=" in requests[0]["messages"][0]["content"]  # the tags guide
    assert "42" in last_user(requests[1])
    notes = [e["message"] for e in display.of("note") if "cannot take tools" in e["message"]]
    assert len(notes) == 1 and "using the tags protocol" in notes[0] and "\n" not in notes[0]


@pytest.mark.parametrize("server", ["llama.cpp", "ollama"])
async def test_tools_are_kept_where_the_endpoint_takes_them(engine, server):
    make = {"llama.cpp": like_llama_server, "ollama": like_ollama}[server]
    with make({"keep": ["done"]}) as srv:
        result = await run_task("keep", models=registry(srv.url, model=srv.model_id), engine=engine,
                                protocol="tools")
        requests = srv.requests
    assert result.answer == "done" and requests[0]["tool_choice"] == "auto"
    assert [t["function"]["name"] for t in requests[0]["tools"]] == ["run_code", "run_agent", "wait"]


def test_run_protocol_tools_says_it_falls_back_in_one_line(tmp_path):
    script = {"*": ["<run_code>\nprint(2 + 2)\n</run_code>", "Four."]}
    with like_llama_server(script, supports_tools=False) as srv:
        proc = agentloop(tmp_path, "run", "add", "--protocol", "tools", url=srv.url)
        requests = srv.requests
    assert proc.returncode == 0 and proc.stdout == "Four.\n", proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "cannot take tools" in line]
    assert len(warned) == 1 and "using the tags protocol" in warned[0]
    assert "tools" not in requests[0]


# ------------------------------------------------------------------ item 3: the context size

async def test_the_compaction_reminder_comes_at_half_the_servers_window(engine):
    # Sized from the prompt the server gets (the system prompt's length depends on the packages
    # installed): the first result brings the prompt to 60% of the window.  A status counts the
    # exchange before it: the one after the first result counts the bare prompt, the next 60%.
    def fill(share: float):
        def turn(body: dict) -> str:
            used = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4  # the server's count
            return f"<run_code>\nprint('x' * {max(0, int(share * 6000) - used) * 4})\n</run_code>"
        return turn

    script = {"window": [fill(0.6), "<run_code>\nprint(1)\n</run_code>", "ok"]}
    with like_llama_server(script, n_ctx=6000) as srv:
        result = await run_task("window", models=registry(srv.url), engine=engine)
        requests = srv.requests
    assert result.answer == "ok"
    assert "- default: m (context 6000)" in requests[0]["messages"][0]["content"]
    assert "<reminder>" not in last_user(requests[1])  # the bare prompt: under half the window
    assert "<reminder>" in last_user(requests[2])  # ~60%: past half of it
    assert requests[0]["max_tokens"] < 6000  # the cap leaves the prompt its room


async def test_a_configured_window_wins_over_the_servers(engine):
    script = {"configured": ["<run_code>\nprint('x' * 3000)\n</run_code>", "ok"]}
    with like_llama_server(script, n_ctx=2000) as srv:
        await run_task("configured", models=registry(srv.url, context_window=100_000), engine=engine)
        requests = srv.requests
    assert "(context 100000)" in requests[0]["messages"][0]["content"]
    assert "<reminder>" not in last_user(requests[1])
    assert requests[0]["max_tokens"] == 8192


def test_models_and_doctor_show_the_learned_context(tmp_path):
    with like_vllm({"*": ["hi"]}, model="org/coder", max_model_len=32768) as srv:
        models = agentloop(tmp_path, "models", url=srv.url, model="org/coder")
        doctor = agentloop(tmp_path, "doctor", url=srv.url, model="org/coder")
    assert models.returncode == 0, models.stderr
    assert "default: org/coder (context 32768 from the server)" in models.stdout
    assert "max_tokens 8192" in models.stdout
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "✓ context window: 32768 tokens (from the server, /v1/models max_model_len)" in doctor.stdout
    assert "✓ server: vllm" in doctor.stdout


# ------------------------------------------------------------------ item 4: the model id

def test_doctor_checks_the_model_id(tmp_path):
    with like_vllm({"*": ["hi"]}, model="org/coder") as vllm, like_llama_server({"*": ["hi"]}) as llama:
        wrong = agentloop(tmp_path, "doctor", url=vllm.url, model="no-such-model")
        single = agentloop(tmp_path, "doctor", url=llama.url, model="no-such-model")
    assert wrong.returncode == 1
    assert "✗ model id 'no-such-model' is not among the server's models: org/coder" in wrong.stdout
    assert single.returncode == 0, single.stdout
    assert ("✓ the server serves one model (/models/SmolLM2-135M-Instruct.Q4_1.gguf) and ignores the id: "
            "'no-such-model' gets it") in single.stdout
    assert "tools: supported (/props chat_template_caps.supports_tools)" in single.stdout
    assert "images: not sent: the model takes none (/props modalities.vision)" in single.stdout


def test_models_and_doctor_say_whether_images_are_sent(tmp_path):
    with like_llama_server({"*": ["hi"]}, vision=True) as srv:
        models = agentloop(tmp_path, "models", url=srv.url, model="m")
        doctor = agentloop(tmp_path, "doctor", url=srv.url, model="m")
    assert models.returncode == 0 and "takes images" in models.stdout, models.stdout + models.stderr
    assert "✓ images: taken (/props modalities.vision)" in doctor.stdout, doctor.stdout


async def test_a_run_says_when_the_server_ignores_the_model_id(engine):
    display = Recorder()
    with like_llama_server({"*": ["ok"]}) as srv:
        await run_task("x", models=registry(srv.url, model="no-such-model"), engine=engine, display=display)
    assert any("ignores the id: 'no-such-model'" in e["message"] for e in display.of("note"))
    endpoint = display.of("endpoint")[0]
    assert endpoint["kind"] == "llama.cpp" and endpoint["context_window"] == 4096


# ------------------------------------------------------------------ item 5: reasoning

def test_think_splitter_keeps_tags_cut_between_pieces_out_of_the_answer():
    splitter = ThinkSplitter()
    text = "<think>let me see</think>The answer < 5 is 4. <thi"
    pieces = [splitter.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [splitter.flush()]
    assert "".join(p[0] for p in pieces) == "let me see"
    assert "".join(p[1] for p in pieces) == "The answer < 5 is 4. <thi"
    assert not any("<th" in p[1] or "</" in p[1] for p in pieces[:-1])


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_fields_are_shown_and_recorded_but_never_sent_back(engine, field):
    script = {"think": [{"reasoning": "I should run code.", "content": "<run_code>\nprint(1)\n</run_code>"},
                        {"reasoning": "Done now.", "content": "One."}]}
    display = Recorder()
    with ScriptedServer(script, reasoning_field=field) as srv:
        result = await run_task("think", models=registry(srv.url), engine=engine, display=display)
        requests = srv.requests
    assert result.answer == "One."
    assert "".join(e["text"] for e in display.of("reasoning")) == "I should run code.Done now."
    assert "".join(e["text"] for e in display.of("delta")).count("I should") == 0
    assert [e["reasoning"] for e in display.of("replied")] == ["I should run code.", "Done now."]
    sent = requests[1]["messages"][1:]  # the system prompt speaks of "reasoning" itself
    assert "I should" not in json.dumps(sent) and not any(set(m) - {"role", "content"} for m in sent)


async def test_inline_think_is_shown_as_reasoning_live(engine):
    script = {"inline": ["<think>\nWhat is it?\n</think>\nIt is 7."]}
    display = Recorder()
    with ScriptedServer(script, chunk_chars=3) as srv:
        result = await run_task("inline", models=registry(srv.url), engine=engine, display=display)
    assert result.answer == "It is 7."
    shown = "".join(e["text"] for e in display.of("delta"))
    assert "think" not in shown and "What is it" not in shown and "It is 7." in shown
    assert "".join(e["text"] for e in display.of("reasoning")) == "\nWhat is it?\n"


def test_console_shows_reasoning_dimmed_and_collapsed():
    out = io.StringIO()
    console = ConsoleDisplay(Console(file=out, force_terminal=True, width=120, color_system="standard"),
                             reasoning_lines=2)
    for piece in ["first thought\nsecond", " thought\nthird\nfourth\nfif", "th"]:
        console.event("reasoning", name="main", text=piece)
    console.event("delta", name="main", text="The answer.\n")
    console.event("replied", name="main", message="The answer.", stats=None, latency=0.5)
    text = out.getvalue()
    assert "main ∴ " in text and "\x1b[2m" in text  # dimmed
    lines = [line for line in _plain(text).splitlines() if line.strip()]
    assert lines[:2] == ["main ∴ first thought", "main ∴ second thought"]
    assert "main › The answer." in lines
    assert any("∴ … 3 more lines of reasoning not shown" in line for line in lines)
    assert "third" not in _plain(text)


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_run_records_reasoning(tmp_path):
    script = {"*": [{"reasoning": "Thinking hard.", "content": "Answer."}]}
    with like_llama_server(script) as srv:
        proc = agentloop(tmp_path, "run", "q", "-q", "--record", str(tmp_path / "rec.jsonl"), url=srv.url)
    assert proc.returncode == 0 and proc.stdout == "Answer.\n", proc.stderr
    events = read_recording(tmp_path / "rec.jsonl")
    assert "".join(e["text"] for e in events if e["type"] == "reasoning") == "Thinking hard."
    assert next(e for e in events if e["type"] == "replied")["reasoning"] == "Thinking hard."


# ------------------------------------------------------------------ item 6: the first request

async def test_the_endpoint_is_connected_while_the_system_prompt_is_built(engine):
    display = Recorder()
    with like_llama_server({"*": ["ok"]}) as srv:
        await run_task("x", models=registry(srv.url), engine=engine, display=display)
        probes = [r for r in srv.received if r.turn is None]
        completion = next(r for r in srv.received if r.turn is not None)
    assert {r.path for r in probes} == {"/v1/models", "/props", "/api/show"}
    # The probes went out before the system prompt existed (the worker was still starting) ...
    assert max(r.at for r in probes) < display.at["system"]
    # ... and the first completion used a connection they had opened: one client, made early.
    assert completion.peer in {r.peer for r in probes}


async def test_a_second_agent_on_the_endpoint_does_not_probe_again(engine):
    with like_llama_server({"*": ["ok"]}) as srv:
        await run_task("one", models=registry(srv.url), engine=engine)
        await run_task("two", models=registry(srv.url), engine=engine)
        props = [r for r in srv.received if r.path == "/props"]
    assert len(props) == 1


async def test_a_streamed_reply_read_to_its_end_leaves_the_connection_for_the_next_request():
    """After ``[DONE]`` the chat client reads the body's end, so a server that keeps
    connections (vLLM, the scripted one) answers the next request on the same one; one that
    closes after each stream (llama-server) is connected to again, as before."""
    for server, reused in ((ScriptedServer({"*": ["one", "two", "three"]}), True),
                           (like_llama_server({"*": ["one", "two", "three"]}), False)):
        with server as srv:
            config = registry(srv.url).get(None)
            async with Chat("system", config) as chat:
                assert [await chat.send(q) for q in ("a", "b", "c")] == ["one", "two", "three"]
            peers = [r.peer for r in srv.received if r.turn is not None]
        assert len(peers) == 3 and (len(set(peers)) == 1) == reused, peers
