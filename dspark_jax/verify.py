"""Lossless speculative-decoding block verification (pure jnp reference).

Per row r with scheduled length l = lengths[r] in [0, G]:
  * draft token k (0-based, k < l) is accepted iff ``u_k * q_k(d_k) < p_k(d_k)``
    (== u_k < min(1, p/q) without a division: q == 0 < p accepts, p == 0
    rejects); acceptance stops at the first rejection.
  * one extra token is drawn with ``u_G``: at the first rejection k the
    residual norm(max(0, p_k - q_k)) (falling back to p_k when the residual is
    all zero, reachable only by adversarial inputs), or p_l when all l drafts
    were accepted.

Inverse-CDF arithmetic (shared bit for bit with ``pallas_kernels.verify_block``)
------------------------------------------------------------------------------
Float sums depend on their evaluation order, so the order is fixed:

  1. ``dist = max(dist, 0)`` in float32, zero-padded to ``nC * C`` where
     ``C = effective_chunk(V, chunk_size)`` (power of two, <= chunk_size).
  2. Within each chunk: ``c_in = jnp.cumsum(chunk)`` (inclusive, float32).
  3. Chunk total := ``c_in[-1]`` (of the padded chunk; no separate reduction).
  4. Chunk offsets: a *sequential* float32 running sum of chunk totals starting
     at 0.0; ``total`` is the final running sum.
  5. ``cum[v] = offset[chunk(v)] + c_in[v]``; ``t = u * total``.
  6. Sample = smallest v with ``cum[v] > t`` and ``dist[v] > 0`` (strict ``>``
     handles t landing exactly on a boundary; the ``dist > 0`` mask guarantees
     zero-probability tokens are never emitted even if round-off makes ``cum``
     non-monotone).  If no v qualifies (round-off with u close to 1) clamp to the
     last v with ``dist[v] > 0``; if dist is all zero return 0.

The Pallas kernel walks the same chunks with a loop carry, so both produce
identical bits whenever the backend evaluates ``cumsum`` on a length-C vector the
same way in both places (always true in interpret mode on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dspark_jax.sampling import argmax_last

# Default chunk (tile) length of the two-level cumulative sum.  Must equal
# pallas_kernels.verify_block.DEFAULT_CHUNK (asserted in tests).
DEFAULT_CHUNK = 1024


def effective_chunk(vocab: int, chunk_size: int = DEFAULT_CHUNK) -> int:
    """Chunk length actually used: a power of two, no larger than needed for V.

    Shrinking to next_pow2(V) avoids padding tiny vocabularies to a full tile.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    return min(chunk_size, 1 << max(0, (vocab - 1).bit_length()))


def _chunked_cumsum(dist, chunk):
    """Two-level float32 prefix sums in the fixed order described above.

    dist: [B, V] float32, non-negative.  Returns (cum [B, V], total [B]).
    """
    b, v = dist.shape
    n_chunks = -(-v // chunk)
    x = jnp.pad(dist, ((0, 0), (0, n_chunks * chunk - v)))
    x = x.reshape(b, n_chunks, chunk)  # [B, nC, C]
    c_in = jnp.cumsum(x, axis=-1)  # [B, nC, C]
    chunk_tot = c_in[..., -1]  # [B, nC]

    def step(carry, tot):  # strictly sequential over chunks, like the kernel
        return carry + tot, carry

    total, offsets = lax.scan(step, jnp.zeros((b,), jnp.float32), chunk_tot.T)
    cum = offsets.T[..., None] + c_in  # [B, nC, C]
    return cum.reshape(b, n_chunks * chunk)[:, :v], total


def _inverse_cdf(dist, uniform, chunk):
    """Robust inverse-CDF sample per row. dist [B, V] (>= 0), uniform [B]."""
    v = dist.shape[-1]
    cum, total = _chunked_cumsum(dist, chunk)  # [B, V], [B]
    t = uniform.astype(jnp.float32) * total  # [B]
    pos = dist > 0  # [B, V]
    idx = jnp.arange(v, dtype=jnp.int32)
    hit = (cum > t[:, None]) & pos
    first = jnp.min(jnp.where(hit, idx, v), axis=-1)  # [B]
    last_pos = jnp.max(jnp.where(pos, idx, -1), axis=-1)  # [B]
    return jnp.where(first < v, first, jnp.maximum(last_pos, 0)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def sample_from_probs(probs, uniform, *, chunk_size: int = DEFAULT_CHUNK):
    """Inverse-CDF sample of (unnormalised) probs [B, V] with uniform [B] -> [B].

    Uses exactly the chunked arithmetic of the module docstring so plain
    sampling agrees with the verifier's correction/bonus sampling.
    """
    probs = jnp.maximum(probs.astype(jnp.float32), 0.0)
    return _inverse_cdf(probs, uniform, effective_chunk(probs.shape[-1], chunk_size))


def _num_accepted(accept, lengths):
    """Leading run of accepts restricted to k < lengths. accept [B, G] bool."""
    g = accept.shape[1]
    valid = jnp.arange(g, dtype=jnp.int32)[None, :] < lengths[:, None]
    run = jnp.cumprod((accept & valid).astype(jnp.int32), axis=1)  # [B, G]
    return jnp.sum(run, axis=1).astype(jnp.int32)  # [B]


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def verify_block(draft_tokens, draft_probs, target_probs, lengths, uniforms, *,
                 chunk_size: int = DEFAULT_CHUNK):
    """Lossless block verification; returns (num_accepted [B], next_token [B]).

    draft_tokens [B, G] int, draft_probs [B, G, V], target_probs [B, G+1, V],
    lengths [B] in [0, G], uniforms [B, G+1] in [0, 1).  Draft tokens are
    clipped to [0, V) before gathering, so padding (e.g. -1) at k >= length is
    harmless.  The next token uses the chunked inverse CDF of the module doc.
    """
    b, g = draft_tokens.shape
    v = target_probs.shape[-1]
    chunk = effective_chunk(v, chunk_size)
    p = target_probs.astype(jnp.float32)  # [B, G+1, V]
    q = draft_probs.astype(jnp.float32)  # [B, G, V]
    u = uniforms.astype(jnp.float32)  # [B, G+1]
    lengths = lengths.astype(jnp.int32)

    if g > 0:
        tok = jnp.clip(draft_tokens.astype(jnp.int32), 0, v - 1)[..., None]
        p_d = jnp.take_along_axis(p[:, :g], tok, axis=-1)[..., 0]  # [B, G]
        q_d = jnp.take_along_axis(q, tok, axis=-1)[..., 0]  # [B, G]
        n = _num_accepted(u[:, :g] * q_d < p_d, lengths)  # [B]
        q_row = jnp.take_along_axis(
            q, jnp.minimum(n, g - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    else:
        n = jnp.zeros((b,), jnp.int32)
        q_row = jnp.zeros((b, v), jnp.float32)
    p_row = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]

    residual = jnp.maximum(p_row - q_row, 0.0)  # [B, V]
    # any(residual > 0) <=> chunked residual total > 0 (sums of non-negatives).
    use_res = (n < lengths) & jnp.any(residual > 0, axis=-1)  # [B]
    dist = jnp.where(use_res[:, None], residual, jnp.maximum(p_row, 0.0))
    return n, _inverse_cdf(dist, u[:, g], chunk)


@jax.jit
def verify_greedy(draft_tokens, target_logits, lengths):
    """Greedy verification: accept while d_k == argmax(target_logits[:, k]).

    draft_tokens [B, G], target_logits [B, G+1, V], lengths [B].  next_token is
    the target argmax at the first mismatch (or at position l if all accepted).
    """
    g = draft_tokens.shape[1]
    best = argmax_last(target_logits)  # [B, G+1]
    n = _num_accepted(draft_tokens.astype(jnp.int32) == best[:, :g],
                      lengths.astype(jnp.int32))
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
