"""The integrations against the code they run: smolagents' executor holds nothing a worker names.

``AgentloopExecutor`` answers host calls from the step's code in the agent's own process; the
code can call them under any block id it likes (the id travels with the call).  Each attack runs
a real sandboxed worker and measures what the host process keeps afterwards.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("smolagents", reason="the smolagents extra is not installed (scripts/test installs it)")

from engine.errors import CodeFailed  # noqa: E402
from engine.integrations.smolagents import AgentloopExecutor  # noqa: E402

pytestmark = pytest.mark.attack

#: Megabytes the attack sends under forged ids; the host may keep a small fraction at most.
FORGED_MB = 200

#: Step code: the last-value and final-answer host calls, each under a block id of its own
#: choosing, FORGED_MB times with a megabyte each.
FORGE = f'''
import sys
current_block = sys.modules["worker.capture"].current_block
payload = "x" * (1 << 20)
refused = 0
for i in range({FORGED_MB} // 2):
    token = current_block.set(f"forged{{i}}")
    try:
        for call in (_agentloop_last_value, final_answer):
            try:
                call(payload)
            except Exception as exc:
                refused += "running" in str(exc)
    finally:
        current_block.reset(token)
print("refused", refused)
'''


def test_forged_block_ids_leave_nothing_in_the_host(tmp_path: Path):
    executor = AgentloopExecutor(workspace=tmp_path / "files", cwd=tmp_path, state_dir=tmp_path / "state",
                                 timeout="120s")
    try:
        executor.send_tools({})
        assert executor("x = 1").logs == ""  # warm: the first step's own allocations are not the attack's
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            out = executor(FORGE)
            gc.collect()
            kept_mb = (tracemalloc.get_traced_memory()[0] - before) / 2**20
        finally:
            tracemalloc.stop()
        print(f"host memory kept after {FORGED_MB} MB sent under forged ids: {kept_mb:.1f} MB")
        assert not out.is_final_answer  # a final answer under another id does not end this step
        assert f"refused {FORGED_MB}" in out.logs, out.logs
        assert kept_mb < FORGED_MB / 10, f"the host kept {kept_mb:.0f} MB of what the worker sent"
        # The step's own calls still work: its last value and its final answer.
        assert executor("6 * 7").output == "42"
        answer = executor("final_answer(41 + 1)")
        assert answer.is_final_answer and answer.output == 42
        with pytest.raises(CodeFailed, match="ZeroDivisionError"):
            executor("1 / 0")
    finally:
        executor.cleanup()
