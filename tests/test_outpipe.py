"""The output pipes of a local worker, both ends in this process: framing, moved fd output,
what a death leaves (a cut frame, a cut moved chunk, bytes the pump never moved), and what a
hostile worker could write."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from engine.errors import OutputError
from engine.launch import OutputPipes
from worker._outpipe import PipeWriter, open_fifos
from worker.contract import wire
from worker.contract.framing import HEADER, encode
from worker.contract.limits import MAX_CHUNK, MAX_FRAME, STDERR, STDOUT


@pytest.fixture
def ends(tmp_path: Path):
    coordinator = OutputPipes(tmp_path)
    worker = open_fifos(str(tmp_path))
    yield coordinator, worker
    coordinator.close()
    for fd in [worker.out, *(end for pair in worker.pipes.values() for end in pair)]:
        os.close(fd)


def _all(pipes: OutputPipes) -> list[dict]:
    pipes.read(pipes.capacity, probe=True)
    found = []
    while (msg := pipes.next()) is not None:
        found.append(msg)
    return found


def test_frames_arrive_whole_and_in_order(ends):
    pipes, fifos = ends
    writer = PipeWriter(fifos.out)
    for i in range(3):
        writer.send(_out("b1", [[STDOUT, b"line %d\n" % i]]))
    assert _all(pipes) == [_out("b1", [[STDOUT, b"line %d\n" % i]]) for i in range(3)]


def test_a_frame_read_in_pieces_waits_for_its_end(ends):
    pipes, fifos = ends
    frame = encode(_out("b1", [[STDERR, b"x" * 1000]]))
    data = HEADER.pack(len(frame)) + frame
    os.write(fifos.out, data[:500])
    assert _all(pipes) == []
    os.write(fifos.out, data[500:])
    assert _all(pipes) == [_out("b1", [[STDERR, b"x" * 1000]])]


def test_fd_output_is_moved_whole_and_what_was_not_moved_stays_for_after_the_death(ends):
    pipes, fifos = ends
    (read1, write1), (_, write2) = fifos.pipes[1], fifos.pipes[2]
    os.write(write1, b"from a subprocess\n")
    PipeWriter(fifos.out).move("b1", STDOUT, read1, 5)
    assert _all(pipes) == [_out("b1", [[STDOUT, b"from "]])]
    os.write(write2, b"on stderr\n")
    assert pipes.leftovers(1 << 20) == [(STDOUT, b"a subprocess\n"), (STDERR, b"on stderr\n")]
    assert pipes.leftovers(1 << 20) == []


def test_the_end_of_a_worker_that_died_mid_write(ends):
    pipes, fifos = ends
    header = encode(_out("b1", [], [STDOUT, 10]))
    frame = encode(_out("b1", [[STDOUT, b"never whole"]]))
    os.write(fifos.out, HEADER.pack(len(header)) + header + b"half")
    assert _all(pipes) == [_out("b1", [[STDOUT, b"half"]])]  # what of a moved chunk came
    os.write(fifos.out, b"-rest-" + HEADER.pack(len(frame)) + frame[:5])
    assert _all(pipes) == [_out("b1", [[STDOUT, b"-rest-"]])]
    os.close(fifos.out)
    fifos.out = os.open(os.devnull, os.O_WRONLY)  # (for the fixture to close)
    assert _all(pipes) == [] and pipes.ended  # the cut frame is dropped


def test_names_go_once_the_worker_has_opened_them(ends, tmp_path: Path):
    pipes, _ = ends
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fd1", "fd2", "out"]
    pipes.unlink()
    assert list(tmp_path.iterdir()) == []


def _out(block_id: str, chunks: list, raw: list | None = None) -> wire.Out:
    return wire.Out(block_id, tuple(tuple(c) for c in chunks), tuple(raw) if raw is not None else None)


def _frame(msg: wire.Out | dict) -> bytes:
    data = encode(msg)
    return HEADER.pack(len(data)) + data


@pytest.mark.parametrize("data", [
    b"\x00\x00\x00\x00",
    HEADER.pack(MAX_FRAME + 1),
    HEADER.pack(2) + b"\xc1\xc1",
    _frame({"t": "done", "id": "b1", "status": "ok"}),
    _frame({"t": "out", "id": "b1", "o": [], "raw": [3, 10]}),
    _frame({"t": "out", "id": "b1", "o": [], "raw": [STDOUT, MAX_CHUNK + 1]}),
    _frame({"t": "out", "id": "b1", "o": [], "raw": [STDOUT, "10"]}),
], ids=["zero length", "over the limit", "not msgpack", "not output", "moved to no stream",
        "moved chunk over the limit", "moved chunk of no size"])
def test_what_breaks_the_protocol(ends, data: bytes):
    pipes, fifos = ends
    os.write(fifos.out, data)
    with pytest.raises(OutputError):
        _all(pipes)


def test_the_writer_leaves_the_signal_mask_as_it_found_it(ends):
    _, fifos = ends
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    PipeWriter(fifos.out, keep=signal.SIGUSR1).send(_out("b1", [[STDOUT, b"x"]]))
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
