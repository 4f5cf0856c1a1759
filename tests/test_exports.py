"""The public surface is what we mean it to be, and the worker stays free of the coordinator."""

from __future__ import annotations

import subprocess
import sys

import engine


def test_engine_exports():
    assert sorted(engine.__all__) == sorted([
        "Agent", "AgentloopError", "BlockResult", "ConfigError", "Engine", "ModelError",
        "ModelResponseError", "ModelUnreachable", "OutputChunk", "RunResult", "SandboxError",
        "SandboxPolicy", "Worker", "WorkerClosed", "WorkerError", "WorkerStartError", "WorkerState",
        "make_agent", "run_task"])
    for name in engine.__all__:  # each is the thing itself, defined in the engine package
        assert getattr(engine, name).__module__.split(".")[0] == "engine", name


def test_worker_imports_nothing_from_engine():
    code = ("import sys, worker.serve, worker.fork_server, worker.slot, worker._confine, worker.proxy, "
            "worker.environment, worker.repo_tools, worker.tool_server, worker.egress\n"
            "print(sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_package_loads_its_names_on_first_use():
    # `import engine` (every command's first import) costs nothing of the agent loop: exec FILE
    # and --help start without httpx, rich or the model client.
    assert sorted(engine._WHERE) == sorted(engine.__all__)
    code = "import sys, engine.cli.exec\nprint(sorted(m for m in ('httpx', 'rich', 'engine.agent._loop', 'zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr
