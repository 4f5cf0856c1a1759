"""Pictures come back: figures, images and rich representations a block displays reach the model.

Real workers plot with matplotlib and display Pillow images and objects with ``_repr_svg_`` and
``_repr_html_``; the scripted model server stands in for a vision model (the PNGs arrive as
``image_url`` parts of a user message) and for a text-only one (each image is a line naming a
file that exists).  Nothing here mocks the worker, the channel or the server.
"""

from __future__ import annotations

import asyncio
import base64
import re
import struct
from pathlib import Path

import pytest

from engine.agent import AgentDisplay, run_task
from engine.models import ModelConfig, ModelRegistry
from engine.scripted import ScriptedServer
from engine.scripted._flavours import like_llama_server, like_ollama
from engine.workers import Engine
from worker.contract.display import png_size
from worker.contract.limits import MAX_DISPLAYS

pytest.importorskip("matplotlib")
pytest.importorskip("PIL")

PLOTS = '''
import matplotlib.pyplot as plt
from PIL import Image
plt.plot([1, 2, 3], [1, 4, 9])
print("plotted")
plt.show()
display(Image.new("RGB", (64, 32), (200, 30, 30)))
class Rich:
    def _repr_svg_(self):
        return '<svg xmlns="http://www.w3.org/2000/svg" width="20" height="10"><rect width="20" height="10"/></svg>'
    def _repr_html_(self):
        return "<b>bold</b>"
display(Rich())
plt.figure()
plt.bar([1, 2], [3, 4])
print("left open")
'''

IMAGE_LINE = re.compile(r"\[image (\d+)×(\d+) PNG: (\S+)\]")


def models(url: str, **config) -> ModelRegistry:
    return ModelRegistry({"default": ModelConfig(alias="default", base_url=url, model="scripted", timeout=30,
                                                 **config)}, "default")


def user_parts(body: dict) -> list[dict]:
    """The parts of a request's last user message (a plain string as one text part)."""
    content = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def texts(body: dict) -> str:
    return "".join(p.get("text", "") for p in user_parts(body) if p["type"] == "text")


def images(body: dict) -> list[bytes]:
    found = []
    for m in body["messages"]:
        for part in m["content"] if isinstance(m["content"], list) else ():
            if part["type"] == "image_url":
                url = part["image_url"]["url"]
                assert url.startswith("data:image/png;base64,"), url[:40]
                found.append(base64.b64decode(url.split(",", 1)[1]))
    return found


class Events(AgentDisplay):
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def event(self, type, **fields):
        self.seen.append((type, fields))


async def test_a_vision_model_receives_the_pngs_as_image_parts(engine: Engine):
    task = "plot for a vision model"
    events = Events()
    with ScriptedServer({task: [f'<run_code id="fig">\n{PLOTS}</run_code>', "I see a curve and bars."]}) as server:
        result = await run_task(task, models=models(server.url, vision=True), engine=engine, display=events)
    assert result.status == "answered", result
    second = server.requests[1]
    pngs = images(second)
    # plt.show()'s figure, the Pillow image, and the figure left open, shown when the block ended.
    assert len(pngs) == 3, texts(second)
    sizes = [png_size(p) for p in pngs]
    assert sizes[1] == (64, 32) and all(w > 100 and h > 100 for w, h in (sizes[0], sizes[2])), sizes
    text = texts(second)
    lines = IMAGE_LINE.findall(text)
    assert [(int(w), int(h)) for w, h, _ in lines] == [sizes[0], sizes[1], sizes[2]], text
    assert re.search(r"\[image SVG, 1 KiB: \S+\.svg\]", text), text
    assert text.index("plotted") < text.index("left open") < text.index("[image"), text
    # The parts follow the text they belong to, in one user message (the last).
    kinds = [p["type"] for p in user_parts(second)]
    assert kinds[0] == "text" and kinds.count("image_url") == 3, kinds
    # The live display got one event per display, each with what a viewer shows.
    shown = [f for t, f in events.seen if t == "display"]
    assert [f["index"] for f in shown] == [1, 2, 3, 4]
    assert shown[0]["png"] and shown[2]["svg"].startswith("<svg") and shown[2]["html"] == "<b>bold</b>"


async def test_a_text_only_model_gets_one_line_per_image_naming_a_file_that_exists(engine: Engine):
    task = "plot for a text model"
    found: list[tuple[str, bool, bytes]] = []

    def look(body: dict) -> str:
        for w, h, path in IMAGE_LINE.findall(texts(body)):
            data = Path(path).read_bytes() if Path(path).is_file() else b""
            found.append((f"{w}x{h}", Path(path).is_file(), data[:8]))
        return "seen"

    # llama-server without a projector: /props says no vision, and an image would be a 500.
    with like_llama_server({task: [f'<run_code id="fig">\n{PLOTS}</run_code>', look]}) as server:
        result = await run_task(task, models=models(server.url), engine=engine)
    assert result.status == "answered" and result.answer == "seen", result
    assert not images(server.requests[1])
    assert len(found) == 3 and all(exists and head == b"\x89PNG\r\n\x1a\n" for _, exists, head in found), found
    assert found[1][0] == "64x32"
    text = texts(server.requests[1])
    assert "<__main__.Rich object" not in text  # an image's text is its line


@pytest.mark.parametrize("flavour", ["llama-server", "ollama"])
async def test_vision_is_learned_from_the_server(engine: Engine, flavour: str):
    task = f"a picture, {flavour}"
    code = '<run_code>\nfrom PIL import Image\nImage.new("L", (8, 8)).show()\n</run_code>'
    make = (lambda s: like_llama_server(s, vision=True)) if flavour == "llama-server" else \
        (lambda s: like_ollama(s, capabilities=("completion", "vision")))
    with make({task: [code, "a black square"]}) as server:
        result = await run_task(task, models=models(server.url), engine=engine)
    assert result.status == "answered", result
    assert [png_size(p) for p in images(server.requests[1])] == [(8, 8)]


async def test_tool_results_carry_their_images_in_the_user_message_after_them(engine: Engine):
    task = "plot with tools"
    call = {"content": "", "tool_calls": [{"id": "c1", "name": "run_code",
                                           "arguments": {"code": "from PIL import Image\n"
                                                                 "display(Image.new('RGB', (5, 7)))\nprint('ok')"}}]}
    with ScriptedServer({task: [call, "a tiny image"]}) as server:
        result = await run_task(task, models=models(server.url, vision=True, protocol="tools"), engine=engine)
    assert result.status == "answered", result
    messages = server.requests[1]["messages"]
    tool = next(m for m in messages if m["role"] == "tool")
    assert isinstance(tool["content"], str) and IMAGE_LINE.search(tool["content"]), tool
    after = messages[messages.index(tool) + 1]
    assert after["role"] == "user" and [png_size(p) for p in images({"messages": [after]})] == [(5, 7)]
    # (and the conftest checks every request against the rules strict servers hold to)


async def test_an_endpoint_that_refuses_images_is_asked_again_without_them(engine: Engine):
    task = "refused pictures"
    code = '<run_code>\nfrom PIL import Image\ndisplay(Image.new("RGB", (3, 3)))\n</run_code>'
    events = Events()
    with like_llama_server({task: [code, "fine", "again"]}) as server:  # no projector: 500 for images
        result = await run_task(task, models=models(server.url, vision=True), engine=engine, display=events)
    assert result.status == "answered" and result.answer == "fine", result
    statuses = [r.status for r in server.received if r.turn == 1]
    assert statuses[0] == 500 and statuses[-1] == 200, statuses
    assert not images(server.requests[-1]) and IMAGE_LINE.search(texts(server.requests[-1]))
    assert any(t == "note" and "refused images" in f["message"] for t, f in events.seen)


async def test_an_image_over_the_bound_is_refused_in_words_and_the_coordinator_stays_flat(worker):
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: measure this test alone
    except OSError as exc:
        pytest.skip(f"cannot reset this process's peak memory (VmHWM) to measure: {exc}")
    baseline = _status_kib("VmRSS")
    code = ("import os\nfrom PIL import Image\n"
            "def noise(side):\n    return Image.frombytes('RGB', (side, side), os.urandom(side * side * 3))\n"
            "for i in range(3):\n    display(noise(1400))\n"  # about 5.6 MiB of PNG each: refused
            "for i in range(20):\n    display(noise(1080))\n"  # about 3.3 MiB each: kept, as files
            "print('after')\n")
    result = await worker.run(code, timeout=120)
    rise_mib = (_status_kib("VmHWM") - baseline) / 1024
    print(f"coordinator VmHWM rise while a block displayed 20 images of 3.3 MiB: {rise_mib:.1f} MiB")
    assert result.ok, result
    refusals = re.findall(r"display\(\): an image/png of [\d.]+ MiB was not shown: over the limit of 4\.0 MiB "
                          r"an image", result.output)
    assert len(refusals) == 3 and "after" in result.output, result.output
    # The refused ones still show their text (Jupyter's rule: the other types still go).
    assert [s.png is None for s in result.displays] == [True] * 3 + [False] * 20
    assert all(Path(s.png).stat().st_size > 3 << 20 for s in result.displays[3:])
    assert rise_mib < 40, f"the coordinator grew by {rise_mib:.0f} MiB"


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


async def test_displays_beyond_the_limit_are_said_and_dropped(worker):
    result = await worker.run(f"for i in range({MAX_DISPLAYS + 5}):\n    display(i)\n", timeout=30)
    assert result.ok and len(result.displays) == MAX_DISPLAYS, result
    assert f"reached the limit of {MAX_DISPLAYS} displays" in result.output
    assert [s.text for s in result.displays[:3]] == ["0", "1", "2"]


async def test_concurrent_blocks_show_their_own_figures(worker):
    code = ("import matplotlib.pyplot as plt, time\nfig = plt.figure(figsize=({w}, 2))\n"
            "fig.add_subplot().plot([1, 2])\ntime.sleep(0.3)\n")
    wide, narrow = await asyncio.gather(worker.run(code.format(w=8), timeout=60),
                                        worker.run(code.format(w=3), timeout=60))
    assert wide.ok and narrow.ok, (wide, narrow)
    assert len(wide.displays) == 1 and len(narrow.displays) == 1, (wide.displays, narrow.displays)
    assert wide.displays[0].width > narrow.displays[0].width


async def test_matplotlib_is_imported_only_by_the_code_and_a_figure_shown_once(worker):
    result = await worker.run("import sys\nprint('matplotlib' in sys.modules, 'PIL' in sys.modules)", timeout=30)
    assert result.output == "False False\n", result
    code = ("import matplotlib\nprint(matplotlib.get_backend())\nimport matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots()\nax.plot([3, 1])\ndisplay(fig)\n")
    result = await worker.run(code, timeout=60)
    assert result.output == "module://worker.mpl_backend\n" and len(result.displays) == 1, result
    # An empty figure shows nothing; plt.show() closed everything it showed.
    result = await worker.run("plt.figure()\nplt.show()\nprint(len(plt.get_fignums()))", timeout=30)
    assert result.output == "0\n" and not result.displays, result
    # A figure displayed and drawn on afterwards is shown again when the block ends.
    result = await worker.run("fig, ax = plt.subplots()\nax.plot([1, 2])\ndisplay(fig)\nax.plot([2, 1])", timeout=30)
    assert len(result.displays) == 2, result


async def test_a_python_the_code_starts_plots_as_python_does(worker):
    """The worker's backend is set inside the worker, not by an environment variable a child
    would inherit (and whose module a child Python may not find)."""
    code = ("import os, subprocess, sys\nprint(os.environ.get('MPLBACKEND'))\n"
            "subprocess.run([sys.executable, '-c', 'import matplotlib.pyplot as plt; plt.plot([1]); "
            "plt.savefig(\"c.png\"); print(plt.get_backend())'], cwd=os.environ['TMPDIR'], check=True)\n")
    result = await worker.run(code, timeout=60)
    assert result.ok, result
    assert result.output.splitlines() == ["None", "agg"] and not result.displays, result.output


def _ihdr(width: int, height: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height)


def test_png_size_reads_the_header_only_and_bounds_it():
    assert png_size(_ihdr(640, 480) + b"\x08\x06\x00\x00\x00") == (640, 480)
    assert png_size(_ihdr(0, 5)) is None and png_size(_ihdr(40000, 5)) is None
    assert png_size(b"GIF89a" + bytes(30)) is None and png_size(_ihdr(3, 3)[:20]) is None
    assert png_size(_ihdr(3, 3).replace(b"IHDR", b"IDAT")) is None


def _part(width: int, height: int) -> dict:
    data = _ihdr(width, height) + b"\x08\x02\x00\x00\x00"
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def test_images_count_in_the_context_estimate_at_the_servers_rate_or_conservatively():
    from engine.models import Chat
    from engine.models._images import DEFAULT_IMAGE_TOKENS, image_tokens, keep_last_images

    assert image_tokens(_part(640, 480), openai=True) == 85 + 170 * 2  # two 512-pixel tiles
    assert image_tokens(_part(4096, 4096), openai=True) == 85 + 170 * 4  # 2048, then 768 a side
    assert image_tokens(_part(640, 480), openai=False) == DEFAULT_IMAGE_TOKENS
    messages = [{"role": "user", "content": [{"type": "text", "text": "abc"}, _part(640, 480)]}]
    elsewhere = Chat("s", ModelConfig(alias="a", base_url="http://127.0.0.1:1/v1", model="m"))
    openai = Chat("s", ModelConfig(alias="a", base_url="https://api.openai.com/v1", model="m"))
    assert elsewhere._chars(messages) == 3 + 3 * DEFAULT_IMAGE_TOKENS  # not the base64's length
    assert openai._chars(messages) == 3 + 3 * 425
    history = [{"role": "user", "content": [_part(8, 8), _part(8, 8)]} for _ in range(10)]
    assert keep_last_images(history, 16) == 4
    assert sum(p["type"] == "image_url" for m in history for p in m["content"]) == 16
    assert history[0]["content"][0]["type"] == "text" and history[-1]["content"][1]["type"] == "image_url"


def test_a_strict_server_refuses_images_outside_user_messages():
    from engine.scripted._sequence import sequence_problems

    part = _part(2, 2)
    ok = [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    assert sequence_problems(ok) == []
    bad = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function"}]},
           {"role": "tool", "tool_call_id": "c", "content": [part]}]
    assert sequence_problems(bad) == ["message 1: an image in a 'tool' message (images go in user messages)"]
