# Neighbours named like the packages agentloop's own runtime uses: each is the project's, and
# nothing of agentloop is imported.
# expect-stdout: "mine 1 2 []\n"
import sys

import click
import msgpack
import zmq

print(msgpack.X, zmq.Z, click.C, [m for m in ("worker", "engine") if m in sys.modules])
