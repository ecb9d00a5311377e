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
        self.rounds = []  # rounds asked of each step
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
        self.on_free()
        state.pop(slot, None)
        self.log.append(("free", slot))
        return state

    def on_free(self):
        """A test's hook, run as each free begins (to hold the loop there)."""

    def step(self, state, rounds=1):
        self.gate.wait(30)
        self.rounds.append(rounds)
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


def test_steps_run_the_configured_rounds_but_one_round_before_a_first_token():
    """A step runs `rounds` rounds, except while a request admitted since the last step has not
    had its first token (a 4-round step would hold it back)."""
    engine = FakeEngine(slots=2)
    o = Orchestrator(engine, LetterTokenizer(), queue_size=1, rounds=4)
    o.start()
    try:
        a = o.submit(job("a", 1, 0, 8))  # 4 steps of 2 tokens
        assert [e.token_ids for e in events(a)] == [[1, 2], [3, 4], [5, 6], [7, 8]]
        assert engine.rounds == [1, 4, 4, 4]
        b = o.submit(job("b", 2, 10, 4))
        assert [e.token_ids for e in events(b)] == [[11, 12], [13, 14]]
        assert engine.rounds[4:] == [1, 4]
    finally:
        o.stop()


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


def test_the_bound_counts_requests_in_flight_while_slots_change_hands():
    """Slots + queue bound the requests in flight at every moment: a request given up while
    queued frees its place at once, and while the loop hands freed slots to queued requests (a
    freed slot is back in the free list before the next request takes it) no extra one gets in."""
    engine = FakeEngine(slots=2)
    o = Orchestrator(engine, LetterTokenizer(), queue_size=2)
    o.start()
    try:
        engine.gate.clear()
        a, b = o.submit(job("a", 1, 0, 40)), o.submit(job("b", 2, 0, 40))
        assert wait_until(lambda: len(o._running) == 2)
        c, d = o.submit(job("c", 3, 0, 4)), o.submit(job("d", 4, 0, 4))
        with pytest.raises(QueueFull):
            o.submit(job("x", 5, 0, 4))
        assert o.abort("c")  # still queued: its place is free before the loop's next pass
        e = o.submit(job("e", 6, 0, 4))
        # Hold the loop in the second of the frees of a and b: a's slot is back in the free list,
        # promised to d, e being admitted with b's.
        frees, holding, release = [], threading.Event(), threading.Event()

        def hook():
            frees.append(1)
            if len(frees) == 2:
                holding.set()
                release.wait(10)

        engine.on_free = hook
        o.abort("a"), o.abort("b")
        engine.gate.set()
        assert holding.wait(10)
        f, g = o.submit(job("f", 7, 0, 4)), o.submit(job("g", 8, 0, 4))  # d, e take the slots: 2 may wait
        with pytest.raises(QueueFull):
            o.submit(job("h", 9, 0, 4))
        release.set()
        assert [events(j)[-1].finish for j in (b, d, e, f, g)] == ["abort", "length", "length", "length", "length"]
        assert events(a)[-1].finish == "abort" and events(c)[-1].finish == "abort"
        assert wait_until(lambda: o.in_flight() == 0 and sorted(o._free) == [0, 1])
    finally:
        release.set()
        o.stop()


def test_a_deadline_is_counted_as_one_though_grpc_also_cancels_the_call(orch):
    """gRPC cancels a call when its deadline passes; the request still ends as a deadline, in
    its failure and in the metric."""
    engine = orch.engine
    engine.gate.clear()
    running = [orch.submit(job(f"r{i}", 1, 0, 40)) for i in range(2)]
    assert wait_until(lambda: len(orch._running) == 2)
    late = orch.submit(job("late", 3, 0, 4), deadline=time.monotonic() + 0.05)
    time.sleep(0.1)
    orch.cancel(late)  # what the server's call callback does at the deadline
    before = orch.metrics.failed.labels(reason="deadline")._value.get()
    for r in running:
        orch.abort(r.request_id)
    engine.gate.set()
    assert events(late)[-1].kind == "deadline"
    assert orch.metrics.failed.labels(reason="deadline")._value.get() == before + 1


class ByteTokenizer:
    """Tokens below 300 are letters (as LetterTokenizer); 300 is a space and the first byte of
    "é", whose text is incomplete until another token brings the second byte."""

    chat_template = None

    def decode(self, ids, **kwargs):
        raw = b"".join(b" \xc3" if t == 300 else bytes([ord("a") + t % 26]) for t in ids)
        return raw.decode("utf-8", errors="replace")


def test_a_stop_string_completed_by_the_last_token_before_a_partial_character():
    """The request's last token completes the stop string "n " and ends in half a character:
    the final flush still finds the stop (finish "stop", its text cut before it)."""
    o = Orchestrator(FakeEngine(slots=1), ByteTokenizer(), queue_size=1)
    o.start()
    try:
        j = o.submit(job("j", 1, 297, 3, stops=["n "]))  # tokens 298, 299, 300: "m", "n", " " + half of "é"
        out = events(j)
        assert out[-1].finish == "stop" and "".join(e.text for e in out) == "m"
    finally:
        o.stop()


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
