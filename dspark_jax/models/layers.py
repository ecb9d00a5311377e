"""Building blocks shared by the target models and the drafters.

Einsum letters: b batch, t query position, s key position, k KV head, g query heads per KV
head, d head dim, e model dim, f MLP dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dspark_jax.models.config import RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as the Hugging Face reference does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Rotary inverse frequencies [head_dim // 2], with Llama-3 scaling when configured."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [b, t, 1, d/2] for positions [b, t]; computed once per forward, used by every layer."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, d/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rotate(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate x [b, t, heads, d] with rope_tables (half-split convention of HF)."""
    cos, sin = tables
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, kv_major: bool = False) -> jax.Array:
    """Grouped-query attention of q over one set of keys and values.

    q [b, t, kv_heads * groups, d]; k, v [b, s, kv_heads, d], or [b, kv_heads, s, d] with kv_major
    (the KV-cache layout, so the cache is never transposed); mask [b, t, s] (True = visible).
    Returns [b, t, kv_heads * groups, d]. Softmax runs in float32.

    Products are plain batched matmuls over (b, kv_heads) with the (group, query) rows together:
    scores [g*t, d] x [s, d]^T and weights [g*t, s] x [s, d]. Written as einsums with other
    output orders, XLA:CPU transposed the whole cache or ran the weights x values product as a
    slow transposed matmul in every layer.
    """
    if not kv_major:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [b, kv_heads, s, d]
    b, t, num_heads, d = q.shape
    kv_heads = k.shape[1]
    g = num_heads // kv_heads
    rows = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)  # (g, t) rows
    batch = ((0, 1), (0, 1))
    scores = lax.dot_general(rows, k.astype(q.dtype), (((3,), (3,)), batch),
                             preferred_element_type=jnp.float32).reshape(b, kv_heads, g, t, -1)
    scores = jnp.where(mask[:, None, None, :, :], scores * (1.0 / math.sqrt(d)), jnp.finfo(jnp.float32).min)
    scores = scores.reshape(b, kv_heads, g * t, -1)  # [b, kv_heads, g*t, s] float32, masked
    top = lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    weights = jnp.exp(scores - top)
    out = lax.dot_general(weights.astype(v.dtype), v.astype(q.dtype), (((3,), (2,)), batch),
                          preferred_element_type=jnp.float32)  # [b, kv_heads, g*t, d]
    out = (out / weights.sum(axis=-1, keepdims=True)).astype(q.dtype)
    return out.reshape(b, kv_heads, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, num_heads, d)


# Token counts up to this run as (weight x activations^T) on XLA:CPU (see `linear`).
_CPU_SKINNY_TOKENS = 32


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] times a weight stored [out, in] (the checkpoints' own layout) -> [..., out].

    Every projection and the LM head go through here. On XLA:CPU a skinny product (decode and
    verification: a few tokens against a large weight) runs about twice as fast as
    w [out, in] x x^T -> [out, n] followed by a small transpose than as x [n, in] x w^T: the
    kernels handle a small N far better than a small M. The optimization barrier keeps XLA from
    folding the transpose back into the product. Other platforms, and long inputs (prefill,
    training), get the plain product. The arithmetic is the same dot product either way.
    """
    lead, n_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n_in)  # [n, in]
    contract = (((1,), (1,)), ((), ()))

    def plain(x2, w):
        return lax.dot_general(x2, w, contract, preferred_element_type=out_dtype)

    def cpu(x2, w):
        n = x2.shape[0]
        if n > _CPU_SKINNY_TOKENS:
            return plain(x2, w)
        if n == 1:  # XLA:CPU sends a one-row product to a slow generic kernel; two rows reach the fast one
            x2 = jnp.concatenate([x2, jnp.zeros_like(x2)], axis=0)
        y = lax.optimization_barrier(lax.dot_general(w, x2, contract, preferred_element_type=out_dtype)).T
        return y[:n]

    y = lax.platform_dependent(x2, w, cpu=cpu, default=plain)
    return y.reshape(*lead, w.shape[0])


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: down(silu(gate x) * (up x)); weights are [out, in]."""
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)
