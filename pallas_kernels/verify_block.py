"""Pallas kernel for lossless speculative-decoding block verification.

Bit-identical to ``dspark_jax.verify.verify_block``.  One program per row; the
[G+1, V] target block is never loaded whole (V can be ~49k): the kernel

  1. gathers p_k(d_k), q_k(d_k) with scalar loads and counts the leading
     accepts ``u_k * q < p`` over k < length (fori_loop over G);
  2. pass A over V tiles of C: totals of max(p_n, 0) and max(p_n - q_n, 0),
     each a *sequential* float32 running sum of per-tile ``cumsum(tile)[-1]``;
     picks the residual (first rejection with a non-zero residual) or p_n;
  3. pass B over V tiles: ``cum = offset + cumsum(tile)`` with the same running
     offsets, ``t = u_G * total``; the sample is the smallest v with
     ``cum > t`` and ``dist > 0``, else the last v with ``dist > 0``, else 0.

This is exactly the chunked inverse-CDF arithmetic documented in
``dspark_jax.verify`` (same C, same per-tile cumsum, same sequential offsets),
so results agree bit for bit wherever ``jnp.cumsum`` of a length-C vector is
evaluated identically (always in interpret mode).  V is zero-padded to a
multiple of C in the wrapper; padded tokens have zero mass and are never hit.
Written with Triton-lowerable ops (power-of-two tile loads, scalar loads,
fori_loop, cumsum, min/max/sum reductions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# The tile length and its rule are the reference's: one definition keeps the two bit-identical.
from dspark_jax.verify import DEFAULT_CHUNK, effective_chunk


def _kernel(tok_ref, len_ref, u_ref, q_ref, p_ref, n_ref, next_ref, *,
            g: int, v: int, chunk: int, n_chunks: int):
    # tok_ref [G] i32, len_ref [1] i32, u_ref [G+1] f32,
    # q_ref [G, Vp] f32, p_ref [G+1, Vp] f32; n_ref / next_ref [1] i32.
    length = len_ref[0]

    def accept_step(k, carry):
        n, alive = carry
        d = jnp.clip(tok_ref[k], 0, v - 1)
        p_d = p_ref[k, d]
        q_d = q_ref[k, d]
        ok = jnp.where((k < length) & (u_ref[k] * q_d < p_d), alive, 0)
        return n + ok, ok  # int32 carry: ok == 1 while still accepting

    n, _ = lax.fori_loop(0, g, accept_step, (jnp.int32(0), jnp.int32(1)))
    kq = jnp.minimum(n, g - 1)
    rejected = n < length
    lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)  # [C]
    is_last = lane == chunk - 1

    def tile(j):
        start = pl.multiple_of(j * chunk, chunk)
        p_t = p_ref[n, pl.ds(start, chunk)]  # [C]
        q_t = q_ref[kq, pl.ds(start, chunk)]  # [C]
        return start, jnp.maximum(p_t - q_t, 0.0), jnp.maximum(p_t, 0.0)

    def tile_total(x):  # cumsum(x)[-1] without value indexing; exact (+0s).
        return jnp.sum(jnp.where(is_last, jnp.cumsum(x), 0.0))

    def pass_a(j, carry):
        tot_res, tot_p = carry
        _, res_t, p_t = tile(j)
        return tot_res + tile_total(res_t), tot_p + tile_total(p_t)

    zero = jnp.float32(0.0)
    tot_res, tot_p = lax.fori_loop(0, n_chunks, pass_a, (zero, zero))
    use_res = rejected & (tot_res > 0)
    total = jnp.where(use_res, tot_res, tot_p)
    t = u_ref[g] * total
    big = jnp.int32(n_chunks * chunk)

    def pass_b(j, carry):
        offset, first, last_pos = carry
        start, res_t, p_t = tile(j)
        dist = jnp.where(use_res, res_t, p_t)  # [C]
        c_in = jnp.cumsum(dist)  # [C]
        idx = start + lane
        pos = dist > 0
        hit = ((offset + c_in) > t) & pos
        first = jnp.minimum(first, jnp.min(jnp.where(hit, idx, big)))
        last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(pos, idx, -1)))
        offset = offset + jnp.sum(jnp.where(is_last, c_in, 0.0))
        return offset, first, last_pos

    _, first, last_pos = lax.fori_loop(
        0, n_chunks, pass_b, (zero, big, jnp.int32(-1)))
    n_ref[0] = n
    next_ref[0] = jnp.where(first < big, first, jnp.maximum(last_pos, 0))


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size"))
def _verify_block(draft_tokens, draft_probs, target_probs, lengths, uniforms, *,
                  interpret: bool, chunk_size: int):
    b, g = draft_tokens.shape
    v = target_probs.shape[-1]
    chunk = effective_chunk(v, chunk_size)
    n_chunks = -(-v // chunk)
    vp = n_chunks * chunk
    tok = draft_tokens.astype(jnp.int32)  # [B, G]
    q = draft_probs.astype(jnp.float32)  # [B, G, V]
    p = target_probs.astype(jnp.float32)  # [B, G+1, V]
    u = uniforms.astype(jnp.float32)  # [B, G+1]
    if g == 0:  # dummy draft slot, never accepted since lengths == 0
        tok = jnp.zeros((b, 1), jnp.int32)
        q = jnp.zeros((b, 1, v), jnp.float32)
        p = jnp.concatenate([p, p], axis=1)
        u = jnp.concatenate([u, u], axis=1)
        g = 1
    q = jnp.pad(q, ((0, 0), (0, 0), (0, vp - v)))  # [B, G, Vp]
    p = jnp.pad(p, ((0, 0), (0, 0), (0, vp - v)))  # [B, G+1, Vp]
    lens = lengths.astype(jnp.int32).reshape(b, 1)

    kernel = functools.partial(_kernel, g=g, v=v, chunk=chunk, n_chunks=n_chunks)
    row = lambda i: (i, 0)
    n, nxt = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[
            pl.BlockSpec((None, g), row),
            pl.BlockSpec((None, 1), row),
            pl.BlockSpec((None, g + 1), row),
            pl.BlockSpec((None, g, vp), lambda i: (i, 0, 0)),
            pl.BlockSpec((None, g + 1, vp), lambda i: (i, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((None, 1), row), pl.BlockSpec((None, 1), row)],
        out_shape=[jax.ShapeDtypeStruct((b, 1), jnp.int32)] * 2,
        interpret=interpret,
        name="verify_block",
    )(tok, lens, u, q, p)
    return n[:, 0], nxt[:, 0]


def verify_block(draft_tokens, draft_probs, target_probs, lengths, uniforms, *,
                 interpret=None, chunk_size: int = DEFAULT_CHUNK):
    """Pallas twin of dspark_jax.verify.verify_block -> (num_accepted, next_token).

    interpret defaults to True on CPU.  chunk_size (power of two) is the V tile
    and must match the reference's chunk_size for bit-identical results.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _verify_block(draft_tokens, draft_probs, target_probs, lengths,
                         uniforms, interpret=bool(interpret), chunk_size=chunk_size)
