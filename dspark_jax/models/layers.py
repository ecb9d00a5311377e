"""Building blocks shared by the target models and the drafters.

Einsum letters: b batch, t query position, s key position, k KV head, g query heads per KV
head, d head dim, e model dim, f MLP dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

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
    """Grouped-query attention.

    q [b, t, kv_heads * groups, d]; k, v [b, s, kv_heads, d], or [b, kv_heads, s, d] with kv_major
    (the KV-cache layout, so the cache is never transposed); mask [b, t, s] (True = visible).
    Returns [b, t, kv_heads * groups, d]. Softmax runs in float32.
    """
    b, t, num_heads, d = q.shape
    kv_heads = k.shape[1] if kv_major else k.shape[2]
    qg = q.reshape(b, t, kv_heads, num_heads // kv_heads, d)
    spec = "bksd" if kv_major else "bskd"
    scores = jnp.einsum(f"btkgd,{spec}->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None, :, :], scores * (1.0 / math.sqrt(d)), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{spec}->btkgd", weights, v.astype(q.dtype))
    return out.reshape(b, t, num_heads, d)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)); weights are [in, out]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
