"""The Pallas verification kernel against its jnp reference: equal outputs, and time of each.

Meant for a GPU or TPU (native kernel); on CPU the kernel runs in interpret mode, so only the
equality check means anything there.

    .venv/bin/python benchmarks/bench_verify_kernel.py [--batch 64] [--block 16] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--trials", type=int, default=5, help="random input sets checked for equality")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import pallas_kernels
    from dspark_jax.verify import verify_block

    reference = jax.jit(verify_block)
    kernel = jax.jit(pallas_kernels.verify_block)
    print(f"backend {jax.default_backend()}, B={args.batch} G={args.block} V={args.vocab}")
    for trial in range(args.trials):
        inputs = _inputs(jax.random.PRNGKey(trial), args.batch, args.block, args.vocab)
        ref, ker = jax.device_get(reference(*inputs)), jax.device_get(kernel(*inputs))
        same = all(np.array_equal(a, b) for a, b in zip(ref, ker))
        print(f"trial {trial}: outputs equal: {same}; mean accepted {np.mean(ref[0]):.2f}")
        if not same:
            raise SystemExit("kernel and reference differ")
    ref_ms = _best_ms(reference, inputs, args.repeats)
    ker_ms = _best_ms(kernel, inputs, args.repeats)
    print(f"jnp reference {ref_ms:.3f} ms, pallas kernel {ker_ms:.3f} ms, kernel / reference {ker_ms / ref_ms:.2f}x")


if __name__ == "__main__":
    main()
