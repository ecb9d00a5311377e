"""The DSpark drafter's cost at each draft depth the engine compiles, side by side in one run.

One greedy draft (backbone, head and sequential scan) of the shipped drafter, jitted alone with the
weights as the Engine holds them (cast to the target's dtype, draft head bound), at depths 1, 3 and
G per batch size; all depths interleaved in every repeat, the best repeat reported, with each
depth's time as a fraction of the whole block's.

    .venv/bin/python benchmarks/bench_draft_depth.py [--batches 1 4 16 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="smollm2-135m-dspark")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--context", type=int, default=100, help="committed positions before the anchor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="drafts per timed repeat")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from dspark_jax import load_drafter, load_target
    from dspark_jax.decode import draft_depths
    from dspark_jax.drafters import cast_floats, dflash, vocab
    from dspark_jax.sampling import RowSampling

    target = load_target(args.model)
    drafter = load_drafter(args.drafter, target)
    tcfg, dcfg = target.config, drafter.config
    params = vocab.bind_head(jax.device_put(cast_floats(drafter.params, target.dtype)), target.params)
    depths = draft_depths(dcfg.block_size)
    print(f"{args.drafter}, G = {dcfg.block_size}, {jax.devices()[0].device_kind}: ms per draft (fraction of depth "
          f"{depths[-1]})")
    for b in args.batches:
        state = dflash.init_state(params, tcfg, dcfg, b, 2 * args.context)
        inputs = dict(state=state, anchor=jnp.full((b,), 100, jnp.int32),
                      anchor_pos=jnp.full((b,), args.context, jnp.int32),
                      keys=jax.random.split(jax.random.PRNGKey(0), b), sampling=RowSampling.uniform(b))
        runs = {d: jax.jit(functools.partial(dflash.draft, tcfg=tcfg, dcfg=dcfg, depth=d)) for d in depths}
        best = {d: float("inf") for d in depths}
        for repeat in range(args.repeats + 1):  # the first one compiles: untimed
            for d, run in runs.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    out = run(params, target.params, **inputs)[0]
                jax.block_until_ready(out.tokens)
                if repeat:
                    best[d] = min(best[d], (time.perf_counter() - start) / args.calls * 1e3)
        full = best[depths[-1]]
        print(f"batch {b:3d}  " + "  ".join(f"depth {d}: {ms:6.2f} ms ({ms / full:.2f})" for d, ms in best.items()),
              flush=True)


if __name__ == "__main__":
    main()
