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
from dspark_jax.models.layers import attend, attend_two, rms_norm, rope_inv_freq, rope_tables, rotate, swiglu


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


def target_rope(config: ModelConfig, positions: jax.Array):
    """Rotary tables for positions [b, t] under the config's theta and scaling."""
    return rope_tables(positions, rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))


def project_qkv(lp: dict, config: ModelConfig, x: jax.Array, rope):
    """Normed input x [b, t, e] -> rotated q [b, t, heads, d], k and v [b, t, kv_heads, d].

    `rope` is target_rope(config, positions) (computed once per forward, shared by all layers).
    """
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
    return rotate(q, rope), rotate(k, rope), v


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
    positions: jax.Array,  # [b, t] int32 absolute positions, consecutive within a row
    cache: KVCache | None = None,
    feature_layers: tuple[int, ...] = (),
):
    """Run the decoder stack over a chunk of new tokens.

    With a cache, each row's chunk starts at positions[:, 0]: queries attend to the cache slots
    before it and causally to the chunk itself, under one softmax; the chunk's K/V are written
    into the cache once, after the layer stack, at slots `positions` (out-of-range slots are
    dropped). Without a cache, attention is causal by position among the given tokens (padding
    must carry positions past the real ones).

    Returns (hidden [b, t, e] after the final norm, updated cache or None,
    features [b, t, m, e] of `feature_layers` (layer -1 = embedding output) or None).
    The cache's `lengths` are left to the caller, who knows how many tokens were committed.
    """
    rope = target_rope(config, positions)
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

    chunk_mask = positions[:, None, :] <= positions[:, :, None]  # [b, t, t] causal by position
    if cache is not None:
        slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        cache_mask = jnp.broadcast_to(slots[None, None, :] < positions[:, :1, None], (b, t, cache.max_len))

    def layer_step(carry, xs):
        h, feats = carry
        lp, slot, cache_k, cache_v = xs
        x = rms_norm(h, lp["attn_norm"], config.rms_norm_eps)
        q, k, v = project_qkv(lp, config, x, rope)
        if cache_k is None:
            attn = attend(q, k, v, chunk_mask)
        else:
            attn = attend_two(q, cache_k, cache_v, cache_mask, k, v, chunk_mask)
        h = h + attn.reshape(b, t, -1) @ lp["wo"]
        h = mlp_residual(lp, config, h)
        if feats is not None:
            feats = feats.at[slot].set(h)
        return (h, feats), (k, v)

    layer_cache = (None, None) if cache is None else (cache.k, cache.v)
    xs = (params["layers"], jnp.asarray(slot_of_layer, jnp.int32), *layer_cache)
    (h, feats), (new_k, new_v) = jax.lax.scan(layer_step, (h, feats), xs)  # new_k: [L, b, t, kv, d]
    hidden = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    new_cache = None
    if cache is not None:
        rows = jnp.arange(b)[:, None]
        new_cache = KVCache(
            k=cache.k.at[:, rows, positions].set(new_k.astype(cache.k.dtype), mode="drop"),
            v=cache.v.at[:, rows, positions].set(new_v.astype(cache.v.dtype), mode="drop"),
            lengths=cache.lengths,
        )
    features = None if feats is None else jnp.moveaxis(feats[:num_feats], 0, 2)
    return hidden, new_cache, features
