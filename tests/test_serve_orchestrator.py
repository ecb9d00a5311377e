"""The orchestrator against a small fake engine whose outputs are worked out by hand: which
request gets which slot and when, what each request receives, and that every slot comes back.
No JAX programs: this pins down the scheduling logic alone."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import wait_until

from dspark_jax.engine import StepOutput
from dspark_jax.sampling import SamplingParams
from serve.orchestrator import Chunk, Failure, NotServing, Orchestrator, QueueFull
from serve.requests import Prepared


class LetterTokenizer:
    """Token t decodes to the letter chr(ord('a') + t % 26)."""

    chat_template = None

    def decode(self, ids, **kwargs):
        return "".join(chr(ord("a") + t % 26) for t in ids)


class FakeEngine:
    """Each step, every live slot commits two tokens: last + 1, last + 2 (last = the prompt's
    final id at first), until its budget is met ("length"). Inserts and frees are logged."""

    block_size = 1
    max_len = 64
    extra_positions = 0
    policy = "none"
    mesh = None

    def __init__(self, slots=2):
        self.slots = slots
        self.log = []
        self.gate = threading.Event()
        self.gate.set()

    def new_state(self):
        return {}

    def insert_many(self, state, requests):
        for slot, ids, params in requests:
            assert slot not in state, f"slot {slot} inserted while busy"
            state[slot] = {"last": ids[-1], "left": params.max_new_tokens}
            self.log.append(("insert", slot, ids[0]))
        return state

    def free(self, state, slot):
        state.pop(slot, None)
        self.log.append(("free", slot))
        return state

    def step(self, state, rounds=1):
        self.gate.wait(30)
        n = self.slots
        tokens, finished = [[] for _ in range(n)], [False] * n
        for slot, row in state.items():
            if row["left"] <= 0:
                finished[slot] = True
                continue
            k = min(2, row["left"])
            tokens[slot] = [row["last"] + i + 1 for i in range(k)]
            row["last"] += k
            row["left"] -= k
            finished[slot] = row["left"] == 0
        return state, StepOutput(tokens=tokens, finished=finished,
                                 finish_reason=["length" if f else None for f in finished], drafted=[0] * n,
                                 accepted=[0] * n, rounds=1, round_accepted=[[0] if t else [] for t in tokens],
                                 round_lengths=[[0] if t else [] for t in tokens])


def job(request_id, first, last, budget, stops=()):
    return Prepared(request_id=request_id, prompt_ids=[first, last],
                    params=SamplingParams(max_new_tokens=budget), stops=tuple(stops))


def events(j, timeout=10.0):
    out = []
    while True:
        e = j.events.get(timeout=timeout)
        out.append(e)
        if isinstance(e, Failure) or e.finish is not None:
            return out


@pytest.fixture
def orch():
    engine = FakeEngine(slots=2)
    o = Orchestrator(engine, LetterTokenizer(), queue_size=1)
    o.start()
    yield o
    o.stop()


def test_tokens_text_and_slot_order_worked_out_by_hand(orch):
    engine = orch.engine
    engine.gate.clear()  # hold the first step until all three are queued
    a = orch.submit(job("a", 100, 0, 5))  # tokens 1..5  -> "bcdef"
    b = orch.submit(job("b", 101, 10, 3))  # tokens 11..13 -> "lmn"
    c = orch.submit(job("c", 102, 20, 2))  # waits for a slot: tokens 21, 22 -> "vw"
    engine.gate.set()
    ea, eb, ec = events(a), events(b), events(c)
    assert [e.token_ids for e in ea] == [[1, 2], [3, 4], [5]]
    assert "".join(e.text for e in ea) == "bcdef" and ea[-1].finish == "length" and ea[-1].completion_tokens == 5
    assert [e.token_ids for e in eb] == [[11, 12], [13]] and "".join(e.text for e in eb) == "lmn"
    assert [e.token_ids for e in ec] == [[21, 22]] and ec[-1].prompt_tokens == 2
    # b finishes after its second step and frees its slot; c takes that slot in the same pass.
    inserts = [entry for entry in engine.log if entry[0] == "insert"]
    assert [i[2] for i in inserts] == [100, 101, 102]
    assert engine.log.index(("free", inserts[1][1])) < engine.log.index(inserts[2])
    assert inserts[2][1] == inserts[1][1]
    assert wait_until(lambda: orch.in_flight() == 0 and sorted(orch._free) == [0, 1])


def test_queue_limit_cancel_admits_the_next_at_once_and_abort(orch):
    engine = orch.engine
    engine.gate.clear()
    a = orch.submit(job("a", 1, 0, 40))
    b = orch.submit(job("b", 2, 0, 40))
    assert wait_until(lambda: len(orch._running) == 2)  # both in slots, the loop held in its step
    c = orch.submit(job("c", 3, 0, 4))  # the one waiting place
    with pytest.raises(QueueFull):
        orch.submit(job("d", 4, 0, 4))
    orch.cancel(a)  # the client went away
    assert orch.abort("b") and not orch.abort("zzz")
    engine.gate.set()
    assert isinstance(events(a)[-1], Failure)
    assert events(b)[-1].finish == "abort"
    assert [e.token_ids for e in events(c)] == [[1, 2], [3, 4]]
    # a and b were freed before c's insert: c went in right after the step they were cut in.
    log = engine.log
    frees = [i for i, e in enumerate(log) if e[0] == "free"]
    insert_c = next(i for i, e in enumerate(log) if e[0] == "insert" and e[2] == 3)
    assert sum(f < insert_c for f in frees) >= 1
    assert wait_until(lambda: orch.in_flight() == 0 and sorted(orch._free) == [0, 1])


def test_stop_string_deadline_drain_and_fault(orch):
    s = orch.submit(job("s", 1, 0, 20, stops=["de"]))  # b c d e ...: stops before "de"
    es = events(s)
    assert "".join(e.text for e in es) == "bc" and es[-1].finish == "stop" and es[-1].completion_tokens == 4
    late = orch.submit(job("late", 1, 0, 20), deadline=time.monotonic() - 1)
    assert events(late)[-1].kind == "deadline"
    assert orch.drain(5)
    with pytest.raises(NotServing):
        orch.submit(job("after", 1, 0, 2))


def test_engine_fault_fails_everything_and_reports():
    engine = FakeEngine(slots=1)
    faults = []

    def broken(state, rounds=1):
        raise RuntimeError("boom")

    engine.step = broken
    o = Orchestrator(engine, LetterTokenizer(), queue_size=2, on_fault=faults.append)
    o.start()
    try:
        a, b = o.submit(job("a", 1, 0, 4)), o.submit(job("b", 1, 0, 4))
        assert events(a)[-1].kind == "internal" and events(b)[-1].kind == "internal"
        assert faults and "boom" in faults[0]
        with pytest.raises(NotServing):
            o.submit(job("c", 1, 0, 4))
    finally:
        o.stop()


def test_stop_requested_during_startup_is_not_served():
    """A stop signal whose exception was swallowed during start-up (CI saw it raised inside JAX's
    gc callback) leaves only the stop flag: start() must still end before serving, health never
    SERVING and no orchestrator running."""
    import types

    from grpc_health.v1 import health_pb2

    from serve.server import Server, StartupInterrupted

    engine = FakeEngine(slots=2)
    engine.settings = types.SimpleNamespace(dconfig=None, config=types.SimpleNamespace(vocab_size=64))  # no drafter
    srv = Server(engine, LetterTokenizer(), port=0, host="localhost", queue_size=2)
    try:
        with pytest.raises(StartupInterrupted):
            srv.start(warmup=False, interrupted=lambda: True)
        assert not srv.ready.is_set()
        assert srv.health.Check(health_pb2.HealthCheckRequest(), None).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        srv.stop(0)
