"""SandboxFusion's ``/run_code`` API in agentloop's terms: a request as a ``Sample`` and the
limits the server lets it have, a ``SampleResult`` as the response.  Pure: no HTTP here
(``run_code_server`` serves it).

The request (SandboxFusion's ``RunCodeRequest``): ``code`` (required), ``language`` (required;
``python`` only here, also named ``python3``: anything else is refused in words, as a
``SandboxError``), ``stdin`` (a string or null), ``run_timeout`` (seconds, default 10),
``compile_timeout`` (taken and unused: Python is not compiled), ``memory_limit_MB`` (default
-1: the server's limit), ``files`` (path -> base64 content, or null to skip it), ``fetch_files``
(paths to send back), ``args`` (``sys.argv[1:]``).  Other keys are ignored, as SandboxFusion's
models ignore them.  A field of the wrong type is ``InvalidRequest`` (HTTP 422, in words).

The response (``RunCodeResponse``): ``status`` ``Success`` (exit status 0), ``Failed`` (another
exit status, a death by a signal, the deadline) or ``SandboxError`` (the code could not be run);
``message``; ``compile_result`` (always null); ``run_result`` with ``status`` ``Finished``,
``TimeLimitExceeded`` (``return_code`` null) or ``Error``, ``execution_time`` (seconds),
``return_code`` (as Python's ``subprocess`` gives it: -N for a death by signal N), ``stdout``,
``stderr``; ``executor_pod_name`` (null); ``files`` (path -> base64, what was fetched); and,
for a server started with ``--allow-net`` only, ``network`` (the sample's connections, as a
sample's result lists them: a key SandboxFusion's clients ignore).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any

from engine.errors import EXIT_OWN, InvalidRequest
from engine.samples import FILES_CAP, Sample, SampleResult
from worker.contract.limits import MAX_ID
from worker.contract.sample import MAX_FETCHED

__all__ = ["LANGUAGES", "RequestLimits", "Run", "parse_request", "refused", "response"]

#: The ``language`` values run (SandboxFusion's name for Python, and the usual other one).
LANGUAGES = ("python", "python3")
#: SandboxFusion's default ``run_timeout``, in seconds.
_RUN_TIMEOUT = 10.0
_MIB = 1024 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """What the server lets a request have: the longest ``run_timeout`` and the most memory
    (bytes; None: no limit of the server's)."""

    timeout: float
    memory_bytes: int | None


@dataclass(frozen=True)
class Run:
    """A valid request: the sample to run, the memory limit to run it under (bytes; None: the
    server's own) and notes for the response (a limit lowered to the server's)."""

    sample: Sample
    memory_bytes: int | None
    notes: tuple[str, ...] = ()
    language: str = "python"


def parse_request(body: Any, ident: int, limits: RequestLimits) -> Run:
    """The run ``body`` (a decoded JSON value) asks for, as sample ``ident``; InvalidRequest in
    words for a body that is not a RunCodeRequest.  A language other than Python is not an
    error here: ``Run.language`` says it, and the server answers ``refused``."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"a request is a JSON object, not {type(body).__name__}")
    code = body.get("code")
    if not isinstance(code, str):
        raise InvalidRequest("code: a string is required")
    language = body.get("language")
    if not isinstance(language, str):
        raise InvalidRequest("language: a string is required (python)")
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise InvalidRequest("stdin: a string or null")
    notes: list[str] = []
    timeout = _number(body, "run_timeout", _RUN_TIMEOUT)
    if timeout <= 0:
        raise InvalidRequest("run_timeout: a positive number of seconds")
    if timeout > limits.timeout:
        notes.append(f"run_timeout {_shown(timeout)} s is past this server's {_shown(limits.timeout)} s; "
                     f"{_shown(limits.timeout)} s applied")
        timeout = limits.timeout
    _number(body, "compile_timeout", 10.0)
    memory = _memory(_number(body, "memory_limit_MB", -1), limits, notes)
    args = body.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidRequest("args: a list of strings")
    files = _files(body.get("files") or {})
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise InvalidRequest("fetch_files: a list of paths")
    if len(fetch) > MAX_FETCHED:
        raise InvalidRequest(f"fetch_files: at most {MAX_FETCHED} paths")
    for path in fetch:
        _relative(path, "fetch_files")
    sample = Sample(ident, code, stdin=stdin, args=tuple(args), timeout=timeout, files=files,
                    fetch=tuple(dict.fromkeys(fetch)))
    return Run(sample, memory, tuple(notes), language)


def _shown(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name}: a number")
    return float(value)


def _memory(asked: float, limits: RequestLimits, notes: list[str]) -> int | None:
    """The memory limit to run under: the request's, in MiB rounded up to a power of two (the
    server keeps slots warm for each such limit it has been asked for), never past the
    server's; -1 or 0: the server's."""
    if asked <= 0:
        return limits.memory_bytes
    wanted = max(16, 1 << math.ceil(math.log2(asked))) * _MIB
    if limits.memory_bytes is not None and wanted >= limits.memory_bytes:
        if asked * _MIB > limits.memory_bytes:
            notes.append(f"memory_limit_MB {_shown(asked)} is past this server's {limits.memory_bytes // _MIB} MiB; "
                         f"{limits.memory_bytes // _MIB} MiB applied")
        return limits.memory_bytes
    return wanted


def _relative(path: str, where: str) -> str:
    parts = path.split("/")
    if not path or len(path) > MAX_ID or path.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "\0" in path:
        raise InvalidRequest(f"{where}: {path[:80]!r} is not a path inside the sample's workspace "
                           "(relative, without . or .. parts)")
    return path


def _files(value: Any) -> tuple[tuple[str, bytes, int], ...]:
    if not isinstance(value, dict):
        raise InvalidRequest("files: an object of paths and base64 contents")
    out, size = [], 0
    for path, content in value.items():
        if content is None:  # (SandboxFusion skips these too)
            continue
        _relative(path, "files")
        if not isinstance(content, str):
            raise InvalidRequest(f"files: {path[:80]!r}: base64 text or null")
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"files: {path[:80]!r} is not base64") from None
        size += len(data)
        if size > FILES_CAP:
            raise InvalidRequest(f"files: more than the {FILES_CAP // _MIB} MiB a sample may carry")
        out.append((path, data, 0o644))
    return tuple(out)


def _run_result(status: str, seconds: float | None, code: int | None, stdout: str, stderr: str) -> dict:
    return {"status": status, "execution_time": seconds, "return_code": code, "stdout": stdout, "stderr": stderr}


def refused(language: str) -> dict:
    """The response to a language that is not run here."""
    return {"status": "SandboxError", "message": f"language {language[:40]!r} is not run here: agentloop serve "
            f"runs Python only (language {' or '.join(LANGUAGES)})", "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def response(result: SampleResult, notes: tuple[str, ...] = ()) -> dict:
    """SandboxFusion's response to the run that ended in ``result`` (the module docstring)."""
    seconds = round(result.duration_s, 4)
    message = "; ".join(m for m in (result.message, *notes) if m)
    files = {path: base64.b64encode(data).decode("ascii") for path, data in result.files.items()}
    network = {"network": result.network} if result.network is not None else {}  # (--allow-net)
    if result.status == "cancelled" or (result.status == "error" and result.exit_code == EXIT_OWN
                                        and result.message.startswith("it could not be started")):
        run = _run_result("Error", seconds, None, result.stdout, result.stderr or result.message)
        return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": run,
                "executor_pod_name": None, "files": files, **network}
    if result.status == "timeout":
        run, status = _run_result("TimeLimitExceeded", seconds, None, result.stdout, result.stderr), "Failed"
    else:
        # A death by signal N (the memory limit's kill included) is -N, as subprocess says it.
        code = result.exit_code - 128 if result.status in ("died", "oom") else result.exit_code
        code = -code if result.status in ("died", "oom") else code
        run = _run_result("Finished", seconds, code, result.stdout, result.stderr)
        status = "Success" if code == 0 else "Failed"
    return {"status": status, "message": message, "compile_result": None, "run_result": run,
            "executor_pod_name": None, "files": files, **network}
