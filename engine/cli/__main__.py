"""``python -m engine.cli``: the ``agentloop`` command."""

from . import main

main(prog_name="agentloop")
