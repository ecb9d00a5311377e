"""Tests for the EAGLE-3 drafter: inference matches the training unroll, incremental extends match
one extend, batched rows match rows alone, the loss trains, and sampling returns valid q."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_target_params
from dspark_jax.drafters import eagle3, vocab
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.transformer import forward
from dspark_jax.sampling import RowSampling, filtered_probs

TCFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
DCFG = DrafterConfig(kind="eagle3", block_size=4, num_layers=1, head_type="none", head_rank=0,
                     confidence_head=False, target_layer_ids=(0, 1, 2))
G = DCFG.block_size
T = 24
CACHE = 32

_extend = jax.jit(eagle3.extend, static_argnums=(2, 3))
_draft = jax.jit(eagle3.draft_with_logits, static_argnums=(2, 3))
_train = jax.jit(eagle3.train_forward, static_argnums=(2, 3, 6))
_features = jax.jit(lambda p, toks: forward(p, TCFG, toks, jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape),
                                            feature_layers=DCFG.target_layer_ids)[2])


def _target_params(key):
    return random_target_params(key, TCFG)


def _randomize(params, key):
    """Replace the 0.02 init with unit-scale weights so every path visibly moves the outputs."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    new = [1 + 0.2 * jax.random.normal(k, x.shape) if x.ndim == 1 else
           1.5 * jax.random.normal(k, x.shape) / np.sqrt(x.shape[0]) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(tree, new)


@pytest.fixture(scope="module")
def setup():
    key = jax.random.PRNGKey(0)
    tparams = _target_params(jax.random.fold_in(key, 1))
    dparams = eagle3.init_params(jax.random.fold_in(key, 2), TCFG, DCFG)
    assert dparams["fc"].shape == (3 * 32, 32) and dparams["layer"]["wq"].shape == (32, 64)
    dparams = _randomize(dparams, jax.random.fold_in(key, 3))
    tokens = jax.random.randint(jax.random.fold_in(key, 4), (2, T), 0, TCFG.vocab_size, dtype=jnp.int32)
    return tparams, dparams, tokens


def _prefill(tparams, dparams, tokens, feats, lengths, cache=CACHE):
    """Extend a fresh state with positions 0..lengths-1 of each row (right padding invalid)."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    state = eagle3.init_state(dparams, TCFG, DCFG, b, cache)
    return _extend(dparams, tparams, TCFG, DCFG, state, tokens, feats, pos, pos < jnp.asarray(lengths)[:, None])


def _draft_at(tparams, dparams, state, tokens, anchor_pos, sampling=None, key=None):
    anchor_pos = jnp.asarray(anchor_pos, jnp.int32)
    anchor = jnp.take_along_axis(tokens, anchor_pos[:, None], axis=1)[:, 0]
    b = anchor.shape[0]
    keys = jax.random.split(jax.random.PRNGKey(7) if key is None else key, b)
    sampling = RowSampling.uniform(b) if sampling is None else sampling
    return _draft(dparams, tparams, TCFG, DCFG, state, anchor, anchor_pos, keys, sampling)


def test_inference_matches_training_unroll(setup):
    tparams, dparams, tokens = setup
    P = np.array([7, 12])
    state = _prefill(tparams, dparams, tokens, _features(tparams, tokens), P)
    out, logits, _ = _draft_at(tparams, dparams, state, tokens, P)
    drafted = np.asarray(out.tokens)
    np.testing.assert_array_equal(np.asarray(out.full_probs(TCFG.vocab_size)), np.eye(TCFG.vocab_size)[drafted])
    np.testing.assert_array_equal(np.asarray(out.confidence_logits), 0.0)
    # Teacher tokens that follow the draft: step j at position P-1 reads token P+j = d_j.
    teacher = np.asarray(tokens).copy()
    for r in range(2):
        teacher[r, P[r] + 1:P[r] + G] = drafted[r, :G - 1]
    teacher = jnp.asarray(teacher)
    train = np.asarray(_train(dparams, tparams, TCFG, DCFG, teacher, _features(tparams, teacher), None))
    assert train.shape == (G, 2, T, TCFG.vocab_size)
    for r in range(2):
        for j in range(G):
            np.testing.assert_allclose(np.asarray(logits)[r, j], train[j, r, P[r] - 1], atol=1e-5, rtol=0)
    # Drafts differ across steps, so the comparison is not trivially satisfied.
    assert np.abs(train[1, :, P - 1] - train[0, :, P - 1]).max() > 1e-2
    # The trainer's unroll at sampled rows only (steps 1.. on those rows alone) drafts alike.
    rows = jnp.asarray(np.stack([P - 1, [3, 2]], axis=1), jnp.int32)  # [b, 2]: the anchor row, another
    on_rows = np.asarray(_train(dparams, tparams, TCFG, DCFG, teacher, _features(tparams, teacher), None, rows))
    assert on_rows.shape == (G, 2, 2, TCFG.vocab_size)
    np.testing.assert_allclose(np.moveaxis(on_rows[:, :, 0], 0, 1), np.asarray(logits), atol=1e-5, rtol=0)


def test_two_extends_match_one(setup):
    tparams, dparams, tokens = setup
    feats = _features(tparams, tokens)
    P, n = np.array([6, 9]), np.array([3, 1])
    # Incremental: prefill, a draft round (leaves stale speculative slots), then commit P..P+n.
    state = _prefill(tparams, dparams, tokens, feats, P)
    _, _, state = _draft_at(tparams, dparams, state, tokens, P)
    W = 5
    pos = jnp.asarray(P[:, None] + np.arange(W), jnp.int32)
    valid = jnp.asarray(np.arange(W)[None] <= n[:, None])
    step_tokens = jnp.take_along_axis(tokens, pos, axis=1)
    step_feats = jnp.take_along_axis(feats, pos[:, :, None, None], axis=1)
    noop = _extend(dparams, tparams, TCFG, DCFG, state, step_tokens, step_feats, pos, jnp.zeros_like(valid))
    for a, b in zip(jax.tree_util.tree_leaves(noop), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    inc = _extend(dparams, tparams, TCFG, DCFG, state, step_tokens, step_feats, pos, valid)
    # Direct: one extend over 0..P+n.
    direct = _prefill(tparams, dparams, tokens, feats, P + n + 1)
    for r in range(2):
        upto = P[r] + n[r]  # entries 0..P+n-1 are committed
        np.testing.assert_allclose(np.asarray(inc.k)[r, :upto], np.asarray(direct.k)[r, :upto], atol=1e-6)
        np.testing.assert_allclose(np.asarray(inc.v)[r, :upto], np.asarray(direct.v)[r, :upto], atol=1e-6)
    np.testing.assert_allclose(np.asarray(inc.pending), np.asarray(direct.pending), atol=1e-6)
    nxt = P + n + 1
    out_inc, logits_inc, _ = _draft_at(tparams, dparams, inc, tokens, nxt)
    out_dir, logits_dir, _ = _draft_at(tparams, dparams, direct, tokens, nxt)
    np.testing.assert_array_equal(np.asarray(out_inc.tokens), np.asarray(out_dir.tokens))
    np.testing.assert_allclose(np.asarray(logits_inc), np.asarray(logits_dir), atol=1e-5)


def test_rows_independent_and_future_slots_ignored(setup):
    tparams, dparams, tokens = setup
    feats = _features(tparams, tokens)
    P = np.array([5, 14])
    state = _prefill(tparams, dparams, tokens, feats, P)
    out, logits, _ = _draft_at(tparams, dparams, state, tokens, P)
    for r in range(2):
        s1 = _prefill(tparams, dparams, tokens[r:r + 1], feats[r:r + 1], P[r:r + 1])
        o1, l1, _ = _draft_at(tparams, dparams, s1, tokens[r:r + 1], P[r:r + 1])
        np.testing.assert_array_equal(np.asarray(o1.tokens)[0], np.asarray(out.tokens)[r])
        np.testing.assert_allclose(np.asarray(l1)[0], np.asarray(logits)[r], atol=1e-5)
    # Garbage at slots >= anchor_pos - 1 (rewritten by the draft or stale) must not matter.
    slot = np.arange(CACHE)[None, :, None, None]
    junk = slot >= (P - 1)[:, None, None, None]
    noisy = eagle3.Eagle3State(k=jnp.where(junk, 100.0, state.k), v=jnp.where(junk, -50.0, state.v),
                               pending=state.pending)
    o2, l2, _ = _draft_at(tparams, dparams, noisy, tokens, P)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(logits), atol=1e-5)
    # ...while a committed slot does matter (the check above can fail).
    broken = eagle3.Eagle3State(k=state.k.at[:, 0].add(3.0), v=state.v.at[:, 0].add(3.0), pending=state.pending)
    _, l3, _ = _draft_at(tparams, dparams, broken, tokens, P)
    assert np.abs(np.asarray(l3) - np.asarray(logits)).max() > 1e-3


def test_loss_value_and_gradients(setup):
    tparams, dparams, tokens = setup
    feats = _features(tparams, tokens)
    mask = jnp.broadcast_to(jnp.arange(T) >= 4, tokens.shape)

    def loss_fn(p):
        return eagle3.eagle3_loss(eagle3.train_forward(p, tparams, TCFG, DCFG, tokens, feats, 3), tokens, mask)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(dparams)
    assert np.isfinite(float(loss)) and float(loss) > 0
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), path
        assert np.abs(g).max() > 0, path
    # The loss formula against a direct numpy computation.
    rng = np.random.default_rng(0)
    S, b, t, V = 3, 2, 6, 5
    logits = rng.normal(size=(S, b, t, V)).astype(np.float32)
    toks = rng.integers(0, V, size=(b, t))
    m = rng.random((b, t)) > 0.3
    want = 0.0
    for j in range(S):
        terms = []
        for r in range(b):
            for i in range(t):
                if i + 2 + j < t and m[r, i + 2 + j]:
                    lg = logits[j, r, i].astype(np.float64)
                    terms.append(np.log(np.exp(lg).sum()) - lg[toks[r, i + 2 + j]])
        want += 0.8 ** j * (np.mean(terms) if terms else 0.0)
    got = eagle3.eagle3_loss(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(m))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_unroll_on_sampled_rows_matches_the_full_unroll(setup):
    """Rows in any order, repeated, past the supervised span: the full unroll's logits at those
    rows, and the loss over them the terms of those rows alone (a dropped row counts nothing)."""
    tparams, dparams, tokens = setup
    feats = _features(tparams, tokens)
    full = np.asarray(_train(dparams, tparams, TCFG, DCFG, tokens, feats, 3))  # [S, b, T, V]
    rows = jnp.array([[0, 5, 9, 3], [11, 2, 7, 7]], jnp.int32)  # any order, repeats allowed
    got = np.asarray(_train(dparams, tparams, TCFG, DCFG, tokens, feats, 3, rows))
    want = np.take_along_axis(full, np.asarray(rows)[None, :, :, None], axis=2)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The loss over rows, one row dropped, against the per-term numpy formula.
    mask = np.asarray(jnp.broadcast_to(jnp.arange(T) >= 4, tokens.shape))
    row_valid = np.array([[True, True, True, False], [True, True, True, True]])
    toks, r = np.asarray(tokens), np.asarray(rows)
    want_loss = 0.0
    for j in range(3):
        terms = []
        for bi in range(2):
            for ri in range(4):
                i = r[bi, ri] + 2 + j
                if row_valid[bi, ri] and i < T and mask[bi, i]:
                    lg = got[j, bi, ri].astype(np.float64)
                    terms.append(np.log(np.exp(lg - lg.max()).sum()) + lg.max() - lg[toks[bi, i]])
        want_loss += 0.8 ** j * np.mean(terms)
    loss = eagle3.eagle3_loss(jnp.asarray(got), tokens, jnp.asarray(mask), rows=rows, row_valid=jnp.asarray(row_valid))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)


def test_sampling_path(setup):
    tparams, dparams, tokens = setup
    P = np.array([8, 10])
    state = _prefill(tparams, dparams, tokens, _features(tparams, tokens), P)
    cfg = RowSampling.uniform(2, temperature=0.9, top_k=6)
    out, logits, _ = _draft_at(tparams, dparams, state, tokens, P, cfg, jax.random.PRNGKey(3))
    probs, drafted = np.asarray(out.full_probs(TCFG.vocab_size)), np.asarray(out.tokens)
    assert probs.shape == (2, G, TCFG.vocab_size)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.take_along_axis(probs, drafted[..., None], -1) > 0)
    assert np.all((probs > 0).sum(-1) <= 6)
    np.testing.assert_allclose(probs, np.asarray(jax.vmap(filtered_probs, (1, None), 1)(logits, cfg)), atol=1e-6)
    out2, _, _ = _draft_at(tparams, dparams, state, tokens, P, cfg, jax.random.PRNGKey(4))
    outs = {tuple(np.asarray(out.tokens).ravel()), tuple(np.asarray(out2.tokens).ravel())}
    assert len(outs) == 2  # the key drives the samples


def test_reduced_draft_vocabulary(setup):
    """With a reduced vocabulary, EAGLE-3 drafts only its ids, step 1 (which depends on the context
    alone) has the full drafter's logits on them, and everything outside has probability 0."""
    tparams, dparams, tokens = setup
    n = 24
    dcfg_r = dataclasses.replace(DCFG, draft_vocab_size=n)
    reduced = dict(dparams, draft_vocab=jax.random.permutation(jax.random.PRNGKey(5), TCFG.vocab_size)[:n].astype(jnp.int32))
    ids = np.asarray(reduced["draft_vocab"])
    P = np.array([7, 12])
    feats = _features(tparams, tokens)
    state = _prefill(tparams, dparams, tokens, feats, P)
    anchor_pos = jnp.asarray(P, jnp.int32)
    anchor = jnp.take_along_axis(tokens, anchor_pos[:, None], axis=1)[:, 0]
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    sampling = RowSampling(jnp.full((2,), 1.0), jnp.zeros((2,), jnp.int32), jnp.ones((2,)))
    out, logits, _ = _draft(reduced, tparams, TCFG, dcfg_r, state, anchor, anchor_pos, keys, sampling)
    _, full_logits, _ = _draft(dparams, tparams, TCFG, DCFG, state, anchor, anchor_pos, keys, sampling)
    outside = np.ones(TCFG.vocab_size, bool)
    outside[ids] = False
    assert np.isin(np.asarray(out.tokens), ids).all()
    # q is kept over the draft ids only, and spreads to zero everywhere else.
    assert out.probs.shape == (2, G, n) and np.array_equal(np.asarray(out.support), ids)
    probs = np.asarray(out.full_probs(TCFG.vocab_size))
    assert (probs[..., outside] == 0).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits)[:, 0, ids], np.asarray(full_logits)[:, 0, ids], atol=1e-5, rtol=0)
    # The engine's bound head (rows gathered once) drafts the same tokens with the same logits.
    bound = vocab.bind_head(reduced, tparams)
    assert bound["draft_head"].shape == (n, TCFG.hidden_size)
    out_b, logits_b, _ = _draft(bound, tparams, TCFG, dcfg_r, state, anchor, anchor_pos, keys, sampling)
    np.testing.assert_array_equal(np.asarray(out_b.tokens), np.asarray(out.tokens))
    np.testing.assert_array_equal(np.asarray(logits_b), np.asarray(logits))
    train = np.asarray(_train(reduced, tparams, TCFG, dcfg_r, tokens, feats, 2))
    assert np.isneginf(train[..., outside]).all() and np.isfinite(train[..., ids]).all()
