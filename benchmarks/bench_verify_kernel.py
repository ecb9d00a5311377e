"""The Pallas verification kernel against its jnp reference: equal outputs, and time of each.

Meant for a GPU or TPU, where the kernel is compiled (Triton on GPU, Mosaic on TPU); on CPU
the kernel body runs in Pallas's interpreter, so only the equality check means anything
there (use a small case, e.g. --batch 4 --block 4 --vocab 4096).

    .venv/bin/python benchmarks/bench_verify_kernel.py [--batch 64] [--block 16] [--vocab 49152]
    .venv/bin/python benchmarks/bench_verify_kernel.py --sweep   # B 1,16,64 x G 7,16 x V 49152,151936

In interpret mode the outputs must be bit-identical; compiled, they normally are too (same
additions in the same order), but the kernel only has to be statistically lossless there,
so a mismatch is reported, not fatal.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

SWEEP = {"batch": (1, 16, 64), "block": (7, 16), "vocab": (49152, 151936)}


def _inputs(key, b, g, v):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    base = 3.0 * jax.random.normal(k1, (b, g + 1, v))
    q = jax.nn.softmax(base[:, :g], axis=-1)  # a draft close to the target, as a trained one is
    p = jax.nn.softmax(base + 0.7 * jax.random.normal(k2, (b, g + 1, v)), axis=-1)
    # Draw the drafts from q so that acceptance actually happens.
    tokens = jax.random.categorical(k3, jnp.log(q), axis=-1).astype(jnp.int32)
    lengths = jax.random.randint(k4, (b,), 0, g + 1).astype(jnp.int32)
    uniforms = jax.random.uniform(k5, (b, g + 1))
    return tokens, q, p, lengths, uniforms


def _best_ms(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run_case(reference, kernel, b, g, v, *, trials, repeats, strict):
    """Check equality on `trials` input sets, then time both; returns a result row."""
    equal_rows = total_rows = 0
    for trial in range(trials):
        inputs = _inputs(jax.random.PRNGKey(trial), b, g, v)
        ref, ker = jax.device_get(reference(*inputs)), jax.device_get(kernel(*inputs))
        same = np.logical_and(ref[0] == ker[0], ref[1] == ker[1])
        equal_rows += int(same.sum())
        total_rows += same.size
        if strict and not same.all():
            raise SystemExit(f"B={b} G={g} V={v} trial {trial}: kernel and reference differ")
    accepted = float(np.mean(ref[0]))
    ref_ms = _best_ms(reference, inputs, repeats)
    ker_ms = _best_ms(kernel, inputs, repeats)
    del inputs
    return dict(b=b, g=g, v=v, equal=f"{equal_rows}/{total_rows}", accepted=accepted,
                ref_ms=ref_ms, ker_ms=ker_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block", type=int, default=16, help="draft block size G")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--sweep", action="store_true",
                        help="every combination of B in %s, G in %s, V in %s" % tuple(SWEEP.values()))
    parser.add_argument("--backend", choices=("tpu", "triton"), default=None,
                        help="force one kernel (default: the platform's; on CPU the TPU kernel body)")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--trials", type=int, default=3, help="random input sets checked for equality")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import pallas_kernels
    from dspark_jax.verify import DEFAULT_CHUNK, verify_block

    chunk = args.chunk_size or DEFAULT_CHUNK
    interpret = jax.default_backend() == "cpu"
    reference = jax.jit(functools.partial(verify_block, chunk_size=chunk))
    kernel = jax.jit(functools.partial(pallas_kernels.verify_block, chunk_size=chunk,
                                       backend=args.backend))
    if args.sweep:
        cases = list(itertools.product(SWEEP["batch"], SWEEP["block"], SWEEP["vocab"]))
    else:
        cases = [(args.batch, args.block, args.vocab)]
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"kernel {'interpreted' if interpret else 'compiled'}, chunk {chunk}")
    print(f"{'B':>4} {'G':>3} {'V':>7} {'equal rows':>11} {'accepted':>8} "
          f"{'jnp ms':>9} {'kernel ms':>9} {'kernel/jnp':>10}")
    for b, g, v in cases:
        r = run_case(reference, kernel, b, g, v, trials=args.trials, repeats=args.repeats,
                     strict=interpret)
        print(f"{r['b']:>4} {r['g']:>3} {r['v']:>7} {r['equal']:>11} {r['accepted']:>8.2f} "
              f"{r['ref_ms']:>9.3f} {r['ker_ms']:>9.3f} {r['ker_ms'] / r['ref_ms']:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
