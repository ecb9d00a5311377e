"""Drafter losses against plain numpy on tiny inputs, in the draft-vocabulary space the trainer uses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.drafters import eagle3
from dspark_jax.losses import dflash_loss, dspark_loss

B, A, G, V, N = 2, 3, 4, 11, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    draft_vocab = rng.permutation(V)[:N].astype(np.int32)
    logits = rng.normal(size=(B, A, G, N)).astype(np.float32)
    conf = rng.normal(size=(B, A, G)).astype(np.float32)
    p = rng.dirichlet(np.ones(V) * 0.5, size=(B, A, G)).astype(np.float32)
    targets = rng.integers(0, V, size=(B, A, G))
    mask = rng.random((B, A, G)) > 0.25
    return draft_vocab, logits, conf, p, targets, mask


def _numpy_dspark(draft_vocab, logits, conf, p, targets, mask, temperature):
    """The loss written out term by term (float64)."""
    index = {int(t): i for i, t in enumerate(draft_vocab)}
    w = np.exp(-np.arange(G) / G)
    sums = dict(ce=0.0, ce_w=0.0, tv=0.0, bce=0.0, w=0.0, label=0.0)
    for b in range(B):
        for a in range(A):
            for k in range(G):
                if not mask[b, a, k]:
                    continue
                z = logits[b, a, k].astype(np.float64) / temperature
                q = np.exp(z - z.max())
                q /= q.sum()
                q_full = np.zeros(V)
                q_full[draft_vocab] = q
                l1 = np.abs(q_full - p[b, a, k]).sum()  # includes p's mass outside the draft ids
                label = min(max(1 - 0.5 * l1, 0.0), 1.0)
                s = 1 / (1 + np.exp(-conf[b, a, k]))
                bce = -(label * np.log(s) + (1 - label) * np.log(1 - s))
                sums["tv"] += w[k] * l1
                sums["bce"] += w[k] * bce
                sums["label"] += w[k] * label
                sums["w"] += w[k]
                t = int(targets[b, a, k])
                if t in index:
                    sums["ce"] += w[k] * -np.log(q[index[t]])
                    sums["ce_w"] += w[k]
    ce, tv, bce = sums["ce"] / sums["ce_w"], sums["tv"] / sums["w"], sums["bce"] / sums["w"]
    return 0.1 * ce + 0.9 * tv + 1.0 * bce, dict(ce=ce, tv=tv, bce=bce, accept_est=sums["label"] / sums["w"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dspark_loss_against_numpy_with_out_of_vocabulary_mass(temperature):
    draft_vocab, logits, conf, p, targets, mask = _inputs()
    outputs = {"draft_logits": jnp.asarray(logits), "confidence_logits": jnp.asarray(conf)}
    loss, metrics = dspark_loss(outputs, jnp.asarray(targets), jnp.asarray(p), jnp.asarray(mask), temperature,
                                draft_vocab=jnp.asarray(draft_vocab))
    want, terms = _numpy_dspark(draft_vocab, logits, conf, p, targets, mask, temperature)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    for name, value in terms.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, err_msg=name)
    # The soft confidence label is 1 - TV (TV = half the L1 distance): its mean is 1 - tv / 2 here
    # because no position's L1 exceeds 2, so the clip never binds.
    np.testing.assert_allclose(float(metrics["accept_est"]), 1 - float(metrics["tv"]) / 2, rtol=1e-5)

    # The full-vocabulary path (-inf outside the draft ids) is the same loss.
    full = np.full((B, A, G, V), -np.inf, np.float32)
    full[..., draft_vocab] = logits
    loss_full, _ = dspark_loss({"logits": jnp.asarray(full), "confidence_logits": jnp.asarray(conf)},
                               jnp.asarray(targets), jnp.asarray(p), jnp.asarray(mask), temperature)
    np.testing.assert_allclose(float(loss_full), want, rtol=1e-5)

    # The teacher given over the draft ids only, with its outside mass (what the trainer passes,
    # built from the cached log-normaliser), is the same loss.
    p_draft = p[..., draft_vocab]
    outside = 1.0 - p_draft.sum(-1)
    loss_draft, _ = dspark_loss(outputs, jnp.asarray(targets), jnp.asarray(p_draft), jnp.asarray(mask), temperature,
                                draft_vocab=jnp.asarray(draft_vocab), target_outside=jnp.asarray(outside), vocab_size=V)
    np.testing.assert_allclose(float(loss_draft), want, rtol=1e-5)


def test_dflash_loss_against_numpy():
    draft_vocab, logits, _, _, targets, mask = _inputs(1)
    got, _ = dflash_loss({"draft_logits": jnp.asarray(logits)}, jnp.asarray(targets), jnp.asarray(mask),
                         draft_vocab=jnp.asarray(draft_vocab), vocab_size=V)
    index = {int(t): i for i, t in enumerate(draft_vocab)}
    w = np.exp(-np.arange(G) / G)
    num = den = 0.0
    for b, a, k in np.ndindex(B, A, G):
        t = int(targets[b, a, k])
        if mask[b, a, k] and t in index:
            z = logits[b, a, k].astype(np.float64)
            num += w[k] * (np.log(np.exp(z).sum()) - z[index[t]])
            den += w[k]
    np.testing.assert_allclose(float(got), num / den, rtol=1e-5)


def test_eagle3_loss_in_draft_space_skips_targets_it_cannot_emit():
    rng = np.random.default_rng(2)
    S, b, t = 3, 2, 7
    draft_vocab = rng.permutation(V)[:N].astype(np.int32)
    logits = rng.normal(size=(S, b, t, N)).astype(np.float32)
    tokens = rng.integers(0, V, size=(b, t))
    mask = rng.random((b, t)) > 0.2
    got = eagle3.eagle3_loss(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask),
                             draft_vocab=jnp.asarray(draft_vocab), vocab_size=V)
    index = {int(x): i for i, x in enumerate(draft_vocab)}
    want = 0.0
    for j in range(S):
        terms = [np.log(np.exp(logits[j, r, i].astype(np.float64)).sum()) - logits[j, r, i, index[int(tokens[r, i + 2 + j])]]
                 for r in range(b) for i in range(t)
                 if i + 2 + j < t and mask[r, i + 2 + j] and int(tokens[r, i + 2 + j]) in index]
        want += 0.8 ** j * (np.mean(terms) if terms else 0.0)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
