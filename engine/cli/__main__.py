"""``python -m engine.cli``: the ``agentloop`` command."""

from engine.cli import main

main(prog_name="agentloop")
