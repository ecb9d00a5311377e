"""Decoder-only target forward pass (Llama / Qwen2 / Qwen3) as a pure function over a params pytree.

Params layout (layer weights stacked on a leading layer axis so the stack runs as one lax.scan):

    embed        [vocab, e]
    final_norm   [e]
    lm_head      [e, vocab]          (absent when embeddings are tied)
    layers:
      attn_norm  [L, e]              mlp_norm [L, e]
      wq [L, e, heads*d]  wk, wv [L, e, kv_heads*d]  wo [L, heads*d, e]
      bq [L, heads*d]  bk, bv [L, kv_heads*d]        (attention_bias only)
      q_norm, k_norm [L, d]                          (qk_norm only)
      w_gate, w_up [L, e, f]  w_down [L, f, e]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.models.config import ModelConfig
from dspark_jax.models.layers import apply_rope, attend, rms_norm, rope_inv_freq, swiglu


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated per-batch KV cache. Slot s of a row holds the token at position s.

    A row's entries at slots >= its length are stale or empty; attention masks them by position
    (a query at position p sees slots <= p), so rejected draft tokens never need erasing.
    """

    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    lengths: jax.Array  # [batch] int32, committed tokens per row

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def project_qkv(lp: dict, config: ModelConfig, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """Normed input x [b, t, e] -> rotated q [b, t, heads, d], k and v [b, t, kv_heads, d]."""
    b, t, _ = x.shape
    q = x @ lp["wq"]
    k = x @ lp["wk"]
    v = x @ lp["wv"]
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, t, config.num_heads, config.head_dim)
    k = k.reshape(b, t, config.num_kv_heads, config.head_dim)
    v = v.reshape(b, t, config.num_kv_heads, config.head_dim)
    if "q_norm" in lp:
        q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention_out(lp: dict, q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of q over (keys, values) followed by the output projection -> [b, t, e]."""
    b, t = q.shape[:2]
    return attend(q, keys, values, mask).reshape(b, t, -1) @ lp["wo"]


def mlp_residual(lp: dict, config: ModelConfig, h: jax.Array) -> jax.Array:
    """Second half of a pre-norm decoder layer: h + MLP(norm(h))."""
    x = rms_norm(h, lp["mlp_norm"], config.rms_norm_eps)
    return h + swiglu(x, lp["w_gate"], lp["w_up"], lp["w_down"])


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head_weight(params: dict) -> jax.Array:
    """[e, vocab]; the transposed embedding when embeddings are tied."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def logits_from_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., e] -> float32 logits [..., vocab]."""
    return jnp.matmul(hidden, lm_head_weight(params), preferred_element_type=jnp.float32)


def forward(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,  # [b, t] int32
    positions: jax.Array,  # [b, t] int32 absolute positions
    cache: KVCache | None = None,
    feature_layers: tuple[int, ...] = (),
):
    """Run the decoder stack.

    With a cache, the new tokens' K/V are written at slots `positions` (out-of-range slots are
    dropped) and each query attends to cache slots <= its position. Without a cache, attention is
    causal by position among the given tokens (padding must carry positions past the real ones).

    Returns (hidden [b, t, e] after the final norm, updated cache or None,
    features [b, t, m, e] of `feature_layers` (layer -1 = embedding output) or None).
    The cache's `lengths` are left to the caller, who knows how many tokens were committed.
    """
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    h = embed(params, tokens)
    b, t, e = h.shape
    num_feats = len(feature_layers)
    if list(feature_layers) != sorted(set(feature_layers)) or any(
        not -1 <= l < config.num_layers for l in feature_layers
    ):
        raise ValueError(f"feature_layers must be strictly increasing ids in [-1, {config.num_layers}), "
                         f"got {feature_layers}")
    # Slot of each decoder layer in the feature buffer; unrequested layers write to a spare slot.
    slot_of_layer = [num_feats] * config.num_layers
    for j, layer_id in enumerate(feature_layers):
        if layer_id >= 0:
            slot_of_layer[layer_id] = j
    feats = None
    if num_feats:
        feats = jnp.zeros((num_feats + 1, b, t, e), h.dtype)
        if feature_layers[0] == -1:
            feats = feats.at[0].set(h)

    if cache is None:
        self_mask = positions[:, None, :] <= positions[:, :, None]  # [b, t, t]
        cache_k = cache_v = None
    else:
        slot_positions = jnp.arange(cache.max_len, dtype=jnp.int32)
        cache_mask = slot_positions[None, None, :] <= positions[:, :, None]  # [b, t, s]
        batch_index = jnp.arange(b)[:, None]
        cache_k, cache_v = cache.k, cache.v

    def layer_step(carry, xs):
        h, cache_k, cache_v, feats = carry
        lp, layer_index, slot = xs
        x = rms_norm(h, lp["attn_norm"], config.rms_norm_eps)
        q, k, v = project_qkv(lp, config, x, positions, inv_freq)
        if cache_k is None:
            keys, values, mask = k, v, self_mask
        else:
            cache_k = cache_k.at[layer_index, batch_index, positions].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[layer_index, batch_index, positions].set(v.astype(cache_v.dtype), mode="drop")
            keys, values, mask = cache_k[layer_index], cache_v[layer_index], cache_mask
        h = h + attention_out(lp, q, keys.astype(q.dtype), values.astype(q.dtype), mask)
        h = mlp_residual(lp, config, h)
        if feats is not None:
            feats = feats.at[slot].set(h)
        return (h, cache_k, cache_v, feats), None

    xs = (params["layers"], jnp.arange(config.num_layers), jnp.asarray(slot_of_layer, jnp.int32))
    (h, cache_k, cache_v, feats), _ = jax.lax.scan(layer_step, (h, cache_k, cache_v, feats), xs)
    hidden = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    new_cache = None if cache is None else KVCache(k=cache_k, v=cache_v, lengths=cache.lengths)
    features = None if feats is None else jnp.moveaxis(feats[:num_feats], 0, 2)
    return hidden, new_cache, features
