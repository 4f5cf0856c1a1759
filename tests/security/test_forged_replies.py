"""The coordinator against a worker that forges its replies to control requests.

Each control request (``bind``, ``export``, ``inject``, ``describe``, ``env``) has its own typed
reply; the worker's code rewires the worker's answering so that the next request is answered
with a reply of the wrong shape (a field mistyped, a bound broken, a key no reply has, another
request's reply).  Each must stop that worker at once, end the request in words naming what was
wrong (which proves the forged reply was sent and read), and leave a replacement that answers
honestly.  A reply to no request is dropped, not obeyed.
"""

from __future__ import annotations

import pytest

from engine.errors import WorkerError
from engine.workers import Engine, WorkerState
from worker.contract import wire
from worker.contract.limits import MAX_ERROR

from .harness import WAIT, agent_attack, assert_still_works, attack, block

pytestmark = pytest.mark.attack

# The worker's code finds the worker's own answering of control requests (``serve.Crew``) and
# replaces it: ``forge`` sends any map as a reply, ``true_answer`` is the honest one.
FIND_ANSWERING = '''
import gc
import msgpack
crew = next(o for o in gc.get_objects() if type(o).__name__ == "Crew")
true_answer = crew._answer
def forge(reply):
    crew.channel.send_frame(msgpack.packb(reply, use_bin_type=True))
'''


def arm(body: str) -> str:
    """Attack code: from now on, each control request ``msg`` is answered by ``body``."""
    return FIND_ANSWERING + f"def forged(msg):\n    rid = msg.rid\n    {body}\ncrew._answer = forged\nprint('armed', flush=True)\n"


_BIND = wire.Bind((wire.HostFunction("lookup", "(key)"),))
_EXPORT = wire.Export(("x",))
_INJECT = wire.Inject({"x": wire.Item("value", 1)})
_DESCRIBE = wire.Describe(("x",))
_ENV = wire.Env()

#: The request, the worker's forged answer to it (``rid`` is the request's), and the words the
#: worker's stop names.
FORGED = {
    "bind: its names not a list": (_BIND, 'forge({"t": "bound", "rid": rid, "names": "lookup"})', "bound.names"),
    "bind: answered with another request's reply":
        (_BIND, 'forge({"t": "described", "rid": rid, "entries": []})', "'described' where 'bound' answers"),
    "export: an item of two kinds at once":
        (_EXPORT, 'forge({"t": "exported", "rid": rid, "items": {"x": {"kind": "host", "name": "f", "data": b"p"}}})',
         "exported.items"),
    "export: an item with a key no item has":
        (_EXPORT, 'forge({"t": "exported", "rid": rid, "items": {"x": {"kind": "host", "name": "f", "spec": {}}}})',
         "unknown field 'spec'"),
    "export: plain data nested past its bound":
        (_EXPORT, 'v = 1\n    for _ in range(200): v = [v]\n'
                  '    forge({"t": "exported", "rid": rid, "items": {"x": {"kind": "value", "value": v}}})', "nested"),
    "export: answered as a host call's reply":
        (_EXPORT, 'forge({"t": "reply", "cid": rid, "ok": True, "value": {"items": {}, "errors": {}}})',
         "not a message of this channel: 'reply'"),
    "inject: more names than it could define":
        (_INJECT, f'forge({{"t": "injected", "rid": rid, "names": ["n"] * {wire.MAX_HANDED + 1}}})', "injected.names"),
    "describe: an entry over its bound":
        (_DESCRIBE, f'forge({{"t": "described", "rid": rid, "entries": ["x" * {wire.MAX_ENTRY + 1}]}})',
         "described.entries"),
    "env: its count of cores a word": (_ENV, 'forge({"t": "environment", "rid": rid, "cpu": "lots"})', "environment.cpu"),
    "env: ten thousand packages":
        (_ENV, 'forge({"t": "environment", "rid": rid, "packages": ["p"] * 10_000})', "environment.packages"),
    "env: the old untyped reply": (_ENV, 'forge({"t": "resp", "rid": rid, "ok": True, "value": {}})',
                                   "not a message of this channel: 'resp'"),
    "refused: its words over their bound":
        (_ENV, f'forge({{"t": "refused", "rid": rid, "error": "e" * {MAX_ERROR + 1}}})', "refused.error"),
}


@pytest.mark.parametrize("kind", list(FORGED))
async def test_a_forged_reply_stops_the_worker_and_ends_its_request_in_words(worker, kind: str):
    request, body, words = FORGED[kind]
    await worker.run("x = 1", timeout=WAIT)
    got = await attack(worker, arm(body))
    assert got.result.ok and "armed" in got.result.output, got.result
    first = worker.pid
    with pytest.raises(WorkerError) as stopped:
        await worker.request(request, timeout=WAIT)
    said = str(stopped.value)
    assert "the worker broke the protocol (" in said and words in said, said
    assert worker.state is not WorkerState.CLOSED
    # The replacement is another process, and answers honestly.
    reply = await worker.request(wire.Env(), timeout=WAIT)
    assert isinstance(reply, wire.Environment) and reply.python and worker.pid != first
    await assert_still_works(worker)


async def test_replies_to_no_request_are_dropped_and_the_true_one_answers(worker):
    # Replies for a request never made (a later rid, the one just made's again afterwards) and
    # one sent ahead of any request: dropped, never obeyed, and no reason to stop the worker.
    ahead = FIND_ANSWERING + 'forge({"t": "environment", "rid": 1, "python": "ahead"})\nprint("sent", flush=True)\n'
    got = await attack(worker, ahead)
    assert got.result.ok and "sent" in got.result.output, got.result
    got = await attack(worker, arm('forge({"t": "environment", "rid": rid + 1000, "python": "forged"})\n'
                                   '    true_answer(msg)\n'
                                   '    forge({"t": "environment", "rid": rid, "python": "late"})'))
    assert got.result.ok and "armed" in got.result.output, got.result
    session, first = worker.session, worker.pid
    dropped = session.dropped
    for _ in range(2):
        reply = await worker.request(wire.Env(), timeout=WAIT)
        assert isinstance(reply, wire.Environment) and reply.python not in ("ahead", "forged", "late"), reply
    await assert_still_works(worker)
    assert worker.pid == first and worker.session is session
    assert session.dropped >= dropped + 3  # (the forged one and the late one of each request, at least)


async def test_a_forged_export_ends_a_sub_agent_start_in_words_and_the_run_goes_on(engine: Engine):
    # The model asks for a sub-agent with an object of its namespace; the worker answers the
    # export with an item of the wrong shape.  The model reads why no sub-agent started.
    forge = arm('forge({"t": "exported", "rid": rid, "items": {"x": {"kind": "pickle"}}})')
    run = await agent_attack(engine, block("attack", "x = 1\n" + forge),
                             '<run_agent name="kid" namespace="x">kid task</run_agent>', name="forged export")
    assert "armed" in run.blocks["attack"], run.blocks
    seen = "".join(m["content"] for body in run.server.requests for m in body["messages"] if m["role"] == "user")
    assert "<error name=kid>" in seen and "Could not start this sub-agent" in seen, seen[-3000:]
    assert "the worker broke the protocol (" in seen and "exported.items" in seen, seen[-3000:]
    run.assert_kept_working()
