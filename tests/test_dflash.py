"""Tests for the DFlash / DSpark drafter: masking, heads, inference-vs-training agreement, losses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_target_params
from dspark_jax.drafters import dflash, heads
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.losses import dflash_loss, dspark_loss, position_weights
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.transformer import forward
from dspark_jax.sampling import RowSampling

TCFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5)
TCFG_BQ = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                      attention_bias=True, qk_norm=True, tie_word_embeddings=True)
LAYERS = (-1, 1, 2)
G = 4
T = 20


def _dcfg(**kw):
    base = dict(kind="dspark", block_size=G, num_layers=2, target_layer_ids=LAYERS, head_type="markov",
                head_rank=8, confidence_head=True)
    base.update(kw)
    return DrafterConfig(**base)


def _random_target(key, cfg):
    return random_target_params(key, cfg)


def _randomize(params, key, scale=0.2):
    """Perturb every float leaf (so zero-initialised W2 / biases are exercised too)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = [leaf + scale * jax.random.normal(k, leaf.shape) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf
           for leaf, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _setup(tcfg=TCFG, dcfg=None, seed=0, batch=2):
    dcfg = dcfg or _dcfg()
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    tp = _random_target(k[0], tcfg)
    dp = _randomize(dflash.init_params(k[1], tcfg, dcfg), k[2])
    tokens = jax.random.randint(k[3], (batch, T), 0, tcfg.vocab_size, jnp.int32)
    return tcfg, dcfg, tp, dp, tokens, _features(tp, tcfg, tokens, dcfg.target_layer_ids)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _features(tp, tcfg, tokens, layers):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return forward(tp, tcfg, tokens, positions, feature_layers=layers)[2]


@functools.partial(jax.jit, static_argnums=(0, 1, 6))
def _context(tcfg, dcfg, tp, dp, feats, valid, cache_len=24):
    b = feats.shape[0]
    state = dflash.init_state(dp, tcfg, dcfg, b, cache_len)
    positions = jnp.broadcast_to(jnp.arange(feats.shape[1], dtype=jnp.int32), feats.shape[:2])
    return dflash.extend(dp, tp, tcfg, dcfg, state, None, feats, positions, valid)


_backbone = jax.jit(dflash.draft_backbone, static_argnums=(2, 3))
_train = jax.jit(dflash.train_forward, static_argnums=(2, 3))


# ------------------------------------------------------------------ inference context isolation
def test_context_isolation_and_extend_validity():
    tcfg, dcfg, tp, dp, tokens, feats = _setup()
    anchor_pos = jnp.array([9, 13], jnp.int32)
    anchor = tokens[jnp.arange(2), anchor_pos]
    all_valid = jnp.ones(tokens.shape, bool)
    base = _backbone(dp, tp, tcfg, dcfg, _context(tcfg, dcfg, tp, dp, feats, all_valid),
                                 anchor, anchor_pos)[1]
    assert base.shape == (2, G, tcfg.vocab_size)

    # Features at positions >= the anchor (stale slots) must not matter.
    late = (jnp.arange(T)[None, :] >= anchor_pos[:, None])[:, :, None, None]
    feats_late = jnp.where(late, feats + 3.0 * jax.random.normal(jax.random.PRNGKey(5), feats.shape), feats)
    base_late = _backbone(dp, tp, tcfg, dcfg, _context(tcfg, dcfg, tp, dp, feats_late, all_valid),
                                      anchor, anchor_pos)[1]
    np.testing.assert_allclose(base_late, base, atol=1e-6)

    # ... but the one just before the anchor must.
    feats_early = feats.at[:, 8].add(3.0)
    base_early = _backbone(dp, tp, tcfg, dcfg, _context(tcfg, dcfg, tp, dp, feats_early, all_valid),
                                       anchor, anchor_pos)[1]
    assert np.all(np.abs(np.asarray(base_early - base)).max(axis=(1, 2)) > 1e-3)

    # Invalid entries leave the state untouched.
    state = _context(tcfg, dcfg, tp, dp, feats, all_valid)
    none_valid = jnp.zeros(tokens.shape, bool)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    again = jax.jit(dflash.extend, static_argnums=(2, 3))(dp, tp, tcfg, dcfg, state, None, feats_late,
                                                          positions, none_valid)
    np.testing.assert_array_equal(again.k, state.k)
    np.testing.assert_array_equal(again.v, state.v)


# ------------------------------------------------------------------ heads
def test_heads():
    key = jax.random.PRNGKey(1)
    b, e, r = 3, TCFG.hidden_size, 8
    h1, h2 = jax.random.normal(key, (2, b, e))
    prev = jnp.array([1, 2, 3], jnp.int32)
    state = jnp.zeros((b, r))

    mk = _dcfg(head_type="markov")
    hp = _randomize(heads.init_head(key, TCFG, mk), jax.random.PRNGKey(2))
    bias1, s1 = heads.head_step(hp, mk, h1, prev, state)
    bias2, _ = heads.head_step(hp, mk, h2, prev, state)
    bias3, _ = heads.head_step(hp, mk, h1, prev + 5, state)
    assert bias1.shape == (b, TCFG.vocab_size)
    np.testing.assert_array_equal(bias1, bias2)  # depends on the previous token only
    assert np.all(np.abs(np.asarray(bias1 - bias3)).max(-1) > 1e-3)
    np.testing.assert_allclose(bias1, hp["w1"][prev] @ hp["w2"], atol=1e-6)

    gt = _dcfg(head_type="gated", draft_vocab_size=40)
    hp = heads.init_head(key, TCFG, gt)  # W2 starts at zero
    bias, _ = heads.head_step(hp, gt, h1, prev, state)
    assert bias.shape == (b, 40)
    np.testing.assert_array_equal(bias, 0.0)
    hp = _randomize(hp, jax.random.PRNGKey(3))
    bias_a, _ = heads.head_step(hp, gt, h1, prev, state)
    bias_b, _ = heads.head_step(hp, gt, h2, prev, state)
    assert np.abs(np.asarray(bias_a - bias_b)).max() > 1e-4  # the gate reads h_k

    rn = _dcfg(head_type="rnn")
    hp = _randomize(heads.init_head(key, TCFG, rn), jax.random.PRNGKey(4))
    bias, s1 = heads.head_step(hp, rn, h1, prev, state)
    _, s2 = heads.head_step(hp, rn, h1, prev, s1)
    assert bias.shape == (b, TCFG.vocab_size) and s1.shape == (b, r)
    assert np.abs(np.asarray(s1)).max() > 0 and np.abs(np.asarray(s2 - s1)).max() > 0
    assert np.all(np.abs(np.asarray(s1)) < 1.0)

    # Confidence: own embedding without a head, head's W1 with one.
    cp = heads.init_confidence(key, TCFG, _dcfg(head_type="none", head_rank=0))
    assert cp["emb"].shape == (TCFG.vocab_size, heads.CONF_EMBED_RANK)
    assert heads.confidence_logit(cp, None, h1, prev).shape == (b,)
    cp = heads.init_confidence(key, TCFG, rn)
    assert "emb" not in cp and heads.confidence_logit(cp, hp, h1, prev).shape == (b,)


# ------------------------------------------------------------------ inference == training
CONSISTENCY_CASES = {
    "markov": (TCFG, _dcfg()),
    "rnn_bias_qknorm_reduced": (TCFG_BQ, _dcfg(head_type="rnn", draft_vocab_size=40)),
    "dflash_mask_token": (TCFG, _dcfg(kind="dflash", head_type="none", head_rank=0, confidence_head=False,
                                      mask_token_id=3, num_layers=1)),
}


@pytest.mark.parametrize("case", sorted(CONSISTENCY_CASES))
def test_draft_matches_train_forward(case):
    tcfg, dcfg = CONSISTENCY_CASES[case]
    tcfg, dcfg, tp, dp, tokens, feats = _setup(tcfg, dcfg, seed=7)
    if dcfg.draft_vocab_size:  # a non-prefix reduced vocabulary
        dp["draft_vocab"] = jax.random.permutation(jax.random.PRNGKey(9), tcfg.vocab_size)[:40].astype(jnp.int32)
    anchor_pos = jnp.array([7, 12], jnp.int32)
    rows = jnp.arange(2)
    anchor = tokens[rows, anchor_pos]
    valid = jnp.arange(T)[None, :] < anchor_pos[:, None]
    state = _context(tcfg, dcfg, tp, dp, feats, valid)

    train = _train(dp, tp, tcfg, dcfg, tokens, feats,
                                                                   anchor_pos[:, None])
    hidden, base = _backbone(dp, tp, tcfg, dcfg, state, anchor, anchor_pos)
    np.testing.assert_allclose(base, train["base_logits"][:, 0], atol=1e-5)
    np.testing.assert_allclose(hidden, train["hidden"][:, 0], atol=1e-5)
    if dcfg.draft_vocab_size:
        outside = np.ones(tcfg.vocab_size, bool)
        outside[np.asarray(dp["draft_vocab"])] = False
        assert np.all(np.isneginf(np.asarray(base)[..., outside]))
        assert np.all(np.isfinite(np.asarray(base)[..., ~outside]))

    # Forcing the drafted tokens to the teacher tokens makes the head scan see the same previous
    # tokens as teacher forcing; at temperature 1 the draft probs are softmax(logits).
    forced = tokens[rows[:, None], anchor_pos[:, None] + 1 + jnp.arange(G)]
    draft = jax.jit(dflash.draft, static_argnums=(2, 3))
    b = anchor.shape[0]
    keys = jnp.stack([jax.random.PRNGKey(0)] * b)
    out, _ = draft(dp, tp, tcfg, dcfg, state, anchor, anchor_pos, keys, RowSampling.uniform(b, temperature=1.0),
                   forced)
    np.testing.assert_array_equal(out.tokens, forced)
    np.testing.assert_allclose(out.full_probs(tcfg.vocab_size), jax.nn.softmax(train["logits"][:, 0], -1), atol=1e-5)
    np.testing.assert_allclose(out.confidence_logits, train["confidence_logits"][:, 0], atol=1e-5)
    if dcfg.has_head:  # the head really changed the distribution
        assert np.abs(np.asarray(train["logits"] - train["base_logits"]))[np.isfinite(base)[:, None]].max() > 1e-3
    else:
        np.testing.assert_array_equal(out.confidence_logits, 0.0)

    # Greedy drafting: one-hot probs of the argmax of the head-corrected logits.
    out, _ = draft(dp, tp, tcfg, dcfg, state, anchor, anchor_pos, keys, RowSampling.uniform(b))
    np.testing.assert_array_equal(out.full_probs(tcfg.vocab_size), jax.nn.one_hot(out.tokens, tcfg.vocab_size))
    train_g = _train(dp, tp, tcfg, dcfg, tokens.at[rows[:, None], anchor_pos[:, None] + 1
                                                               + jnp.arange(G - 1)].set(out.tokens[:, :-1]),
                                   feats, anchor_pos[:, None])
    np.testing.assert_array_equal(out.tokens, jnp.argmax(train_g["logits"][:, 0], -1))


# ------------------------------------------------------------------ training attention mask
def test_train_forward_block_isolation():
    tcfg, dcfg, tp, dp, tokens, feats = _setup(batch=1)
    a1, a2 = 3, 11
    anchors = jnp.array([[a1, a2, T - 2]], jnp.int32)  # the last block runs past the sequence end
    run = _train
    out = run(dp, tp, tcfg, dcfg, tokens, feats, anchors)
    assert out["logits"].shape == (1, 3, G, tcfg.vocab_size)
    assert out["confidence_logits"].shape == (1, 3, G) and out["hidden"].shape == (1, 3, G, tcfg.hidden_size)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in out.values())

    def block(o, i):
        return {k: np.asarray(v[:, i]) for k, v in o.items()}

    noise = jax.random.normal(jax.random.PRNGKey(11), feats.shape)
    # Features at >= a1 and tokens past block 1 (including block 2's anchor): block 1 unchanged.
    feats2 = feats.at[:, a1:].add(noise[:, a1:])
    tokens2 = tokens.at[:, a1 + G:].set((tokens[:, a1 + G:] + 1) % tcfg.vocab_size)
    out2 = run(dp, tp, tcfg, dcfg, tokens2, feats2, anchors)
    for name, value in block(out2, 0).items():
        np.testing.assert_allclose(value, block(out, 0)[name], atol=1e-6, err_msg=name)
    assert np.abs(block(out2, 1)["hidden"] - block(out, 1)["hidden"]).max() > 1e-3

    # Tokens inside block 1 (after its anchor) only reach it through the teacher-forced head.
    tokens3 = tokens.at[:, a1 + 1:a1 + G].set((tokens[:, a1 + 1:a1 + G] + 1) % tcfg.vocab_size)
    out3 = run(dp, tp, tcfg, dcfg, tokens3, feats, anchors)
    for name in ("hidden", "base_logits"):
        np.testing.assert_allclose(block(out3, 0)[name], block(out, 0)[name], atol=1e-6)
    np.testing.assert_allclose(block(out3, 0)["logits"][:, 0], block(out, 0)["logits"][:, 0], atol=1e-6)
    assert np.abs(block(out3, 0)["logits"][:, 1:] - block(out, 0)["logits"][:, 1:]).max() > 1e-3

    # Block 1's own anchor token is its input.
    tokens4 = tokens.at[:, a1].set((tokens[:, a1] + 1) % tcfg.vocab_size)
    out4 = run(dp, tp, tcfg, dcfg, tokens4, feats, anchors)
    assert np.abs(block(out4, 0)["base_logits"] - block(out, 0)["base_logits"]).max() > 1e-3


# ------------------------------------------------------------------ losses
def _batch(tcfg, dcfg, tp, dp, tokens, feats):
    anchors = jnp.array([[2, 9], [5, 13]], jnp.int32)
    tpos = anchors[:, :, None] + 1 + jnp.arange(G)  # [b, A, G] positions of the targets
    b = tokens.shape[0]
    targets = jnp.take_along_axis(tokens, jnp.clip(tpos, 0, T - 1).reshape(b, -1), axis=1).reshape(tpos.shape)
    p = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), tpos.shape + (tcfg.vocab_size,)), -1)
    mask = tpos < T
    return anchors, targets, p, mask


def _grad_norms(grads):
    return {jax.tree_util.keystr(path): float(np.linalg.norm(np.asarray(leaf, np.float64)))
            for path, leaf in jax.tree_util.tree_leaves_with_path(grads) if leaf.dtype != jax.dtypes.float0}


def test_losses_and_gradients():
    tcfg, dcfg, tp, dp, tokens, feats = _setup()
    anchors, targets, p, mask = _batch(tcfg, dcfg, tp, dp, tokens, feats)

    def loss_fn(params):
        out = dflash.train_forward(params, tp, tcfg, dcfg, tokens, feats, anchors)
        return dspark_loss(out, targets, p, mask)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(dp)
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
    norms = _grad_norms(grads)
    assert all(np.isfinite(v) for v in norms.values())
    for name in ("['w_c']", "['ctx_norm']", "['layers']['wq']", "['layers']['w_down']", "['mask_embed']",
                 "['head']['w1']", "['head']['w2']", "['confidence']['w']", "['confidence']['b']"):
        assert norms[name] > 0, name

    # q == p: the TV term vanishes and the confidence label is 1.
    out = _train(dp, tp, tcfg, dcfg, tokens, feats, anchors)
    _, m = dspark_loss(out, targets, jax.nn.softmax(out["logits"], -1), mask)
    assert float(m["tv"]) < 1e-5 and abs(float(m["accept_est"]) - 1.0) < 1e-5
    _, m2 = dspark_loss(out, targets, p, mask)
    assert float(m2["tv"]) > 0.1
    np.testing.assert_allclose(position_weights(4), np.exp(-np.arange(4) / 4), rtol=1e-6)

    # DFlash: CE only; reduced vocab with targets outside it stays finite.
    dcfg_f = _dcfg(kind="dflash", head_type="none", head_rank=0, confidence_head=False, draft_vocab_size=16)
    dpf = _randomize(dflash.init_params(jax.random.PRNGKey(4), tcfg, dcfg_f), jax.random.PRNGKey(5))

    def loss_f(params):
        out = dflash.train_forward(params, tp, tcfg, dcfg_f, tokens, feats, anchors)
        return dflash_loss(out, targets, mask)[0] + dspark_loss(out, targets, p, mask)[0]

    loss_v, grads = jax.jit(jax.value_and_grad(loss_f, allow_int=True))(dpf)
    norms = {k: v for k, v in _grad_norms(grads).items() if "draft_vocab" not in k}
    assert np.isfinite(float(loss_v)) and all(np.isfinite(v) for v in norms.values())
    assert norms["['w_c']"] > 0 and norms["['layers']['wk']"] > 0


# ------------------------------------------------------------------ sampling
def test_sampled_draft_is_consistent():
    tcfg, dcfg, tp, dp, tokens, feats = _setup(dcfg=_dcfg(head_type="gated"))
    anchor_pos = jnp.array([6, 10], jnp.int32)
    anchor = tokens[jnp.arange(2), anchor_pos]
    state = _context(tcfg, dcfg, tp, dp, feats, jnp.arange(T)[None, :] < anchor_pos[:, None])
    for top_k, sampling in ((None, RowSampling.uniform(2, temperature=0.8)),
                            (5, RowSampling.uniform(2, temperature=1.3, top_k=5, top_p=0.9))):
        run = jax.jit(functools.partial(dflash.draft, tcfg=tcfg, dcfg=dcfg))
        tok_sets = []
        for seed in range(3):
            out, state_out = run(dp, tp, state=state, anchor=anchor, anchor_pos=anchor_pos,
                                 keys=jax.random.split(jax.random.PRNGKey(seed), 2), sampling=sampling)
            assert out.tokens.shape == (2, G) and out.tokens.dtype == jnp.int32
            probs = np.asarray(out.full_probs(tcfg.vocab_size))  # [2, G, V]
            np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
            picked = np.take_along_axis(probs, np.asarray(out.tokens)[..., None], -1)
            assert np.all(picked > 0)
            assert np.all(np.isfinite(np.asarray(out.confidence_logits)))
            tok_sets.append(np.asarray(out.tokens))
        assert state_out.k is not None and np.array_equal(np.asarray(state_out.k), np.asarray(state.k))
        assert any(not np.array_equal(tok_sets[0], t) for t in tok_sets[1:])  # the key matters
        if top_k:
            assert np.all((probs > 0).sum(-1) <= 5)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_shallow_draft_is_the_first_positions_of_the_whole_block(layers):
    """draft(depth=D) equals the first D positions of the full draft (same keys: the same tokens,
    probabilities and confidences), for a sampled and a greedy row; past D it proposes nothing."""
    tcfg, dcfg, tp, dp, tokens, feats = _setup(dcfg=_dcfg(num_layers=layers), seed=3)
    anchor_pos = jnp.array([7, 12], jnp.int32)
    anchor = tokens[jnp.arange(2), anchor_pos]
    state = _context(tcfg, dcfg, tp, dp, feats, jnp.arange(T)[None, :] < anchor_pos[:, None])
    sampling = RowSampling(temperature=jnp.array([0.9, 0.0], jnp.float32), top_k=jnp.zeros(2, jnp.int32),
                           top_p=jnp.ones(2, jnp.float32))
    keys = jax.random.split(jax.random.PRNGKey(11), 2)
    run = jax.jit(dflash.draft, static_argnums=(2, 3), static_argnames=("depth",))
    full, _ = run(dp, tp, tcfg, dcfg, state, anchor, anchor_pos, keys, sampling)
    assert full.proposed is None
    for depth in range(1, G):
        part, _ = run(dp, tp, tcfg, dcfg, state, anchor, anchor_pos, keys, sampling, depth=depth)
        np.testing.assert_array_equal(part.tokens[:, :depth], full.tokens[:, :depth])
        np.testing.assert_allclose(part.probs[:, :depth], full.probs[:, :depth], atol=1e-5)
        np.testing.assert_allclose(part.confidence_logits[:, :depth], full.confidence_logits[:, :depth],
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(part.proposed, [depth, depth])
        assert np.all(np.asarray(part.confidence_logits[:, depth:]) == dflash.NO_CONFIDENCE)
        assert np.all(np.asarray(part.probs[:, depth:]) == 0.0)


@pytest.mark.parametrize("tcfg", [TCFG, TCFG_BQ], ids=["llama", "qwen3"])
def test_copy_target_layers_takes_the_last_layers(tcfg):
    """The drafter's layers become the target's last num_layers layers (stacked or per-layer target
    params alike), final_norm the target's; everything else keeps its initial value."""
    from dspark_jax.drafters.config import DrafterConfigError
    from dspark_jax.models.transformer import unstack_layers

    dcfg = _dcfg()
    tp = _random_target(jax.random.PRNGKey(3), tcfg)
    dp = dflash.init_params(jax.random.PRNGKey(4), tcfg, dcfg)
    for source in (tp, unstack_layers(tp)):
        out = dflash.copy_target_layers(dp, source, dcfg)
        for name, value in out["layers"].items():
            want = np.asarray(tp["layers"][name])[tcfg.num_layers - dcfg.num_layers:]  # tp is stacked
            np.testing.assert_array_equal(np.asarray(value), want, err_msg=name)
            assert value.dtype == dp["layers"][name].dtype
        np.testing.assert_array_equal(np.asarray(out["final_norm"]), np.asarray(tp["final_norm"]))
        np.testing.assert_array_equal(np.asarray(out["w_c"]), np.asarray(dp["w_c"]))
    too_deep = _dcfg(num_layers=tcfg.num_layers + 1)
    with pytest.raises(DrafterConfigError, match="cannot copy"):
        dflash.copy_target_layers(dflash.init_params(jax.random.PRNGKey(4), tcfg, too_deep), tp, too_deep)


def test_grown_layers_start_as_the_identity_and_then_train():
    """A drafter grown by a layer outputs exactly what it did (the new layer's wo / w_down are
    zero), keeps its trained layers in front, and the new layer's output projections get a
    gradient, so training can use it. Shrinking is refused."""
    from dspark_jax.drafters.config import DrafterConfigError

    tcfg, dcfg, tp, dp, tokens, feats = _setup(dcfg=_dcfg(num_layers=1), batch=1)
    grown_cfg = _dcfg(num_layers=3)
    grown = dflash.grow_layers(jax.random.PRNGKey(9), dp, tcfg, dcfg, 3)
    anchors = jnp.array([[2, 9]], jnp.int32)
    before = _train(dp, tp, tcfg, dcfg, tokens, feats, anchors)
    after = _train(grown, tp, tcfg, grown_cfg, tokens, feats, anchors)
    for name in ("logits", "confidence_logits", "hidden"):
        np.testing.assert_allclose(np.asarray(after[name]), np.asarray(before[name]), atol=1e-5, err_msg=name)
    for name, value in grown["layers"].items():
        assert value.shape[0] == 3
        np.testing.assert_array_equal(np.asarray(value[:1]), np.asarray(dp["layers"][name]), err_msg=name)
    assert np.abs(np.asarray(grown["layers"]["wq"][1:])).max() > 0  # fresh, not copies of zeros

    def loss(layers):
        out = _train({**grown, "layers": layers}, tp, tcfg, grown_cfg, tokens, feats, anchors)
        return jnp.sum(out["logits"] ** 2)

    grads = jax.grad(loss)(grown["layers"])
    for name in ("wo", "w_down"):
        assert np.abs(np.asarray(grads[name][1:])).max() > 1e-6, name
    assert dflash.grow_layers(jax.random.PRNGKey(9), dp, tcfg, dcfg, 1) is dp
    with pytest.raises(DrafterConfigError, match="cannot grow"):
        dflash.grow_layers(jax.random.PRNGKey(9), grown, tcfg, grown_cfg, 2)
