"""``agentloop view`` as a user runs it: real runs and a real 1,000-run batch (traced into a real
OTLP receiver), their pages loaded in headless Chromium, the DOM checked, screenshots saved.

Chromium is Debian's ``chromium`` (``scripts/test`` installs it when run as root), driven by
Playwright with one browser for the whole module; without it the browser tests are skipped,
saying why.  ``AGENTLOOP_SCREENSHOTS=DIR`` also saves the screenshots there (those of
docs/commands/view.md come from it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from engine.scripted import Delay, Fail, ScriptedServer
from tests.otlp_receiver import Receiver, trees
from tests.test_activity import odd_events
from tests.test_tracing import HOSTILE, SCRIPT, TASK

AGENTLOOP = [sys.executable, "-m", "engine.cli"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BATCH = 1000


def agentloop(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update({"XDG_STATE_HOME": str(cwd / "state"), **(env or {})})
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=cwd, env=full, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# -- files view refuses, files cut short ----------------------------------------------------------

@pytest.mark.parametrize("content, why", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "line 1 is not JSON"),
    (b"hello, this is a log file\n", "line 1 is not JSON"),
    (b'{"custom_id": "r1", "response": {"status_code": 200}, "error": null}\n', "line 1 is a JSON object with"),
    (b'{"id": 1, "status": "success"}\n', "line 1 is a JSON object with"),
    (b"[1, 2, 3]\n", "line 1 is a JSON list, not an object"),
    (b"", "it is empty"),
])
def test_a_file_view_does_not_read_is_one_line_and_non_zero(tmp_path: Path, content: bytes, why: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    proc = agentloop(tmp_path, "view", str(bad), "--no-open")
    assert proc.returncode == 125, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0], proc.stderr
    assert 'it expects a --record file (JSON lines with "t" and "type") or the results of batch or exec --jsonl' \
        in lines[0]
    assert proc.stdout == "" and not (tmp_path / "bad.html").exists()


def test_a_damaged_line_in_the_middle_is_refused(tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    rec.write_text('{"t": 1.0, "type": "note", "name": "x", "message": "a"}\n{"t": 1.\n'
                   '{"t": 2.0, "type": "note", "name": "x", "message": "b"}\n')
    proc = agentloop(tmp_path, "view", str(rec), "--no-open")
    assert proc.returncode == 125 and "line 2 is not JSON" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_a_recording_of_any_shape_makes_a_page(tmp_path: Path) -> None:
    """A recording is data someone else may have written: every event type with fields of every
    JSON type still makes a page (the fold and the page take what they can use)."""
    from engine.view import write

    rec = tmp_path / "odd.jsonl"
    rec.write_text("".join(json.dumps(event) + "\n" for event in odd_events()))
    written = write(rec)
    assert written.kind == "timeline" and written.path.stat().st_size > 1000


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory) -> dict:
    """The run of ``tests/test_tracing.py`` (two blocks at once, one that prints markup, one
    killed, a sub-agent, a retried request), recorded and traced."""
    where = tmp_path_factory.mktemp("run")
    with Receiver() as rx, ScriptedServer(SCRIPT) as server:
        proc = agentloop(where, "--trace", "run", TASK, "-q", "--record", str(where / "run.jsonl"),
                         env={"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "LLM_URL": server.url,
                              "LLM_MODEL": "scripted"})
        assert proc.returncode == 0, proc.stderr
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
    return {"dir": where, "recording": where / "run.jsonl", "spans": rx.spans}


def test_a_recording_cut_short_is_shown_as_far_as_it_goes(traced_run: dict, tmp_path: Path) -> None:
    text = traced_run["recording"].read_text()
    whole = agentloop(tmp_path, "view", str(traced_run["recording"]), "-o", str(tmp_path / "whole.html"), "--no-open")
    assert whole.returncode == 0 and "warning" not in whole.stderr, whole.stderr
    assert whole.stdout.strip() == str(tmp_path / "whole.html")
    # Killed mid-line: the torn line is left out, one warning.
    torn = tmp_path / "torn.jsonl"
    lines = text.splitlines(keepends=True)
    half = len(lines) // 2
    torn.write_text("".join(lines[:half]) + lines[half][: len(lines[half]) // 2])
    proc = agentloop(tmp_path, "view", str(torn), "--no-open")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"line {half + 1} was cut short" in warnings[0], proc.stderr
    assert (tmp_path / "torn.html").stat().st_size > 1000
    # Killed between two lines: the run never said it ended.
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_text("".join(lines[:half]))
    proc = agentloop(tmp_path, "view", str(stopped), "--no-open")
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert proc.returncode == 0 and len(warnings) == 1 and "ends before its run did" in warnings[0], proc.stderr


def test_what_a_worker_prints_stays_text_in_the_file(traced_run: dict, tmp_path: Path) -> None:
    out = tmp_path / "run.html"
    proc = agentloop(tmp_path, "view", str(traced_run["recording"]), "-o", str(out), "--no-open")
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert page.count("<script") == 2 and page.count("</script>") == 2  # the data, and our one script
    assert page.count("</html>") == 1 and page.rstrip().endswith("</html>")
    assert "<img" not in page and "\\u003cscript\\u003ewindow.pwned" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing to fetch


# -- the 1,000-run batch ------------------------------------------------------------------------

def _batch_turn(body: dict) -> str:
    return "answer: " + body["messages"][-1]["content"][:60].replace("<", "[")


@pytest.fixture(scope="module")
def traced_batch(tmp_path_factory) -> dict:
    """A real batch of ``BATCH`` runs with mixed outcomes, traced: most answer after one block,
    some fail (the endpoint refuses them), some hit their deadline."""
    where = tmp_path_factory.mktemp("batch")
    tasks, expected = [], Counter()
    for i in range(BATCH):
        if i % 10 == 3:
            tasks.append({"id": f"t{i:04d}", "task": f"[fail {i}] this one is refused"})
            expected["failed"] += 1
        elif i % 25 == 7:
            # The deadline falls in its model request (its worker has started by then).
            tasks.append({"id": f"t{i:04d}", "task": f"[slow {i}] this one is too slow", "timeout": "2s"})
            expected["timed_out"] += 1
        else:
            tasks.append({"id": f"t{i:04d}", "task": f"[ok {i}] print a number"})
            expected["answered"] += 1
    (where / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    script = {"[fail": [Fail(400, 1000)], "[slow": [Delay(60.0, then="too late")],
              "[ok": ["<run_code>\nprint(6 * 7)\n</run_code>", _batch_turn]}
    with Receiver() as rx, ScriptedServer(script) as server:
        proc = agentloop(where, "--trace", "batch", "tasks.jsonl", "-o", "results.jsonl", "--parallel", "8",
                         "--progress", "none",
                         env={"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "LLM_URL": server.url,
                              "LLM_MODEL": "scripted"}, timeout=1100)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert rx.wait_for(lambda spans: sum(s.parent_id == "" for s in spans) >= BATCH, timeout=60)
    return {"dir": where, "results": where / "results.jsonl", "spans": rx.spans, "expected": expected}


@pytest.mark.timeout(1200)  # the batch itself: about 100 s as root on 2 idle cores, more as a user
def test_a_batch_is_a_trace_per_run_carrying_its_task_id(traced_batch: dict) -> None:
    records = {r["id"]: r for r in map(json.loads, traced_batch["results"].read_text().splitlines())}
    assert Counter(r["status"] for r in records.values()) == traced_batch["expected"]
    roots = [r for r in trees(traced_batch["spans"]) if r.name == "invoke_agent main"]
    assert len(roots) == BATCH and len({r.trace_id for r in roots}) == BATCH
    by_task = {r.attr("agentloop.task.id"): r for r in roots}
    assert set(by_task) == set(records)
    for task_id, record in records.items():
        root = by_task[task_id]
        assert root.attr("agentloop.run.attempt") == 1
        assert root.attr("agentloop.run.status") == record["status"], task_id
        names = [c.name for c in root.children]
        if record["status"] == "answered":
            assert root.status == "UNSET" and names.count("execute_tool run_code") == 1, names
        elif record["status"] == "failed":
            assert root.status == "ERROR" and root.attr("error.type") == "ModelResponseError"
            assert names == ["chat scripted"] and root.children[0].attr("error.type") == "400"
        else:
            assert root.status == "ERROR" and root.attr("error.type") == "timeout"
            assert names == ["chat scripted"] and root.children[0].status == "UNSET"  # cut by the deadline


# -- in a real browser --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (scripts/test installs it when run as root: "
                    "apt-get install chromium)")
    args = ["--headless=new", "--disable-gpu", "--no-first-run", "--disable-quic", "--disable-sync",
            # This machine's network is closed: Chromium's own background requests would fail.
            "--disable-background-networking", "--disable-component-update"]
    if os.geteuid() == 0:
        # Chromium refuses to start as root with its sandbox on (the sandbox is built for a
        # user's uid); the pages it loads here are our own local files.
        args.append("--no-sandbox")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=args, timeout=60_000)
        yield chromium
        chromium.close()


def _open(browser, path: Path, width: int = 1300):
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready]", timeout=20_000)
    return page, errors, requests


def _shoot(page, tmp_path: Path, name: str, **kwargs) -> Path:
    shot = tmp_path / f"{name}.png"
    page.screenshot(path=str(shot), **kwargs)
    assert shot.stat().st_size > 10_000
    if os.environ.get("AGENTLOOP_SCREENSHOTS"):
        keep = Path(os.environ["AGENTLOOP_SCREENSHOTS"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / shot.name)
    return shot


def test_the_timeline_of_a_run_in_a_browser(browser, traced_run: dict, tmp_path: Path) -> None:
    out = tmp_path / "run.html"
    assert agentloop(tmp_path, "view", str(traced_run["recording"]), "-o", str(out), "--no-open").returncode == 0
    page, errors, requests = _open(browser, out)
    assert errors == [] and requests == [out.as_uri()]  # nothing fetched from anywhere
    assert page.eval_on_selector_all(".lane", "ls => ls.map(l => l.dataset.agent)") == ["main", "helper"]
    bars = page.eval_on_selector_all(".bar", """bs => bs.map(b => ({kind: b.dataset.kind, id: b.dataset.id,
        agent: b.dataset.agent, outcome: b.dataset.outcome, ticks: b.querySelectorAll('.tick').length,
        box: b.getBoundingClientRect().toJSON()}))""")
    blocks = {b["id"]: b for b in bars if b["kind"] == "block"}
    assert set(blocks) == {"left", "right", "loud", "stuck"}
    left, right, stuck = blocks["left"]["box"], blocks["right"]["box"], blocks["stuck"]["box"]
    assert left["x"] < right["x"] + right["width"] and right["x"] < left["x"] + left["width"]  # at once...
    assert left["y"] != right["y"]  # ...so one above the other
    assert stuck["x"] >= left["x"] + left["width"] - 2  # after the pair
    assert blocks["stuck"]["outcome"] == "killed" and blocks["right"]["ticks"] >= 1  # a heartbeat
    # The first request was answered 500 and retried: its failed attempt is hatched, the wait included.
    hatched = page.eval_on_selector_all('.bar.request .attempt-failed', "hs => hs.map(h => h.getBoundingClientRect().width)")
    assert len(hatched) == 1 and hatched[0] > 5
    requests_of = Counter(b["agent"] for b in bars if b["kind"] == "request")
    assert requests_of["main"] >= 3 and requests_of["helper"] == 1
    assert page.inner_text("#totals").count("model requests") == 1
    # The killed block: its code, what the kill took, what the model was told.
    page.click('.bar[data-id="stuck"]')
    detail = page.inner_text("#detail")
    assert "killed" in detail and "from_left" in detail and 're.match(r"(a+)+$"' in detail
    assert "timed out after 1 s" in detail
    _shoot(page, tmp_path, "timeline")
    # What a worker printed is text on the page, not markup: no new element, nothing ran.
    page.click('.bar[data-id="loud"]')
    assert HOSTILE in page.inner_text("#detail pre.output")
    assert page.evaluate("document.querySelectorAll('script').length") == 2
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("window.pwned === undefined")
    page.close()


@pytest.mark.timeout(1200)
def test_the_report_of_a_batch_in_a_browser(browser, traced_batch: dict, tmp_path: Path) -> None:
    results = traced_batch["results"]
    out = traced_batch["dir"] / "report.html"
    proc = agentloop(traced_batch["dir"], "view", str(results), "-o", str(out), "--no-open")
    assert proc.returncode == 0, proc.stderr
    page, errors, requests = _open(browser, out)
    assert errors == [] and requests == [out.as_uri()]
    expected = traced_batch["expected"]
    counts = page.eval_on_selector_all("#by-status tr[data-status]",
                                       "rs => Object.fromEntries(rs.map(r => [r.dataset.status, r.cells[1].innerText]))")
    assert {k: int(v.replace(",", "")) for k, v in counts.items() if v != "0"} == dict(expected)
    assert page.inner_text("#runs") == f"{BATCH:,}"
    reasons = page.eval_on_selector_all("#reasons tbody tr", "rs => rs.map(r => r.cells[0].innerText)")
    assert any("HTTP N" in r for r in reasons) and "no answer within N s" in reasons
    assert page.evaluate("document.querySelectorAll('#histogram rect').length") > 3
    failed = expected["failed"] + expected["timed_out"]
    assert f"page 1 of {-(-failed // 100)}" in page.inner_text("body")
    assert page.evaluate("document.querySelectorAll('#failed tbody tr').length") == min(100, failed)
    _shoot(page, tmp_path, "report")
    # The slowest run links to its timeline, written beside the report, which draws itself.
    link = page.get_attribute("#slowest tbody tr a", "href")
    assert link and link.startswith("report.timelines/")
    timeline, errors, _ = _open(browser, out.parent / link)
    assert errors == [] and timeline.eval_on_selector_all(".lane", "ls => ls.length") == 1
    timeline.close()
    page.close()


def test_the_report_of_10000_runs_stays_small_and_quick(browser, tmp_path: Path) -> None:
    """Size and load time at 10,000 runs, printed for the record (``-s``); the bounds here are ten
    times looser than what is measured on a 2-core machine."""
    results = tmp_path / "results.jsonl"
    with results.open("w") as f:
        for i in range(10_000):
            status = ("answered", "answered", "answered", "failed", "timed_out")[i % 5]
            f.write(json.dumps({"id": f"r{i}", "status": status, "answer": "x", "error": f"err {i % 7}" * (status != "answered"),
                                "messages": 3, "tokens": {"in": 1000 + i, "out": 100}, "cost": 0.001, "duration_s": 1 + (i % 97),
                                "attempts": 1, "transcript": f"/nowhere/{i}/transcript.jsonl"}) + "\n")
    proc = agentloop(tmp_path, "view", str(results), "--no-open")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "results.html"
    size = out.stat().st_size
    page, errors, _ = _open(browser, out)
    load_ms = page.evaluate("performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd")
    drawn_ms = int(page.evaluate("document.body.dataset.ready"))
    print(f"\nreport of 10,000 runs: {size / 1e6:.2f} MB, DOM ready {load_ms:.0f} ms, drawn {drawn_ms} ms")
    assert errors == [] and page.inner_text("#runs") == "10,000"
    assert size < 10_000_000 and drawn_ms < 10_000
    page.close()


def test_a_samples_report_counts_and_says_why(tmp_path: Path) -> None:
    from engine.view import report

    rows = [{"id": "a", "status": "ok", "exit_code": 0, "stdout": "1\n", "stderr": "", "duration_s": 0.1, "message": ""},
            {"id": "b", "status": "error", "exit_code": 1, "stdout": "", "duration_s": 0.2, "message": "",
             "stderr": "Traceback (most recent call last):\n  ...\nValueError: nope 7\n"},
            {"id": "c", "status": "error", "exit_code": 1, "stdout": "", "duration_s": 0.3, "message": "",
             "stderr": "ValueError: nope 8\n"},
            {"id": "d", "status": "error", "exit_code": 3, "stdout": "", "stderr": "", "duration_s": 0.1, "message": ""},
            {"id": "e", "status": "timeout", "exit_code": 124, "stdout": "", "stderr": "", "duration_s": 5.0,
             "message": "its deadline (5 s) passed"}]
    data = report.build(rows, "samples", tmp_path / "out.jsonl")
    assert data["runs"] == 5 and data["by_status"]["error"] == 3 and data["failed_total"] == 4
    assert data["reasons"] == [["ValueError: nope N", 2], ["exit code N", 1], ["its deadline (N s) passed", 1]]
    assert [r["id"] for r in data["slowest"]][:2] == ["e", "c"]


# -- what blocks displayed ------------------------------------------------------------------------

#: A block that plots, shows a Pillow image, and displays an SVG and HTML that try to run script.
PICTURES = '''
import matplotlib.pyplot as plt
from PIL import Image
plt.plot([1, 2, 3], [3, 1, 2])
plt.show()
Image.new("RGB", (40, 20), (0, 160, 0)).show()
class Hostile:
    def _repr_svg_(self):
        return ('<svg xmlns="http://www.w3.org/2000/svg" width="30" height="30" onload="window.pwned=1">'
                '<script>window.pwned=2</script><circle cx="15" cy="15" r="10"/></svg>')
    def _repr_html_(self):
        return '<img src="x" onerror="window.pwned=3"><script>window.pwned=4</script><b>html</b>'
display(Hostile())
plt.figure()
plt.bar([1, 2], [2, 1])
'''


def test_the_images_a_block_displayed_are_on_its_page_and_no_script_of_theirs_runs(browser, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    task = "draw some pictures"
    with ScriptedServer({task: [f'<run_code id="pics" timeout="60s">\n{PICTURES}</run_code>', "drawn"]}) as server:
        proc = agentloop(tmp_path, "run", task, "-q", "--record", str(tmp_path / "run.jsonl"),
                         env={"LLM_URL": server.url, "LLM_MODEL": "scripted"})
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "run.html"
    assert agentloop(tmp_path, "view", str(tmp_path / "run.jsonl"), "-o", str(out), "--no-open").returncode == 0
    text = out.read_text()
    assert text.count("<script") == 2 and "<svg xmlns" not in text and "<img" not in text  # data, never markup
    page, errors, requests = _open(browser, out)
    page.click('.bar[data-id="pics"]')
    page.wait_for_function("[...document.querySelectorAll('#detail figure.shown img')].every(i => i.complete)")
    images = page.eval_on_selector_all("#detail figure.shown img", """is => is.map(i => ({kind: i.dataset.kind,
        width: i.naturalWidth, height: i.naturalHeight, src: i.getAttribute('src').slice(0, 26)}))""")
    assert [i["kind"] for i in images] == ["png", "png", "svg", "png"], images
    assert all(i["width"] > 0 for i in images) and (images[1]["width"], images[1]["height"]) == (40, 20)
    assert images[2]["src"] == "data:image/svg+xml;base64,"
    html = page.inner_text("#detail pre.html")
    assert "onerror" in html and "<script>window.pwned=4</script>" in html  # shown as text
    assert "[image 40×20 PNG: " in page.inner_text("#detail")
    _shoot(page, tmp_path, "displays", full_page=True)
    assert page.evaluate("window.pwned === undefined"), page.evaluate("window.pwned")
    assert page.evaluate("document.querySelectorAll('script').length") == 2
    assert page.evaluate("document.querySelectorAll('iframe, object, embed, svg script').length") == 0
    assert errors == [] and requests == [out.as_uri()]  # nothing fetched: not even the HTML's "x"
    page.close()


# -- files of any size ------------------------------------------------------------------------
# view streams its input: a 600 MB recording once took 2.6 GB and 19 s, 200,000 results 1.4 GB
# and a 41 MB page.  The memory of the view process is measured by a parent of its own (the
# suite's other children do not count), its page checked for size and for saying what it left.

#: What view may hold, whatever the file (about twice what it takes here).
VIEW_RSS = 300 * 1024 * 1024
TIMELINE_PAGE, REPORT_PAGE = 40_000_000, 10_000_000

_MEASURED = r'''
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.stderr.write(done.stderr)
'''


def _viewed(tmp_path: Path, source: Path) -> tuple[int, str, Path]:
    """(the view process's peak RSS in bytes, its stderr, its page)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *AGENTLOOP, "view", str(source), "--no-open"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    status, rss = proc.stdout.split()
    assert status == "0", proc.stderr
    return int(rss), proc.stderr, default_page(source)


def default_page(source: Path) -> Path:
    return source.with_suffix(".html")


def _page_data(page: Path) -> dict:
    text = page.read_text(encoding="utf-8")
    start = text.index('<script type="application/json" id="data">') + len('<script type="application/json" id="data">')
    return json.loads(text[start:text.index("</script>", start)])


def _big_recording(path: Path, blocks: int) -> None:
    """A run of ``blocks`` blocks (about 13 KB each: code, four output chunks, a heartbeat, the
    result), and two output lines of 20 MiB."""
    code = json.dumps("print('x')\n" * 180)[1:-1]
    chunk = json.dumps(("y" * 99 + "\n") * 15)[1:-1]
    result = json.dumps(("z" * 99 + "\n") * 20)[1:-1]
    t = 1_700_000_000.0
    with path.open("w") as f:
        f.write(json.dumps({"t": t, "type": "run_started", "name": "main", "task": "big", "model": "m"}) + "\n")
        for i in range(blocks):
            t += 0.01
            f.write(f'{{"t": {t}, "type": "launched", "name": "main", "id": "b{i}", "timeout": 30, "code": "{code}"}}\n')
            for _ in range(4):
                f.write(f'{{"t": {t}, "type": "output", "name": "main", "id": "b{i}", "text": "{chunk}"}}\n')
            f.write(f'{{"t": {t}, "type": "progress", "name": "main", "id": "b{i}"}}\n')
            f.write(f'{{"t": {t + 0.005}, "type": "finished", "name": "main", "id": "b{i}", "status": "ok", '
                    f'"output": "{result}", "output_bytes": 6000}}\n')
            if i in (10, 20):
                f.write(json.dumps({"t": t, "type": "output", "name": "main", "id": f"b{i}", "text": "L" * (20 << 20)}) + "\n")
        f.write(json.dumps({"t": t + 1, "type": "run_finished", "name": "main", "status": "answered",
                            "tokens_in": 5, "tokens_out": 6, "cost": 0.0}) + "\n")


def test_a_200_mb_recording_costs_bounded_memory_and_a_bounded_page(tmp_path: Path, request) -> None:
    source = tmp_path / "big.jsonl"
    _big_recording(source, 16_000)
    assert source.stat().st_size > 200_000_000
    rss, stderr, page = _viewed(tmp_path, source)
    print(f"\nview of a {source.stat().st_size / 1e6:.0f} MB recording: peak RSS {rss / 1e6:.0f} MB, "
          f"page {page.stat().st_size / 1e6:.1f} MB")
    assert rss < VIEW_RSS, rss
    assert page.stat().st_size < TIMELINE_PAGE
    data = _page_data(page)
    said = " ".join(data["summarised"])
    assert "2 lines longer than 16 MiB were left out unread" in said, said
    assert "only the first 10,000 bars" in said and "6,000 more blocks" in said, said
    assert "texts are cut to 200 characters" in said, said
    assert len(data["items"]) == 10_000 and data["totals"]["blocks"] == 16_000
    assert data["totals"]["status"] == "answered"  # the run's end, after the bound, still counts
    assert "the page summarises it" in stderr and len([s for s in stderr.splitlines() if "summarises" in s]) == 1
    if CHROMIUM is not None and importlib.util.find_spec("playwright"):
        shown, errors, _ = _open(request.getfixturevalue("browser"), page)
        assert errors == [] and "This page summarises" in shown.inner_text("#summarised")
        shown.close()


def test_200000_results_cost_bounded_memory_and_a_small_page(tmp_path: Path) -> None:
    source = tmp_path / "results.jsonl"
    with source.open("w") as f:
        for i in range(200_000):
            status = ("answered", "answered", "failed", "timed_out", "answered")[i % 5]
            error = f"boom {i % 13} at 'x{i}'" + "e" * 300 if status != "answered" else ""
            f.write(json.dumps({"id": f"task-{i}", "status": status, "answer": "a" * 200, "error": error, "messages": 3,
                                "tokens": {"in": 1000, "out": 100}, "cost": 0.001, "duration_s": 1 + (i % 997) / 10,
                                "attempts": 1, "model": "m", "transcript": f"/nowhere/{i}/transcript.jsonl"}) + "\n")
        # A run redone: its last line counts.
        f.write(json.dumps({"id": "task-2", "status": "answered", "duration_s": 5000, "tokens": {"in": 1, "out": 1}})
                + "\n")
    rss, _, page = _viewed(tmp_path, source)
    print(f"\nview of 200,000 results ({source.stat().st_size / 1e6:.0f} MB): peak RSS {rss / 1e6:.0f} MB, "
          f"page {page.stat().st_size / 1e6:.1f} MB")
    assert rss < VIEW_RSS, rss
    assert page.stat().st_size < REPORT_PAGE
    data = _page_data(page)
    assert data["runs"] == 200_000 and data["lines"] == 200_001 and data["failed_total"] == 79_999
    assert data["slowest"][0]["id"] == "task-2" and data["by_status"]["answered"] == 120_001
    assert len(data["failed"]) == 2_000 and "the first 2,000 of 79,999 failed runs are listed" in data["summarised"]
    assert data["reasons"][0][1] + sum(n for _, n in data["reasons"][1:]) == 79_999


def test_a_blocks_connections_are_listed_on_its_page_as_text(browser, tmp_path: Path) -> None:
    """``--allow-net``: each connection of a block (a recording's ``connection`` events) is a row
    of its detail, whatever the recording says it was called."""
    t = 1_700_000_000.0
    hostile = "<img src=x onerror=window.pwned=1>"
    events = [{"t": t, "type": "run_started", "name": "main", "task": "fetch", "model": "m"},
              {"t": t, "type": "launched", "name": "main", "id": "get", "timeout": 30, "code": "fetch()"},
              {"t": t + 0.1, "type": "connection", "name": "main", "id": "get", "host": "pypi.org", "port": 443,
               "verdict": "allowed", "why": "", "sent": 1200, "received": 45000},
              {"t": t + 0.2, "type": "connection", "name": "main", "id": "get", "host": hostile, "port": 80,
               "verdict": "refused", "why": "not-listed", "sent": 0, "received": 0},
              {"t": t + 0.3, "type": "finished", "name": "main", "id": "get", "status": "ok", "output": "ok"},
              {"t": t + 1, "type": "run_finished", "name": "main", "status": "answered"}]
    source = tmp_path / "run.jsonl"
    source.write_text("".join(json.dumps(e) + "\n" for e in events))
    out = tmp_path / "run.html"
    assert agentloop(tmp_path, "view", str(source), "-o", str(out), "--no-open").returncode == 0
    page, errors, requests = _open(browser, out)
    page.click('.bar[data-id="get"]')
    rows = page.eval_on_selector_all("#detail table.network tr", "rs => rs.map(r => r.innerText.split('\\t'))")
    assert rows == [["pypi.org:443", "allowed", "1,200 B out, 45,000 B in"],
                    [f"{hostile}:80", "refused (not-listed)", "0 B out, 0 B in"]], rows
    assert page.evaluate("window.pwned === undefined") and page.evaluate("document.querySelectorAll('img').length") == 0
    assert errors == [] and requests == [out.as_uri()]
    page.close()


def test_a_samples_report_lists_each_samples_connections_as_text(browser, tmp_path: Path) -> None:
    """``exec --jsonl --allow-net``: a listed sample's row holds its connections, as text."""
    hostile = "<img src=x onerror=window.pwned=1>"
    network = [{"host": "pypi.org", "port": 443, "verdict": "allowed", "why": ""},
               {"host": hostile, "port": 80, "verdict": "refused", "why": "not-listed"}]
    rows = [{"id": "net", "status": "error", "exit_code": 1, "stdout": "", "stderr": "HTTP Error 403\n",
             "duration_s": 0.5, "message": "", "network": network},
            {"id": "plain", "status": "ok", "exit_code": 0, "stdout": "", "stderr": "", "duration_s": 0.1, "message": ""}]
    source = tmp_path / "results.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.html"
    assert agentloop(tmp_path, "view", str(source), "-o", str(out), "--no-open").returncode == 0
    page, errors, requests = _open(browser, out)
    listed = page.eval_on_selector_all('tr[data-id="net"] details.network', "ds => ds.map(d => d.textContent)")
    assert listed and listed[0] == f"network (2)pypi.org:443 allowed\n{hostile}:80 refused (not-listed)", listed
    assert page.evaluate("document.querySelectorAll('tr[data-id=\"plain\"] details.network').length") == 0
    assert page.evaluate("window.pwned === undefined") and page.evaluate("document.querySelectorAll('img').length") == 0
    assert errors == [] and requests == [out.as_uri()]
    page.close()
