"""Worker entry point: ``main()`` with ENDPOINT as the only argument, started by the coordinator
as ``python -I -B -c "...; from worker.__main__ import main; main()" ENDPOINT`` (isolated: see
``engine.sandbox.runtime_argv``); ``python -m worker ENDPOINT`` works too, by hand.

The coordinator passes the handshake token, the confinement spec, its own pid and (a local
coordinator) the directory of the output pipes through the environment (removed from
``os.environ`` before any user code runs).  Order matters: the output pipes are opened
first, then confinement is applied, while the process still has a single thread, so every
thread started later (ZeroMQ's, the capture pump, user code) inherits it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _guard_parent(parent: int) -> None:
    """Die with the coordinator, and keep orphaned descendants (double forks) under us so a
    tree kill can still find them when no PID namespace is available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except OSError:
        pass
    if parent and os.getppid() != parent and os.getppid() == 1:
        os._exit(70)  # the coordinator died before we could arm the death signal


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m worker ENDPOINT (started by the agentloop coordinator)", file=sys.stderr)
        sys.exit(2)
    run_worker(sys.argv[1])


def run_worker(endpoint: str) -> None:
    """Confine this process as the environment says, then serve the coordinator until told to
    stop.  Never returns.  Used by ``python -m worker`` and by the fork server's forked children."""
    from .contract.start import StartSpec

    try:
        start = StartSpec.take()
    except ValueError as exc:  # (a ContractError) nothing may run half-told
        print(f"agentloop worker: {exc}", file=sys.stderr)
        os._exit(71)
    _guard_parent(start.parent)
    from . import _memory

    _memory.tune()
    fifos = None
    if start.output:
        from ._outpipe import open_fifos

        # Before the confinement: the FIFOs stay the coordinator's, opened while this process
        # still has its uid (a root coordinator's workers switch to another), and Landlock
        # need not let the code open anything in the socket directory for writing.
        try:
            fifos = open_fifos(start.output)
        except OSError as exc:  # the socket carries the output then, as for a remote worker
            print(f"agentloop worker: output pipes unusable ({exc}); output goes over the socket",
                  file=sys.stderr)
    if start.confine:
        from . import _confine

        try:
            _confine.apply(start.confine)
        except Exception as exc:  # noqa: BLE001 - a half-applied sandbox must not run code
            print(f"agentloop worker: sandbox could not be applied: {exc}", file=sys.stderr)
            os._exit(71)
    if start.egress:
        # The sandbox's one way out (``--allow-net``), before any thread or code: the
        # forwarder inherits the confinement, and a sandbox without it has no network at all.
        from .contract.egress import FORWARDER_PORT
        from .egress import start as forward

        try:
            forward(start.egress, port=FORWARDER_PORT)
        except OSError as exc:
            print(f"agentloop worker: the egress forwarder could not start: {exc}", file=sys.stderr)
            os._exit(71)
    from .serve import serve

    # Confined, and the runtime imported: user code imports from the directory it runs in, as
    # under ``python -c``.  Never earlier: the directory may hold a `zmq/` an earlier worker
    # planted, and it must neither run unconfined nor break the worker's own start.
    sys.path.insert(0, "")

    code = serve(endpoint, start.token, fifos, start.tty, start.curve)
    sys.stdout.flush() if hasattr(sys.stdout, "flush") else None
    os._exit(code)  # never wait for threads user code left running


if __name__ == "__main__":
    main()
