"""Offline continuous batching over an Engine: many requests through a few slots.

Used by the training programs (self-distillation, calibration): a slot is refilled as soon as
its request finishes, so a long answer never holds a whole batch back. Each `Engine.step` runs
up to `rounds_per_step` rounds on the device before the host looks at the slots again.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dspark_jax.sampling import SamplingParams


@dataclasses.dataclass
class RequestResult:
    tokens: list[int]  # generated token ids (prompt excluded)
    finish_reason: str
    round_accepted: list[int]  # accepted draft tokens per verification round (empty without a drafter)
    round_confidence_logits: np.ndarray  # [rounds, G] raw confidence logits of those rounds
    round_lengths: list[int]  # draft tokens each of those rounds verified


def run_requests(engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 rounds_per_step: int = 8, progress=None, waves: bool = False) -> list[RequestResult]:
    """Every prompt (token ids) generated with its SamplingParams, in the engine's slots.

    `waves`: insert only once every slot is free, a whole batch at a time, instead of refilling
    each freed slot at once. Slots idle while a wave's longest answer finishes, but the inserts
    always have the engine's full batch shape; on an accelerator, where each new insert shape
    costs a compile of seconds, that is the cheaper trade (warm the engine up for it first)."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    for i, (ids, p) in enumerate(zip(prompts, params)):  # every request before any runs, named by its index
        engine.check_request(ids, p, i)
    g = engine.block_size
    results: list = [None] * len(prompts)
    pending = list(range(len(prompts)))[::-1]  # pop() takes them in order
    owner: dict[int, int] = {}  # slot -> request index
    acc: dict[int, RequestResult] = {}
    state = engine.new_state()
    while pending or owner:
        free = [s for s in range(engine.slots) if s not in owner] if not (waves and owner) else []
        batch = []
        for slot in free[:len(pending)]:
            i = pending.pop()
            batch.append((slot, prompts[i], params[i]))
            owner[slot] = i
            acc[slot] = RequestResult([], "", [], np.zeros((0, g), np.float32), [])
        state = engine.insert_many(state, batch)
        state, out = engine.step(state, rounds=rounds_per_step)
        for slot in list(owner):
            r = acc[slot]
            r.tokens.extend(out.tokens[slot])
            r.round_accepted.extend(out.round_accepted[slot])
            r.round_lengths.extend(out.round_lengths[slot])
            r.round_confidence_logits = np.concatenate([r.round_confidence_logits, out.round_confidence_logits[slot]])
            if out.finished[slot]:
                r.finish_reason = out.finish_reason[slot]
                results[owner.pop(slot)] = acc.pop(slot)
                state = engine.free(state, slot)
                if progress is not None:
                    progress.update(1)
    return results
