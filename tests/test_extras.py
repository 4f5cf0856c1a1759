"""Optional extras: what a command says when one is missing, and that no install instruction
anywhere can resolve to the unrelated ``agentloop`` project on the package index."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from engine.extras import install_hint

ROOT = Path(__file__).resolve().parent.parent

#: The missing SDK, as a Python without it sees it: every import of these names fails.
WITHOUT_MCP = "import sys\nfor name in ('mcp', 'mcp_types'):\n    sys.modules[name] = None\n" \
              "from engine.cli import main\nmain()\n"


def test_mcp_without_its_extra_says_how_to_get_it_from_this_checkout(tmp_path):
    done = subprocess.run([sys.executable, "-c", WITHOUT_MCP, "mcp"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                         "XDG_STATE_HOME": str(tmp_path / "state")})
    assert done.returncode == 125, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "the MCP server needs the MCP SDK" in done.stderr
    assert not _index_installs(done.stderr), done.stderr
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():  # the checkout's own environment
        assert f"AGENTLOOP_EXTRAS=mcp {ROOT / 'scripts' / 'agentloop'}" in done.stderr, done.stderr
    else:
        assert f"pip install -e '{ROOT}[mcp]'" in done.stderr, done.stderr


def test_an_installed_copy_names_the_extras_own_requirements():
    hint = install_hint("mcp", None)
    assert hint.startswith(f"install its packages: {sys.executable} -m pip install 'mcp"), hint
    assert "agentloop" not in hint.split("pip install", 1)[1]
    assert "pip install 'ray" in install_hint("ray", None)


#: ``pip install`` and what follows it, up to a closing quote or backtick (a line of prose may
#: wrap within the instruction: one newline is part of it, a blank line is not).
_PIP = re.compile(r"pip\s+install((?:[^`\"\n]|\n(?!\s*\n))*)")


def _index_installs(text: str) -> list[str]:
    """The install instructions in ``text`` that name ``agentloop`` as a requirement from the
    index (``agentloop``, ``agentloop[x]``, ``agentloop>=1``), rather than by a path."""
    bad = []
    for match in _PIP.finditer(text):
        for word in match.group(1).split():
            word = word.strip("'\"()")
            if re.fullmatch(r"agentloop(\[[^\]]*\])?([<>=!~].*)?", word):
                bad.append(match.group(0))
    return bad


def test_no_install_instruction_can_fetch_another_projects_agentloop():
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "engine").rglob("*.py")),
               *sorted((ROOT / "worker").rglob("*.py")), *sorted((ROOT / "scripts").iterdir()),
               *sorted((ROOT / "tests").rglob("*.py"))]
    found = {str(path.relative_to(ROOT)): bad for path in sources if path.is_file() and path.name != "test_extras.py"
             for bad in [_index_installs(path.read_text(errors="replace"))] if bad}
    assert found == {}
    assert _index_installs("run `pip install 'agentloop[mcp]'` or pip install agentloop")  # the check itself bites
    assert _index_installs("an optional extra: `pip\ninstall 'agentloop[otel]'` (scripts/test installs it)")
    assert not _index_installs("pip install '/src/agentloop[mcp]' or pip install -e '.[mcp]'")
