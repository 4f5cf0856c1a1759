"""The chat client and the model registry, against the scripted server over real HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.errors import ConfigError, ModelResponseError, ModelUnreachable
from engine.models import Chat, ModelConfig, ModelRegistry, load_models, strip_think
from engine.scripted import Delay, Fail, ScriptedServer

from .conftest import closed_port


class Recorder:
    """A display that keeps every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, type: str, **fields) -> None:
        self.events.append((type, fields))

    def of(self, type: str) -> list[dict]:
        return [fields for kind, fields in self.events if kind == type]


def model(url: str, **overrides) -> ModelConfig:
    return ModelConfig(**{"alias": "test", "base_url": url, "model": "m", "timeout": 10.0, **overrides})


def chat(url: str, display: Recorder | None = None, **kwargs) -> Chat:
    config = kwargs.pop("config", None) or model(url)
    return Chat("you are a test", config, display=display, backoff=0.01, **kwargs)


# ------------------------------------------------------------------ replies and transcript

async def test_streamed_reply_arrives_in_deltas_and_lands_in_the_transcript():
    text = "a reply long enough to be split into several stream chunks"
    display = Recorder()
    with ScriptedServer([text]) as srv:
        async with chat(srv.url, display, name="main") as c:
            assert await c.send("hello") == text
    body = srv.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m"
    assert c.messages == [{"role": "system", "content": "you are a test"}, {"role": "user", "content": "hello"},
                          {"role": "assistant", "content": text}]
    deltas = [e["text"] for e in display.of("delta")]
    assert len(deltas) > 1 and "".join(deltas) == text
    assert [kind for kind, _ in display.events] == (["system", "sent", "waiting"] + ["delta"] * len(deltas)
                                                    + ["waited", "replied"])
    assert display.of("sent")[0] == {"name": "main", "message": "hello", "count": 2}
    replied = display.of("replied")[0]
    assert replied["message"] == text and replied["stats"]["requests"] == 1 and replied["latency"] >= 0


async def test_a_server_that_ignores_stream_is_read_as_plain_json():
    with ScriptedServer(["plain answer"], streaming=False) as srv:
        async with chat(srv.url) as c:
            assert await c.send("hi") == "plain answer"
    assert srv.requests[0]["stream"] is True


async def test_a_server_refusing_stream_options_is_asked_again_without_streaming_and_remembered():
    refusal = Fail(400, body='{"error": "unsupported parameter: stream_options"}')
    with ScriptedServer([refusal, "one", "two"]) as srv:
        async with chat(srv.url) as c:
            assert await c.send("a") == "one"
            assert await c.send("b") == "two"
    assert [r.get("stream", False) for r in srv.requests] == [True, False, False]


async def test_usage_and_cost_follow_the_server_counts():
    with ScriptedServer(["x" * 40, "y" * 80]) as srv:
        async with chat(srv.url, config=model(srv.url, price_in=1.0, price_out=2.0)) as c:
            await c.send("first question")
            await c.send("second")
            stats = c.stats
    prompts = [sum(len(m["content"]) for m in r["messages"]) // 4 for r in srv.requests]
    assert stats["tokens_in"] == sum(prompts)
    assert stats["tokens_out"] == stats["generated"] == 10 + 20
    assert stats["context"] == c.context == prompts[1] + 20
    assert stats["requests"] == 2 and stats["seconds"] >= c.last_latency > 0
    assert c.cost == pytest.approx((sum(prompts) * 1.0 + 30 * 2.0) / 1e6)
    assert not c.usage_estimated


async def test_missing_usage_is_estimated_from_characters():
    with ScriptedServer(["z" * 40], usage=False) as srv:
        async with chat(srv.url) as c:
            await c.send("q" * 20)
    assert c.usage_estimated
    assert c.stats["tokens_out"] == 10
    assert c.stats["tokens_in"] == (len("you are a test") + 20) // 4


async def test_thinking_is_stripped_from_reply_and_transcript():
    with ScriptedServer(["<think>\nlet me see\n</think>\nthe answer"]) as srv:
        async with chat(srv.url) as c:
            assert await c.send("q") == "the answer"
    assert c.messages[-1] == {"role": "assistant", "content": "the answer"}


def test_strip_think():
    assert strip_think("<think>a\nb</think> x <think>c</think>y") == "x y"
    assert strip_think("reasoning without an opening tag</think>\nanswer") == "answer"
    assert strip_think("no reasoning at all") == "no reasoning at all"


async def test_compact_replaces_history_and_the_next_message_joins_the_summary():
    with ScriptedServer(["r1", "r2", "r3"]) as srv:
        async with chat(srv.url) as c:
            await c.send("one")
            await c.send("two")
            c.compact("SUMMARY: facts")
            assert c.messages == [{"role": "system", "content": "you are a test"},
                                  {"role": "user", "content": "SUMMARY: facts"}]
            await c.send("three")
    assert [m["role"] for m in srv.requests[-1]["messages"]] == ["system", "user"]
    assert srv.requests[-1]["messages"][1]["content"] == "SUMMARY: facts\n\nthree"


async def test_extra_body_is_sent():
    with ScriptedServer(["ok"]) as srv:
        async with chat(srv.url, extra_body={"temperature": 0.2}) as c:
            await c.send("x")
    assert srv.requests[0]["temperature"] == 0.2


# ------------------------------------------------------------------ the reply cap and reasoning

async def test_every_request_carries_the_reply_cap_and_a_cut_reply_says_length():
    with ScriptedServer(["short", "y" * 100]) as srv:
        async with chat(srv.url, config=model(srv.url, max_tokens=5)) as c:
            assert await c.send("a") == "short"
            assert c.last_finish_reason == "stop"
            assert await c.send("b") == "y" * 20
            assert c.last_finish_reason == "length" and c.last_max_tokens == 5
    assert [r["max_tokens"] for r in srv.requests] == [5, 5]
    with ScriptedServer(["ok"]) as srv:
        async with chat(srv.url) as c:
            await c.send("default")
    assert srv.requests[0]["max_tokens"] == 8192


async def test_the_cap_leaves_the_prompt_its_room_in_a_known_window():
    with ScriptedServer(["ok", "ok"]) as srv:
        async with chat(srv.url, config=model(srv.url, max_tokens=4000, context_window=3000)) as c:
            await c.send("q" * 3000)  # ~1,000 tokens at the low estimate, with the system prompt
            await c.send("r" * 6000)  # what the server counted, plus ~2,000 tokens: less than the floor
    first, second = (r["max_tokens"] for r in srv.requests)
    assert 3000 - 1010 <= first <= 3000 - 1000
    assert second == 256  # MIN_REPLY_TOKENS: the server says what it makes of an overfull prompt


async def test_a_server_that_wants_max_completion_tokens_gets_it_and_it_is_remembered():
    refusal = Fail(400, body='{"error": {"message": "Unsupported parameter: \'max_tokens\' is not supported '
                             'with this model. Use \'max_completion_tokens\' instead."}}')
    with ScriptedServer([refusal, "one", "two"]) as srv:
        async with chat(srv.url, config=model(srv.url, max_tokens=50)) as c:
            assert await c.send("a") == "one"
            assert await c.send("b") == "two"
    assert [(r.get("max_tokens"), r.get("max_completion_tokens")) for r in srv.requests] == \
        [(50, None), (None, 50), (None, 50)]


async def test_reasoning_is_an_event_of_its_own_and_never_content():
    display = Recorder()
    turn = {"reasoning": "Let me think about this at length.", "content": "Yes."}
    with ScriptedServer([turn, turn], chunk_chars=7) as srv:
        async with chat(srv.url, display) as c:
            assert await c.send("streamed?") == "Yes."
            assert c.last_reasoning == turn["reasoning"]
    assert "".join(e["text"] for e in display.of("reasoning")) == turn["reasoning"]
    assert "".join(e["text"] for e in display.of("delta")) == "Yes."
    assert display.of("replied")[0]["reasoning"] == turn["reasoning"]
    assert c.messages[-1] == {"role": "assistant", "content": "Yes."}
    display = Recorder()
    with ScriptedServer([{"reasoning": "Plainly.", "content": "<think>inline too</think>No."}],
                        streaming=False, reasoning_field="reasoning") as srv:
        async with chat(srv.url, display) as c:
            assert await c.send("plain?") == "No."
    assert [e["text"] for e in display.of("reasoning")] == ["Plainly.", "inline too"]
    assert [e["text"] for e in display.of("delta")] == ["No."]


async def test_a_client_handed_in_is_used_and_closed():
    import httpx

    with ScriptedServer(["ok"]) as srv:
        client = httpx.AsyncClient()
        async with chat(srv.url, client=client) as c:
            await c.send("x")
            assert c._http() is client
        assert client.is_closed


# ------------------------------------------------------------------ tool calls and stop

async def test_tool_calls_are_assembled_from_stream_deltas():
    arguments = json.dumps({"path": "some/rather/long/path/to/a/file.py", "offset": 1})
    turn = {"content": "looking", "tool_calls": [{"id": "c1", "name": "read_file", "arguments": arguments},
                                                 {"id": "c2", "name": "list_dir", "arguments": '{"path": "."}'}]}
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    with ScriptedServer([turn, turn], streaming=True) as srv:
        async with chat(srv.url) as c:
            streamed = await c.request([{"role": "user", "content": "go"}], tools=tools, tool_choice="auto")
    assert srv.requests[0]["tools"] == tools and srv.requests[0]["tool_choice"] == "auto"
    assert streamed["content"] == "looking"
    assert streamed["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": arguments}},
        {"id": "c2", "type": "function", "function": {"name": "list_dir", "arguments": '{"path": "."}'}}]
    assert c.last_finish_reason == "tool_calls"
    assert len(c.messages) == 1  # request() leaves the transcript alone
    with ScriptedServer([turn], streaming=False) as srv:
        async with chat(srv.url) as c:
            assert await c.request([{"role": "user", "content": "go"}]) == streamed


async def test_stop_sequences_are_sent_and_honoured():
    reply = '<run_code id="a">\nprint(1)\n</run_code>\nand then I made up a result'
    with ScriptedServer([reply]) as srv:
        async with chat(srv.url, stop=["</run_code>"]) as c:
            text = await c.send("x")
    assert srv.requests[0]["stop"] == ["</run_code>"]
    assert text == '<run_code id="a">\nprint(1)'


# ------------------------------------------------------------------ failures

async def test_server_errors_are_retried_until_success():
    display = Recorder()
    with ScriptedServer([Fail(500, times=2), "finally"]) as srv:
        async with chat(srv.url, display) as c:
            assert await c.send("x") == "finally"
    assert len(srv.requests) == 3
    assert [e["attempt"] for e in display.of("retrying")] == [1, 2]
    assert display.of("retrying")[0]["reason"] == "HTTP 500"


async def test_persistent_server_errors_end_in_model_response_error_and_keep_the_transcript():
    with ScriptedServer([Fail(502, times=10)]) as srv:
        async with chat(srv.url, max_retries=2) as c:
            with pytest.raises(ModelResponseError) as caught:
                await c.send("x")
    assert len(srv.requests) == 3
    assert "HTTP 502" in str(caught.value) and "scripted failure" in str(caught.value)
    assert c.messages == [{"role": "system", "content": "you are a test"}]


async def test_retry_after_is_honoured():
    display = Recorder()
    with ScriptedServer([Fail(429, retry_after=0.3), "ok"]) as srv:
        async with chat(srv.url, display) as c:
            started = time.monotonic()
            assert await c.send("x") == "ok"
    assert time.monotonic() - started >= 0.3
    assert display.of("retrying")[0]["wait"] == pytest.approx(0.3)


async def test_retry_after_is_capped():
    display = Recorder()
    with ScriptedServer([Fail(503, retry_after=100), "ok"]) as srv:
        async with chat(srv.url, display, retry_after_max=0.05) as c:
            assert await c.send("x") == "ok"
    assert display.of("retrying")[0]["wait"] == 0.05


async def test_client_errors_are_not_retried():
    with ScriptedServer([Fail(404, times=5)]) as srv:
        async with chat(srv.url) as c:
            with pytest.raises(ModelResponseError, match="HTTP 404.*check the URL"):
                await c.send("x")
    assert len(srv.requests) == 1


async def test_unreachable_endpoint_says_how_to_start_one_quickly():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    started = time.monotonic()
    async with chat(url, max_retries=2) as c:
        with pytest.raises(ModelUnreachable) as caught:
            await c.send("x")
    message = str(caught.value)
    assert message.startswith(f"cannot reach the model at {url} (connection refused). Start one there:")
    port = url.split(":")[-1].split("/")[0]
    assert f"llama-server -m MODEL.gguf --port {port} --jinja" in message, message  # its port, not 8080
    assert "LLM_URL=http://localhost:11434/v1" in message
    assert "Traceback" not in message and "\n" not in message
    assert time.monotonic() - started < 5
    assert len(c.messages) == 1


async def test_a_refused_connection_is_retried_only_once_the_endpoint_has_answered():
    nobody = Recorder()
    async with chat(f"http://127.0.0.1:{closed_port()}/v1", nobody) as c:
        with pytest.raises(ModelUnreachable, match="connection refused"):
            await c.send("x")
    assert len(nobody.of("waiting")) == 1 and nobody.of("retrying") == []  # said at once
    restarted = Recorder()  # a server that answered and then went away is restarting: retried
    with ScriptedServer(["first"]) as srv:
        async with chat(srv.url, restarted) as c:
            assert await c.send("x") == "first"
            srv.close()
            with pytest.raises(ModelUnreachable):
                await c.send("y")
    assert len(restarted.of("retrying")) == 4


async def test_a_silent_server_times_out_saying_it_is_slow_not_absent():
    with ScriptedServer([Delay(5, then="too late")]) as srv:
        async with chat(srv.url, config=model(srv.url, timeout=0.3), max_retries=0) as c:
            with pytest.raises(ModelUnreachable) as caught:
                await c.send("x")
    message = str(caught.value)
    assert message.startswith(f"the model at {srv.url} did not answer within 0.3 s"), message
    assert "LLM_TIMEOUT" in message and "Raise the timeout" in message
    assert "Start one" not in message and "llama-server" not in message  # a server is there


def test_the_start_hint_uses_the_configured_host_and_port():
    from engine.models._http import start_hint

    assert "llama-server -m MODEL.gguf --port 9123 --jinja" in start_hint("http://127.0.0.1:9123/v1")
    assert "--host 10.0.0.5 --port 80 " in start_hint("http://10.0.0.5/v1")
    assert "8080" not in start_hint("https://models.example/v1")


# ------------------------------------------------------------------ keys

async def test_api_key_goes_in_the_header_and_nowhere_else(monkeypatch):
    secret = "sk-test-0123456789"
    monkeypatch.setenv("AGENTLOOP_TEST_KEY", secret)
    display = Recorder()
    with ScriptedServer(["fine", Fail(401, body=f"invalid key {secret}")]) as srv:
        config = model(srv.url, api_key_env="AGENTLOOP_TEST_KEY")
        async with chat(srv.url, display, config=config) as c:
            await c.send("x")
            with pytest.raises(ModelResponseError) as caught:
                await c.send("y")
    assert srv.received[0].headers["authorization"] == f"Bearer {secret}"
    assert secret not in str(caught.value) and "$AGENTLOOP_TEST_KEY" in str(caught.value)
    for text in (repr(c), repr(config), str(display.events), str(c.stats), str(c.messages)):
        assert secret not in text


async def test_no_key_no_authorization_header(monkeypatch):
    monkeypatch.delenv("AGENTLOOP_TEST_KEY", raising=False)
    with ScriptedServer(["fine"]) as srv:
        async with chat(srv.url, config=model(srv.url, api_key_env="AGENTLOOP_TEST_KEY")) as c:
            await c.send("x")
    assert "authorization" not in srv.received[0].headers


# ------------------------------------------------------------------ concurrency

async def test_concurrent_conversations_get_their_own_scripts():
    script = {"TASK-A": [Delay(0.1, then="a1"), "a2"], "TASK-B": ["b1", Delay(0.1, then="b2")]}

    async def converse(task: str) -> list[str]:
        async with chat(srv.url) as c:
            return [await c.send(task), await c.send("next")]

    with ScriptedServer(script) as srv:
        a, b = await asyncio.wait_for(asyncio.gather(converse("do TASK-A"), converse("do TASK-B")), 20)
    assert a == ["a1", "a2"] and b == ["b1", "b2"]
    assert len(srv.conversation("TASK-A")) == 2 and len(srv.conversation("TASK-B")) == 2


# ------------------------------------------------------------------ models

def test_environment_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = load_models(env={}).default
    assert (default.alias, default.base_url, default.model, default.timeout) == \
        ("default", "http://127.0.0.1:8080/v1", "qwen3-coder", 300.0)
    custom = load_models(env={"LLM_URL": "http://localhost:11434/v1/", "LLM_MODEL": "qwen3:4b",
                              "LLM_TIMEOUT": "60"}).default
    assert (custom.base_url, custom.model, custom.timeout) == ("http://localhost:11434/v1", "qwen3:4b", 60.0)
    with pytest.raises(ConfigError, match="LLM_TIMEOUT"):
        load_models(env={"LLM_TIMEOUT": "soon"})


TOML = """
default = "flash"

[models.flash]
base_url = "http://127.0.0.1:8080/v1/"
model = "qwen3-coder"
context_window = 32768
price_in = 0.1
price_out = 0.4

[models.big]
base_url = "https://api.example.invalid/v1"
model = "big-model-2"
api_key_env = "BIG_KEY"
protocol = "tools"
timeout = 120
max_tokens = 2048
"""


def test_toml_file_is_loaded_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "agentloop.toml").write_text(TOML)
    monkeypatch.chdir(tmp_path)
    registry = load_models(env={})
    assert registry.aliases() == ["flash", "big"]
    assert registry.default.alias == "flash"
    assert registry.get("").alias == "flash"
    assert registry.get("big") == ModelConfig("big", "https://api.example.invalid/v1", "big-model-2", "BIG_KEY",
                                              None, 0.0, 0.0, "tools", 120.0, 2048)
    assert registry.get("flash").max_tokens == 8192
    assert registry.replace_all(max_tokens=99).get("flash").max_tokens == 99
    assert registry.get("qwen3-coder").alias == "flash"  # a model id works too
    assert registry.get("flash").base_url == "http://127.0.0.1:8080/v1"
    assert registry.describe() == ("- flash: qwen3-coder (context 32768, $0.10/$0.40 per M tokens)\n"
                                   "- big: big-model-2")


def test_explicit_environment_model_is_kept_next_to_the_file(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(TOML)
    registry = load_models(path, env={"LLM_MODEL": "local"})
    assert registry.aliases() == ["default", "flash", "big"]
    assert registry.default.alias == "flash"
    assert registry.get("default").model == "local"


def test_unknown_alias_lists_the_known_ones(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(TOML)
    with pytest.raises(ConfigError, match="unknown model 'gpt'; known aliases: flash, big"):
        load_models(path, env={}).get("gpt")


@pytest.mark.parametrize(("text", "problem"), [
    ("[models.flash\n", "not valid TOML"),
    ("[models.flash]\nmodel = 'x'\npric_in = 1\n", "unknown key 'pric_in'"),
    ("[models.flash]\nprotocol = 'json'\n", "protocol must be one of tags, tools"),
    ("[models.flash]\nprice_in = -1\n", "price_in must be zero or more"),
    ("[models.flash]\nprice_out = 'cheap'\n", "price_out must be a number"),
    ("[models.flash]\ncontext_window = 0\n", "context_window must be a positive whole number"),
    ("[models.flash]\nmax_tokens = 1.5\n", "max_tokens must be a positive whole number"),
    ("[models.flash]\nbase_url = 'localhost:8080'\n", "base_url must start with http"),
    ("[models.flash]\ntimeout = 0\n", "timeout must be positive"),
    ("default = 'nope'\n[models.flash]\n", "default = 'nope' names no model"),
    ("models = 3\n", "models must be a table"),
    ("[models]\nflash = 'x'\n", "models.flash must be a table"),
])
def test_bad_files_name_the_file_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "agentloop.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_models(path, env={})
    assert str(path) in str(caught.value) and problem in str(caught.value)


def test_a_named_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="no such model configuration file"):
        load_models(tmp_path / "missing.toml", env={})


def test_registry_rejects_a_missing_default():
    config = ModelConfig("a", "http://127.0.0.1:1/v1", "m")
    with pytest.raises(ConfigError):
        ModelRegistry({"a": config}, "b")
    assert "a" in ModelRegistry({"a": config}, "a")


def test_api_key_is_read_at_call_time(monkeypatch):
    config = ModelConfig("a", "http://127.0.0.1:1/v1", "m", api_key_env="AGENTLOOP_TEST_KEY")
    monkeypatch.delenv("AGENTLOOP_TEST_KEY", raising=False)
    assert config.api_key() is None
    monkeypatch.setenv("AGENTLOOP_TEST_KEY", "k")
    assert config.api_key() == "k"
