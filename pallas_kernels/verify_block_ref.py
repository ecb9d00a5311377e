"""Lossless block verification: the arithmetic spec and its pure-jnp reference.

``pallas_kernels.verify_block`` (the Pallas kernels) and ``verify_block_reference`` (here)
share every function in this file; the only V-sized work, the chunk totals, is computed by
a kernel on one side and by ``chunk_totals`` on the other, to the same bits (see below).

Rule, per row r with scheduled length l = lengths[r] in [0, G]
---------------------------------------------------------------
* draft token k (0-based, k < l) is accepted iff ``u_k * q_k(d_k) < p_k(d_k)``
  (== u_k < min(1, p/q) without a division: q == 0 < p accepts, p == 0 rejects);
  acceptance stops at the first rejection (n = number accepted).
* one extra token is drawn with ``u_G``: at the first rejection (n < l) from the
  residual max(0, p_n - q_n) (falling back to p_n when the residual is all zero,
  reachable only by adversarial inputs), or from p_l when all l drafts were accepted.
  Distributions need not be normalised.

Inverse-CDF arithmetic (fixed, so that kernel and reference agree bit for bit)
-------------------------------------------------------------------------------
``dist`` is float32 and made non-negative with ``positive`` (x if x > 0 else +0.0); the
residual is ``positive(p - q)`` of the float32 rows.  V is cut into chunks of
``C = effective_chunk(V, chunk_size)`` tokens (a power of two), the last one zero-padded.

  1. Chunk total T_c := ``fold_halves`` of the chunk: the pairwise sum that folds the
     chunk in halves, ``x[:C/2] + x[C/2:]``, then the result in halves, ... down to one
     value.  Each level is elementwise, so any tiling computes the same additions: the
     kernels do it with vreg adds and lane rolls (TPU) or splits (Triton), always with
     explicit adds, never a reduction op (XLA may reorder those).  This is the only pass
     over all of V, and the only part a kernel computes.
  2. The residual is used iff the row rejected a draft and some residual chunk total is
     > 0; T := the chosen chunk totals [B, nC].
  3. ``run = jnp.cumsum(T)`` over chunks, ``total = run[-1]``, ``t = u_G * total``.
  4. Chunk c* = the first chunk with ``run[c] > t`` and ``T[c] > 0``; if none (t rounded
     up to the total), the last chunk with ``T[c] > 0``.
  5. Within chunk c*: ``cum = run[c*-1] (0.0 for c* = 0) + jnp.cumsum(dist[chunk])``; the
     sample is the first token with ``cum > t`` and ``dist > 0``, else (round-off) the
     last token of the chunk with ``dist > 0``.  All-zero dist gives token 0.

Steps 2-5 touch O(B * (nC + C)) values; they are plain jnp in ``finish`` and run
identically after either totals implementation.  Strict ``>`` handles t landing exactly
on a boundary; the ``dist > 0`` masks guarantee that a zero-probability token is never
emitted even where round-off makes ``cum`` non-monotone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Default chunk (tile) length of the two-level cumulative sum.
DEFAULT_CHUNK = 1024


def effective_chunk(vocab: int, chunk_size: int = DEFAULT_CHUNK) -> int:
    """Chunk length actually used: a power of two, no larger than needed for V.

    Shrinking to next_pow2(V) avoids padding tiny vocabularies to a full tile.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    return min(chunk_size, 1 << max(0, (vocab - 1).bit_length()))


def positive(x):
    """x where x > 0, else +0.0 (also for -0.0 and NaN): the non-negative dist of the spec."""
    return jnp.where(x > 0, x, jnp.zeros_like(x))


def fold_halves(x):
    """Sum over the last axis (a power of two) by folding in halves: the chunk-total tree."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fold_halves needs a power-of-two length, got {n}")
    while n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:]
    return x[..., 0]


def chunk_totals(dist, chunk: int):
    """Chunk totals T [B, nC] of a non-negative float32 dist [B, V] (spec step 1)."""
    b, v = dist.shape
    n_chunks = -(-v // chunk)
    x = jnp.pad(dist, ((0, 0), (0, n_chunks * chunk - v)))
    return fold_halves(x.reshape(b, n_chunks, chunk))


def num_accepted(accept, lengths):
    """Leading run of accepts restricted to k < lengths. accept [B, G] bool -> [B] int32."""
    g = accept.shape[1]
    valid = jnp.arange(g, dtype=jnp.int32)[None, :] < lengths[:, None]
    run = jnp.cumprod((accept & valid).astype(jnp.int32), axis=1)  # [B, G]
    return jnp.sum(run, axis=1).astype(jnp.int32)  # [B]


def accept_stage(draft_tokens, draft_probs, target_probs, lengths, uniforms):
    """The accept count and everything the correction sample needs; O(B * G) gathers.

    Returns (p [B, G+1, V] f32, q [B, G, V] f32, n [B], kq [B], rejected [B], u_last [B]):
    the correction / bonus token is drawn from row n of p and row kq = min(n, G-1) of q.
    Draft tokens are clipped to [0, V) before gathering, so padding (e.g. -1) at
    k >= length is harmless.  With G == 0, q is p itself (its residual is never used).
    """
    b, g = draft_tokens.shape
    v = target_probs.shape[-1]
    p = target_probs.astype(jnp.float32)  # [B, G+1, V]
    u = uniforms.astype(jnp.float32)  # [B, G+1]
    # A length past G verifies the whole block: unclipped, `n < lengths` would flag a row whose G
    # drafts were all accepted as rejected and draw its bonus from the residual of p_G and q_{G-1}.
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, g)
    if g > 0:
        q = draft_probs.astype(jnp.float32)  # [B, G, V]
        tok = jnp.clip(draft_tokens.astype(jnp.int32), 0, v - 1)  # [B, G]
        at = (jnp.arange(b)[:, None], jnp.arange(g)[None, :], tok)  # B x G scalar gathers
        p_d, q_d = p[at], q[at]  # [B, G] each
        n = num_accepted(u[:, :g] * q_d < p_d, lengths)  # [B]
        kq = jnp.minimum(n, g - 1)
    else:
        q = p
        n = jnp.zeros((b,), jnp.int32)
        kq = n
    return p, q, n, kq, n < lengths, u[:, g]


def gather_chunk(x, rows, chunk_idx, chunk: int):
    """x[r, rows[r], chunk_idx[r] * C : (chunk_idx[r] + 1) * C], zero past V. x [B, K, V] -> [B, C]."""
    b, _, v = x.shape
    tok = chunk_idx[:, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [B, C]
    vals = x[jnp.arange(b)[:, None], rows[:, None], jnp.minimum(tok, v - 1)]
    return jnp.where(tok < v, vals, 0.0)


def _first_or_last(hit, pos):
    """Index of the first True of hit along the last axis, else of the last True of pos, else 0."""
    m = hit.shape[-1]
    idx = jnp.arange(m, dtype=jnp.int32)
    first = jnp.min(jnp.where(hit, idx, m), axis=-1)
    last = jnp.max(jnp.where(pos, idx, -1), axis=-1)
    return jnp.where(first < m, first, jnp.maximum(last, 0)).astype(jnp.int32)


def finish(p, q, n, kq, rejected, tot_res, tot_p, u_last, chunk: int):
    """Spec steps 2-5: the next token [B] from the chunk totals (residual and target).

    p [B, *, V] / q [B, *, V] with rows n / kq (as returned by ``accept_stage``),
    tot_res / tot_p [B, nC] float32, u_last [B].
    """
    use_res = rejected & jnp.any(tot_res > 0, axis=-1)  # [B]
    tot = jnp.where(use_res[:, None], tot_res, tot_p)  # [B, nC]
    run = jnp.cumsum(tot, axis=-1)  # [B, nC]
    total = run[:, -1]
    t = u_last * total  # [B]
    pos = tot > 0
    c = _first_or_last((run > t[:, None]) & pos, pos)  # [B]
    before = jnp.take_along_axis(run, jnp.maximum(c - 1, 0)[:, None], axis=-1)[:, 0]
    offset = jnp.where(c > 0, before, 0.0)
    p_c = gather_chunk(p, n, c, chunk)  # [B, C]
    q_c = gather_chunk(q, kq, c, chunk)
    dist = jnp.where(use_res[:, None], positive(p_c - q_c), positive(p_c))
    cum = offset[:, None] + jnp.cumsum(dist, axis=-1)  # [B, C]
    pos = dist > 0
    local = _first_or_last((cum > t[:, None]) & pos, pos)
    return jnp.where(total > 0, c * chunk + local, 0).astype(jnp.int32)


def reference_totals(p, q, n, kq, chunk: int):
    """Spec step 1 in jnp: (residual totals, target totals) [B, nC] of rows p[n], q[kq]."""
    rows = jnp.arange(p.shape[0])
    p_row = p[rows, n]  # [B, V]
    q_row = q[rows, kq]  # [B, V]
    return (chunk_totals(positive(p_row - q_row), chunk),
            chunk_totals(positive(p_row), chunk))


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def verify_block_reference(draft_tokens, draft_probs, target_probs, lengths, uniforms, *,
                           chunk_size: int = DEFAULT_CHUNK):
    """Lossless block verification in jnp; returns (num_accepted [B], next_token [B]) int32.

    draft_tokens [B, G] int, draft_probs [B, G, V], target_probs [B, G+1, V],
    lengths [B] in [0, G] (clipped to it), uniforms [B, G+1] in [0, 1).  Spec: the module docstring.
    """
    chunk = effective_chunk(target_probs.shape[-1], chunk_size)
    p, q, n, kq, rejected, u_last = accept_stage(
        draft_tokens, draft_probs, target_probs, lengths, uniforms)
    tot_res, tot_p = reference_totals(p, q, n, kq, chunk)
    return n, finish(p, q, n, kq, rejected, tot_res, tot_p, u_last, chunk)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def sample_from_probs(probs, uniform, *, chunk_size: int = DEFAULT_CHUNK):
    """Inverse-CDF sample of (unnormalised) probs [B, V] with uniform [B] -> [B] int32.

    Exactly the arithmetic of the module docstring, so plain sampling agrees with the
    verifier's correction / bonus sampling.
    """
    probs = positive(probs.astype(jnp.float32))  # [B, V]
    b, v = probs.shape
    chunk = effective_chunk(v, chunk_size)
    tot = chunk_totals(probs, chunk)
    rows = probs[:, None, :]  # [B, 1, V]
    zeros = jnp.zeros((b,), jnp.int32)
    return finish(rows, rows, zeros, zeros, jnp.zeros((b,), bool), tot, tot,
                  uniform.astype(jnp.float32), chunk)
