"""Cost split of one speculative round (for benchmarks and `generate(..., profile=True)`).

Each part is jitted alone at the engine's shapes and timed (best of 3), off the hot path: the
drafter's draft, the target's verification forward at full width (LM head included), and the
verification rule (with the filtered target probabilities it needs when some row samples).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from dspark_jax.decode import KEY_DRAFT, KEY_VERIFY, SlotState, drafter_module, verify_rule
from dspark_jax.models.transformer import forward, logits_from_hidden
from dspark_jax.sampling import row_keys


def best_seconds(fn, *args, repeats: int = 3) -> float:
    """Best of `repeats` timed calls of fn(*args) after one warm-up call (which also compiles);
    best-of rejects the noise of a shared machine, which only ever adds time."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def round_cost_split(engine, state: SlotState) -> dict[str, float]:
    """Seconds per round of the draft, the target's verification forward and the verification
    rule, for the requests now in `state` (every slot treated as live, full block verified)."""
    s = engine.settings
    mod = drafter_module(s)
    params, dparams = engine.weights
    g = s.block_size
    b = s.slots

    def draft_part(p, dp, st):
        keys = row_keys(st.seed_key, st.cache.lengths, KEY_DRAFT)
        return mod.draft(dp, p, s.config, s.dconfig, st.drafter, st.anchor, st.cache.lengths, keys, st.sampling)[0]

    span = engine.span_for(state, 1)

    def target_part(p, cache, block):
        # The cache is donated and fed back, as in the step (else XLA copies it every call).
        positions = cache.lengths[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]
        hidden, cache, feats = forward(p, s.config, block, positions, cache, s.feature_layers, kv_len=span)
        return (logits_from_hidden(p, hidden), feats), cache

    def verify_part(draft, logits, st):
        lengths = jnp.full((b,), g, jnp.int32)
        keys = row_keys(st.seed_key, st.cache.lengths, KEY_VERIFY)
        return verify_rule(draft, logits, lengths, keys, st.sampling, s=s)

    draft_fn, verify_fn = jax.jit(draft_part), jax.jit(verify_part)
    target_fn = jax.jit(target_part, donate_argnums=1)
    draft = draft_fn(params, dparams, state)
    block = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)
    cache = jax.tree.map(jnp.copy, state.cache)  # our own copy to donate
    (logits, _), cache = target_fn(params, cache, block)
    target_best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out, cache = target_fn(params, cache, block)
        jax.block_until_ready(out)
        target_best = min(target_best, time.perf_counter() - start)
    return {
        "drafter_seconds_per_round": best_seconds(draft_fn, params, dparams, state),
        "target_seconds_per_round": target_best,
        "verify_seconds_per_round": best_seconds(verify_fn, draft, logits, state),
    }
