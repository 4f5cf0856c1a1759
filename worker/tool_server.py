"""The tool process: serves the repository tools (``worker.repo_tools``) to the coordinator.

Started by ``engine.tools`` with the runtime's one launch command (``engine.sandbox.runtime_argv``,
without site: nothing in the current directory or in site-packages' ``.pth`` hooks runs), with cwd ``/`` and
an environment holding nothing but PATH and LANG.  In order, before it reads a single request:
it dies with its parent (PR_SET_PDEATHSIG), opens the root, then confines itself with
``worker._confine.apply`` (rlimits: DATA, CPU, FSIZE 0, NOFILE, CORE 0; every capability
dropped; no_new_privs; Landlock read-only beneath the root and nothing else; a seccomp filter
that refuses sockets), so that what a bug or a hostile tree could make it do is read the root.

The channel is ``contract.tools``: ``init`` (with the confinement to apply, built by the
coordinator), then one reply per request; the text is cut to ``repo_tools.MAX_TEXT``
characters, whatever ``max_result`` asks.  EOF on stdin ends the process.
"""

from __future__ import annotations

import os
import signal
import unicodedata  # noqa: F401 - for \N{...} in patterns: nothing is importable once Landlock is on
import warnings

from . import _confine
from .contract import tools
from .contract.framing import FrameError, decode_json, encode_json, frame, read_frame, write_all
from .contract.schema import ContractError
from .repo_tools import MAX_TEXT, Refusal, Tree, truncate

__all__ = ["handle", "main"]

_PR_SET_PDEATHSIG = 1
_EXIT_PARENT_GONE = 70
_EXIT_CONFINE = 71


def _read_request() -> tools.Message | None:
    """The next message from the coordinator, or None at EOF (it closed the pipe or died)."""
    body = read_frame(0, tools.MAX_REQUEST)
    return None if body is None else tools.TO_TOOLS.parse(decode_json(body, tools.MAX_REQUEST))


def _write(msg: tools.Message) -> None:
    write_all(1, frame(encode_json(msg)))


def _die_with_parent() -> None:
    """SIGKILL when the coordinator (the thread that started us) ends."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def handle(tree: Tree, req: tools.Request) -> tools.Message:
    """One request's reply; never raises for anything a request can cause."""
    args = req.args
    max_result = min(req.max_result or MAX_TEXT, MAX_TEXT)
    try:
        tree.refresh()
        if req.op == "list_dir":
            text = tree.list_dir(str(args["path"]))
        elif req.op == "read_file":
            text = tree.read_file(str(args["path"]), int(args["offset"]), int(args["limit"]))
        elif req.op == "search":
            text = tree.search(str(args["pattern"]), str(args["path"]))
        else:
            return tools.Failed(f"unknown request {req.op!r}")
    except Refusal as exc:
        return tools.Refused(str(exc))
    except MemoryError:
        return tools.Failed("out of memory: the request needs more than the tools may use")
    except OSError as exc:
        return tools.Failed(str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug must come back as words, not end the process
        return tools.Failed(f"{type(exc).__name__}: {exc}")
    return tools.Ok(truncate(text, max_result))


def main() -> None:
    """Set up as the module docstring says, then serve until EOF.  Never returns."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    warnings.simplefilter("ignore")  # "possible nested set" &c: the model reads results, not these
    try:
        init = _read_request()
        if init is None:
            os._exit(0)
        if not isinstance(init, tools.Init):
            raise ContractError(f"{init.kind} before init")
        if init.parent and os.getppid() != init.parent:  # the coordinator died first
            os._exit(_EXIT_PARENT_GONE)
        root_fd = os.open(init.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)  # Landlock would refuse it later
        tree = Tree(root_fd, init.root, [list(e) for e in init.exclude])
        layers = _confine.apply(init.confine)
    except Exception as exc:  # noqa: BLE001 - a half-confined tool process must not serve
        _write(tools.Fatal(f"{type(exc).__name__}: {exc}"))
        os._exit(_EXIT_CONFINE)
    _write(tools.Ready(tuple(layers)))
    # Nothing drains stderr while this process serves: a write there (a warning about a
    # pattern) could fill the pipe and stall a request.  Startup failures were said above.
    os.dup2(devnull, 2)
    os.close(devnull)
    while True:
        try:
            req = _read_request()
        except (ContractError, FrameError) as exc:
            _write(tools.Failed(f"bad request: {exc}"))
            os._exit(2)  # the stream is out of step: start afresh
        if req is None:
            os._exit(0)
        if not isinstance(req, tools.Request):
            _write(tools.Failed(f"a second {req.kind}"))
            os._exit(2)
        _write(handle(tree, req))
