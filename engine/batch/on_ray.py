"""A batch on a Ray cluster: one Ray task per run, its coordinator and workers on one node.

Imported only by ``agentloop batch --ray ADDRESS`` (the ``ray`` extra: ``engine.extras``).

Capacity.  Each run is a task needing one ``agent_slot``, a custom resource that caps the runs a
node holds: start nodes with ``ray start --address=HEAD:6379 --resources='{"agent_slot": 8}'``
(the head with ``ray start --head --resources=...``).  The task asks Ray for no CPU: a run's
CPU goes to its own worker processes, which Ray does not see, so the slot is the cap.  The
driver keeps at most ``min(--parallel, agent_slots in the cluster)`` tasks in flight.

Failures are kept apart.  Ray re-executes a task whose node or Ray worker died (``max_retries``
= NODE_RETRIES) and never retries an exception (``retry_exceptions=False``); inside the task,
``execute`` retries infrastructure failures ``--retries`` times, and a model's failure is a
record like any other.  A task lost for good after Ray's retries becomes a ``failed`` record
with ``infrastructure: true``.

Results.  The driver (this process) writes each record as its task completes (``ray.wait``)
through the same ResultsFile as a local batch, so resume works the same way.  Records get
``node``, the IP of the node that ran them: ``transcript`` and ``workspace`` are paths there.
A task's files travel with it (read here, written into the workspace there), so nodes need no
shared filesystem; agentloop (the same version) must be installed on every node.

Cancelling.  Ctrl-C, or a run still going well past its timeout (``RunSettings.deadline``),
is ``ray.cancel(force=False)``: Ray interrupts the task, the task cancels its run the way a
local batch does (workers killed, a ``cancelled`` record returned).  A task still there GRACE
seconds later is force-cancelled, which kills its Ray worker process; its agentloop workers
die with it (parent-death signal, bubblewrap's --die-with-parent), so none is left behind.

Environment.  The model registry is resolved here and shipped with each task; API keys are
read where the run happens, so the variables the models name (``api_key_env``) that are set
here are forwarded through the job's runtime_env — visible to whoever can inspect the job,
which token authentication limits to holders of the token.

Token authentication (Ray 2.52+).  Since Ray 2.60 a new local cluster (``ray.init()``) enables
it by default and ``ray start --head`` enables it when a token exists.  To connect to such a
cluster, set before running ``agentloop batch --ray ADDRESS``:

- ``RAY_AUTH_MODE=token`` — an explicit address never turns token mode on by itself;
- the cluster's token, one of: ``RAY_AUTH_TOKEN=<token>``, ``RAY_AUTH_TOKEN_PATH=<file>``, or
  the file ``~/.ray/auth_token``.  ``ray get-auth-token`` on the head node prints it.

With ``--ray auto`` (a cluster started on this machine) a token in ``~/.ray/auth_token`` is
found and used without RAY_AUTH_MODE.  A cluster started with ``RAY_AUTH_MODE=disabled`` needs
nothing.  ``ray://HOST:10001`` (Ray Client) also needs ``pip install 'ray[client]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.batch.progress import LinesView, Tally, short
from engine.batch.results_file import ResultsFile
from engine.batch.run import RunSettings, execute, make_record
from engine.batch.stopping import Stopper, infra_threshold
from engine.batch.tasks import TaskSpec, pack_files
from engine.errors import AgentloopError
from engine.models import raise_if_foreign
from engine.observe import start_tracing, tracing_env

__all__ = [
    "GRACE", "NODE_RETRIES", "SLOTS_EVERY", "agent_slots", "connect", "import_ray", "on_cluster", "run_on_node",
    "run_on_ray"
]

#: Re-executions Ray allows a task whose node or worker process died.
NODE_RETRIES = 3
#: Seconds between a polite cancel and killing the task's Ray worker.
GRACE = 30.0
#: Seconds between two looks at how many agent slots the cluster has (it may autoscale).
SLOTS_EVERY = 30.0

_AUTH_HINT = ("If the cluster uses token authentication (Ray 2.60's default for new clusters), set "
              "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) "
              "to its token; `ray get-auth-token` on the head node prints it.")


def run_on_node(spec: TaskSpec, settings: RunSettings,
                packed: list[tuple[str, bytes, int]]) -> dict:
    """The Ray task: one run on this node, to its record.  Ray's interrupt (a polite
    ``ray.cancel``) cancels the run; the record then says ``cancelled``."""
    import ray

    async def main() -> dict:
        me = asyncio.current_task()
        assert me is not None
        # Ray interrupts the main thread; a loop signal handler wakes the loop for it, so a run
        # blocked in a long wait notices at once.
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, me.cancel)
        return await execute(spec, settings, packed=packed)

    traced = start_tracing()  # as the driver's: its tracing variables came in the job's environment
    try:
        record = asyncio.run(main())
    finally:
        if traced is not None:
            traced.flush()  # this Ray worker lives on: its run's spans leave now
    record["node"] = ray.util.get_node_ip_address()
    return record


@dataclass
class _Flight:
    """A submitted task: its run, when it went, and why it is being cancelled (if it is)."""

    spec: TaskSpec
    ref: Any
    submitted: float
    deadline: float | None
    reason: str | None = None  # "cancelled" | "timed_out"
    asked_at: float = 0.0
    forced: bool = False

    def cancel(self, ray: Any, reason: str, now: float) -> None:
        if self.reason is None:
            self.reason, self.asked_at = reason, now
            ray.cancel(self.ref, force=False)

    def check(self, ray: Any, now: float) -> None:
        if self.reason is None and self.deadline is not None and now > self.deadline:
            self.cancel(ray, "timed_out", now)
        elif self.reason is not None and not self.forced and now > self.asked_at + GRACE:
            self.forced = True
            ray.cancel(self.ref, force=True)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        from engine.extras import install_hint

        raise AgentloopError(f"--ray needs Ray: {install_hint('ray')}") from None
    return ray


def _forwarded_env(settings: RunSettings) -> dict[str, str]:
    names = {config.api_key_env for config in settings.models if config.url_named}  # (no key for a default)
    return {**{name: os.environ[name] for name in sorted(names) if os.environ.get(name)}, **tracing_env()}


def _check_reachable(address: str) -> None:
    """Fail fast on a GCS address nobody listens on: Ray itself keeps retrying for minutes."""
    host, colon, port = address.rpartition(":")
    if address == "auto" or "://" in address or not colon or not port.isdigit():
        return
    try:
        probe = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    except OSError as exc:
        raise AgentloopError(f"cannot connect to the Ray cluster at {address}: {exc.strerror or exc}; "
                             "start it (ray start --head) or check the address") from None
    # The cluster gets the model keys: a GCS port of another user of this machine gets nothing.
    # (Ray makes its own connections after this one; a port that changes hands in between is
    # what this check leaves.)
    with probe:
        raise_if_foreign(probe, "the Ray cluster")


def _warn_unsent_token() -> None:
    """The common slip: a token at hand, but Ray sends none to an explicit address unless
    RAY_AUTH_MODE=token — and then retries for a while before saying so."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") \
            or os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        print("agentloop: a Ray token is set but RAY_AUTH_MODE is not; if the cluster uses token "
              "authentication, set RAY_AUTH_MODE=token", file=sys.stderr, flush=True)


def connect(ray: Any, address: str, env: dict[str, str]) -> bool:
    """Join the cluster; True when this call connected (and so must disconnect)."""
    if ray.is_initialized():
        return False
    _check_reachable(address)
    _warn_unsent_token()
    try:
        ray.init(address=address, runtime_env={"env_vars": env} if env else None,
                 logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here; all mean "not connected"
        raise AgentloopError(f"cannot connect to the Ray cluster at {address}: "
                             f"{type(exc).__name__}: {exc}\n{_AUTH_HINT}") from exc
    return True


@contextlib.contextmanager
def on_cluster(address: str, env: dict[str, str], stopper: Stopper) -> Iterator[Any]:
    """Ray, joined to the cluster at ``address`` (``env`` forwarded to its tasks) while the
    block runs, with SIGINT and SIGTERM only flagging ``stopper`` (no Ray call is made from a
    signal handler); both undone after, whatever happens."""
    ray = import_ray()
    connected = connect(ray, address, env)
    handlers: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda *_: stopper.interrupt())
        yield ray
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
        if connected:
            ray.shutdown()


def agent_slots(ray: Any) -> int:
    return int(ray.cluster_resources().get("agent_slot", 0))


def _collect(ray: Any, flight: _Flight, settings: RunSettings) -> dict:
    """The record of a finished task, made here when the task could not return one."""
    spec = flight.spec
    lost = True
    try:
        record = ray.get(flight.ref)
        lost = False
    except ray.exceptions.TaskCancelledError:
        record = make_record(spec, settings, status="cancelled", error="cancelled")
    except ray.exceptions.RayError as exc:  # worker or node lost after Ray's retries, out of memory, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        record = make_record(spec, settings, status="failed", infrastructure=True,
                                   error=f"Ray: {type(exc).__name__}: {first}"[:2000])
    if flight.reason is not None and (lost or record["status"] == "cancelled"):
        record["status"], record["infrastructure"] = flight.reason, False
        if flight.reason == "timed_out":
            record["error"] = (f"still running {time.monotonic() - flight.submitted:.0f} s after it was sent, "
                               "well past its timeout; cancelled on its node")
        else:
            record["error"] = "cancelled"
    if not record.get("duration_s"):
        record["duration_s"] = round(time.monotonic() - flight.submitted, 3)
    return record


def run_on_ray(address: str, pending: list[TaskSpec], settings: RunSettings, *,
               results: ResultsFile, tally: Tally, view: LinesView, parallel: int | None,
               stopper: Stopper) -> None:
    """Run ``pending`` on the cluster at ``address``, writing each record as it comes."""
    with on_cluster(address, _forwarded_env(settings), stopper) as ray:
        slots = agent_slots(ray)
        if slots < 1:
            raise AgentloopError("no node of the Ray cluster offers the agent_slot resource; start nodes "
                                 "with --resources='{\"agent_slot\": N}' (N: runs the node may hold)")
        remote = ray.remote(num_cpus=0, resources={"agent_slot": 1}, max_retries=NODE_RETRIES,
                            retry_exceptions=False)(run_on_node)
        inflight: dict[Any, _Flight] = {}
        queue = iter(pending)
        slots_seen = time.monotonic()
        cancelled_all = False
        while True:
            now = time.monotonic()
            if now - slots_seen > SLOTS_EVERY:
                slots, slots_seen = max(1, agent_slots(ray)), now
            limit = min(parallel, slots) if parallel else slots
            while not stopper.stopping and len(inflight) < limit:
                spec = next(queue, None)
                if spec is None:
                    break
                ref = remote.remote(spec, settings, pack_files(spec.files))
                budget = settings.deadline(spec)
                inflight[ref] = _Flight(spec, ref, now, now + budget if budget is not None else None)
                tally.start(spec.key)
            if not inflight:
                break
            if stopper.interrupted and not cancelled_all:
                cancelled_all = True
                for flight in inflight.values():
                    flight.cancel(ray, "cancelled", now)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for ref in ready:
                flight = inflight.pop(ref)
                record = _collect(ray, flight, settings)
                results.append(record)
                tally.finish(flight.spec.key, record)
                view.finished(record)
                if tally.consecutive_infra >= infra_threshold(limit):
                    stopper.abort(f"{tally.consecutive_infra} runs in a row failed for infrastructure reasons "
                                  f"(last: {short(record['error'], 200)}); fix it and run the same "
                                  "command again")
            now = time.monotonic()
            for flight in inflight.values():
                flight.check(ray, now)
            view.tick()
