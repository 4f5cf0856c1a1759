"""Where code may write, said once and kept the same; and what a run leaves behind (nothing but
what the code wrote, unless asked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.scripted import ScriptedServer

AGENTLOOP = [sys.executable, "-m", "engine.cli"]


def _agentloop(cwd: Path, state: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "XDG_STATE_HOME": str(state), **env})


def test_exec_says_where_code_may_write_after_a_refused_write(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "w.py").write_text("open('files/ok.txt', 'w').write('ok')\nopen('out.txt', 'w')\n")
    proc = _agentloop(project, tmp_path / "state", "exec", "w.py")
    assert proc.returncode == 1
    assert "Read-only file system: 'out.txt'" in proc.stderr
    assert proc.stderr.rstrip().endswith("agentloop: note: in this sandbox code writes only to the workspace "
                                         "(./files) and $TMPDIR; the rest is read-only")
    assert (project / "files" / "ok.txt").read_text() == "ok"  # what was written stays


def test_no_litter_an_empty_files_directory_and_the_outputs_go(tmp_path):
    project, state = tmp_path / "project", tmp_path / "state"
    project.mkdir()
    (project / "big.py").write_text("for i in range(50_000): print('x' * 100)\n")  # 5 MB: spills to a file
    proc = _agentloop(project, state, "exec", "--json", "big.py")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["output_file"] is None
    assert sorted(os.listdir(project)) == ["big.py"]  # no ./files: nothing was written there
    assert not any((state / "agentloop" / "runs").iterdir())
    # Asked to keep it: the file stays, is named, and a later start does not clean it away.
    proc = _agentloop(project, state, "exec", "--keep-output", "--json", "big.py")
    kept = json.loads(proc.stdout.splitlines()[-1])["output_file"]
    assert kept and os.path.getsize(kept) > 4_000_000 and f"the whole output is in {kept}" in proc.stderr
    _agentloop(project, state, "exec", "big.py")
    assert os.path.exists(kept)


def test_the_system_prompt_and_a_refused_write_name_the_same_places(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    script = {"*": ["<run_code>\nopen('here.txt', 'w')\n</run_code>", "done"]}
    with ScriptedServer(script) as server:
        proc = _agentloop(project, tmp_path / "state", "run", "write", "-q", LLM_URL=server.url)
        system = server.requests[0]["messages"][0]["content"]
        result = server.requests[1]["messages"][-1]["content"]
    assert proc.returncode == 0, proc.stderr
    files = next(line for line in system.splitlines() if line.startswith("Files: "))
    place = files.removeprefix("Files: ")
    assert place == f"the current directory {project} is read-only; write in ./files ({project}/files) and $TMPDIR"
    assert "Read-only file system" in result and f"[note: {place}]" in result


def test_batch_runs_have_files_too(tmp_path):
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "a", "task": "write"}) + "\n")
    code = "import os\nopen('files/r.txt', 'w').write('r')\nprint(sorted(os.listdir('.')))"
    with ScriptedServer({"*": [f"<run_code>\n{code}\n</run_code>", "done"]}) as server:
        proc = _agentloop(tmp_path, tmp_path / "state", "batch", "tasks.jsonl", "-o", "out.jsonl",
                          "--progress", "none", LLM_URL=server.url)
        system = server.requests[0]["messages"][0]["content"]
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert (Path(record["workspace"]) / "files" / "r.txt").read_text() == "r"
    assert "Files: write in the current directory" in system and "./files is there too" in system
