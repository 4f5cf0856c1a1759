"""``--allow-net`` through the real start path: a worker of a real Engine (cold and forked),
``exec FILE`` and the command line, reaching a package index the test builds on 127.0.0.2 and
nothing else.  Every server listens on the host's loopback only (``tests.net_servers``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.launch import WorkerSettings
from engine.sandbox import host_support
from engine.workers import Engine
from tests.net_servers import ALLOWED, Index

pytestmark = pytest.mark.skipif(host_support().bwrap is None, reason="--allow-net needs bubblewrap")

AGENTLOOP = [sys.executable, "-m", "engine.cli"]

#: A block that installs the test's wheel from the index at URL (pip's own variables: the
#: worker's environment only).
PIP = '''
import re, subprocess, sys
done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                       "--no-input", "--retries", "0", "--timeout", "20", "-vv", "--index-url", URL,
                       "--trusted-host", HOST, "--target", "/tmp/site", "egresstest"],
                      capture_output=True, text=True, timeout=180)
# (a status, not a port: the index's port may well contain the digits 403)
said = [line for line in (done.stdout + done.stderr).splitlines() if re.search(r"\\b403\\b|allow-net", line)]
print("pip rc", done.returncode, said[-1:] if said else "")
sys.path.insert(0, "/tmp/site")
try:
    import egresstest
    print("installed", egresstest.INSTALLED)
except ImportError as exc:
    print("not installed", type(exc).__name__)
'''


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    tmp_path.chmod(0o755)  # (a root coordinator's workers run as another uid)
    return tmp_path, tmp_path / "files"


def pip_block(index: Index) -> str:
    return f"URL = {index.url!r}; HOST = {index.address!r}\n" + PIP


@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "cold"])
async def test_a_block_installs_from_a_listed_index(tmp_path, index, canaries, fork_server):
    cwd, workspace = _dirs(tmp_path)
    settings = WorkerSettings(allow_net=[index.address], fork_server=fork_server)
    async with Engine(settings, cwd=cwd, workspace=workspace) as engine:
        worker = await engine.start_worker("main")
        result = await worker.run(pip_block(index), timeout=150)
        assert result.status == "ok", result.error
        assert "pip rc 0" in result.output and "installed egresstest" in result.output, result.output
        env = await worker.run("import os; print(os.environ['HTTPS_PROXY'], os.environ['NO_PROXY'])")
        assert env.output.strip() == "http://127.0.0.1:3128 localhost,127.0.0.1,::1"
        # A direct connection, past the proxy variables, goes nowhere: the namespace is empty.
        direct = await worker.run(f"import socket\ntry:\n    socket.create_connection(({ALLOWED!r}, {index.port}), 5)\n"
                                  "except OSError as exc:\n    print('direct', type(exc).__name__)\n")
        assert direct.output.startswith("direct "), direct.output
        sock_dir = worker._session.sock_dir
        live = engine.launcher.gates.gate(sock_dir).records
    assert [path for _, path, _ in index.requests] == ["/simple/egresstest/", f"/files/{index.wheel_name}"]
    assert [r.verdict for r in live] == ["allowed", "allowed"]
    recorded = engine.launcher.gates.records
    assert [(r["host"], r["port"], r["verdict"], r["process"]) for r in recorded] == \
        [(ALLOWED, index.port, "allowed", sock_dir.name)] * 2
    assert all(r["sent"] > 0 and r["received"] > 0 for r in recorded)


async def test_without_the_entry_the_install_fails_and_the_index_sees_nothing(tmp_path, index, canaries):
    cwd, workspace = _dirs(tmp_path)
    async with Engine(WorkerSettings(allow_net=[f"{ALLOWED}:{index.port + 1}"]), cwd=cwd, workspace=workspace) as engine:
        worker = await engine.start_worker("main")
        result = await worker.run(pip_block(index), timeout=150)
    assert "not installed" in result.output, result.output
    assert f"--allow-net {index.address}" in result.output, result.output
    assert index.requests == []
    assert engine.launcher.gates.records and {r["why"] for r in engine.launcher.gates.records} == {"port"}


async def test_without_an_allowlist_there_is_no_gate_and_no_proxy(tmp_path):
    cwd, workspace = _dirs(tmp_path)
    async with Engine(cwd=cwd, workspace=workspace) as engine:
        worker = await engine.start_worker("main")
        result = await worker.run("import os; print(sorted(k for k in os.environ if 'proxy' in k.lower()))")
        listing = sorted(p.name for p in worker._session.sock_dir.iterdir())
    assert result.output.strip() == "[]"
    assert engine.launcher.gates is None and "egress.sock" not in listing


def test_settings_refuse_network_with_an_allowlist():
    from engine.sandbox import SandboxPolicy

    with pytest.raises(ConfigError, match="--allow-net and --network together"):
        WorkerSettings(sandbox=SandboxPolicy(network=True), allow_net=["pypi.org"])
    with pytest.raises(ConfigError, match="needs the bubblewrap sandbox"):
        WorkerSettings(sandbox=SandboxPolicy(mode="none"), allow_net=["pypi.org"])
    with pytest.raises(ConfigError, match=r"\*\.com would allow a whole top-level domain"):
        WorkerSettings(allow_net=["*.com"])
    assert WorkerSettings(allow_net=["PyPI.org.", "pypi.org"]).allow_net.texts() == ["pypi.org"]


def agentloop(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    state = cwd.parent / f"{cwd.name}-state"  # (beside the directory a script writes, never in it)
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_the_command_line_says_what_is_wrong(tmp_path):
    (tmp_path / "p.py").write_text("print(1)\n")
    both = agentloop(tmp_path, "exec", "--network", "--allow-net", "pypi.org", "p.py")
    assert both.returncode == 125 and "--allow-net and --network together" in both.stderr, both.stderr
    bad = agentloop(tmp_path, "exec", "--allow-net", "*.com", "p.py")
    assert bad.returncode == 125 and "would allow a whole top-level domain" in bad.stderr, bad.stderr
    (tmp_path / "agentloop.toml").write_text('[network]\nallow = ["exa mple.com"]\n')
    filed = agentloop(tmp_path, "exec", "p.py")
    assert filed.returncode == 125 and "agentloop.toml: network.allow 'exa mple.com'" in filed.stderr, filed.stderr
    (tmp_path / "agentloop.toml").write_text('[network]\nallowed = ["pypi.org"]\n')
    typo = agentloop(tmp_path, "exec", "p.py")
    assert typo.returncode == 125 and "network must be a table holding only allow" in typo.stderr, typo.stderr


def test_exec_installs_from_a_listed_index(tmp_path, index, canaries):
    cwd, _ = _dirs(tmp_path)
    (cwd / "install.py").write_text(pip_block(index))
    # The file's entry names another port: refused, in words naming the entry that would do.
    (cwd / "agentloop.toml").write_text(f'[network]\nallow = ["{ALLOWED}:{index.port + 1}"]\n')
    refused = agentloop(cwd, "exec", "install.py")
    assert "not installed" in refused.stdout and f"--allow-net {index.address}" in refused.stdout, refused.stdout
    assert index.requests == []
    done = agentloop(cwd, "exec", "--allow-net", index.address, "install.py")  # (joins the file's)
    assert done.returncode == 0, done.stderr
    assert "pip rc 0" in done.stdout and "installed egresstest" in done.stdout, done.stdout
    assert len(index.requests) == 2


def test_exec_json_lists_the_connections(tmp_path, index, canaries):
    cwd, _ = _dirs(tmp_path)
    (cwd / "get.py").write_text(f"import urllib.request\nprint(urllib.request.urlopen({index.url + 'egresstest/'!r}, "
                                "timeout=20).status)\n")
    done = agentloop(cwd, "exec", "--json", "--allow-net", index.address, "get.py")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(c["host"], c["port"], c["verdict"]) for c in report["network"]] == [(ALLOWED, index.port, "allowed")]


def test_a_run_block_installs_from_a_listed_index(tmp_path, index, canaries):
    """``agentloop run --allow-net``: the model's block installs the package, the answer says so,
    and each connection is in the recording, refused ones on the console too."""
    from engine.agent._display import read_recording
    from engine.scripted import ScriptedServer

    cwd, _ = _dirs(tmp_path)
    refused = f"http://{ALLOWED}:{index.port + 1}/"
    fetch = f"import urllib.request\ntry:\n    urllib.request.urlopen({refused!r}, timeout=10)\nexcept Exception as exc:\n    print(exc)\n"
    script = {"install": [f"<run_code>\n{pip_block(index)}\n{fetch}</run_code>",
                          lambda body: "done: " + ("yes" if "installed egresstest" in body["messages"][-1]["content"]
                                                   else "no")]}
    record = tmp_path.parent / f"{tmp_path.name}-run.jsonl"
    with ScriptedServer(script) as server:
        env = {**os.environ, "XDG_STATE_HOME": str(tmp_path.parent / f"{tmp_path.name}-state"), "LLM_URL": server.url}
        done = subprocess.run([*AGENTLOOP, "run", "install it", "--record", str(record), "--allow-net", index.address],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done: yes", done.stdout + done.stderr
    assert len(index.requests) == 2
    seen = [e for e in read_recording(record) if e["type"] == "connection"]
    assert [(e["host"], e["port"], e["verdict"]) for e in seen] == \
        [(ALLOWED, index.port, "allowed")] * 2 + [(ALLOWED, index.port + 1, "refused")]
    assert all(e["id"] == seen[0]["id"] and e["received"] > 0 for e in seen[:2])
    assert f"network refused: {ALLOWED}:{index.port + 1}" in done.stderr, done.stderr


def test_each_connection_is_an_event_of_its_block_span(tmp_path, index, canaries):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    pytest.importorskip("opentelemetry.proto", reason="the otel extra is not installed")
    from engine.scripted import ScriptedServer
    from tests.otlp_receiver import Receiver

    cwd, _ = _dirs(tmp_path)
    code = (f"import urllib.request\nprint(urllib.request.urlopen({index.url + 'egresstest/'!r}, timeout=10).status)\n"
            f"try:\n    urllib.request.urlopen('http://{ALLOWED}:{index.port + 1}/', timeout=10)\n"
            "except Exception as exc:\n    print(exc)\n")
    with Receiver() as rx, ScriptedServer({"fetch": [f"<run_code id=\"get\">\n{code}</run_code>", "fetched"]}) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({"XDG_STATE_HOME": str(tmp_path.parent / f"{tmp_path.name}-state"), "LLM_URL": server.url,
                    "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint})
        done = subprocess.run([*AGENTLOOP, "--trace", "run", "fetch", "-q", "--allow-net", index.address], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        assert rx.wait_for(lambda spans: any(s.name == "invoke_agent main" for s in spans))
    [block] = [s for s in rx.spans if s.name == "execute_tool run_code"]
    events = [attributes for name, attributes in block.events if name == "connection"]
    assert [(e["server.address"], e["server.port"], e["agentloop.network.verdict"]) for e in events] == \
        [(ALLOWED, index.port, "allowed"), (ALLOWED, index.port + 1, "refused")], block.events
    assert events[0]["agentloop.network.received_bytes"] > 0 and events[1]["agentloop.network.why"] == "port"


async def test_the_way_out_cannot_be_walked_around(tmp_path, index, canaries):
    """Attacks through the real wiring: variables ignored (curl --noproxy), an unlisted port of
    the listed host, the host spelt otherwise, another worker's socket, the forwarder killed."""
    cwd, workspace = _dirs(tmp_path)
    curl = "curl -s -o /dev/null -w '%{http_code}' --max-time 10"
    attack = f'''
import os, signal, subprocess, socket
def sh(cmd):
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or "rc " + str(done.returncode)
print("noproxy", sh("{curl} --noproxy '*' {index.url}"))
print("listed", sh("{curl} {index.url}egresstest/"))
print("port", sh("{curl} http://{ALLOWED}:{index.port + 1}/"))
print("spelt", sh("{curl} --noproxy '' http://2130706433:{index.port}/"))
print("loopback", sh("{curl} http://127.0.0.1:{index.port}/"))
print("host", sh("curl -s -o /dev/null -w '%{{http_connect}}' --max-time 10 https://pypi.org/"))
'''
    async with Engine(WorkerSettings(allow_net=[index.address]), cwd=cwd, workspace=workspace) as engine:
        one, two = await engine.start_worker("one"), await engine.start_worker("two")
        result = await one.run(attack, timeout=120)
        said = dict(line.split(" ", 1) for line in result.output.splitlines())
        # (127.0.0.1 is the sandbox's own loopback, in NO_PROXY: empty; 2130706433, sent through the
        # proxy, is that address and is refused)
        # (an unlisted name is refused before any lookup: the CONNECT's answer is 403)
        assert said == {"noproxy": "000", "listed": "200", "port": "403", "spelt": "403", "loopback": "000",
                        "host": "403"}, said
        # Another worker's gate is not in this sandbox: its socket directory is not shown.
        other = engine.launcher.gates.gate(two._session.sock_dir).path
        seen = await one.run(f"import os; print(os.path.exists({str(other)!r}))")
        assert seen.output.strip() == "False"
        # The forwarder killed (with every process but the worker's own: kill(-1); a plain user's
        # worker does not even see it in /proc): no network at all, never the host's.
        killed = await one.run(f'''
import os, signal, subprocess
os.kill(-1, signal.SIGKILL)
print(subprocess.run("{curl} {index.url}egresstest/", shell=True, capture_output=True, text=True).stdout)
''', timeout=60)
        assert killed.output.split() == ["000"], killed.output
        # The gate closed under a running worker (its sandbox's proxy gone): no network, no fallback.
        fetch = f"import subprocess\nprint(subprocess.run(\"{curl} {index.url}egresstest/\", shell=True, capture_output=True, text=True).stdout)"
        before = await two.run(fetch, timeout=60)
        await engine.launcher.gates.close(two._session.sock_dir)
        after = await two.run(fetch, timeout=60)
        assert (before.output.split(), after.output.split()) == (["200"], ["000"]), (before.output, after.output)
    assert len(index.requests) == 2  # the listed fetches alone


def test_doctor_says_whether_allowlisting_works(tmp_path):
    done = agentloop(tmp_path, "doctor")  # (exit 1 here: no model answers)
    assert "network by name (--allow-net): works (a worker reached a listed listener through its proxy)" \
        in done.stdout, done.stdout + done.stderr


def test_samples_install_from_a_listed_index_each_with_its_own_list(tmp_path, index, canaries):
    """``exec --jsonl --allow-net``: a sample installs from the index; one whose own ``allow_net``
    names another port is refused; each result lists its connections."""
    cwd, _ = _dirs(tmp_path)
    samples = cwd / "samples.jsonl"
    lines = [{"id": "pip", "code": pip_block(index), "timeout": 150},
             {"id": "own", "code": pip_block(index), "timeout": 150, "allow_net": [f"{ALLOWED}:{index.port + 1}"]}]
    samples.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = cwd.parent / f"{cwd.name}-results.jsonl"
    done = agentloop(cwd, "exec", "--jsonl", str(samples), "-o", str(out), "--parallel", "1", "--allow-net", index.address)
    assert done.returncode == 0, done.stderr
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "installed egresstest" in results["pip"]["stdout"], results["pip"]
    assert [(c["host"], c["port"], c["verdict"]) for c in results["pip"]["network"]] == \
        [(ALLOWED, index.port, "allowed")] * 2
    assert "not installed" in results["own"]["stdout"] and f"--allow-net {index.address}" in results["own"]["stdout"]
    assert {c["why"] for c in results["own"]["network"]} == {"port"}
    assert len(index.requests) == 2
    # A sample's own list needs the command's: without it, refused before anything runs.
    alone = agentloop(cwd, "exec", "--jsonl", str(samples), "-o", str(cwd.parent / f"{cwd.name}-2.jsonl"))
    assert alone.returncode == 125 and "line 2: allow_net needs the command's own allowlist" in alone.stderr, alone.stderr
    bad = cwd / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "code": "", "allow_net": ["*.com"]}) + "\n")
    refused = agentloop(cwd, "exec", "--jsonl", str(bad), "-o", str(cwd.parent / f"{cwd.name}-3.jsonl"))
    assert refused.returncode == 125 and "allow_net '*.com': *.com would allow a whole top-level domain" in refused.stderr, \
        refused.stderr


async def test_engine_map_samples_reach_only_their_list(tmp_path, index, canaries):
    from engine.samples import Sample

    cwd, workspace = _dirs(tmp_path)
    code = f"import urllib.request\nprint(urllib.request.urlopen({index.url + 'egresstest/'!r}, timeout=10).status)\n"
    async with Engine(WorkerSettings(allow_net=[index.address]), cwd=cwd, workspace=workspace) as engine:
        results = [r async for r in engine.map([Sample(1, code), Sample(2, code, allow_net=(f"{ALLOWED}:1",)),
                                                Sample(3, "import socket; socket.create_connection(('127.0.0.1', 3128))"
                                                          ".close(); print('forwarder there')")])]
    assert [r.status for r in results] == ["ok", "error", "ok"], [r.stderr[-300:] for r in results]
    assert [c["verdict"] for c in results[0].network] == ["allowed"]
    assert "HTTP Error 403" in results[1].stderr and [c["why"] for c in results[1].network] == ["port"]
    # (a connection that sent nothing is recorded, if the forwarder relayed it, as refused)
    assert results[2].stdout == "forwarder there\n" and all(c["verdict"] == "refused" for c in results[2].network)
    assert len(index.requests) == 1


def test_a_batch_task_reaches_what_its_own_line_lists(tmp_path, index, canaries):
    from engine.scripted import ScriptedServer

    cwd, _ = _dirs(tmp_path)
    reply = lambda body: "done: " + ("yes" if "installed egresstest" in body["messages"][-1]["content"] else "no")  # noqa: E731
    script = {"install": [f"<run_code>\n{pip_block(index)}\n</run_code>", reply]}
    tasks = cwd / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "listed", "task": "install", "allow_net": [index.address]}) + "\n"
                     + json.dumps({"id": "unlisted", "task": "install"}) + "\n")
    out = cwd.parent / f"{cwd.name}-batch.jsonl"
    with ScriptedServer(script) as server:
        env = {**os.environ, "XDG_STATE_HOME": str(cwd.parent / f"{cwd.name}-state"), "LLM_URL": server.url}
        done = subprocess.run([*AGENTLOOP, "batch", str(tasks), "-o", str(out), "--parallel", "1"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    answers = {r["id"]: r["answer"] for r in map(json.loads, out.read_text().splitlines())}
    assert answers == {"listed": "done: yes", "unlisted": "done: no"}, answers
    assert len(index.requests) == 2
    both = agentloop(cwd, "batch", str(tasks), "-o", str(cwd.parent / f"{cwd.name}-2.jsonl"), "--network")
    assert both.returncode == 125 and "line 1: allow_net and --network together" in both.stderr, both.stderr
