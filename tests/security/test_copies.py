"""A fork's copy (``Worker.fork``) attacking its parent worker and its sibling copies.

A copy runs in its parent's sandbox, so what separates them is the Landlock domain each copy
is given of its own (``worker._confine.separate``): no signal, no ptrace (and so no
/proc/PID/mem, environ or fd) and no abstract unix socket reaches a process outside it.  Each
attack checks that the victim still runs ordinary code afterwards."""

from __future__ import annotations

import pytest

from engine.workers import Worker
from worker.contract.confinement import landlock_abi

from .harness import assert_still_works, attack

pytestmark = pytest.mark.attack


async def _copies(worker: Worker) -> tuple[Worker, Worker, int, int]:
    """Two copies of ``worker`` (which listens on an abstract socket), the attacker told the
    parent's pid and its sibling's as ``parent`` and ``sibling``."""
    if landlock_abi() < 6:
        pytest.skip("this kernel's Landlock does not scope signals and sockets (ABI < 6): copies are not apart")
    await worker.run("import os, socket\nparent = os.getpid()\nname = '\\0agentloop-victim-%d' % parent\n"
                     "server = socket.socket(socket.AF_UNIX)\nserver.bind(name)\nserver.listen()")
    attacker, victim = await worker.fork(2)
    parent = int((await worker.run("print(os.getpid())")).output)
    sibling = int((await victim.run("print(os.getpid())")).output)
    await attacker.run(f"sibling = {sibling}")
    return attacker, victim, parent, sibling


#: ``raw(name, *args)``: a system call by name (x86_64 or aarch64), OSError on -1.
_RAW = """
_NUMBERS = {"tgkill": (234, 131), "process_vm_readv": (310, 270)}
def raw(name, *args):
    nr = _NUMBERS[name][0 if _os.uname().machine == "x86_64" else 1]
    if _libc.syscall(nr, *args) == -1:
        code = _ctypes.get_errno()
        raise OSError(code, _os.strerror(code))
"""


async def test_a_copy_cannot_kill_its_parent_or_its_sibling(worker):
    attacker, victim, _, _ = await _copies(worker)
    hit = await attack(attacker, _RAW + "import signal\n"
                                 "probe('parent', lambda: os.kill(parent, signal.SIGKILL))\n"
                                 "probe('sibling', lambda: os.kill(sibling, signal.SIGKILL))\n"
                                 "probe('group', lambda: os.killpg(os.getpgid(parent), signal.SIGKILL))\n"
                                 "def by_pidfd(pid):\n"
                                 "    fd = os.pidfd_open(pid)\n"
                                 "    try:\n"
                                 "        signal.pidfd_send_signal(fd, signal.SIGKILL)\n"
                                 "    finally:\n"
                                 "        os.close(fd)\n"
                                 "probe('pidfd-parent', lambda: by_pidfd(parent))\n"
                                 "probe('pidfd-sibling', lambda: by_pidfd(sibling))\n"
                                 "probe('tgkill', lambda: raw('tgkill', parent, parent, 9))\n"
                                 "import fcntl\n"
                                 "def by_sigio(pid):\n"  # (SIGIO's default action ends a process)
                                 "    r, w = os.pipe()\n"
                                 "    fcntl.fcntl(r, fcntl.F_SETOWN, pid)\n"
                                 "    fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)\n"
                                 "    os.write(w, b'x')\n"
                                 "probe('sigio', lambda: [by_sigio(parent), by_sigio(sibling)])")
    said = hit.probes
    refused = ("PermissionError EPERM", "ProcessLookupError ESRCH")
    for name in ("parent", "sibling", "pidfd-parent", "pidfd-sibling", "tgkill"):
        assert said.get(name) in refused, (name, hit.result.output)
    assert said.get("parent") == said.get("sibling") == "PermissionError EPERM", hit.result.output
    assert said.get("group") in refused, hit.result.output
    await assert_still_works(worker)
    await assert_still_works(victim)


async def test_a_copy_cannot_read_its_parents_or_siblings_memory_or_descriptors(worker):
    await worker.run("secret = 'parent-only-' + 'x' * 8")
    attacker, _, _, _ = await _copies(worker)
    hit = await attack(attacker, _RAW + "for who, pid in (('parent', parent), ('sibling', sibling)):\n"
                                 "    for what in ('mem', 'environ', 'maps'):\n"
                                 "        probe(f'{who}/{what}', lambda: open(f'/proc/{pid}/{what}', 'rb').read(4096))\n"
                                 "    probe(f'{who}/fd', lambda: os.listdir(f'/proc/{pid}/fd'))\n"
                                 "    buf = _ctypes.create_string_buffer(64)\n"
                                 "    mine = (_ctypes.c_void_p * 2)(_ctypes.addressof(buf), 64)\n"
                                 "    theirs = (_ctypes.c_void_p * 2)(id(secret), 64)\n"
                                 "    probe(f'{who}/vm_readv', lambda: raw('process_vm_readv', pid, mine, 1, theirs, 1, 0))")
    said = hit.probes
    wanted = [f"{who}/{what}" for who in ("parent", "sibling") for what in ("mem", "environ", "maps", "fd", "vm_readv")]
    assert all(said.get(k) in ("PermissionError EACCES", "FileNotFoundError ENOENT", "PermissionError EPERM")
               for k in wanted), hit.result.output
    assert "parent-only" not in hit.result.output
    await assert_still_works(worker)


async def test_a_copy_cannot_reach_its_parents_abstract_socket(worker):
    attacker, _, _, _ = await _copies(worker)
    hit = await attack(attacker, "import socket\ndef reach():\n"
                                 "    with socket.socket(socket.AF_UNIX) as s:\n"
                                 "        s.settimeout(5)\n        s.connect(name)\n"
                                 "probe('reach', reach)")
    assert hit.probes.get("reach") == "PermissionError EPERM", hit.result.output
    reached = await worker.run("with socket.socket(socket.AF_UNIX) as s: s.connect(name)\nprint('reached')")
    assert reached.output.strip() == "reached", reached
    await assert_still_works(worker)
