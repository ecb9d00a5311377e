"""The reduced draft vocabulary shared by every drafter that has an LM head (DFlash / DSpark,
EAGLE-3): the N most frequent target ids (params["draft_vocab"] [N] int32, chosen by the training
data) get logits; every other id gets probability exactly zero.

Logits are computed from the N matching rows of the target's own LM head ([V, e], so a row
gather is contiguous), which makes a drafter's head cost N/V of the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.models.layers import linear
from dspark_jax.models.transformer import lm_head_weight


def draft_logits(params: dict, target_params: dict, hidden: jax.Array) -> jax.Array:
    """Hidden [..., e] -> float32 logits [..., N] over the draft vocabulary (N = V when not reduced)."""
    if "draft_head" in params:
        w = params["draft_head"]  # [N, e], gathered once by bind_head
    else:
        w = lm_head_weight(target_params)  # [V, e]
        if "draft_vocab" in params:
            w = jnp.take(w, params["draft_vocab"], axis=0)  # [N, e]
    return linear(hidden, w, out_dtype=jnp.float32)


def bind_head(params: dict, target_params: dict) -> dict:
    """Drafter params plus "draft_head" [N, e], the target LM head's draft-vocabulary rows.

    For serving: without it every round regathers N rows (N * e * 4 bytes, 19 MB at N = 8192 on
    the default model) before reading them again. Training does not bind (the rows are frozen
    target weights, so there is nothing to gain and one array fewer to keep out of the optimizer).
    """
    if "draft_vocab" not in params or "draft_head" in params:
        return params
    return {**params, "draft_head": jnp.take(lm_head_weight(target_params), params["draft_vocab"], axis=0)}


def to_full_vocab(params: dict, vocab_size: int, values: jax.Array, fill: float = -jnp.inf) -> jax.Array:
    """Spread reduced values [..., N] over [..., V], `fill` outside the draft vocabulary (-inf for
    logits, 0 for probabilities)."""
    if "draft_vocab" not in params:
        return values
    return spread_over_vocab(params["draft_vocab"], vocab_size, values, fill)


def spread_over_vocab(ids: jax.Array, vocab_size: int, values: jax.Array, fill: float) -> jax.Array:
    """values [..., N] at target ids [N] -> [..., V], `fill` at every other id.

    Written as a gather through the inverse map (target id -> draft index): XLA:CPU ran the
    equivalent scatter over a [b, G, N] input about 3x slower.
    """
    inverse = jnp.full((vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    spread = jnp.take(values, jnp.maximum(inverse, 0), axis=-1)  # [..., V]
    return jnp.where(inverse >= 0, spread, jnp.asarray(fill, values.dtype))


def support(params: dict) -> jax.Array | None:
    """The target ids [N] that draft distributions cover (DraftOutput.support), None for all V."""
    return params.get("draft_vocab")


def to_target_ids(params: dict, index: jax.Array) -> jax.Array:
    """Draft-vocabulary indices -> target token ids (the identity when the vocabulary is not reduced)."""
    if "draft_vocab" not in params:
        return index
    return jnp.take(params["draft_vocab"], index).astype(jnp.int32)


def check_size(size: int | None, vocab_size: int) -> str | None:
    """The problem with a configured draft_vocab_size, or None when it is usable."""
    if size is not None and not 0 < size <= vocab_size:
        return f"draft_vocab_size must be in [1, {vocab_size}], got {size}"
    return None


def init_table(size: int | None) -> dict:
    """{"draft_vocab": ids 0..N-1} as a placeholder until training picks the top-N ids, or {}."""
    return {} if size is None else {"draft_vocab": jnp.arange(size, dtype=jnp.int32)}
