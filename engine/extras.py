"""How to install one of agentloop's optional extras (mcp, ray, smolagents, bench), in words
that cannot install someone else's code.

The package index holds an unrelated project named ``agentloop``, so installing
``agentloop[mcp]`` from the index would fetch it.  The words here never name this project by that bare name:
from a checkout they name the checkout's own ``scripts/agentloop`` (which installs the extra
into the checkout's ``.venv`` before it runs), or, for another environment installed from the
checkout, the checkout's path; otherwise they name the extra's own requirements, as this
installation's metadata lists them, for the Python that runs agentloop.
"""

from __future__ import annotations

import re
import shlex
import sys
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

__all__ = ["CHECKOUT", "install_hint"]

_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _checkout() -> Path | None:
    """The source checkout this code runs from (its ``scripts/agentloop`` and ``pyproject.toml``
    beside the ``engine`` package), or None for an installed copy."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "scripts" / "agentloop").is_file() and (root / "pyproject.toml").is_file() else None


#: The checkout agentloop runs from, None when it runs installed.
CHECKOUT = _checkout()


def install_hint(extra: str, root: Path | None = CHECKOUT) -> str:
    """How to get ``extra``, as words to follow a colon; ``root``: the checkout agentloop runs
    from (None: an installed copy)."""
    if root is not None:
        if Path(sys.prefix).resolve() == (root / ".venv").resolve():
            return (f"run the command through the checkout with the extra, which it installs first: "
                    f"AGENTLOOP_EXTRAS={extra} {shlex.quote(str(root / 'scripts' / 'agentloop'))} ...")
        return f"install the checkout's extra: {sys.executable} -m pip install -e {shlex.quote(f'{root}[{extra}]')}"
    needs = _requirements(extra)
    if not needs:
        return f"install the {extra} extra from agentloop's source: pip install 'PATH/TO/agentloop[{extra}]'"
    return f"install its packages: {sys.executable} -m pip install {' '.join(shlex.quote(r) for r in needs)}"


def _requirements(extra: str) -> list[str]:
    """The requirements this installation declares for ``extra`` (``mcp<3,>=2.3``), from its
    metadata; empty when there is none to read."""
    try:
        declared = requires("agentloop") or []
    except PackageNotFoundError:
        return []
    out = []
    for line in declared:
        requirement, _, marker = line.partition(";")
        if any(name == extra for name in _EXTRA.findall(marker)):
            out.append(requirement.strip().replace(" ", ""))
    return out
