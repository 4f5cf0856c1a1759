"""The worker's one socket to the coordinator, shared by all of its threads.

Any thread sends (a block's ``done`` from the thread that ran it, a full output batch from
the thread that wrote it): handing every frame to one sender thread would put two thread
wake-ups on every round trip.  One thread at a time listens (see ``serve``).

libzmq sockets are not thread-safe, so every socket operation holds ``_lock`` (a mutex is
also the memory barrier libzmq asks for when a socket changes threads).  The socket's file
descriptor is edge-triggered and any operation may consume its signal, so a sender that
finds a message waiting wakes the listener through a pipe; the listener never sleeps while
a message waits.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time

import zmq

from .contract.framing import encode
from .contract.limits import MAX_FRAME

__all__ = ["Channel", "SEND_TIMEOUT_MS"]

# Plain ints: the enum members cost an enum construction per use on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

#: How long a send may wait for the coordinator to take frames before the frame is dropped
#: with a diagnostic (the coordinator reads all the time; only a wedged one makes this wait).
SEND_TIMEOUT_MS = 30_000


class Channel:
    """One DEALER socket, a lock around it, and a wake-up pipe for the listening thread."""

    def __init__(self, endpoint: str, diag_fd: int = 2, curve: str = "") -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if curve:  # "SERVER_PUBLIC PUBLIC SECRET" (z85): the coordinator lets in this key alone
            server, public, secret = curve.encode().split()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            # While a stranger holds the coordinator's door, our SYNs go unanswered: try again
            # soon rather than at TCP's own backoff.
            self.sock.setsockopt(zmq.CONNECT_TIMEOUT, 1000)
        self.sock.connect(endpoint)
        self.diag_fd = diag_fd
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self.sock.getsockopt(zmq.FD), select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)

    def send(self, msg) -> None:
        """Encode and send one message; from any thread.  Waits while the coordinator's queue is
        full (that is the backpressure on output)."""
        self.send_frame(encode(msg))

    def send_frame(self, frame: bytes) -> None:
        with self._lock:
            try:
                # copy=True always: the zero-copy path needs a new file descriptor, and user
                # code that used them all up must not cut the channel.
                self.sock.send(frame, copy=True)
            except zmq.ZMQError as exc:
                os.write(self.diag_fd, f"agentloop worker: a frame was not sent: {exc}\n".encode())
            waiting = self.sock.getsockopt(_EVENTS) & _POLLIN
        if waiting:
            self.wake()

    def wake(self) -> None:
        """Make the listener look at the socket (or at whatever else it watches) now."""
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # a wake-up is already pending

    def receive(self, timeout: float | None, spin: float = 0.0) -> list[bytes]:
        """The frames waiting, after waiting up to ``timeout`` seconds (None: until one comes
        or ``wake``).  An empty list on timeout or wake-up.  One thread at a time.

        ``spin``: seconds to poll the socket before sleeping.  Right after a block, the next
        request often follows within a round trip, and a thread that slept pays a wake-up
        (20-50 us on a small VM, where idle vCPUs halt) to hear it."""
        frames = self._take()
        if frames:
            return frames
        if spin:
            until = time.perf_counter() + spin
            while time.perf_counter() < until:
                frames = self._take()
                if frames:
                    return frames
        # Rounded up: a timeout rounded down to 0 ms would make the caller spin until its due.
        self._poll.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        return self._take()

    def _take(self) -> list[bytes]:
        frames = []
        with self._lock:
            while len(frames) < 64 and self.sock.getsockopt(_EVENTS) & _POLLIN:
                try:
                    frames.append(self.sock.recv(_NOBLOCK, copy=True))
                except zmq.Again:
                    break
            if len(frames) == 64:
                self.wake()  # more wait: the next receive must not sleep
        return frames

    def close(self) -> None:
        """Close the socket and wait (up to its linger) until what was sent has left."""
        with self._lock:
            self.sock.close(linger=2000)
        self.ctx.term()
