"""The prompt-lookup drafter against a plain-Python reference of the same rule."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from dspark_jax.drafters import ngram
from dspark_jax.drafters.config import default_config
from dspark_jax.models.config import ModelConfig

TCFG = ModelConfig(family="llama", vocab_size=12, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                   num_kv_heads=1, head_dim=8, max_position_embeddings=64)


def reference(seq: list[int], g: int, n_min: int, n_max: int) -> list[int]:
    """Latest earlier occurrence of the longest suffix n-gram (n_max down to n_min); what followed
    it, repeated with the period the match implies (distance from the match to the anchor)."""
    p = len(seq) - 1  # the anchor is seq[-1]
    for n in range(n_max, n_min - 1, -1):
        if n > len(seq):
            continue
        suffix = seq[-n:]
        for end in range(p - 1, n - 2, -1):  # match ending strictly before the anchor
            if seq[end - n + 1:end + 1] == suffix:
                period = p - end
                return [seq[end + 1 + k % period] for k in range(g)]
    return []


def test_matches_reference_on_random_histories():
    rng = np.random.default_rng(0)
    dcfg = default_config("ngram", 1, block_size=5, ngram_min=1, ngram_max=3)
    rows = 64
    lengths = rng.integers(2, 40, size=rows)
    seqs = [rng.integers(0, 4, size=int(n)).tolist() for n in lengths]  # small alphabet: many matches
    state = ngram.init_state({}, TCFG, dcfg, rows, 48)
    width = max(lengths) - 1
    tokens = np.zeros((rows, width), np.int32)
    valid = np.zeros((rows, width), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s) - 1] = s[:-1]
        valid[i, : len(s) - 1] = True
    positions = np.broadcast_to(np.arange(width), (rows, width))
    state = ngram.extend({}, None, TCFG, dcfg, state, jnp.asarray(tokens), None, jnp.asarray(positions),
                         jnp.asarray(valid))
    anchor = jnp.asarray([s[-1] for s in seqs])
    out, _ = ngram.draft({}, None, TCFG, dcfg, state, anchor, jnp.asarray(lengths - 1), None, None)
    proposed = np.asarray(out.proposed)
    drafted = np.asarray(out.tokens)
    matched = 0
    for i, s in enumerate(seqs):
        ref = reference(s, 5, 1, 3)
        assert proposed[i] == len(ref), (s, ref, drafted[i])
        assert drafted[i, : len(ref)].tolist() == ref
        matched += bool(ref)
    assert matched > rows // 2  # the case mix really exercises matching
    probs = np.asarray(out.probs)
    np.testing.assert_array_equal(probs.argmax(-1), drafted)
    np.testing.assert_allclose(probs.sum(-1), 1.0)
