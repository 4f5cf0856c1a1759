"""``agentloop demo``: the whole engine at work, driven by a scripted model.

A built-in conversation plays the model's part (no LLM is involved) through the real engine:
sandboxed workers, two blocks at once, heartbeats, a block stuck in C that is hard-killed, and
a sub-agent working with a function handed over from the parent's namespace.  It needs no
model server, so it is the first thing to run on a fresh machine.

The script is a function of the conversation so far rather than a fixed list of replies: when
results arrive together or one at a time depends on the machine, and a fixed list would drift
out of step.  Each turn looks at what the engine has sent back and picks the next move.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import click

from engine.agent import find_tags, run_task
from engine.cli.options import ending, make_display, run_until_done, worker_options, worker_settings
from engine.inert import inert
from engine.models import ModelConfig, ModelRegistry
from engine.scripted import ScriptedServer
from engine.workers import Engine

__all__ = [
    "COMPLETE", "DEMO_SCRIPT", "DEMO_TASK", "HELPER_TASK", "NOTICE", "OFF_SCRIPT", "demo", "demo_registry",
    "helper_turn", "main_turn"
]

DEMO_TASK = ("Show me what agentloop can do: run blocks at once, report progress while one works, "
             "survive a block stuck in C, and hand work to a sub-agent.")
HELPER_TASK = ("Use collatz(n) to find the starting number below 1000 with the longest Collatz chain; "
               "answer with the number and its step count.")
#: The final answer starts with this when every step went as scripted (exit 0).
COMPLETE = "Demo complete"
OFF_SCRIPT = "Demo went off script"
NOTICE = "scripted model, no LLM involved: a built-in conversation drives the real engine"

_PAIR = """Two blocks at once: each sleeps one second in the same worker.

<run_code id="left" timeout="10s">
import time
left_start = time.time()
time.sleep(1)
left_end = time.time()
print(f"left: slept 1 s ({left_start:.3f} -> {left_end:.3f})")
</run_code>

<run_code id="right" timeout="10s">
import time
right_start = time.time()
time.sleep(1)
right_end = time.time()
print(f"right: slept 1 s ({right_start:.3f} -> {right_end:.3f})")
</run_code>"""

_TICKER = """Now a slower block with a heartbeat every second, so progress arrives while it runs.

<run_code id="ticker" timeout="10s" heartbeat="1s">
import time
for step in range(1, 5):
    time.sleep(0.5)
    print(f"step {step} of 4", flush=True)
</run_code>"""

_STUCK = """Next, a block stuck inside C (a catastrophic regular expression) with a 1 s deadline. No \
interrupt can reach it (a sleeping block would just get TimeoutError), so the engine has to kill the worker.

<run_code id="stuck" timeout="1s">
import re
re.match(r"(a+)+$", "a" * 40 + "b")
</run_code>"""

_AFTER = """What is left in the namespace after the kill? And a function to hand to a sub-agent.

<run_code id="after" timeout="10s">
survivors = [name for name in ("left_start", "right_start", "step") if name in globals()]
print("still defined:", ", ".join(survivors) if survivors else "nothing (this is a fresh worker)")

def collatz(n):
    \"\"\"Steps for n to reach 1 in the Collatz sequence.\"\"\"
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps

print("collatz(27) =", collatz(27))
</run_code>"""

_DELEGATE = f"""A sub-agent gets its own context and its own worker; collatz travels with it.

<run_agent name="helper" namespace="collatz">
{HELPER_TASK}
</run_agent>"""

_SEARCH = """<run_code id="search" timeout="10s">
best = max(range(1, 1000), key=collatz)
print(best, collatz(best))
</run_code>"""

_WAIT = "Still running; letting it continue."


def _conversation(body: dict[str, Any]) -> tuple[str, str]:
    """(everything the assistant said, everything it was sent after the task) in a request."""
    said, seen = [], []
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    users = 0
    for message in messages:
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        if message.get("role") == "assistant":
            said.append(text)
        elif message.get("role") == "user":
            users += 1
            if users > 1:
                seen.append(text)
    return "\n".join(said), "\n".join(seen)


def _results(seen: str) -> dict[str, str]:
    """Block id -> the body of its ``<run_code_result>``."""
    return {attrs.get("id", ""): text.strip("\n") for attrs, text in find_tags(seen, "run_code_result")}


def _span(output: str) -> tuple[float, float] | None:
    match = re.search(r"\(([\d.]+) -> ([\d.]+)\)", output)
    return (float(match.group(1)), float(match.group(2))) if match else None


def _summary(seen: str) -> str:
    """The final answer, told from the results the engine sent back."""
    results = _results(seen)
    agent = {attrs.get("name"): text.strip() for attrs, text in find_tags(seen, "agent_result")}
    problems = []
    left, right = _span(results.get("left", "")), _span(results.get("right", ""))
    if left and right and max(left[0], right[0]) < min(left[1], right[1]):
        both = max(left[1], right[1]) - min(left[0], right[0])
        pair = (f"blocks left and right each slept 1 s in the same worker, at the same time: "
                f"{both:.2f} s for both, not 2 s.")
    else:
        pair = "blocks left and right did not overlap."
        problems.append("the two blocks did not run at the same time")
    beats = len(re.findall(r"^<running id=ticker", seen, re.MULTILINE))
    if not beats:
        problems.append("no heartbeat arrived from block ticker")
    stuck = results.get("stuck", "")
    lost = re.search(r"lost variables: ([^)\]]*)", stuck)
    if "worker was killed" in stuck:
        kill = ("block stuck sat in the regular expression engine past its 1 s deadline; no interrupt "
                "reaches C code, so the worker was killed and a fresh one started"
                + (f" (lost: {lost.group(1)})." if lost else "."))
    else:
        kill = "block stuck was not killed."
        problems.append("the stuck block was not hard-killed")
    after = results.get("after", "")
    found = re.search(r"still defined: (.*)", after)
    if not found or not found.group(1).startswith("nothing"):
        problems.append("the namespace survived the kill")
    helper = agent.get("helper", "")
    if not helper or helper.startswith("["):
        problems.append(f"the sub-agent did not answer ({helper or 'no result'})")
    lines = [
        f"1. Concurrency: {pair}",
        f"2. Heartbeats: block ticker sent {beats} progress report(s) while it worked.",
        f"3. Hard kill: {kill} The next block found {found.group(1) if found else 'nothing it could report'}.",
        f"4. Sub-agent: helper ran in its own worker with the handed-over collatz() and answered: {helper}",
    ]
    head = (f"{COMPLETE} (scripted model, no LLM involved). What ran:" if not problems else
            f"{OFF_SCRIPT} (scripted model, no LLM involved): {'; '.join(problems)}.")
    return "\n".join([head, *lines])


_STEPS = [  # (what the reply launches, the block id or agent name whose result ends the step)
    (_PAIR, ("left", "right")),
    (_TICKER, ("ticker",)),
    (_STUCK, ("stuck",)),
    (_AFTER, ("after",)),
    (_DELEGATE, ("agent:helper",)),
]


def _done(seen: str, what: str) -> bool:
    if what.startswith("agent:"):
        return f"<agent_result name={what[6:]} " in seen
    return f"<run_code_result id={what} " in seen


def main_turn(body: dict[str, Any]) -> str:
    """The demo's main agent: the next step once the previous one has fully reported back."""
    said, seen = _conversation(body)
    for reply, waits_for in _STEPS:
        marker = reply.split("\n<run_", 1)[1].split(">", 1)[0]  # e.g. 'code id="left" timeout="10s"'
        if marker not in said:
            return reply
        if not all(_done(seen, what) for what in waits_for):
            return _WAIT
    return _summary(seen)


def helper_turn(body: dict[str, Any]) -> str:
    """The sub-agent: run the search with the handed-over function, then quote what it printed."""
    said, seen = _conversation(body)
    if 'id="search"' not in said:
        return _SEARCH
    output = _results(seen).get("search")
    if output is None:
        return _WAIT
    numbers = re.findall(r"\d+", output)
    if len(numbers) < 2:
        return f"[failed] the search printed no answer: {output}"
    return f"{numbers[0]} has the longest chain below 1000: {numbers[1]} steps (found with the collatz() I was handed)."


#: Room for every heartbeat and wait a slow machine may add; past it the server says so and the loop ends.
_MAX_TURNS = 60

#: The scripted conversations, keyed by a piece of each task (see engine.scripted).
DEMO_SCRIPT: dict[str, list] = {
    "collatz(n) to find": [helper_turn] * _MAX_TURNS,
    "Show me what agentloop can do": [main_turn] * _MAX_TURNS,
}


def demo_registry(url: str) -> ModelRegistry:
    """One model alias, ``scripted``, at ``url``."""
    config = ModelConfig(alias="scripted", base_url=url, model="scripted", timeout=30.0)
    return ModelRegistry({"scripted": config}, "scripted")


@click.command("demo")
@click.option("--record", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Record every display event to this JSONL file.")
@click.option("-q", "--quiet", is_flag=True, help="No live display on stderr.")
@worker_options
def demo(record: Path | None, quiet: bool) -> None:
    """Watch the engine work: scripted model, no LLM involved.

    A built-in conversation plays the model: two blocks run at once, one streams heartbeats,
    one is stuck in C and gets its worker hard-killed, and a sub-agent works with a function
    handed over from the parent.  Real workers, real sandbox, a few seconds.  Needs no model
    server.  Exits 0 when every step happened as scripted.
    """
    display = make_display(record, quiet)
    options = worker_settings()

    async def go():
        with ScriptedServer(DEMO_SCRIPT) as server:
            display.event("note", name="demo", message=NOTICE)
            display.event("note", name="demo", message=f"task: {DEMO_TASK}")
            async with Engine(options.settings(), workspace=options.workspace) as engine:
                return await run_task(DEMO_TASK, models=demo_registry(server.url), engine=engine,
                                      display=display, timeout=120)

    result = run_until_done(go(), display)
    if result.status != "answered":
        click.echo(inert(f"agentloop: demo: {ending(result)}"), err=True)
        sys.exit(1)
    click.echo(inert(result.answer))
    sys.exit(0 if (result.answer or "").startswith(COMPLETE) else 1)
