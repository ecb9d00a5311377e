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


def draft_index(draft_vocab: jax.Array, vocab_size: int) -> jax.Array:
    """[V] int32: each target id's index in the draft vocabulary, -1 outside it."""
    n = draft_vocab.shape[0]
    return jnp.full((vocab_size,), -1, jnp.int32).at[draft_vocab].set(jnp.arange(n, dtype=jnp.int32))


def _cross_entropy(logq: jax.Array, target_index: jax.Array):
    """-log q[target] (0 where the target is outside the draft vocabulary: index -1 or -inf logit)
    and its validity."""
    picked = jnp.take_along_axis(logq, jnp.maximum(target_index, 0)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    in_vocab = (target_index >= 0) & jnp.isfinite(picked)
    return jnp.where(in_vocab, -picked, 0.0), in_vocab


def _log_q(logits: jax.Array, temperature: float) -> jax.Array:
    if temperature <= 0:
        raise ValueError(f"training temperature must be > 0, got {temperature}")
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _draft_space(outputs: dict, target_token_ids: jax.Array, draft_vocab: jax.Array | None, vocab_size: int | None):
    """(logits, target indices) in the space the loss runs in: the full vocabulary (outputs["logits"],
    -inf outside a reduced vocabulary) or, given `draft_vocab`, the N draft ids only
    (outputs["draft_logits"]), which keeps [.., V] arrays out of the backward pass."""
    if draft_vocab is None:
        return outputs["logits"], target_token_ids
    return outputs["draft_logits"], draft_index(draft_vocab, vocab_size)[target_token_ids]


def dspark_loss(outputs: dict, target_token_ids: jax.Array, target_probs: jax.Array, mask: jax.Array,
                temperature: float = 1.0, draft_vocab: jax.Array | None = None,
                target_outside: jax.Array | None = None, vocab_size: int | None = None):
    """L = 0.1 CE + 0.9 TV + 1.0 BCE over a train_forward output.

    target_token_ids [b, A, G] ground-truth next tokens; target_probs [b, A, G, V] the target's
    distribution p_k at the same temperature; mask [b, A, G] supervised positions. With
    `draft_vocab` and `target_outside` [b, A, G] (the target's mass outside the draft ids),
    target_probs is p_k over the draft ids only, [b, A, G, N], and `vocab_size` V is needed: the
    same loss without [.., V] teacher arrays (the trainer builds p there from the teacher's cached
    log-normaliser).
    q_k = softmax(logits / temperature); TV term ||q_k - p_k||_1; the confidence head is fit to
    the soft label c*_k = clip(1 - 0.5 ||q_k - p_k||_1, 0, 1) (the acceptance probability of
    q_k against p_k), detached so BCE does not pull the draft distribution.
    With `draft_vocab` [N] the loss runs over outputs["draft_logits"] [b, A, G, N]: q is zero
    outside the draft ids, so ||q - p||_1 = sum over the draft ids of |q - p| + p's mass outside
    them, exactly, without [.., V] arrays in the backward pass.
    Returns (loss scalar, metrics dict of the unweighted-by-coefficient terms).
    """
    if target_outside is not None and (draft_vocab is None or vocab_size is None):
        raise ValueError("target_outside is the mass outside a draft vocabulary: pass draft_vocab and vocab_size")
    logits, target_index = _draft_space(outputs, target_token_ids, draft_vocab,
                                        target_probs.shape[-1] if vocab_size is None else vocab_size)
    logq = _log_q(logits, temperature)  # [b, A, G, N]
    q = jnp.exp(logq)
    weight = mask.astype(jnp.float32) * position_weights(mask.shape[-1])  # [b, A, G]
    ce, in_vocab = _cross_entropy(logq, target_index)
    p = target_probs.astype(jnp.float32)
    outside = jnp.zeros(mask.shape, jnp.float32)
    if target_outside is not None:
        outside = target_outside.astype(jnp.float32)
    elif draft_vocab is not None:
        p = jnp.take(p, draft_vocab, axis=-1)  # [b, A, G, N]
        outside = jnp.clip(1.0 - jnp.sum(p, axis=-1), 0.0, 1.0)  # the target's mass the drafter cannot emit
    l1 = jnp.sum(jnp.abs(q - p), axis=-1) + outside  # [b, A, G]
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    z = outputs["confidence_logits"].astype(jnp.float32)
    bce = jax.nn.softplus(z) - c_star * z  # -[c* log sigmoid(z) + (1 - c*) log(1 - sigmoid(z))]
    ce_m = _weighted_mean(ce, weight * in_vocab)
    tv_m = _weighted_mean(l1, weight)
    bce_m = _weighted_mean(bce, weight)
    loss = CE_WEIGHT * ce_m + TV_WEIGHT * tv_m + BCE_WEIGHT * bce_m
    top1 = _weighted_mean((jnp.argmax(logq, -1) == target_index).astype(jnp.float32), weight)
    return loss, {"ce": ce_m, "tv": tv_m, "bce": bce_m, "accept_est": _weighted_mean(c_star, weight),
                  "top1": top1}


def dflash_loss(outputs: dict, target_token_ids: jax.Array, mask: jax.Array, temperature: float = 1.0,
                draft_vocab: jax.Array | None = None, vocab_size: int | None = None):
    """Plain DFlash objective: position-weighted CE of softmax(logits / temperature) only (over
    outputs["draft_logits"] when `draft_vocab` is given, which then needs `vocab_size`).

    Returns (loss scalar, metrics dict).
    """
    logits, target_index = _draft_space(outputs, target_token_ids, draft_vocab, vocab_size)
    logq = _log_q(logits, temperature)
    weight = mask.astype(jnp.float32) * position_weights(mask.shape[-1])
    ce, in_vocab = _cross_entropy(logq, target_index)
    ce_m = _weighted_mean(ce, weight * in_vocab)
    top1 = _weighted_mean((jnp.argmax(logq, -1) == target_index).astype(jnp.float32), weight)
    return ce_m, {"ce": ce_m, "top1": top1}
