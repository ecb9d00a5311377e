"""Pallas kernels for lossless speculative-decoding block verification (TPU and GPU).

``verify_block`` returns exactly what ``verify_block_reference`` (in ``verify_block_ref``,
beside this file, with the arithmetic spec) returns.  Both run the same jnp code for the
small parts (the accept count: B x G gathers; the chunk choice and the inverse CDF inside
one chunk: O(B * (V / C + C))); only the pass over all of V differs: the chunk totals of
the residual max(p_n - q_n, 0) and of the target p_n, which the reference computes with
``chunk_totals`` and a kernel computes here, to the same bits (``fold_halves`` order).

Kernels (each writes nC floats per row and distribution):

* TPU (Mosaic): the wrapper gathers rows p[b, n_b] and q[b, kq_b] with XLA (a row of a
  [B, G+1, V] array cannot be a Mosaic block: the second-minor block dim must be a multiple
  of 8 or the whole dim; a manual-DMA row gather in the kernel would save that pass), then
  a grid (B / 8, V / TV) streams [8, TV] blocks: batch rows on sublanes, V on lanes.  A chunk of C >= 128 tokens is C / 128 vregs: ``fold_halves`` is vreg adds down to
  one vreg, then lane rolls 64, 32, .., 1 (a butterfly: every lane ends with the chunk
  total, in the same pairing); the totals of a block's chunks are packed into the lanes of
  one output vreg.  For C < 128 the lane rolls stop at C / 2 and the folded block itself is
  written (the total sits in each chunk's last lane).
* GPU (Triton): grid (B, chunk groups); a program loads K chunks of rows n_b / kq_b
  straight from [B, G+1, V] (masked past V; each selected row is read once), folds each chunk in halves with
  ``lax.split`` (Triton: reshape + tt.split) and explicit adds, and stores K totals.

Platform choice: ``backend=None`` lets the *lowering platform* pick, with
``jax.lax.platform_dependent`` (tpu -> Mosaic kernel, cuda / rocm -> Triton kernel, any
other platform -> the jnp totals), so one traced function lowers for each platform,
also when lowered from a CPU for another platform.  ``backend="tpu"`` / ``"triton"``
force one kernel.  ``interpret`` (True on CPU by default, or a ``pltpu.InterpretParams``)
runs a kernel body in Pallas's interpreter: the TPU kernel unless backend="triton".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.verify_block_ref import (
    DEFAULT_CHUNK,
    accept_stage,
    effective_chunk,
    finish,
    reference_totals,
)

BACKENDS = ("tpu", "triton")

_LANES = 128
_TPU_BLOCK_TOKENS = 16384  # tokens per row in one TPU block: [8, 16384] f32 = 512 KiB
_TRITON_PROGRAM_TOKENS = 4096  # tokens one Triton program folds
_TRITON_MAX_CHUNK = 16384  # a Triton program holds a whole chunk in registers


# ------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_lane_fold(x, width: int):
    """Lane rolls width/2, .., 1: the last lane of each width-lane segment ends with its
    fold_halves total (every lane, for width == 128)."""
    s = width // 2
    while s:
        x = x + pltpu.roll(x, s, 1)
        s //= 2
    return x


def _tpu_vreg_fold(vregs):
    """fold_halves over a list of [rows, 128] vregs (vreg i holds chunk lanes 128i..)."""
    while len(vregs) > 1:
        h = len(vregs) // 2
        vregs = [a + b for a, b in zip(vregs[:h], vregs[h:])]
    return vregs[0]


def _tpu_kernel(p_ref, q_ref, res_ref, tp_ref, *, v: int, chunk: int, block: int):
    # p_ref, q_ref: [R, TV] rows p[b, n_b], q[b, kq_b] for R batch rows, TV = block tokens.
    # C >= 128: res_ref / tp_ref [R, 128], lane k = total of the block's chunk k.
    # C < 128: res_ref / tp_ref [R, TV], the folded block (total in each chunk's last lane).
    p = p_ref[...]
    d = p - q_ref[...]
    ok = lax.broadcasted_iota(jnp.int32, p.shape, 1) < v - pl.program_id(1) * block  # token < V
    res = jnp.where(ok & (d > 0), d, 0.0)
    tp = jnp.where(ok & (p > 0), p, 0.0)
    if chunk >= _LANES:
        rows, n_k = p.shape[0], block // chunk
        lane = lax.broadcasted_iota(jnp.int32, (rows, _LANES), 1)

        def totals(x):  # fold each chunk to one vreg, stack them on sublanes, fold the lanes
            folded = [_tpu_vreg_fold([x[:, k * chunk + i:k * chunk + i + _LANES]
                                      for i in range(0, chunk, _LANES)]) for k in range(n_k)]
            folded = _tpu_lane_fold(jnp.concatenate(folded, axis=0), _LANES)  # [K * R, 128]
            out = jnp.zeros((rows, _LANES), jnp.float32)
            for k in range(n_k):  # every lane holds the total: put chunk k in lane k
                out = jnp.where(lane == k, folded[k * rows:(k + 1) * rows], out)
            return out

        res_ref[...] = totals(res)
        tp_ref[...] = totals(tp)
    else:
        res_ref[...] = _tpu_lane_fold(res, chunk)
        tp_ref[...] = _tpu_lane_fold(tp, chunk)


def _tpu_block(v: int, chunk: int):
    """(block tokens TV, output lanes per block) for chunk length C."""
    if chunk >= _LANES:
        per_block = max(1, min(_LANES, _TPU_BLOCK_TOKENS // chunk, -(-v // chunk)))
        return per_block * chunk, _LANES
    block = min(_TPU_BLOCK_TOKENS, -(-v // _LANES) * _LANES)
    return block, block


def tpu_chunk_totals(p_row, q_row, *, chunk: int, interpret=False, block_rows: int | None = None):
    """Mosaic kernel: (residual totals, target totals) [B, nC] of rows p_row, q_row [B, V].

    block_rows: batch rows per block (a multiple of 8); default 8, or more in interpret
    mode (whose grid loop copies the outputs at every step), up to 2048 rows and 2**22
    values a block.  Rows are independent, so the results do not depend on it.
    """
    b, v = p_row.shape
    n_chunks = -(-v // chunk)
    block, out_w = _tpu_block(v, chunk)
    if block_rows is None:
        block_rows = 8
        if interpret:
            block_rows = max(8, min(2048, -(-b // 8) * 8, (1 << 22) // block // 8 * 8))
    if block_rows % 8:
        raise ValueError(f"block_rows must be a multiple of 8, got {block_rows}")
    rows = block_rows
    grid = (-(-b // rows), -(-v // block))
    kernel = functools.partial(_tpu_kernel, v=v, chunk=chunk, block=block)
    in_spec = pl.BlockSpec((rows, block), lambda i, j: (i, j))
    out_spec = pl.BlockSpec((rows, out_w), lambda i, j: (i, j))
    out_shape = jax.ShapeDtypeStruct((b, grid[1] * out_w), jnp.float32)
    res, tp = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[in_spec, in_spec],
        out_specs=[out_spec, out_spec],
        out_shape=[out_shape, out_shape],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(flops=6 * b * v, transcendentals=0,
                                      bytes_accessed=8 * b * v + 8 * b * grid[1] * out_w),
        interpret=interpret,
        name="verify_chunk_totals_tpu",
    )(p_row, q_row)
    if chunk >= _LANES:  # lane k of block j holds chunk j * per_block + k
        per_block = block // chunk
        pick = lambda x: x.reshape(b, grid[1], _LANES)[:, :, :per_block].reshape(b, -1)
    else:  # the chunk's last lane
        pick = lambda x: x[:, chunk - 1::chunk]
    return pick(res)[:, :n_chunks], pick(tp)[:, :n_chunks]


def _tpu_totals(p, q, n, kq, *, chunk: int, interpret=False):
    rows = jnp.arange(p.shape[0])
    return tpu_chunk_totals(p[rows, n], q[rows, kq], chunk=chunk, interpret=interpret)


# ------------------------------------------------------------------------- GPU (Triton)
def _triton_fold(x):
    """fold_halves over the last axis: split in halves (Triton: reshape + split), add.

    Explicit adds, not a sum over a pair axis: XLA (interpret mode) may merge a chain of
    reductions into one and reorder it."""
    m = x.shape[-1]
    while m > 1:
        m //= 2
        lo, hi = lax.split(x, (m, m), axis=x.ndim - 1)
        x = lo + hi
    return x.reshape(x.shape[:-1])


def _triton_kernel(n_ref, kq_ref, p_ref, q_ref, res_ref, tp_ref, *, v: int, chunk: int,
                   per_program: int):
    # n_ref, kq_ref [B] int32; p_ref [B, G+1, V], q_ref [B, *, V]; res_ref, tp_ref [B, nC'].
    b = pl.program_id(0)
    size = per_program * chunk
    start = pl.program_id(1) * size
    ok = start + lax.broadcasted_iota(jnp.int32, (size,), 0) < v
    p = pltriton.load(p_ref.at[b, n_ref[b], pl.ds(start, size)], mask=ok, other=0.0)
    q = pltriton.load(q_ref.at[b, kq_ref[b], pl.ds(start, size)], mask=ok, other=0.0)
    d = p - q
    res = jnp.where(d > 0, d, 0.0).reshape(per_program, chunk)
    tp = jnp.where(p > 0, p, 0.0).reshape(per_program, chunk)
    out = pl.ds(pl.program_id(1) * per_program, per_program)
    res_ref[b, out] = _triton_fold(res)
    tp_ref[b, out] = _triton_fold(tp)


def _triton_totals(p, q, n, kq, *, chunk: int, interpret=False):
    """Triton kernel: (residual totals, target totals) [B, nC] of rows p[b, n_b], q[b, kq_b].

    Pallas Triton addresses with int32 offsets: p and q must hold fewer than 2**31 values.
    """
    if chunk > _TRITON_MAX_CHUNK:
        raise NotImplementedError(
            f"the Triton kernel folds a chunk in registers: chunk_size <= {_TRITON_MAX_CHUNK}")
    b, _, v = p.shape
    n_chunks = -(-v // chunk)
    per_program = min(max(1, _TRITON_PROGRAM_TOKENS // chunk),
                      1 << max(0, (n_chunks - 1).bit_length()))
    num_warps = min(16, max(4, per_program * chunk // 1024))
    grid = (b, -(-n_chunks // per_program))
    out_shape = jax.ShapeDtypeStruct((b, grid[1] * per_program), jnp.float32)
    kernel = functools.partial(_triton_kernel, v=v, chunk=chunk, per_program=per_program)
    res, tp = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=[out_shape, out_shape],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="verify_chunk_totals_triton",
    )(n.astype(jnp.int32), kq.astype(jnp.int32), p, q)
    return res[:, :n_chunks], tp[:, :n_chunks]


# ------------------------------------------------------------------------- dispatch
_NATIVE = {"tpu": ("tpu",), "triton": ("gpu", "cuda", "rocm")}  # platforms that run each kernel


def _check_backend(backend: str | None) -> None:
    if backend not in (None,) + BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def default_interpret(backend: str | None) -> bool:
    """Whether a kernel runs in Pallas's interpreter by default on JAX's default backend: always
    on the CPU; for a forced backend, wherever that kernel does not run natively; for backend=None
    never off the CPU (the lowering platform then picks a kernel it runs, or the jnp totals)."""
    _check_backend(backend)
    platform = jax.default_backend()
    if platform == "cpu":
        return True
    return backend is not None and platform not in _NATIVE[backend]


def _chunk_totals(p, q, n, kq, *, chunk: int, interpret, backend):
    _check_backend(backend)
    tpu = functools.partial(_tpu_totals, chunk=chunk, interpret=interpret)
    triton = functools.partial(_triton_totals, chunk=chunk, interpret=interpret)
    if interpret:
        return triton(p, q, n, kq) if backend == "triton" else tpu(p, q, n, kq)
    if backend is not None:
        return {"tpu": tpu, "triton": triton}[backend](p, q, n, kq)
    return lax.platform_dependent(
        p, q, n, kq, tpu=tpu, cuda=triton, rocm=triton,
        default=functools.partial(reference_totals, chunk=chunk))


@functools.partial(jax.jit, static_argnames=("interpret", "chunk_size", "backend"))
def _verify_block(draft_tokens, draft_probs, target_probs, lengths, uniforms, *,
                  interpret, chunk_size: int, backend):
    chunk = effective_chunk(target_probs.shape[-1], chunk_size)
    p, q, n, kq, rejected, u_last = accept_stage(
        draft_tokens, draft_probs, target_probs, lengths, uniforms)
    tot_res, tot_p = _chunk_totals(p, q, n, kq, chunk=chunk, interpret=interpret,
                                   backend=backend)
    return n, finish(p, q, n, kq, rejected, tot_res, tot_p, u_last, chunk)


def verify_block(draft_tokens, draft_probs, target_probs, lengths, uniforms, *,
                 interpret=None, chunk_size: int = DEFAULT_CHUNK, backend: str | None = None):
    """Pallas twin of ``verify_block_reference`` -> (num_accepted [B], next_token [B]) int32.

    draft_tokens [B, G] int, draft_probs [B, G, V], target_probs [B, G+1, V],
    lengths [B] in [0, G] (clipped to it), uniforms [B, G+1] in [0, 1).

    interpret: None -> ``default_interpret(backend)``: the interpreter unless the default
      backend runs the kernel natively (a forced "tpu" kernel on a GPU, or "triton" on a TPU, is
      interpreted: on an H200 the Mosaic-TPU kernel forced onto the GPU failed two tests);
      True or a ``pltpu.InterpretParams`` runs the kernel in Pallas's interpreter.
    chunk_size: power of two; results equal the reference's with the same chunk_size.
    backend: None -> chosen by the lowering platform (tpu: Mosaic, cuda/rocm: Triton,
      others: the jnp totals); "tpu" or "triton" forces that kernel.
    """
    if interpret is None:
        interpret = default_interpret(backend)
    if isinstance(interpret, (bool, int)):
        interpret = bool(interpret)
    return _verify_block(draft_tokens, draft_probs, target_probs, lengths, uniforms,
                         interpret=interpret, chunk_size=chunk_size, backend=backend)
