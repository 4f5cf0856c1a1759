"""The channel of ``agentloop exec FILE``'s confiner (``worker.confiner``), the first process of
the script's sandbox: its setup comes as its first argument (one JSON object), then two pipes
the coordinator made carry frames (``framing``) of ASCII JSON (the confiner runs without
site-packages: no msgpack).

Coordinator -> confiner (``TO_CONFINER``)
    setup    {confine, status, control, stderr, tty?, ignored, parent, lc_ctype?, egress}
                                the confinement (a ``Confinement``'s map), the descriptors
                                of the two pipes and of the script's stderr, the pty slave to make
                                the controlling terminal (none without one), the signals the script
                                starts with ignored, the coordinator's pid (0 under a PID namespace),
                                the script's LC_CTYPE (none: unset) and the egress gate's socket
                                its forwarder relays to (``--allow-net``; empty: no network)
    signal   {to, signal}       deliver ``signal`` to the script's process ``group`` or to the
                                ``program`` alone (the control pipe; its end kills everything)
Confiner -> coordinator (``TO_COORDINATOR``, the status pipe)
    exited     {code}      the script exited with ``code``
    killed     {signal}    the script died of ``signal``
    stopped    {signal}    the script stopped (``signal``: SIGTSTP, SIGSTOP, ...)
    continued  {}          the script was continued
    failed     {error}     the sandbox could not be applied, or the script not started
"""

from __future__ import annotations

from .confinement import Confinement
from .limits import MAX_ERROR
from .schema import (
    Catalogue,
    Message,
    field,
    is_choice,
    is_int,
    is_list,
    is_message,
    is_optional,
    is_text,
    message,
)

__all__ = ["MAX_MESSAGE", "TO_CONFINER", "TO_COORDINATOR", "Continued", "Exited", "Failed", "Killed", "Setup",
           "Signal", "Stopped"]

#: The largest frame either side accepts (a setup holds the confinement: paths, a few KiB).
MAX_MESSAGE = 1 << 20
_FD = is_int(0, 1 << 20)
_SIGNAL = is_int(1, 64)


@message("setup")
class Setup(Message):
    confine: Confinement = field(is_message(Confinement))
    status: int = field(_FD)
    control: int = field(_FD)
    stderr: int = field(_FD)
    tty: int | None = field(is_optional(_FD), None)
    ignored: tuple[int, ...] = field(is_list(_SIGNAL, 64), ())
    parent: int = field(is_int(0, 2**31), 0)
    lc_ctype: str | None = field(is_optional(is_text(256)), None)
    egress: str = field(is_text(4096), "")


@message("signal")
class Signal(Message):
    to: str = field(is_choice("group", "program"))
    signal: int = field(_SIGNAL)


TO_CONFINER = Catalogue("coordinator to the confiner", (Setup, Signal))


@message("exited")
class Exited(Message):
    code: int = field(is_int(0, 255))


@message("killed")
class Killed(Message):
    signal: int = field(_SIGNAL)


@message("stopped")
class Stopped(Message):
    signal: int = field(_SIGNAL)


@message("continued")
class Continued(Message):
    pass


@message("failed")
class Failed(Message):
    error: str = field(is_text(MAX_ERROR))


TO_COORDINATOR = Catalogue("the confiner to coordinator", (Exited, Killed, Stopped, Continued, Failed))
