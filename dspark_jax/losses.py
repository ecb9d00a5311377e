"""Drafter training losses (DESIGN 4).

Position weights: w_k = exp(-k / G) for block position k = 0..G-1 (0-based), i.e. DESIGN's
exp(-(k-1)/gamma) with 1-based k. Later positions matter less because they are only reached when
every earlier draft token was accepted. Each term is a weighted mean over the supervised
(mask = True) positions: sum(w * mask * term) / sum(w * mask).

Logits may hold -inf outside a reduced draft vocabulary; such columns get probability 0, and a
ground-truth token the drafter cannot emit is left out of the CE (it would be infinite) while
still counting in TV, which is what penalises the missing mass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CE_WEIGHT, TV_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0


def position_weights(block_size: int) -> jax.Array:
    """w_k = exp(-k / G), k = 0..G-1 -> [G] float32."""
    return jnp.exp(-jnp.arange(block_size, dtype=jnp.float32) / block_size)


def _weighted_mean(term: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.sum(term * weight) / jnp.maximum(jnp.sum(weight), 1e-9)


def _cross_entropy(logq: jax.Array, target_token_ids: jax.Array):
    """-log q[target] [b, A, G] (0 where the target is outside the draft vocabulary) and its validity."""
    picked = jnp.take_along_axis(logq, target_token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    in_vocab = jnp.isfinite(picked)
    return jnp.where(in_vocab, -picked, 0.0), in_vocab


def _log_q(outputs: dict, temperature: float) -> jax.Array:
    if temperature <= 0:
        raise ValueError(f"training temperature must be > 0, got {temperature}")
    return jax.nn.log_softmax(outputs["logits"].astype(jnp.float32) / temperature, axis=-1)


def dspark_loss(outputs: dict, target_token_ids: jax.Array, target_probs: jax.Array, mask: jax.Array,
                temperature: float = 1.0):
    """L = 0.1 CE + 0.9 TV + 1.0 BCE over a train_forward output.

    target_token_ids [b, A, G] ground-truth next tokens; target_probs [b, A, G, V] the target's
    distribution p_k at the same temperature; mask [b, A, G] supervised positions.
    q_k = softmax(logits / temperature); TV term ||q_k - p_k||_1; the confidence head is fit to
    the soft label c*_k = clip(1 - 0.5 ||q_k - p_k||_1, 0, 1) (the acceptance probability of
    q_k against p_k), detached so BCE does not pull the draft distribution.
    Returns (loss scalar, metrics dict of the unweighted-by-coefficient terms).
    """
    logq = _log_q(outputs, temperature)  # [b, A, G, V]
    q = jnp.exp(logq)
    weight = mask.astype(jnp.float32) * position_weights(mask.shape[-1])  # [b, A, G]
    ce, in_vocab = _cross_entropy(logq, target_token_ids)
    l1 = jnp.sum(jnp.abs(q - target_probs.astype(jnp.float32)), axis=-1)  # [b, A, G]
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    z = outputs["confidence_logits"].astype(jnp.float32)
    bce = jax.nn.softplus(z) - c_star * z  # -[c* log sigmoid(z) + (1 - c*) log(1 - sigmoid(z))]
    ce_m = _weighted_mean(ce, weight * in_vocab)
    tv_m = _weighted_mean(l1, weight)
    bce_m = _weighted_mean(bce, weight)
    loss = CE_WEIGHT * ce_m + TV_WEIGHT * tv_m + BCE_WEIGHT * bce_m
    top1 = _weighted_mean((jnp.argmax(logq, -1) == target_token_ids).astype(jnp.float32), weight)
    return loss, {"ce": ce_m, "tv": tv_m, "bce": bce_m, "accept_est": _weighted_mean(c_star, weight),
                  "top1": top1}


def dflash_loss(outputs: dict, target_token_ids: jax.Array, mask: jax.Array, temperature: float = 1.0):
    """Plain DFlash objective: position-weighted CE of softmax(logits / temperature) only.

    Returns (loss scalar, metrics dict).
    """
    logq = _log_q(outputs, temperature)
    weight = mask.astype(jnp.float32) * position_weights(mask.shape[-1])
    ce, in_vocab = _cross_entropy(logq, target_token_ids)
    ce_m = _weighted_mean(ce, weight * in_vocab)
    top1 = _weighted_mean((jnp.argmax(logq, -1) == target_token_ids).astype(jnp.float32), weight)
    return ce_m, {"ce": ce_m, "top1": top1}
