"""Prompt-lookup drafter: propose the continuation of the latest earlier match of the context's
last n tokens (n from ngram_max down to ngram_min), read as a period that repeats. Training-free;
a baseline and an engine benchmark tool. It reads no target features.

Its draft distributions are one-hot (a deterministic proposal), which verification handles
exactly. A row with no match proposes nothing (`proposed` = 0, the round is a plain decoding
step for it); confidence logits are +BIG when a match was found and -BIG otherwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.drafters.config import DraftOutput, DrafterConfig
from dspark_jax.models.config import ModelConfig

_BIG = 30.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramState:
    history: jax.Array  # [b, cache_len] int32, committed token at each position (slot = position)


def init_params(key, tcfg: ModelConfig, dcfg: DrafterConfig) -> dict:
    del key, tcfg, dcfg
    return {}


def init_state(params, tcfg: ModelConfig, dcfg: DrafterConfig, batch: int, cache_len: int) -> NgramState:
    return NgramState(history=jnp.full((batch, cache_len), -1, jnp.int32))


def extend(params, target_params, tcfg, dcfg, state: NgramState, tokens, features, positions, valid) -> NgramState:
    b, s = state.history.shape
    slots = jnp.where(valid, positions, s)  # invalid entries go out of range and are dropped
    history = state.history.at[jnp.arange(b)[:, None], slots].set(tokens, mode="drop")
    return NgramState(history=history)


def draft(params, target_params, tcfg: ModelConfig, dcfg: DrafterConfig, state: NgramState, anchor, anchor_pos,
          keys, sampling, kv_len=None):
    """Match the n tokens ending at the anchor against every earlier window; copy what followed."""
    del params, keys, sampling, kv_len  # the history is a few bytes a slot: matched whole
    b, s = state.history.shape
    g = dcfg.block_size
    slot = jnp.arange(s)[None, :]  # [1, s]
    seq = jnp.where(slot == anchor_pos[:, None], anchor[:, None], state.history)  # [b, s]
    seq = jnp.where(slot <= anchor_pos[:, None], seq, -1)  # nothing past the anchor is known

    def gather(pos):  # seq at positions pos [b, k], -1 outside [0, s)
        inside = (pos >= 0) & (pos < s)
        return jnp.where(inside, jnp.take_along_axis(seq, jnp.clip(pos, 0, s - 1), axis=1), -1)

    best_end = jnp.full((b,), -1, jnp.int32)  # end position of the chosen earlier match
    for n in range(dcfg.ngram_max, dcfg.ngram_min - 1, -1):  # longest n first: static, tiny loop
        suffix = gather(anchor_pos[:, None] - n + 1 + jnp.arange(n)[None, :])  # [b, n]
        match = (slot < anchor_pos[:, None]) & (slot >= n - 1)  # candidate end positions j < anchor
        for i in range(n):
            shifted = jnp.roll(seq, n - 1 - i, axis=1)  # shifted[j] = seq[j - (n-1-i)]
            match &= shifted == suffix[:, i:i + 1]
        match &= (suffix >= 0).all(axis=1, keepdims=True)
        latest = jnp.max(jnp.where(match, slot, -1), axis=1).astype(jnp.int32)
        best_end = jnp.where(best_end >= 0, best_end, latest)

    # The match says the text repeats with period P - j; continue that period, so a proposal that
    # reaches the anchor keeps copying (a loop "a b a b" is drafted in full, not cut at the anchor).
    found = best_end >= 0  # [b]
    period = jnp.maximum(anchor_pos - best_end, 1)[:, None]
    follow = best_end[:, None] + 1 + jnp.arange(g)[None, :] % period  # [b, g], all <= anchor_pos
    tokens = jnp.where(found[:, None], gather(follow), anchor[:, None])
    tokens = jnp.clip(tokens, 0, tcfg.vocab_size - 1).astype(jnp.int32)
    probs = jax.nn.one_hot(tokens, tcfg.vocab_size, dtype=jnp.float32)  # [b, g, V]
    conf = jnp.broadcast_to(jnp.where(found, _BIG, -_BIG)[:, None], (b, g)).astype(jnp.float32)
    proposed = jnp.where(found, g, 0).astype(jnp.int32)
    return DraftOutput(tokens=tokens, probs=probs, confidence_logits=conf, proposed=proposed), state
