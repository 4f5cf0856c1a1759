"""Reading secrets: the host's password hashes, another user's home, the coordinator's process
and environment.  Model code must not get any of them, and must not even see that they exist."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from engine.sandbox import python_paths

from .harness import (
    ABSENT,
    API_KEY,
    OTHER_SECRETS,
    Host,
    agent_attack,
    assert_still_works,
    attack,
    block,
    needs_namespaces,
)

pytestmark = pytest.mark.attack



async def test_etc_shadow_is_not_readable(worker):
    needs_namespaces()
    got = await attack(worker, '''
probe("shadow", lambda: open("/etc/shadow").read())
probe("gshadow", lambda: open("/etc/gshadow").read())
probe("listed", lambda: sorted(n for n in _os.listdir("/etc") if "shadow" in n))
''')
    assert got["shadow"] == ABSENT and got["gshadow"] == ABSENT, got.probes
    assert got["listed"] == "ok []"
    await assert_still_works(worker)


async def test_another_users_home_is_not_readable(worker, host: Host):
    needs_namespaces()
    home = Path(os.path.expanduser("~"))
    # The coordinator's own home: every entry but the one leading to the worker's Python.
    needed = python_paths(sys.executable)
    private = sorted(n for n in os.listdir(home)
                     if not any(p == str(home / n) or p.startswith(f"{home / n}/") for p in needed))
    got = await attack(worker, f'''
probe("key", lambda: open({str(host.alice_key)!r}).read())
probe("list_alice", lambda: _os.listdir({str(host.alice)!r}))
probe("list_homes", lambda: _os.listdir({str(host.alice.parent)!r}))
probe("list_home", lambda: sorted(_os.listdir({str(home)!r})))
for name in {private[:8]!r}:
    probe("home/" + name, lambda: _os.stat({str(home)!r} + "/" + name) and "visible")
''')
    assert got["key"] == ABSENT and got["list_alice"] == ABSENT and got["list_homes"] == ABSENT, got.probes
    assert host.alice_secret not in got.result.output
    if got["list_home"] != ABSENT:
        assert not set(ast.literal_eval(got["list_home"][3:])) & set(private), got["list_home"]
    for name in private[:8]:
        assert got["home/" + name] == ABSENT, (name, got.probes)
    await assert_still_works(worker)


async def test_coordinator_process_is_unreachable(worker):
    needs_namespaces()
    me = os.getpid()
    got = await attack(worker, f'''
for name in ("environ", "cmdline", "mem", "maps", "status"):
    probe("proc/" + name, lambda: open("/proc/{me}/" + name, "rb").read(4096))
probe("proc/root", lambda: open("/proc/{me}/root/etc/shadow").read())
probe("proc/cwd", lambda: _os.listdir("/proc/{me}/cwd"))
probe("proc/fd", lambda: _os.listdir("/proc/{me}/fd"))
probe("pidfd", lambda: _os.pidfd_open({me}))
''')
    for name in ("environ", "cmdline", "mem", "maps", "status", "root", "cwd", "fd"):
        assert got["proc/" + name] == ABSENT, (name, got.probes)
    assert got["pidfd"] == "ProcessLookupError ESRCH"
    assert API_KEY not in got.result.output
    await assert_still_works(worker)


# Searches every environment model code can reach for the coordinator's keys, by name (the
# values are not in the code, so a hit cannot come from the code itself).
SCAN_ENVIRON = '''
names = {names!r}
hits = [n for n in names if n in _os.environ]
for entry in _os.listdir("/proc"):
    if not entry.isdigit() and entry not in ("self", "thread-self"):
        continue
    for what in ("environ", "cmdline"):
        try:
            with open("/proc/" + entry + "/" + what, "rb") as f:
                data = f.read()
        except OSError:
            continue
        hits += [entry + "/" + what + ":" + n for n in names if (n + "=").encode() in data]
print("hits:", len(hits), hits)
probe("getenv", lambda: _os.getenv("LLM_API_KEY"))
'''


async def test_coordinator_api_key_does_not_reach_model_code(worker):
    names = ["LLM_API_KEY", *OTHER_SECRETS]
    got = await attack(worker, SCAN_ENVIRON.format(names=names))
    assert got["hits"] == "0 []", got.result.output
    assert got["getenv"] == "ok"  # None: not set in the worker
    for value in (API_KEY, *OTHER_SECRETS.values()):
        assert value not in got.result.output
    await assert_still_works(worker)


async def test_agent_cannot_read_secrets(engine, host: Host):
    """The same attacks through the agent loop: nothing secret reaches the model."""
    needs_namespaces()
    code = f'''
probe("shadow", lambda: open("/etc/shadow").read())
probe("key", lambda: open({str(host.alice_key)!r}).read())
probe("environ", lambda: open("/proc/{os.getpid()}/environ").read())
''' + SCAN_ENVIRON.format(names=["LLM_API_KEY", *OTHER_SECRETS])
    run = await agent_attack(engine, block("attack", code), name="secrets")
    text = run.blocks["attack"]
    assert "shadow: " + ABSENT in text and "key: " + ABSENT in text and "environ: " + ABSENT in text, text
    assert "hits: 0 []" in text
    sent = json.dumps([r["messages"] for r in run.server.requests])
    for secret in (API_KEY, host.alice_secret, *OTHER_SECRETS.values()):
        assert secret not in sent
    run.assert_kept_working()
