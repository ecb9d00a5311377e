"""Token sampling settings and the filtered distributions they define.

Speculative verification must preserve exactly the distribution that plain sampling draws from,
so both paths get their probabilities from `filtered_probs` here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (part of the compiled program's key)."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature-scaled logits [..., vocab] with top-k / top-p exclusions set to -inf."""
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it
        # is still below top_p. Its logit is the cut-off.
        keep = mass_before < cfg.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def filtered_probs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The distribution sampling draws from: softmax of `filtered_logits` (float32)."""
    return jax.nn.softmax(filtered_logits(logits, cfg), axis=-1)


def argmax_last(x: jax.Array) -> jax.Array:
    """argmax over the last axis (first index of the maximum) -> int32.

    Written as max + masked min-index: two plain reductions, which XLA on CPU vectorises, instead
    of one variadic (value, index) reduction, which it does not (about 2x faster at [64, 49152]).
    NaN rows give the last index.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1).astype(jnp.int32)


def sample_tokens(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token per row from logits [b, vocab] -> [b] int32 (argmax when greedy)."""
    if cfg.greedy:
        return argmax_last(logits)
    return jax.random.categorical(key, filtered_logits(logits, cfg), axis=-1).astype(jnp.int32)
