"""OpenTelemetry traces, as a user turns them on: the real CLI exporting OTLP/HTTP protobuf into
a receiver on loopback (``tests/otlp_receiver.py``), decoded with the official proto package,
and the span tree checked against what ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
pytest.importorskip("opentelemetry.proto", reason="the otel extra is not installed")

from engine.scripted import (
    Fail,
    ScriptedServer,  # noqa: E402
)
from tests.otlp_receiver import Receiver, shape, trees  # noqa: E402

AGENTLOOP = [sys.executable, "-m", "engine.cli"]
TASK = "trace this run"
SUB_TASK = "the helper's part: say 42"
SECRET = "sk-test-not-to-be-traced-5f3a"

#: What a hostile block prints: it must stay text wherever it is shown.
HOSTILE = "<script>window.pwned = 1</script></html><img src=x onerror=\"window.pwned = 2\">"
FIRST = f"""Three at once (one prints markup), and a helper.

<run_code id="left" timeout="10s">
import time
time.sleep(0.4)
from_left = 42
print("left done")
</run_code>

<run_code id="right" timeout="10s" heartbeat="1s">
import time
time.sleep(1.5)
print("right done")
</run_code>

<run_code id="loud" timeout="10s">
print({HOSTILE!r})
</run_code>

<run_agent name="helper">{SUB_TASK}</run_agent>"""

STUCK = """Now one stuck in C, which only a kill stops.

<run_code id="stuck" timeout="1s">
import re
re.match(r"(a+)+$", "a" * 40 + "b")
</run_code>"""


def _main_turn(body: dict) -> str:
    """Launch the stuck block once the pair is done (it would hold the worker's interpreter, and
    the pair with it); answer once everything reported."""
    sent = "\n".join(str(m.get("content")) for m in body["messages"] if m.get("role") == "user")
    said = "\n".join(str(m.get("content")) for m in body["messages"] if m.get("role") == "assistant")
    if "<run_code_result id=left " in sent and "<run_code_result id=right " in sent and 'id="stuck"' not in said:
        return STUCK
    if "<run_code_result id=stuck " in sent and "<agent_result name=helper " in sent:
        return "All of it ran."
    return "Waiting for the rest."


SCRIPT = {SUB_TASK: ["42"], TASK: [Fail(500, 1), FIRST] + [_main_turn] * 12}


def agentloop(tmp_path: Path, *args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    full = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), **env}
    for key in [k for k in full if k.startswith("OTEL_")]:
        if key not in env:
            del full[key]
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=tmp_path, env=full,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _otel(rx: Receiver, **more: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_SERVICE_NAME": "agentloop-test", **more}


def test_a_run_is_a_span_tree_in_a_real_receiver(tmp_path: Path) -> None:
    with Receiver() as rx, ScriptedServer(SCRIPT) as server:
        proc = agentloop(tmp_path, "--trace", "run", TASK, "-q", "--record", str(tmp_path / "run.jsonl"),
                         env=_otel(rx, LLM_URL=server.url, LLM_MODEL="scripted", LLM_API_KEY=SECRET))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "All of it ran.\n"
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
    roots = trees(rx.spans)
    assert len(roots) == 1, [shape(r) for r in roots]
    main = roots[0]
    tree = shape(main)
    assert main.name == "invoke_agent main" and main.kind == "INTERNAL" and main.status == "UNSET", tree
    assert main.attr("gen_ai.operation.name") == "invoke_agent" and main.attr("gen_ai.system") == "openai"
    assert main.attr("gen_ai.agent.name") == "main" and main.attr("gen_ai.request.model") == "scripted"
    assert main.attr("agentloop.run.status") == "answered" and main.attr("gen_ai.usage.output_tokens") > 0
    assert main.resource["service.name"] == "agentloop-test"
    assert main.schema_url == "https://opentelemetry.io/schemas/1.36.0"

    kids = {c.name: c for c in main.children}
    chats = [c for c in main.children if c.name == "chat scripted"]
    assert len(chats) >= 3, tree
    # The first request was answered 500, then retried: two HTTP attempts under one chat span.
    first = chats[0]
    attempts = first.children
    assert [a.name for a in attempts] == ["POST", "POST"], tree
    assert attempts[0].status == "ERROR" and attempts[0].attr("http.response.status_code") == 500
    assert attempts[0].attr("error.type") == "500"
    assert attempts[1].status == "UNSET" and attempts[1].attr("http.request.resend_count") == 1
    assert first.kind == "CLIENT" and first.status == "UNSET"
    assert first.attr("gen_ai.usage.input_tokens") > 0 and first.attr("gen_ai.response.finish_reasons") == ["stop"]
    assert first.attr("server.address") == "127.0.0.1" and first.attr("gen_ai.request.max_tokens") == 8192
    assert any(name == "retry" for name, _ in first.events)

    blocks = {c.attr("gen_ai.tool.call.id"): c for c in main.children if c.name == "execute_tool run_code"}
    assert set(blocks) == {"left", "right", "loud", "stuck"}, tree
    left, right, stuck = blocks["left"], blocks["right"], blocks["stuck"]
    assert left.attr("agentloop.block.ended") == "ok" and left.status == "UNSET"
    assert left.attr("agentloop.block.output_bytes") == len("left done\n")
    assert left.start < right.end and right.start < left.end  # they ran at once
    assert stuck.attr("agentloop.block.ended") == "killed" and stuck.status == "ERROR"
    assert stuck.attr("error.type") == "timeout" and stuck.attr("agentloop.block.timeout_s") == 1.0
    assert "from_left" in stuck.attr("agentloop.block.lost_variables")  # what the kill took
    assert stuck.end - stuck.start >= 1e9  # it ran at least its deadline

    helper = kids["invoke_agent helper"]
    assert helper.parent_id == main.span_id and helper.attr("agentloop.run.status") == "answered"
    assert [c.name for c in helper.children] == ["chat scripted"], tree
    assert main.start <= helper.start and helper.end <= main.end

    # Nothing of the contents without the opt-in, and the key never.
    everything = json.dumps([s.attributes for s in rx.spans] + [s.events for s in rx.spans])
    assert SECRET not in everything and "re.match" not in everything and TASK not in everything


def test_contents_only_on_opt_in_under_the_latest_conventions(tmp_path: Path) -> None:
    script = {"say hi": ["<run_code id=\"hi\">\nprint('<b>hi</b>')\n</run_code>", "said hi"]}
    with Receiver() as rx, ScriptedServer(script) as server:
        proc = agentloop(tmp_path, "--trace", "run", "say hi", "-q",
                         env=_otel(rx, LLM_URL=server.url, LLM_MODEL="scripted", LLM_API_KEY=SECRET,
                                   OTEL_SEMCONV_STABILITY_OPT_IN="gen_ai_latest_experimental",
                                   OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true"))
        assert proc.returncode == 0, proc.stderr
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
    main = trees(rx.spans)[0]
    assert main.schema_url == "https://opentelemetry.io/schemas/1.38.0"
    assert main.attr("gen_ai.provider.name") == "openai" and main.attr("gen_ai.system") is None
    assert json.loads(main.attr("gen_ai.input.messages"))[0]["parts"][0]["content"] == "say hi"
    block = next(c for c in main.children if c.name == "execute_tool run_code")
    assert "print('<b>hi</b>')" in json.loads(block.attr("gen_ai.tool.call.arguments"))["code"]
    assert "<b>hi</b>" in block.attr("gen_ai.tool.call.result")
    chats = [c for c in main.children if c.name.startswith("chat")]
    assert json.loads(chats[-1].attr("gen_ai.output.messages"))[0]["parts"][0]["content"] == "said hi"
    assert SECRET not in json.dumps([s.attributes for s in rx.spans])


def test_off_by_default_and_none_disables(tmp_path: Path) -> None:
    with Receiver() as rx, ScriptedServer({"*": ["plain answer"]}) as server:
        for env in ({}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}):
            proc = agentloop(tmp_path, "run", "x", "-q", env={**_otel(rx), "LLM_URL": server.url, **env})
            assert proc.returncode == 0, proc.stderr
        proc = agentloop(tmp_path, "run", "x", "-q",
                         env={**_otel(rx), "LLM_URL": server.url, "OTEL_TRACES_EXPORTER": "otlp"})
        assert proc.returncode == 0, proc.stderr
        assert rx.wait_for(lambda spans: len(spans) > 0)
    assert rx.requests >= 1 and {s.name for s in rx.spans} >= {"invoke_agent main"}


def test_off_imports_nothing_of_opentelemetry(tmp_path: Path) -> None:
    code = ("import sys\nfrom engine.cli import main\ntry:\n    main(['run', 'x', '-q'])\nexcept SystemExit:\n    pass\n"
            "print('loaded' if any(m.startswith('opentelemetry') for m in sys.modules) else 'not loaded')")
    with ScriptedServer({"*": ["plain answer"]}) as server:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "LLM_URL": server.url,
               "XDG_STATE_HOME": str(tmp_path / "state")}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=120)
    assert proc.stdout == "plain answer\nnot loaded\n", proc.stderr


def test_an_unreachable_collector_costs_one_line(tmp_path: Path) -> None:
    with ScriptedServer({"*": ["plain answer"]}) as server:
        proc = agentloop(tmp_path, "--trace", "run", "x", "-q",
                         env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "LLM_URL": server.url})
    assert proc.returncode == 0 and proc.stdout == "plain answer\n"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentloop: traces could not all be sent to "
                                                   "http://127.0.0.1:9/v1/traces"), proc.stderr


def test_bad_trace_settings_are_one_line(tmp_path: Path) -> None:
    proc = agentloop(tmp_path, "run", "x", "-q", env={"OTEL_TRACES_EXPORTER": "zipkin"})
    assert proc.returncode == 125
    assert proc.stderr.strip() == ("agentloop: tracing: OTEL_TRACES_EXPORTER names zipkin: agentloop sends "
                                   "traces with otlp or console")
    proc = agentloop(tmp_path, "--trace", "run", "x", "-q", env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert proc.returncode == 125 and "http/protobuf or grpc" in proc.stderr


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_batch_runs_on_ray_are_traced_where_they_run(ray_cluster, tmp_path: Path) -> None:
    address, auth = ray_cluster
    ids = [f"r{i}" for i in range(3)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"id": i, "task": f"[{i}] say hi"}) + "\n" for i in ids))
    with Receiver() as rx, ScriptedServer({"*": ["<run_code>\nprint('hi')\n</run_code>", "hi"]}) as server:
        proc = agentloop(tmp_path, "--trace", "batch", "tasks.jsonl", "-o", "out.jsonl", "--ray", address,
                         "--progress", "none", env=_otel(rx, LLM_URL=server.url, LLM_MODEL="scripted", **auth))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert rx.wait_for(lambda spans: sum(s.name == "invoke_agent main" for s in spans) >= 3, timeout=60)
    roots = {r.attr("agentloop.task.id"): r for r in trees(rx.spans) if r.name == "invoke_agent main"}
    assert set(roots) == set(ids)
    assert all([c.name for c in r.children].count("execute_tool run_code") == 1 for r in roots.values())


def test_the_observer_takes_events_of_any_shape() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.observe._spans import SpanObserver
    from engine.observe._tracing import TraceSettings
    from tests.test_activity import odd_events

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for settings in (TraceSettings(), TraceSettings(latest=True, content=True)):
        observer = SpanObserver(provider.get_tracer("test"), settings)
        for event in odd_events():
            observer.event(event["type"], **{k: v for k, v in event.items() if k not in ("t", "type", "name")},
                           name=event["name"])
        observer.close()
    assert len(exporter.get_finished_spans()) > 0


def test_each_code_sample_is_a_span_with_its_status(tmp_path: Path) -> None:
    samples = [{"id": "good", "code": "print(1)"}, {"id": "bad", "code": "raise SystemExit(3)"},
               {"id": "slow", "code": "import time\ntime.sleep(30)", "timeout": "0.5s"}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    with Receiver() as rx:
        proc = agentloop(tmp_path, "--trace", "exec", "--jsonl", "samples.jsonl", "-o", "out.jsonl",
                         "--progress", "none", env=_otel(rx))
        assert proc.returncode == 0, proc.stderr
        assert rx.wait_for(lambda spans: len(spans) >= 3)
    spans = {s.attr("agentloop.sample.id"): s for s in rx.spans}
    assert all(s.name == "execute_tool sample" and s.parent_id == "" for s in spans.values())
    assert spans["good"].status == "UNSET" and spans["good"].attr("agentloop.sample.exit_code") == 0
    assert spans["bad"].status == "ERROR" and spans["bad"].attr("error.type") == "error"
    assert spans["bad"].attr("agentloop.sample.exit_code") == 3
    assert spans["slow"].attr("error.type") == "timeout" and spans["slow"].end - spans["slow"].start >= 4e8


def test_workers_see_none_of_the_tracing_variables(tmp_path: Path) -> None:
    """A collector's token often travels in OTEL_EXPORTER_OTLP_HEADERS: no worker may read it."""
    block = "<run_code id=\"env\">\nimport os\nprint(sorted(k for k in os.environ if 'OTEL' in k) or 'none')\n</run_code>"
    with Receiver() as rx, ScriptedServer({"*": [block, "checked"]}) as server:
        proc = agentloop(tmp_path, "--trace", "run", "look", "-q", "--record", str(tmp_path / "rec.jsonl"),
                         env=_otel(rx, LLM_URL=server.url, OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer {SECRET}"))
        assert proc.returncode == 0, proc.stderr
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
    finished = [json.loads(line) for line in (tmp_path / "rec.jsonl").read_text().splitlines()
                if '"type": "finished"' in line]
    assert finished[0]["output"].startswith("none")
