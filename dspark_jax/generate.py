"""The public batched generate API: a thin loop over an Engine (one slot per prompt)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from dspark_jax.engine import Engine, pow2
from dspark_jax.prompts import bucket, check_prompts, encode_prompts
from dspark_jax.sampling import SamplingParams
from dspark_jax.schedule import TABLE_POLICIES
from dspark_jax.target import Target

# Rounds per Engine.step call: each call copies its tokens to the host once.
MAX_ROUNDS_PER_STEP = 32


@dataclasses.dataclass
class GenerateResult:
    texts: list[str]  # decoded new text per prompt (special tokens and the final EOS dropped)
    token_ids: list[list[int]]  # new token ids per prompt, EOS included when the row produced one
    stats: dict[str, Any]


def _decode_texts(tokenizer, token_ids: list[list[int]], eos_ids: Sequence[int]) -> list[str]:
    if tokenizer is None:
        return ["" for _ in token_ids]
    texts = []
    for ids in token_ids:
        body = ids[:-1] if ids and ids[-1] in eos_ids else ids
        texts.append(tokenizer.decode(body, skip_special_tokens=True))
    return texts


def row_seed(seed: int, row: int) -> int:
    """The seed of row `row` of a generate call: distinct per row, a pure function of both."""
    return int(np.random.SeedSequence([seed, row]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def engine_for(target: Target, drafter, slots: int, max_len: int, block_size: int | None, verifier: str,
               policy: str = "fixed") -> Engine:
    """An Engine of these shapes, kept on the target so repeated calls reuse its compiled programs
    (and its profiled cost table); the Engine checks the drafter against the target."""
    key = (id(drafter), slots, max_len, block_size, verifier, policy)
    engine = target.engines.get(key)
    if engine is None or engine.drafter is not drafter:
        engine = Engine(target, drafter, slots=slots, max_len=max_len, block_size=block_size, verifier=verifier,
                        mesh=target.mesh, policy=policy)
        target.engines[key] = engine
    return engine


def generate(
    target: Target,
    prompts: Sequence,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    chat: bool = True,
    drafter=None,
    block_size: int | None = None,
    verifier: str = "jnp",
    profile: bool = False,
    ignore_eos: bool = False,
    policy: str = "fixed",
    sps_table=None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` for each prompt; rows stop at their own EOS.

    `prompts` is a list of strings (chat=True wraps each as a user message with the model's chat
    template) or a list of token-id lists. `ignore_eos=True` always generates `max_new_tokens`
    (for benchmarks). Row i samples with its own seed `row_seed(seed, i)`.

    With `drafter` (from `init_drafter`, `load_drafter`, or the name "ngram") generation is
    speculative: each round drafts `block_size` tokens (default: the drafter's), verifies them in
    one target forward and commits the accepted prefix; the output distribution is the target's
    (identical tokens when greedy). `verifier` picks the jnp reference or the "pallas" kernel.
    `profile` adds a per-round cost split (each part jitted and timed alone) to the stats.

    `policy` picks how many draft tokens each round verifies (dspark_jax.schedule): "fixed" (the
    whole block), "dspark" (the load-aware prefix scheduler) or "dspark-lagged" (both read the
    engine's cost table: `sps_table`, else profiled once per engine), "threshold", or "none"
    (plain decoding).

    Runs on an Engine with one slot per prompt (slots bucketed to a power of two, the cache to
    the bucketed need); the engine is kept on the target, so a repeated call compiles nothing.
    """
    if isinstance(drafter, str):
        from dspark_jax.drafters import load_drafter

        if drafter not in target.drafters:  # a new Drafter object per call missed the engine cache
            target.drafters[drafter] = load_drafter(drafter, target)
        drafter = target.drafters[drafter]
    params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p, seed=int(seed),
                            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    ids = encode_prompts(target.tokenizer, prompts, chat)
    g = 0 if drafter is None else (block_size or drafter.config.block_size)
    extra = g + 1 if drafter is not None and policy != "none" else 0  # plain decoding drafts nothing
    check_prompts(ids, target.config, max_new_tokens, extra)
    max_len = min(bucket(max(len(r) for r in ids) + max_new_tokens + extra, minimum=128),
                  target.config.max_position_embeddings)
    engine = engine_for(target, drafter, pow2(len(ids)), max_len, block_size, verifier, policy)
    if sps_table is not None:
        engine.sps_table = sps_table
    if engine.cost_table is None and engine.policy in TABLE_POLICIES and engine.settings.dconfig is not None:
        engine.profile()  # once per engine, outside the timed generation
    compile_before = engine.compile_seconds
    start = time.perf_counter()

    state = engine.new_state()
    requests = [(i, row, dataclasses.replace(params, seed=row_seed(seed, i))) for i, row in enumerate(ids)]
    state = engine.insert_many(state, requests)
    split = {}
    if profile and engine.settings.dconfig is not None:
        from dspark_jax.profiling import round_cost_split

        split = round_cost_split(engine, state)
    rounds = min(pow2(max_new_tokens), MAX_ROUNDS_PER_STEP)
    token_ids = [[] for _ in ids]
    finished = [False] * len(ids)
    while not all(finished):
        state, out = engine.step(state, rounds=rounds)
        for i in range(len(ids)):
            token_ids[i].extend(out.tokens[i])
            finished[i] = out.finished[i]
    forwards, row_rounds, committed, tried, accepted, drafted = jax.device_get(
        (state.forwards, state.row_rounds, state.committed, state.tried, state.accepted_at, state.drafted))
    compile_seconds = engine.compile_seconds - compile_before
    wall = time.perf_counter() - start - compile_seconds - sum(split.values())

    new_tokens = int(sum(len(t) for t in token_ids))
    stats = {
        "new_tokens": new_tokens,
        "target_forward_passes": int(forwards),
        "wall_seconds": wall,
        "tokens_per_second": new_tokens / wall if wall > 0 else float("inf"),
        "compile_seconds": compile_seconds,
        "batch_bucket": engine.slots,
        "max_len": engine.max_len,
    }
    if engine.settings.dconfig is not None:
        stats.update({
            "drafter": drafter.config.kind,
            "policy": engine.policy,
            "verified_per_round": float(drafted[:len(ids)].sum()) / max(int(row_rounds), 1),
            "block_size": engine.block_size,
            "tau": float(committed) / max(int(row_rounds), 1),
            "acceptance_per_position": [float(a) / float(t) if t else None for a, t in zip(accepted, tried)],
            "verify_rounds": int(forwards) - 1,
            "row_rounds": int(row_rounds),  # rounds summed over rows: tau's denominator
        })
        stats.update(split)
        if split:
            stats["drafter_to_target_time"] = split["drafter_seconds_per_round"] / split["target_seconds_per_round"]
    texts = _decode_texts(target.tokenizer, token_ids, target.config.eos_token_ids)
    return GenerateResult(texts=texts, token_ids=token_ids, stats=stats)
