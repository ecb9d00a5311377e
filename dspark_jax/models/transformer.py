"""Decoder-only target forward pass (Llama / Qwen2 / Qwen3) as a pure function over a params pytree.

Params layout. Checkpoints and training keep layer weights stacked on a leading layer axis (the
shapes below); a loaded target holds them as a tuple of per-layer dicts (unstack_layers), which
the unrolled layer loop reads without copies. `forward` accepts both.

    embed        [vocab, e]
    final_norm   [e]
    lm_head      [vocab, e]          (absent when embeddings are tied)
    layers:
      attn_norm  [L, e]              mlp_norm [L, e]
      wq [L, heads*d, e]  wk, wv [L, kv_heads*d, e]  wo [L, e, heads*d]
      bq [L, heads*d]  bk, bv [L, kv_heads*d]        (attention_bias only)
      q_norm, k_norm [L, d]                          (qk_norm only)
      w_gate, w_up [L, f, e]  w_down [L, e, f]

Linear weights are stored [out, in], as the checkpoints store them, and applied by
layers.linear (see there why that orientation is the fast one for decoding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from dspark_jax.models.config import ModelConfig
from dspark_jax.models.layers import attend, linear, rms_norm, rope_inv_freq, rope_tables, rotate, swiglu


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Preallocated per-batch KV cache, one buffer per layer. Slot s of a row holds the token at
    position s.

    A row's entries at slots >= its length are stale or empty; a chunk starting at position P
    only reads slots < P, and every slot it will later read is rewritten when its token is
    committed, so rejected draft tokens never need erasing.
    """

    k: tuple[jax.Array, ...]  # per layer [rows, kv_heads, max_len, head_dim] (kv-major: no transposes)
    v: tuple[jax.Array, ...]  # per layer [rows, kv_heads, max_len, head_dim]
    lengths: jax.Array  # [batch] int32, committed tokens per row
    # rows >= batch: a forward over a batch of b rows uses the buffers' first b rows, so an
    # engine steps its first few slots without copying the others' caches (decode.step_rows).

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    layers = range(config.num_layers)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   lengths=jnp.zeros((batch,), jnp.int32))


def unstack_layers(params: dict) -> dict:
    """Params with `layers` as a tuple of per-layer dicts (the inference layout).

    Slicing a layer out of stacked [L, ...] weights inside the step copies it on CPU and GPU
    (the slice does not fuse into the matmul), which roughly doubled decode time; separate
    buffers per layer are read in place.
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    count = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a: a[i], layers) for i in range(count))}


def target_rope(config: ModelConfig, positions: jax.Array):
    """Rotary tables for positions [b, t] under the config's theta and scaling."""
    return rope_tables(positions, rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))


def project_qkv(lp: dict, config: ModelConfig, x: jax.Array, rope):
    """Normed input x [b, t, e] -> rotated q [b, t, heads, d], k and v [b, t, kv_heads, d].

    `rope` is target_rope(config, positions) (computed once per forward, shared by all layers).
    """
    b, t, _ = x.shape
    q = linear(x, lp["wq"])
    k = linear(x, lp["wk"])
    v = linear(x, lp["wv"])
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
    return linear(attend(q, keys, values, mask).reshape(b, t, -1), lp["wo"])


def mlp_residual(lp: dict, config: ModelConfig, h: jax.Array) -> jax.Array:
    """Second half of a pre-norm decoder layer: h + MLP(norm(h))."""
    x = rms_norm(h, lp["mlp_norm"], config.rms_norm_eps)
    return h + swiglu(x, lp["w_gate"], lp["w_up"], lp["w_down"])


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head_weight(params: dict) -> jax.Array:
    """[vocab, e] (out, in); the embedding itself when embeddings are tied."""
    return params["lm_head"] if "lm_head" in params else params["embed"]


def logits_from_hidden(params: dict, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., e] -> float32 logits [..., vocab]."""
    return linear(hidden, lm_head_weight(params), out_dtype=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChunkKV:
    """Keys and values of a chunk of new tokens, not yet written to a cache."""

    k: tuple[jax.Array, ...]  # per layer [batch, t, kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # per layer [batch, t, kv_heads, head_dim]


def write_chunk(buffer: jax.Array, chunk: jax.Array, start: jax.Array) -> jax.Array:
    """Write chunk [b, t, kv_heads, d] into a cache buffer [b, kv_heads, max_len, d] at slots
    start[b] .. start + t - 1 of each row.

    One dynamic-update-slice per row: XLA updates the donated buffer in place. (A scatter with
    out-of-range dropping made XLA:CPU copy the buffer several times per layer.) The slots must
    lie inside the buffer; the Engine guarantees it by checking prompt + budget against max_len.
    """
    b, t = chunk.shape[:2]
    if buffer.shape[0] != b:  # the batch is the buffer's first b rows (KVCache): one in-bounds scatter
        slots = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]  # [b, t]
        return buffer.at[jnp.arange(b)[:, None], :, slots].set(chunk.astype(buffer.dtype), mode="promise_in_bounds")
    rows = jnp.swapaxes(chunk.astype(buffer.dtype), 1, 2)  # [b, kv_heads, t, d]
    return jax.vmap(lambda row, new, s0: lax.dynamic_update_slice(row, new, (0, s0, 0)))(buffer, rows, start)


def _decoder_stack(params, config, tokens, positions, cache, feature_layers, kv_len):
    """The layers of forward / forward_chunk: (hidden, cache written or None, ChunkKV, features).

    With a cache, each layer writes its chunk into the cache first and then attends to the
    updated buffer (committed slots and the chunk's own slots, causally): the read depends on the
    write, so XLA updates the buffer in place. Reading the old buffer and writing it afterwards
    made XLA copy it inside the decode loop, and attending to a cache that is only read made
    XLA:CPU copy its attention span in every layer. Without a cache only the chunk is visible.
    """
    rope = target_rope(config, positions)
    h = embed(params, tokens)
    b, t, e = h.shape
    if list(feature_layers) != sorted(set(feature_layers)) or any(
        not -1 <= l < config.num_layers for l in feature_layers
    ):
        raise ValueError(f"feature_layers must be strictly increasing ids in [-1, {config.num_layers}), "
                         f"got {feature_layers}")
    taps = {-1: h} if -1 in feature_layers else {}  # layer id -> its output [b, t, e]

    if cache is not None:
        span = cache.max_len if kv_len is None else min(int(kv_len), cache.max_len)
        slots = jnp.arange(span, dtype=jnp.int32)[None, None, :]
        committed = slots < positions[:, :1, None]  # [b, 1, span]
        # the chunk's own slots too, causally
        cache_mask = committed | ((slots >= positions[:, :1, None]) & (slots <= positions[:, :, None]))

    layers = unstack_layers(params)["layers"]  # a no-op for loaded targets
    new_k, new_v, out_k, out_v = [], [], [], []
    for i, lp in enumerate(layers):
        x = rms_norm(h, lp["attn_norm"], config.rms_norm_eps)
        q, k, v = project_qkv(lp, config, x, rope)
        new_k.append(k)
        new_v.append(v)
        if cache is None:
            attn = attend(q, k, v, positions[:, None, :] <= positions[:, :, None])  # causal by position
        else:
            layer_k = write_chunk(cache.k[i], k, positions[:, 0])
            layer_v = write_chunk(cache.v[i], v, positions[:, 0])
            attn = attend(q, layer_k[:b, :, :span], layer_v[:b, :, :span], cache_mask, kv_major=True)
            out_k.append(layer_k)
            out_v.append(layer_v)
        h = h + linear(attn.reshape(b, t, -1), lp["wo"])
        h = mlp_residual(lp, config, h)
        if i in feature_layers:
            taps[i] = h
    hidden = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    written = KVCache(k=tuple(out_k), v=tuple(out_v), lengths=cache.lengths) if out_k else None
    features = jnp.stack([taps[l] for l in feature_layers], axis=2) if feature_layers else None
    return hidden, written, ChunkKV(k=tuple(new_k), v=tuple(new_v)), features


def forward_chunk(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                  feature_layers: tuple[int, ...] = ()):
    """Run the decoder stack over a chunk of new tokens [b, t] at absolute positions [b, t]
    (consecutive within a row) with no cache: each token attends causally (by position) to the
    chunk alone (padding must carry positions past the real ones). For a caller that places the
    chunk's K/V itself (the Engine's insert writes each prompt's into its slot's rows).

    Returns (hidden [b, t, e] after the final norm, ChunkKV of the chunk,
    features [b, t, m, e] of `feature_layers` (layer -1 = embedding output) or None).
    """
    hidden, _, chunk, features = _decoder_stack(params, config, tokens, positions, None, feature_layers, None)
    return hidden, chunk, features


def forward(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,  # [b, t] int32
    positions: jax.Array,  # [b, t] int32 absolute positions, consecutive within a row
    cache: KVCache | None = None,
    feature_layers: tuple[int, ...] = (),
    kv_len: int | None = None,
):
    """Run the decoder stack over a chunk of new tokens [b, t] at absolute positions [b, t]
    (consecutive within a row), its K/V written into the cache at slots `positions` (which must lie
    inside it) in place. Queries attend to the cache's committed slots before positions[:, 0] and
    causally to the chunk. `kv_len` (static) limits attention to slots [0, kv_len): the caller
    guarantees every position it reads is below it, so a short context does not pay for reading
    the whole max_len cache. Without a cache, only the chunk is visible. Layers run as an
    unrolled loop over per-layer buffers (see unstack_layers).

    Returns (hidden [b, t, e] after the final norm, updated cache or None,
    features [b, t, m, e] or None). The cache's `lengths` are left to the caller, who knows how
    many tokens were committed.
    """
    hidden, written, _, features = _decoder_stack(params, config, tokens, positions, cache, feature_layers, kv_len)
    return hidden, written, features
