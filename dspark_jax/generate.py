"""The public batched generate API."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decode import decode_loop, prefill
from dspark_jax.prompts import bucket, encode_prompts, make_batch
from dspark_jax.sampling import SamplingConfig
from dspark_jax.target import Target


@dataclasses.dataclass
class GenerateResult:
    texts: list[str]  # decoded new text per prompt (special tokens and the final EOS dropped)
    token_ids: list[list[int]]  # new token ids per prompt, EOS included when the row produced one
    stats: dict[str, Any]


class _CompileCache:
    """Ahead-of-time compiled executables keyed by function, static settings and input shapes."""

    def __init__(self):
        self._cache: dict = {}
        self.last_compile_seconds = 0.0

    def get(self, name: str, fn: Callable, static: tuple, args: tuple, donate: tuple[int, ...] = ()):
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args))
        key = (name, static, shapes)
        if key not in self._cache:
            start = time.perf_counter()
            self._cache[key] = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
            self.last_compile_seconds += time.perf_counter() - start
        return self._cache[key]


COMPILED = _CompileCache()


def _decode_texts(tokenizer, token_ids: list[list[int]], eos_ids: Sequence[int]) -> list[str]:
    if tokenizer is None:
        return ["" for _ in token_ids]
    texts = []
    for ids in token_ids:
        body = ids[:-1] if ids and ids[-1] in eos_ids else ids
        texts.append(tokenizer.decode(body, skip_special_tokens=True))
    return texts


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
    profile: bool = True,
    ignore_eos: bool = False,
) -> GenerateResult:
    """Generate up to `max_new_tokens` for each prompt; rows stop at their own EOS.

    `prompts` is a list of strings (chat=True wraps each as a user message with the model's chat
    template) or a list of token-id lists. `ignore_eos=True` always generates `max_new_tokens`
    (for benchmarks).

    With `drafter` (from `init_drafter`, `load_drafter`, or the name "ngram") generation is
    speculative: each round drafts `block_size` tokens (default: the drafter's), verifies them in
    one target forward and commits the accepted prefix; the output distribution is the target's
    (identical tokens when greedy). `verifier` picks the jnp reference or the "pallas" kernel.
    `profile` adds a per-round cost split (measured once per compiled shape) to the stats.

    The whole decode loop runs on the device; shapes are bucketed (batch, prompt length, output
    length) and compiled ahead once per bucket.
    """
    sampling = SamplingConfig(temperature=float(temperature), top_k=top_k, top_p=top_p)
    config = target.config
    if ignore_eos:
        config = dataclasses.replace(config, eos_token_ids=())
    if verifier not in ("jnp", "pallas"):
        raise ValueError(f"verifier must be 'jnp' or 'pallas', got {verifier!r}")
    dconfig = None
    if drafter is not None:
        if isinstance(drafter, str):
            from dspark_jax.drafters import load_drafter

            drafter = load_drafter(drafter, target)
        drafter.check_target(target.config)
        dconfig = drafter.config
        if block_size is not None:
            if block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {block_size}")
            dconfig = dataclasses.replace(dconfig, block_size=int(block_size))
    elif block_size is not None:
        raise ValueError("block_size needs a drafter (drafter=None is plain autoregressive decoding)")

    ids = encode_prompts(target.tokenizer, prompts, chat)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    extra = 0 if dconfig is None else dconfig.block_size + 1
    batch = make_batch(ids, config, max_new_tokens, pad_id, extra_slots=extra)
    out_len = bucket(max_new_tokens)
    budget = np.where(np.arange(len(batch.lengths)) < batch.num_rows, max_new_tokens, 0).astype(np.int32)
    inputs = (jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), jnp.asarray(budget), jax.random.PRNGKey(seed))
    COMPILED.last_compile_seconds = 0.0
    if dconfig is None:
        run, extra_stats = _plain_program(target, config, sampling, batch.cache_len, out_len, inputs)
    else:
        run, extra_stats = _spec_program(target, config, drafter, dconfig, sampling, batch.cache_len, out_len,
                                         verifier, profile, inputs)
    start = time.perf_counter()
    state = run()
    out, num_out, forwards = jax.device_get((state.out, state.num_out, state.forwards))
    wall = time.perf_counter() - start

    token_ids = [out[i, : num_out[i]].tolist() for i in range(batch.num_rows)]
    new_tokens = int(sum(len(t) for t in token_ids))
    stats = {
        "new_tokens": new_tokens,
        "target_forward_passes": int(forwards),
        "wall_seconds": wall,
        "tokens_per_second": new_tokens / wall if wall > 0 else float("inf"),
        "compile_seconds": COMPILED.last_compile_seconds,
        "batch_bucket": int(batch.tokens.shape[0]),
        "prompt_bucket": int(batch.tokens.shape[1]),
    }
    stats.update(extra_stats(state))
    texts = _decode_texts(target.tokenizer, token_ids, config.eos_token_ids)
    return GenerateResult(texts=texts, token_ids=token_ids, stats=stats)


def _compile_program(name: str, prefill_part, loop_part, static: tuple, weights: tuple, inputs: tuple):
    """Compile prefill(*weights, *inputs) -> state and loop(*weights, state) -> state ahead (state
    donated to the loop); returns (prefill_fn, loop_fn)."""
    args = (*weights, *inputs)
    prefill_fn = COMPILED.get(f"{name}_prefill", prefill_part, static, args)
    state_shape = jax.eval_shape(prefill_part, *args)
    loop_fn = COMPILED.get(f"{name}_loop", loop_part, static, (*weights, state_shape), donate=(len(weights),))
    return prefill_fn, loop_fn


def _plain_program(target, config, sampling, cache_len, out_len, inputs):
    """Compiled prefill + autoregressive loop; returns (run, stats_fn)."""
    prefill_fn, loop_fn = _compile_program(
        "decode", functools.partial(prefill, config=config, sampling=sampling, cache_len=cache_len, out_len=out_len),
        functools.partial(decode_loop, config=config, sampling=sampling),
        (config, sampling, cache_len, out_len), (target.params,), inputs)
    return (lambda: loop_fn(target.params, prefill_fn(target.params, *inputs))), (lambda state: {})


_PROFILES: dict = {}


def _spec_program(target, config, drafter, dconfig, sampling, cache_len, out_len, verifier, profile, inputs):
    """Compiled speculative prefill + round loop; returns (run, stats_fn)."""
    from dspark_jax.spec_decode import SpecSettings, profile_round, spec_loop, spec_prefill

    settings = SpecSettings(config=config, dconfig=dconfig, sampling=sampling, cache_len=cache_len,
                            out_len=out_len, verifier=verifier)
    weights = (target.params, drafter.params)
    prefill_fn, loop_fn = _compile_program("spec", functools.partial(spec_prefill, s=settings),
                                           functools.partial(spec_loop, s=settings), (settings,), weights, inputs)
    split = {}
    if profile:
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves((weights, inputs)))
        key = (settings, shapes)  # timings depend on shapes and settings, not on weight values
        if key not in _PROFILES:
            _PROFILES[key] = profile_round(*weights, prefill_fn(*weights, *inputs), s=settings)
        split = _PROFILES[key]

    def stats(state):
        row_rounds, committed, tried, accepted = jax.device_get(
            (state.row_rounds, state.committed, state.tried, state.accepted))
        result = {
            "drafter": dconfig.kind,
            "block_size": dconfig.block_size,
            "tau": float(committed) / max(int(row_rounds), 1),
            "acceptance_per_position": [float(a) / float(t) if t else None for a, t in zip(accepted, tried)],
            "verify_rounds": int(state.forwards) - 1,
        }
        result.update(split)
        if split:
            result["drafter_to_target_time"] = split["drafter_seconds_per_round"] / split["target_seconds_per_round"]
        return result

    return (lambda: loop_fn(*weights, prefill_fn(*weights, *inputs))), stats
