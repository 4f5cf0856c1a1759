"""``agentloop batch``: thousands of agent runs over a task file, every result kept.

Input is JSONL, one task a line: ``{"id": ..., "task": ...}`` plus, optionally, ``model`` (an
alias), ``max_messages``, ``timeout`` (wall-clock cap of one attempt: seconds or ``5m``) and
``files`` (paths, relative to the task file's directory, copied into the run's workspace).
Every line is checked before anything starts; problems are reported with their line numbers.

Output is JSONL, one record a line per finished run (see ``make_record``), appended, flushed and
fsynced as the run ends.  So a crash loses no finished run, and rerunning the same command skips
every id already in the output.  A torn last line (a crash mid-write) is cut off and its run
done again.  Runs recorded as ``cancelled`` never finished and are run again too, as are those
that failed for infrastructure reasons (they say nothing of the model); ``--redo`` adds other
statuses.  The progress, rate and ETA count neither as done.  Before anything is made, every
model endpoint the tasks use is asked for its ``/models``; one that does not answer stops the
batch in one line (exit 1), rather than recording every run as failed.

Each run gets its own directory ``<output stem>.runs/<id>/``: ``workspace/`` (its working
directory, where ``files`` are copied), ``transcript.jsonl`` (every display event, all
attempts), ``state/`` (block outputs too large to keep in memory).  Runs share nothing else
but the batch's one fork server (bubblewrap, as root or unprivileged: ``RunSettings.shared_fork_server``),
which forks each run's workers in their run's view, uid, confinement and cgroups.

Failures of the infrastructure (model endpoint unreachable or answering 5xx after the client's
own retries, a worker that does not start, an internal error) are retried ``--retries`` times
with exponential backoff.  What the model does (no answer within its messages, a timeout) is
its result, never retried.

``--parallel`` default: ``min(2 × usable CPUs, available memory / 1 GiB)``, between 1 and 64.
A run is a coordinator task in this process, mostly waiting on the model, plus its worker
processes; an idle worker takes ~25 MB but may grow to its 2 GiB limit, and a GiB per run
leaves room for half of them to peak at once.  Each run holds at most
``--max-workers-per-run`` workers (its agent and sub-agents), so a batch never holds more than
``parallel × max_workers_per_run``.

Ctrl-C (or SIGTERM) stops starting runs, cancels the running ones (their workers killed, their
records written as ``cancelled``) and exits 130; a second Ctrl-C exits at once — finished
records are already on disk.  ``--ray ADDRESS`` runs each run as a Ray task instead
(``engine.batch.on_ray``, imported only then).

Exit status: 0 the batch ran to its end (whatever the runs' statuses), 1 a model endpoint did
not answer or the batch stopped early because the infrastructure kept failing, 125 bad input or
options, 130 interrupted.

Progress lines, the bar and the summary print ids, errors and messages inert
(``engine.inert``: no escape sequence or control character of a task file, a model or an
endpoint reaches the terminal) and never as rich markup; RESULTS.jsonl keeps them exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

# Every name is imported when first used (PEP 562): ``exec --jsonl`` uses this package's
# driver and results file without loading the agent loop that task runs need.
_WHERE = {
    "default_parallel": "capacity", "BatchOutcome": "local", "run_batch": "local", "BarView": "progress",
    "Tally": "progress", "print_summary": "progress", "ResultsFile": "results_file", "RunSettings": "run",
    "execute": "run", "is_infrastructure": "run", "make_record": "run", "TaskSpec": "tasks", "read_tasks": "tasks",
}

if TYPE_CHECKING:
    from engine.batch.capacity import default_parallel
    from engine.batch.local import BatchOutcome, run_batch
    from engine.batch.progress import BarView, Tally, print_summary
    from engine.batch.results_file import ResultsFile
    from engine.batch.run import RunSettings, execute, is_infrastructure, make_record
    from engine.batch.tasks import TaskSpec, read_tasks


__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = ["BarView", "BatchOutcome", "ResultsFile", "RunSettings", "TaskSpec", "Tally", "default_parallel",
           "execute", "is_infrastructure", "make_record", "print_summary", "read_tasks", "run_batch"]
