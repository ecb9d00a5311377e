"""Our target forward against transformers on tiny random Llama / Qwen2 / Qwen3 models."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import make_tiny_hf_model
from dspark_jax import load_target
from dspark_jax.models.transformer import forward, init_cache, logits_from_hidden

CASES = [
    ("llama", True, {}),
    ("llama", False, {}),
    ("llama", False, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("qwen2", False, {}),
    ("qwen2", True, {}),
    ("qwen3", False, {}),
    ("qwen3", True, {"num_key_value_heads": 6}),
]


def _torch_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("family,tie,overrides", CASES)
def test_logits_match_transformers(tmp_path, family, tie, overrides):
    hf = make_tiny_hf_model(str(tmp_path), family, tie, **overrides)
    target = load_target(str(tmp_path))
    assert target.config.family == family and target.config.tie_word_embeddings == tie
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 96, size=(2, 40))
    expected = _torch_logits(hf, ids)

    # Full forward, no cache.
    positions = jnp.broadcast_to(jnp.arange(40), (2, 40))
    hidden, _, _ = forward(target.params, target.config, jnp.asarray(ids), positions)
    ours = np.asarray(logits_from_hidden(target.params, hidden))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)

    # KV-cache path: a prefill of 25 tokens, then the rest one token at a time.
    step = jax.jit(lambda p, t, pos, c: forward(p, target.config, t, pos, c))
    cache = init_cache(target.config, 2, 64)
    hidden, cache, _ = step(target.params, jnp.asarray(ids[:, :25]), positions[:, :25], cache)
    got = [np.asarray(logits_from_hidden(target.params, hidden))]
    for t in range(25, 40):
        hidden, cache, _ = step(target.params, jnp.asarray(ids[:, t:t + 1]), positions[:, t:t + 1], cache)
        got.append(np.asarray(logits_from_hidden(target.params, hidden)))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=1e-4, rtol=0)


def test_rows_at_different_positions_in_one_cache(tmp_path):
    """Rows decode at their own positions; each equals the row run alone."""
    hf = make_tiny_hf_model(str(tmp_path), "llama", False)
    target = load_target(str(tmp_path))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 96, size=12).tolist(), rng.integers(0, 96, size=30).tolist()
    cache = init_cache(target.config, 2, 64)
    tokens = np.zeros((2, 30), np.int32)
    tokens[0, :12], tokens[1] = a, b
    positions = jnp.broadcast_to(jnp.arange(30), (2, 30))
    _, cache, _ = forward(target.params, target.config, jnp.asarray(tokens), positions, cache)
    # One more token per row, each at its own position (12 and 30).
    nxt = jnp.asarray([[5], [7]])
    hidden, _, _ = forward(target.params, target.config, nxt, jnp.asarray([[12], [30]]), cache)
    ours = np.asarray(logits_from_hidden(target.params, hidden))[:, 0]
    np.testing.assert_allclose(ours[0], _torch_logits(hf, [a + [5]])[0, -1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[1], _torch_logits(hf, [b + [7]])[0, -1], atol=1e-4, rtol=0)


def test_feature_taps_match_hidden_states(tmp_path):
    import torch

    hf = make_tiny_hf_model(str(tmp_path), "qwen3", False)
    target = load_target(str(tmp_path))
    ids = np.random.default_rng(2).integers(0, 96, size=(1, 10))
    with torch.no_grad():
        states = hf(torch.tensor(ids), output_hidden_states=True).hidden_states  # embeddings, then each layer
    layers = (-1, 0, 2)
    positions = jnp.arange(10)[None]
    hidden, _, feats = forward(target.params, target.config, jnp.asarray(ids), positions, feature_layers=layers)
    assert feats.shape == (1, 10, 3, 48)
    np.testing.assert_allclose(np.asarray(feats[0, :, 0]), states[0][0].numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(feats[0, :, 1]), states[1][0].numpy(), atol=1e-5)
    # HF's last entry is after the final norm; our layer 2 tap is before it.
    no_taps, _, none = forward(target.params, target.config, jnp.asarray(ids), positions)
    assert none is None
    np.testing.assert_allclose(np.asarray(no_taps), np.asarray(hidden))
    with pytest.raises(ValueError, match="feature_layers"):
        forward(target.params, target.config, jnp.asarray(ids), positions, feature_layers=(2, 1))


def test_bfloat16_params_run_close_to_float32(tmp_path):
    make_tiny_hf_model(str(tmp_path), "llama", True)
    f32 = load_target(str(tmp_path))
    bf16 = load_target(str(tmp_path), dtype="bfloat16")
    assert bf16.params["embed"].dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 96, size=(1, 16)))
    pos = jnp.arange(16)[None]
    a = logits_from_hidden(f32.params, forward(f32.params, f32.config, ids, pos)[0])
    b = logits_from_hidden(bf16.params, forward(bf16.params, bf16.config, ids, pos)[0])
    assert b.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - b))) < 0.1 * float(jnp.max(jnp.abs(a)))
