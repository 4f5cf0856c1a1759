"""``python -m engine.cli``: the ``agentloop`` command."""

from engine.cli import run

run()
