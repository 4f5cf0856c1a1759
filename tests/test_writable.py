"""Where code may write, said once and kept the same; and what a run leaves behind (nothing but
what the code wrote, unless asked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.scripted import ScriptedServer

AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]


def _agentloop(cwd: Path, state: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENTLOOP, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "XDG_STATE_HOME": str(state), **env})


def test_exec_leaves_nothing_of_its_own(tmp_path):
    # A script that writes nothing leaves the directory as it was: no ./files, no output files
    # (its output went where it was sent), nothing in agentloop's state.
    project, state = tmp_path / "project", tmp_path / "state"
    project.mkdir()
    (project / "big.py").write_text("for i in range(50_000): print('x' * 100)\n")
    for mode in ("--write-cwd", "--read-only"):
        proc = _agentloop(project, state, "exec", mode, "big.py")
        assert proc.returncode == 0 and len(proc.stdout) == 50_000 * 101, proc.stderr
        assert sorted(os.listdir(project)) == ["big.py"]
    assert not (state / "agentloop" / "runs").exists() or not any((state / "agentloop" / "runs").iterdir())


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


def test_run_with_write_cwd_writes_the_current_directory_as_the_user(tmp_path):
    # The flag the other way: model code writes the project (not its .git), as the user, and the
    # directory's owner and mode stay as they were.
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "config").write_text("[core]\n")
    before = project.stat()
    code = ("import os\nopen('made.txt', 'w').write('m')\n"
            "try:\n    open('.git/config', 'a').write('evil')\nexcept OSError as e:\n    print('git', e.errno)\n")
    script = {"*": [f"<run_code>\n{code}\n</run_code>", "done"]}
    with ScriptedServer(script) as server:
        proc = _agentloop(project, tmp_path / "state", "run", "write", "-q", "--write-cwd", LLM_URL=server.url)
        system = server.requests[0]["messages"][0]["content"]
        result = server.requests[1]["messages"][-1]["content"]
    assert proc.returncode == 0, proc.stderr
    assert f"Files: write in the current directory {project} (the workspace) and $TMPDIR" in system
    assert "git 30" in result  # EROFS
    assert (project / "made.txt").read_text() == "m" and (project / "made.txt").stat().st_uid == os.geteuid()
    assert (project / ".git" / "config").read_text() == "[core]\n"
    after = project.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)
    assert sorted(os.listdir(project)) == [".git", "made.txt"]


def test_a_workspace_of_model_code_gets_its_group_and_mode_back(tmp_path):
    # As root, model code runs under a uid of the run's and the workspace is shared with it
    # (group, mode 3770) while the run lasts; the user's directory does not keep that after it.
    workspace = tmp_path / "project"
    workspace.mkdir(mode=0o750)
    before = workspace.stat()
    code = f"open({str(workspace / 'made.txt')!r}, 'w').write('m')\n"
    script = {"*": [f"<run_code>\n{code}\n</run_code>", "done"]}
    with ScriptedServer(script) as server:
        proc = _agentloop(tmp_path, tmp_path / "state", "run", "write", "-q", "--workspace", str(workspace),
                          LLM_URL=server.url)
        result = server.requests[1]["messages"][-1]["content"]
    assert proc.returncode == 0, proc.stderr
    assert (workspace / "made.txt").read_text() == "m", result
    after = workspace.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid), result


def test_one_table_in_the_manual_and_the_same_words_in_help():
    # Where code may write is said once: --help of every command that has the flag and the
    # table of docs/worker-options.md use the same words, and each command says its own default.
    from engine.cli.options import WRITE_HELP

    readme = (Path(__file__).resolve().parent.parent / "docs" / "worker-options.md").read_text()
    cells = [part.split(":", 1)[1].strip().rstrip(".") for part in WRITE_HELP.split("  ")
             if part.startswith(("--write-cwd:", "--read-only:"))]
    writes_cwd = cells[0].split("; code runs as")[0]
    assert f"| `--write-cwd` | {writes_cwd} |" in readme
    assert f"| `--read-only` | {cells[1]} |" in readme
    for command, default in (("exec", "--write-cwd"), ("run", "--read-only"), ("chat", "--read-only")):
        out = subprocess.run([*AGENTLOOP, command, "--help"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "1000"}).stdout
        assert " ".join(WRITE_HELP.split()) in " ".join(out.split()), command
        assert f"Default: {default}." in out, command
