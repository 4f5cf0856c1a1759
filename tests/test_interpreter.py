"""Workers run the user's Python: ``--python``, ``AGENTLOOP_PYTHON``, ``python`` in agentloop.toml,
the active virtual environment.  Each case runs the same script under that interpreter directly
and through ``agentloop exec``, and compares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from engine.scripted import ScriptedServer

AGENTLOOP = [sys.executable, "-P", "-m", "engine.cli"]
BASE_PYTHON = os.path.realpath(os.path.join(sys.base_prefix, "bin", "python3"))

SCRIPT = """\
import sys
import mylib
print(mylib.greet(sys.argv[1]), sys.prefix == sys.base_prefix)
"""


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    """A virtual environment of the user's, without pyzmq or msgpack, holding a package of its
    own (``mylib``, installed as a distribution) that agentloop's environment does not have."""
    root = tmp_path_factory.mktemp("uservenv") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = next(root.glob("lib/python3*/site-packages"))
    (site / "mylib").mkdir()
    (site / "mylib" / "__init__.py").write_text("def greet(name):\n    return f'hello {name}'\n")
    dist = site / "mylib-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mylib\nVersion: 1.0\n")
    return root


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "AGENTLOOP_PYTHON")}
    return {**env, **extra}  # (agentloop's state: the session's, never in the directory exec writes)


def _both(tmp_path: Path, python: str, *options: str, **env: str):
    script = tmp_path / "greet.py"
    script.write_text(SCRIPT)
    direct = subprocess.run([python, str(script), "Bob"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=60)
    ours = subprocess.run([*AGENTLOOP, "exec", *options, str(script), "Bob"], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(tmp_path, **env), timeout=120)
    return direct, ours


def test_python_option_runs_the_users_venv_as_python_does(tmp_path, user_venv):
    python = str(user_venv / "bin" / "python")
    direct, ours = _both(tmp_path, python, "--python", python)
    assert direct.returncode == 0 and direct.stdout == "hello Bob False\n", direct.stderr
    assert (ours.stdout, ours.returncode) == (direct.stdout, 0), ours.stderr


def test_the_active_virtual_environment_is_the_default(tmp_path, user_venv):
    direct, ours = _both(tmp_path, str(user_venv / "bin" / "python"), VIRTUAL_ENV=str(user_venv))
    assert (ours.stdout, ours.returncode) == (direct.stdout, 0), ours.stderr


def test_agentloop_python_and_the_toml_choose_too(tmp_path, user_venv):
    # Relative to the file that names it.  (Written before exec writes the directory: one written
    # while, or just as, a script could write there is refused, see test_trust.)
    (tmp_path / "agentloop.toml").write_text(f'python = "{os.path.relpath(user_venv / "bin" / "python", tmp_path)}"\n')
    direct, ours = _both(tmp_path, str(user_venv / "bin" / "python"))
    assert (ours.stdout, ours.returncode) == (direct.stdout, 0), ours.stderr
    # AGENTLOOP_PYTHON wins over the file, --python over both: agentloop's own Python has no mylib.
    for options, env in (((), {"AGENTLOOP_PYTHON": sys.executable}),
                         (("--python", sys.executable), {"AGENTLOOP_PYTHON": str(user_venv / "bin" / "python")})):
        direct, ours = _both(tmp_path, sys.executable, *options, **env)
        assert "No module named 'mylib'" in direct.stderr and direct.returncode == 1
        assert ours.returncode == 1 and "No module named 'mylib'" in ours.stderr, ours.stderr


@pytest.mark.skipif(subprocess.run([BASE_PYTHON, "-c", "import numpy"], capture_output=True).returncode != 0,
                    reason="the base interpreter has no numpy")
def test_numpy_of_the_chosen_interpreter(tmp_path):
    script = tmp_path / "np.py"
    script.write_text("import numpy as np\nprint(np.arange(10).sum(), np.__name__)\n")
    direct = subprocess.run([BASE_PYTHON, str(script)], capture_output=True, text=True, timeout=60)
    ours = subprocess.run([*AGENTLOOP, "exec", "--python", BASE_PYTHON, str(script)], capture_output=True,
                          text=True, cwd=tmp_path, env=_env(tmp_path), timeout=120)
    assert (ours.stdout, ours.returncode) == (direct.stdout, 0) == ("45 numpy\n", 0), ours.stderr


@pytest.mark.parametrize("sandbox", ["auto", "landlock"])
def test_runtime_packages_come_from_agentloop_for_a_python_without_them(tmp_path, user_venv, sandbox):
    # The user's venv has neither pyzmq nor msgpack; the worker runs anyway, and its package
    # list (what the model is told is installed) is that venv's, without them.
    python = str(user_venv / "bin" / "python")
    code = tmp_path / "dists.py"
    code.write_text("from importlib import metadata\n"
                    "print(sorted(d.metadata['Name'] for d in metadata.distributions()))\n")
    ours = subprocess.run([*AGENTLOOP, "exec", "--sandbox", sandbox, "--python", python, str(code)],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path), timeout=120)
    direct = subprocess.run([python, str(code)], capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == direct.stdout and "'mylib'" in ours.stdout and "pyzmq" not in ours.stdout


def test_the_system_prompt_lists_the_chosen_interpreters_packages(tmp_path, user_venv):
    with ScriptedServer({"*": ["done"]}) as server:
        proc = subprocess.run([*AGENTLOOP, "run", "hello", "-q", "--python", str(user_venv / "bin" / "python")],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120,
                              env=_env(tmp_path, LLM_URL=server.url))
        system = server.requests[0]["messages"][0]["content"]
    assert proc.returncode == 0, proc.stderr
    listed = next(line for line in system.splitlines() if line.startswith("Top-level installed packages"))
    assert "mylib" in listed and "httpx" not in listed and "pyzmq" not in listed


def _samples(tmp_path: Path, code: str = "print(1)") -> list[str]:
    """``exec --jsonl`` of one sample, the command line up to its options (samples preload)."""
    (tmp_path / "s.jsonl").write_text(json.dumps({"id": "a", "code": code}) + "\n")
    return [*AGENTLOOP, "exec", "--jsonl", str(tmp_path / "s.jsonl"), "-o", str(tmp_path / "out.jsonl"),
            "--progress", "none"]


def test_a_bad_interpreter_or_preload_is_one_line(tmp_path):
    (tmp_path / "x.py").write_text("print(1)\n")
    for command, words in (([*AGENTLOOP, "exec", "--python", str(tmp_path / "nope"), str(tmp_path / "x.py")],
                            "is not an executable Python"),
                           ([*_samples(tmp_path), "--preload", "no_such_module_here"],
                            "no_such_module_here cannot be imported")):
        proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path), timeout=120)
        assert proc.returncode == 125 and words in proc.stderr.splitlines()[-1], proc.stderr
        assert "Traceback" not in proc.stderr  # (--jsonl says first what it is about to run)
    proc = subprocess.run([*_samples(tmp_path), "--preload", "json,decimal"], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["stdout"] == "1\n"


def test_a_preload_module_that_fails_as_it_is_imported_is_one_line(tmp_path, user_venv):
    # Importable (found) but raising at import: the fork server says so in one line.
    site = next(user_venv.glob("lib/python3*/site-packages"))
    (site / "breaks_on_import.py").write_text("raise RuntimeError('broken at import')\n")
    proc = subprocess.run([*_samples(tmp_path), "--python", str(user_venv / "bin" / "python"), "--preload",
                           "breaks_on_import"], capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path),
                          timeout=120)
    if "fork server" not in proc.stderr and proc.returncode == 0:
        pytest.skip("no fork server here: nothing preloads")
    assert proc.returncode == 125, proc.stderr
    assert "--preload breaks_on_import: importing it failed: RuntimeError: broken at import" in proc.stderr
    assert "Traceback" not in proc.stderr and "broken at import" in proc.stderr.splitlines()[-1]



#: Every command that reads ./agentloop.toml, with arguments it would otherwise run with.
READERS = [["models"], ["doctor"], ["exec", "x.py"], ["exec", "--jsonl", "s.jsonl", "-o", "r.jsonl"],
           ["run", "-q", "hi"], ["chat"], ["ask", "hi"], ["batch", "t.jsonl", "-o", "o.jsonl"], ["demo", "-q"],
           ["mcp"]]


@pytest.mark.parametrize(("config", "commands"), [
    ('python = "/usr/bin/python3"\n[models.a\n', READERS),                           # not TOML
    ('python = "/usr/bin/python3"\n[models.a]\nbogus = 1\n', READERS[:3]),           # a model's unknown key
    ('pyhton = "/usr/bin/python3"\n', READERS[:3]),                                   # a misspelt key
], ids=["not-toml", "bad-model", "misspelt"])
def test_an_invalid_config_is_refused_alike_by_every_command_that_reads_it(tmp_path, config, commands):
    (tmp_path / "agentloop.toml").write_text(config)
    (tmp_path / "x.py").write_text("print('ran')\n")
    (tmp_path / "s.jsonl").write_text('{"id": 1, "code": "print(1)"}\n')
    (tmp_path / "t.jsonl").write_text('{"id": 1, "task": "hi"}\n')
    said = {}
    for command in commands:
        done = subprocess.run([*AGENTLOOP, *command], capture_output=True, text=True, cwd=tmp_path, input="",
                              env=_env(tmp_path, LLM_URL="http://127.0.0.1:9/v1"), timeout=120)
        said[" ".join(command)] = (done.returncode, done.stdout, done.stderr)
    first = said["models"]
    assert first[0] == 125 and first[2].startswith("agentloop: agentloop.toml: ") and first[2].count("\n") == 1, first
    assert {command: outcome for command, outcome in said.items() if outcome != first} == {}


def test_doctor_says_which_python_workers_run_and_which_source_chose_it(tmp_path, user_venv):
    python = str(user_venv / "bin" / "python")
    (tmp_path / "agentloop.toml").write_text(f'python = "{python}"\n')
    cases = [((), {}, "python in agentloop.toml"), (("--python", sys.executable), {}, "--python"),
             ((), {"AGENTLOOP_PYTHON": sys.executable}, "AGENTLOOP_PYTHON")]
    for options, env, source in cases:
        done = subprocess.run([*AGENTLOOP, "doctor", *options], capture_output=True, text=True, cwd=tmp_path,
                              env=_env(tmp_path, LLM_URL="http://127.0.0.1:9/v1", **env), timeout=120)
        line = next((x for x in done.stdout.splitlines() if x.startswith("workers' python: ")), done.stdout)
        assert line.endswith(f", chosen by {source}"), line
        assert f"(Python {sys.version.split()[0]})" in line, line
    (tmp_path / "agentloop.toml").unlink()
    done = subprocess.run([*AGENTLOOP, "doctor"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=_env(tmp_path, LLM_URL="http://127.0.0.1:9/v1", VIRTUAL_ENV=str(user_venv)))
    assert f"chosen by the active virtual environment (VIRTUAL_ENV={user_venv})" in done.stdout, done.stdout
