"""Continuous batching over an Engine: one thread owns the engine and its slot state.

Between steps it frees the slots of finished, aborted, cancelled and expired requests, prefills
waiting requests into free slots (one insert program for all of them), then runs one engine step
for every live slot and hands each request the tokens it committed. A step runs up to `rounds`
rounds (one program, one copy to the host), and one round while a new request awaits its first
token. gRPC handler threads only submit, cancel and read their request's event queue; they never
touch the engine.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from dspark_jax.prompts import PromptError
from serve.metrics import ServerMetrics
from serve.requests import InvalidRequest, Prepared
from serve.textstream import TextStream

log = logging.getLogger("dspark.serve")


class QueueFull(Exception):
    """The admission queue is at capacity (the server answers RESOURCE_EXHAUSTED)."""


class NotServing(Exception):
    """Draining or failed: new requests are refused (UNAVAILABLE)."""


@dataclasses.dataclass
class Chunk:
    """Tokens a request committed in one step; the last chunk has `finish` set and its usage."""

    text: str
    token_ids: list[int]
    finish: str | None = None  # "length" | "stop" | "eos" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0


@dataclasses.dataclass
class Failure:
    """The request ended by an error: "deadline", "internal" or "invalid" (with a message)."""

    kind: str
    message: str


@dataclasses.dataclass(eq=False)
class Job:
    """One request from arrival to its last event."""

    prepared: Prepared
    deadline: float | None  # time.monotonic() after which it is dropped, or None
    stream: TextStream
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    slot: int | None = None
    cancel: str | None = None  # "abort" | "cancelled": set by other threads, acted on by the loop
    done: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def request_id(self) -> str:
        return self.prepared.request_id


class Orchestrator:
    """Owns `engine` and its state; `submit` from any thread, events arrive on `job.events`."""

    def __init__(self, engine, tokenizer, *, queue_size: int = 64, rounds: int = 1,
                 metrics: ServerMetrics | None = None, on_fault: Callable[[str], None] | None = None):
        if queue_size < 0 or rounds < 1:
            raise ValueError("queue_size must be >= 0 and rounds >= 1")
        self.engine = engine
        self.tokenizer = tokenizer
        self.queue_size = int(queue_size)
        self.rounds = int(rounds)
        self.metrics = metrics if metrics is not None else ServerMetrics(positions=engine.block_size)
        self.on_fault = on_fault
        self.state = engine.new_state()
        self.fault: str | None = None
        self.accepting = True
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}
        self._free = list(range(engine.slots))
        self._by_id: dict[str, Job] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dspark-orchestrator", daemon=True)

    # ------------------------------------------------------------ other threads
    def start(self) -> None:
        self._thread.start()

    def submit(self, prepared: Prepared, deadline: float | None = None) -> Job:
        """Queue a request; raises QueueFull, NotServing or InvalidRequest (request id in use)."""
        job = Job(prepared=prepared, deadline=deadline,
                  stream=TextStream(self.tokenizer, prepared.stops, prepared.prompt_ids))
        with self._lock:
            if self.fault is not None:
                raise NotServing(f"the engine failed ({self.fault}); the server must be restarted")
            if not self.accepting:
                raise NotServing("the server is draining (shutting down)")
            if job.request_id in self._by_id:
                raise InvalidRequest("request_id", f"{job.request_id!r} is already in flight")
            # The bound is on the requests in flight (slots + queue), counted under the lock: the
            # free-slot list lags while the loop moves requests from the queue into slots (it
            # counted a slot being freed once for its next request and once for a new one), and a
            # request given up holds no place although it leaves the books only at the next pass.
            live = sum(1 for j in self._by_id.values() if j.cancel is None)
            if live >= self.engine.slots + self.queue_size:
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(f"{live} requests in flight fill the {self.engine.slots} slots and the queue of "
                                f"{self.queue_size}; retry later")
            self._waiting.append(job)
            self._by_id[job.request_id] = job
            self.metrics.waiting.set(len(self._waiting))
            self._changed.notify_all()
        return job

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The client is gone (or gave up): free its slot before the next step."""
        with self._lock:
            if not job.done and job.cancel is None:
                job.cancel = reason
                self._changed.notify_all()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            job = self._by_id.get(request_id)
            if job is None or job.done:
                return False
            job.cancel = job.cancel or "abort"
            self._changed.notify_all()
            return True

    def in_flight(self) -> int:
        with self._lock:
            return len(self._by_id)

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests and wait until every accepted one has finished; True if they all did."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self.accepting = False
            while self._by_id and self.fault is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            return not self._by_id

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._waiting and not self._running:
                        self._changed.wait()
                    if self._stopping:
                        return
                    now = time.monotonic()
                    ending = [j for j in self._running.values() if j.cancel or self._expired(j, now)]
                    dropped = [j for j in self._waiting if j.cancel or self._expired(j, now)]
                    for job in dropped:
                        self._waiting.remove(job)
                    free = len(self._free) + len(ending)
                    admit = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                for job in ending + dropped:
                    self._end_early(job, now)
                if admit:
                    self._admit(admit)
                if self._running:
                    self._step()
        except Exception as err:  # noqa: BLE001 - an engine fault ends every request, never the process
            self._fail_all(err)

    @staticmethod
    def _expired(job: Job, now: float) -> bool:
        return job.deadline is not None and now > job.deadline

    def _release(self, job: Job) -> None:
        """The job is over: its slot (if any) is freed and it leaves the books."""
        if job.slot is not None:
            self.state = self.engine.free(self.state, job.slot)
        with self._lock:
            if job.slot is not None:
                del self._running[job.slot]
                self._free.append(job.slot)
            job.done = True
            self._by_id.pop(job.request_id, None)
            self._update_gauges()
            self._changed.notify_all()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.slot_usage.set(len(self._running) / self.engine.slots)

    def _end_early(self, job: Job, now: float) -> None:
        if job.cancel == "abort":
            self._finish(job, "abort", [], now)
            return
        # gRPC cancels a call at its deadline, so an expired job usually carries "cancelled" too.
        reason = "deadline" if self._expired(job, now) else job.cancel or "deadline"
        self._release(job)
        self.metrics.failed.labels(reason=reason).inc()
        job.events.put(Failure(reason, "deadline exceeded" if reason == "deadline" else "cancelled by the client"))

    def _admit(self, jobs: list[Job]) -> None:
        with self._lock:
            self._free.sort(reverse=True)  # lowest slots first: a step visits the rows up to the highest live one
            slots = [self._free.pop() for _ in jobs]
        for job, slot in zip(jobs, slots):
            job.slot = slot
        try:
            self.state = self.engine.insert_many(
                self.state, [(job.slot, job.prepared.prompt_ids, job.prepared.params) for job in jobs])
        except (PromptError, ValueError) as err:  # raised before the state is touched
            if len(jobs) > 1:  # find the bad one: each alone
                with self._lock:
                    self._free.extend(slots)
                for job in jobs:
                    job.slot = None
                for job in jobs:
                    self._admit([job])
                return
            with self._lock:
                self._free.extend(slots)
            job = jobs[0]
            job.slot = None
            self._release(job)
            self.metrics.rejected.labels(reason="invalid").inc()
            job.events.put(Failure("invalid", str(err)))
            return
        now = time.monotonic()
        with self._lock:
            for job in jobs:
                self._running[job.slot] = job
                self.metrics.queue_time.observe(now - job.arrival)
                self.metrics.prompt_tokens.inc(len(job.prepared.prompt_ids))
            self._update_gauges()

    def _step(self) -> None:
        # Up to `rounds` rounds per step (one program and one copy to the host for all of them),
        # but one round while a request admitted since the last step still waits for its first
        # token: that token is ready after the prefill, and a longer step would hold it back.
        first = any(job.first_token_at is None for job in self._running.values())
        self.state, out = self.engine.step(self.state, rounds=1 if first else self.rounds)
        now = time.monotonic()
        for slot, job in list(self._running.items()):
            new = out.tokens[slot]
            for verified, kept in zip(out.round_lengths[slot], out.round_accepted[slot]):
                self.metrics.observe_round(verified, kept)
            job.rounds += len(out.round_accepted[slot])
            job.drafted, job.accepted = out.drafted[slot], out.accepted[slot]
            ids, stopped = [], False
            for token in new:
                ids.append(token)
                if job.stream.push(token):
                    stopped = True
                    break
            finish = "stop" if stopped else out.finish_reason[slot] if out.finished[slot] else None
            if ids:
                self._timing(job, len(ids), now)
            if finish is not None:
                self._finish(job, finish, ids, now)
            elif ids:
                text = job.stream.take()
                job.tokens.extend(ids)
                job.events.put(Chunk(text=text, token_ids=ids))

    def _timing(self, job: Job, n: int, now: float) -> None:
        """TTFT on the first token; later steps count n intervals of dt/n (n tokens in one step)."""
        self.metrics.generation_tokens.inc(n)
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.ttft.observe(now - job.arrival)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - job.last_token_at) / n)
        job.last_token_at = now

    def _finish(self, job: Job, reason: str, ids: list[int], now: float) -> None:
        job.tokens.extend(ids)
        text = job.stream.take(final=True)
        if job.stream.stopped is not None and reason in ("length", "eos"):
            reason = "stop"  # the last token completed a stop string (found on the final flush)
        self._release(job)
        self.metrics.finished.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe(now - job.arrival)
        job.events.put(Chunk(text=text, token_ids=ids, finish=reason, prompt_tokens=len(job.prepared.prompt_ids),
                             completion_tokens=len(job.tokens), drafted=job.drafted, accepted=job.accepted,
                             rounds=job.rounds))

    def _fail_all(self, err: Exception) -> None:
        """Refuse new requests, report the fault (health turns NOT_SERVING) and only then fail
        the requests in flight, so a client that sees INTERNAL already finds health NOT_SERVING."""
        message = f"{type(err).__name__}: {err}"
        log.exception("engine fault; failing every request in flight")
        with self._lock:
            self.fault = message
        if self.on_fault is not None:
            self.on_fault(message)
        with self._lock:
            jobs = list(self._by_id.values())
            self._by_id.clear()
            self._waiting.clear()
            self._running.clear()
            for job in jobs:
                job.done = True
                job.events.put(Failure("internal", f"engine fault: {message}"))
            self.metrics.failed.labels(reason="internal").inc(len(jobs))
            self._update_gauges()
            self._changed.notify_all()
