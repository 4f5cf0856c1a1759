"""The agent end to end: real workers, a real HTTP server standing in for the model."""

from __future__ import annotations

import re

from engine.agent import Agent, AgentDisplay, run_task
from engine.models import ModelConfig, ModelRegistry
from engine.scripted import Fail, ScriptedServer
from engine.workers import Engine


def registry(url: str, **extra) -> ModelRegistry:
    models = {"default": ModelConfig(alias="default", base_url=url, model="scripted", timeout=30),
              "flash": ModelConfig(alias="flash", base_url=url, model="scripted-flash", timeout=30)}
    return ModelRegistry(models, "default")


class Recorder(AgentDisplay):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, type, **fields):
        self.events.append((type, fields))



async def solve(engine, script, task, **kwargs):
    with ScriptedServer(script) as server:
        result = await run_task(task, models=registry(server.url), engine=engine, **kwargs)
        return result, server


def last_user(request: dict) -> str:
    return request["messages"][-1]["content"]


async def test_result_reaches_the_next_request_in_seed_format(engine):
    script = {"square": ['<run_code id="sq">\nprint(7 * 7)\n</run_code>', "It is 49."]}
    result, server = await solve(engine, script, "square seven")
    assert result.status == "answered" and result.answer == "It is 49."
    second = last_user(server.requests[1])
    assert re.fullmatch(
        r"<run_code_result id=sq duration=\d+\.\d\ds>\n49\n\n</run_code_result>\n"
        r"<status context_tokens=\d+ spent=\$0\.0000 last_reply=\d+\.\ds/>\n", second), second
    assert result.messages == 2 and result.tokens_in > 0 and result.tokens_out > 0


def adaptive(*steps):
    """A scripted turn that picks its reply from what the conversation has seen so far:
    ``steps`` are (needed_texts, reply); the first whose texts are all absent... is skipped.
    The reply of the last step whose needs are all met is sent, once; otherwise "waiting"."""
    def turn(body):
        seen = "".join(m["content"] for m in body["messages"] if m["role"] == "user")
        said = "".join(m["content"] for m in body["messages"] if m["role"] == "assistant")
        for needs, reply in reversed(steps):
            if all(n in seen for n in needs):
                return reply if reply not in said else "waiting"
        return "waiting"
    return turn


async def test_namespace_persists_and_blocks_run_concurrently(engine):
    turn = adaptive(
        ([], "<run_code>\nimport time\nvalue = 20\n</run_code>"),
        (["id=b1"], '<run_code id="one">\nimport time; t1 = time.monotonic(); time.sleep(1); print("one", value + 1)\n'
                    '</run_code>\n<run_code id="two">\nimport time; t2 = time.monotonic(); time.sleep(1); '
                    'print("two", value + 2)\n</run_code>'),
        (["one 21", "two 22"], '<run_code id="span">\nprint("overlap", abs(t1 - t2) < 0.5)\n</run_code>'),
        (["id=span"], "done"))
    result, server = await solve(engine, {"persist": [turn] * 12}, "persist and overlap")
    assert result.status == "answered" and result.answer == "done"
    replies = "".join(last_user(r) for r in server.requests)
    assert "overlap True" in replies


async def test_timeout_and_heartbeat(engine):
    # Heartbeats shorter than a second come every second (HEARTBEAT_FLOOR): the block runs 2.8 s.
    turn = adaptive(
        ([], '<run_code id="hb" heartbeat="0.3s" timeout="20s">\nimport time\nfor i in range(4):\n'
             '    print("step", i, flush=True); time.sleep(0.7)\n</run_code>'),
        # Waits in the kernel with every signal blocked: no interrupt reaches it, the deadline kills.
        (["<run_code_result id=hb"], '<run_code id="stuck" timeout="1s">\nimport os, signal\n'
                                     'signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())\n'
                                     'os.read(os.pipe()[0], 1)\n</run_code>'),
        (["<run_code_result id=stuck"], "fine"))
    script = {"slow": [turn] * 12}
    result, server = await solve(engine, script, "slow work")
    texts = [last_user(r) for r in server.requests]
    running = [t for t in texts if t.startswith("<running id=hb")]
    assert running, texts
    assert re.match(r"<running id=hb current=\d+s now=\d\d:\d\d:\d\d deadline=\d\d:\d\d:\d\d>\n", running[0])
    # 2.8 s of work, a report at most every second: at least two, the later ones counting the
    # output the earlier ones showed.
    assert len(running) >= 2, running
    assert all("bytes of output shown before" in t for t in running[1:]), running
    final = next(t for t in texts if "<run_code_result id=hb" in t)
    assert "step 0\nstep 1\nstep 2\nstep 3" in final
    stuck = next(t for t in texts if "<run_code_result id=stuck" in t)
    assert "[timed out after 1 s" in stuck and "namespace was reset" in stuck


async def test_sub_agent_gets_values_functions_and_host_functions(engine):
    def shout(text: str) -> str:
        """Upper-case a text (runs in the coordinator)."""
        return text.upper()

    script = {
        "parent task": [
            "<run_code>\nlimit = 3\ndef double(v):\n    return 2 * v\n</run_code>",
            '<run_agent name="kid" namespace="limit,double,shout">child task</run_agent>',
            "waiting for kid",
            "Kid said it."],
        "child task": ["<run_code>\nprint(double(limit), shout('ok'))\n</run_code>", "six and OK"],
    }
    display = Recorder()
    result, server = await solve(engine, script, "parent task", functions={"shout": shout}, display=display)
    assert result.status == "answered"
    child = server.conversation("child task")
    assert "6 OK" in last_user(child[1])
    system = child[0]["messages"][0]["content"]
    assert "double(v)" in system and "shout(text: str)" in system and "limit: int = 3" in system
    parent_texts = "".join(last_user(r) for r in server.conversation("parent task"))
    assert re.search(r"<agent_result name=kid duration=\d+s>\nsix and OK\n</agent_result>", parent_texts)
    assert any(t == "agent_started" and f["name"] == "kid" for t, f in display.events)


async def test_handover_failure_is_words_to_the_model(engine):
    script = {"bad handover": [
        "<run_code>\nimport threading\nlock = threading.Lock()\n</run_code>",
        '<run_agent name="kid" namespace="lock,missing">x</run_agent>',
        "ok"]}
    result, server = await solve(engine, script, "bad handover")
    text = last_user(server.requests[2])
    assert text.startswith("<error name=kid>") and "lock" in text and "missing" in text


async def test_run_agent_from_code_and_await_handles(engine):
    script = {
        "fan out": [
            "<run_code>\nhs = [self.run_agent(f'child {i}', name='w', namespace={'i': i}) for i in range(2)]\n"
            "print([h.name for h in hs])\nprint(sorted(await asyncio.gather(*hs)))\nprint(hs[0].done(), "
            "hs[0].result())\n</run_code>",
            "waiting", "waiting", "all done"],
        "child 0": ["<run_code>\nprint(i * 10)\n</run_code>", "zero"],
        "child 1": ["<run_code>\nprint(i * 10)\n</run_code>", "ten"],
    }
    result, server = await solve(engine, script, "fan out")
    texts = "".join(last_user(r) for r in server.conversation("fan out"))
    assert "['w', 'w2']" in texts
    assert "['ten', 'zero']" in texts
    assert "True zero" in texts


async def test_depth_limit(engine):
    script = {"level": ['<run_agent name="deeper">level down</run_agent>', "wait", "top"]}
    with ScriptedServer(script) as server:
        agent = Agent(engine=engine, models=registry(server.url), max_depth=0)
        try:
            await agent.run("level zero")
        finally:
            await agent.close()
        assert "max delegation depth 0 reached" in last_user(server.requests[1])


async def test_tag_boundaries_end_to_end(engine):
    script = {"tags": [
        "Here:\n<run_code>\ns = '</run_code> mid-line is inert'\nprint(s)\n</run_code>",
        '<run_code boundary="zz">\nx = """\n</run_code>\n"""\nprint("</run_code_result>")\n</run_code boundary="zz">',
        "<run_code>\nprint('never closed')\n",
        "<run_code timeout=\"soon\">\nprint(1)\n</run_code>",
        "done"]}
    result, server = await solve(engine, script, "tags")
    texts = [last_user(r) for r in server.requests]
    assert "</run_code> mid-line is inert" in texts[1]
    # The body printed the result's own close tag: the result gets a boundary so its end stays findable.
    assert re.match(r'<run_code_result id=b2 duration=\S+ boundary="(\w+)">\n</run_code_result>\n\n'
                    r'</run_code_result boundary="\1">', texts[2]), texts[2]
    assert "Your reply was cut off" in texts[3]
    assert "Could not parse the attributes" in texts[4] and "timeout" in texts[4]


async def test_hallucinated_result_is_cut(engine):
    script = {"invent": [
        "<run_code id=\"real\">\nprint('real')\n</run_code>\n<run_code_result id=real duration=0.01s>\nfake\n"
        "</run_code_result>\n<run_code id=\"after\">\nprint('must not run')\n</run_code>",
        "ok"]}
    result, server = await solve(engine, script, "invent")
    second = server.requests[1]
    assert "must not run" not in last_user(second)
    assistant = [m for m in second["messages"] if m["role"] == "assistant"][0]["content"]
    assert "fake" not in assistant and "<run_code_result" not in assistant
    assert second.get("stop") and any("<run_code_result" in s for s in second["stop"])


async def test_unreachable_endpoint_is_one_clear_error(engine):
    models = ModelRegistry({"default": ModelConfig(alias="default", base_url="http://127.0.0.1:9/v1",
                                                   model="x", timeout=5)}, "default")

    def quick_chat(*args, **kwargs):
        from engine.models import Chat
        return Chat(*args, **kwargs, max_retries=1, backoff=0.01)

    result = await run_task("anything", models=models, engine=engine, chat_factory=quick_chat)
    assert result.status == "failed"
    assert "cannot reach the model" in result.error and "LLM_URL" in result.error
    assert "Traceback" not in result.error


async def test_retries_on_server_errors(engine):
    script = {"flaky": [Fail(500, times=2), "<run_code>\nprint('after retries')\n</run_code>", "fine"]}

    def fast_chat(*args, **kwargs):
        from engine.models import Chat
        return Chat(*args, **kwargs, backoff=0.01)

    result, server = await solve(engine, script, "flaky", chat_factory=fast_chat)
    assert result.status == "answered" and result.answer == "fine"
    assert len(server.requests) == 4


async def test_api_key_is_invisible_to_worker_code(engine, monkeypatch):
    monkeypatch.setenv("LLM_API_KEY", "sk-do-not-leak")
    script = {"leak": [
        "<run_code>\nimport os, glob\nfound = [k for k, v in os.environ.items() if 'do-not-leak' in v]\n"
        "for p in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n        found += [p] if b'do-not-leak' in open(p, 'rb').read() else []\n"
        "    except OSError:\n        pass\nprint('leaks:', found)\n</run_code>",
        "ok"]}
    result, server = await solve(engine, script, "leak")
    assert "leaks: []" in last_user(server.requests[1])
    assert server.received[0].headers.get("authorization") == "Bearer sk-do-not-leak"


async def test_max_messages_bound(engine):
    script = {"loop": ["<run_code>\nprint(1)\n</run_code>"] * 10}
    result, server = await solve(engine, script, "loop", max_messages=3)
    assert result.status == "failed" and "unfinished after 3 messages" in result.error


async def test_workspace_size_is_checked_between_blocks(tmp_path):
    from engine.sandbox import SandboxPolicy

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    policy = SandboxPolicy(workspace_bytes=1024 * 1024)
    script = {"fill": ["<run_code>\nopen('files/big.bin', 'wb').write(b'x' * 3 * 1024 * 1024)\n</run_code>",
                       "<run_code>\nimport os\nos.remove('files/big.bin')\n</run_code>", "done"]}
    async with Engine(cwd=cwd, state_dir=tmp_path / "state", sandbox=policy) as engine:
        result, server = await solve(engine, script, "fill")
    assert result.answer == "done"
    assert "over its 1 MiB limit: delete files before writing more" in last_user(server.requests[1])
    assert "limit" not in last_user(server.requests[2])
