"""Replay recorded verification rounds through the dspark schedule at several draft depths.

train.calibrate records, for every round it ran (the whole block verified), the confidence
head's logits and the accepted length (calibration-rounds.npz). Here those rounds are grouped
into batches of --batch rows, each batch is scheduled by the library's level schedule with the
drafter's calibration, confidences past a draft depth cut to zero (what a shallow draft gives
the schedule), and priced by a profiled cost table (bench_schedule's sps-b{batch}.json): expected
committed tokens per second, as a ratio to the table's plain rounds. It measures how much a depth
limit costs on this drafter and table, without running the model (deterministic; no timing).
The table prices width w with a draft of depth w - 1, so a draft deeper than what a batch
verifies is priced as the shallower one (its extra drafter cost is benchmarks/bench_draft_depth.py's).

    .venv/bin/python benchmarks/replay_schedule.py --drafter smollm2-135m-dspark \
        --rounds train/results/2026-12-06-confidence-refit/calibration-rounds.npz \
        --table benchmarks/results/sps-cpu-2026-12-06/sps-b1.json
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="a drafter (folder or shipped name) with its calibration")
    parser.add_argument("--rounds", required=True, help="calibration-rounds.npz written by train.calibrate")
    parser.add_argument("--table", required=True, help="a cost table JSON for --batch slots (bench_schedule --out)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    parser.add_argument("--seed", type=int, default=0, help="how rounds are grouped into batches")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from dspark_jax import load_drafter
    from dspark_jax import schedule as sched
    from dspark_jax.calibration import confidence_probs
    from dspark_jax.engine import confidence_calibration

    drafter = load_drafter(args.drafter)
    table = sched.CostTable.load(args.table)
    if table.slots != args.batch:
        parser.error(f"--table {args.table} was profiled at {table.slots} slots, not --batch {args.batch}")
    with np.load(args.rounds) as f:
        z, accepted = f["z"].astype(np.float64), f["accepted"]
    g = z.shape[1]
    if g != drafter.config.block_size:
        parser.error(f"--rounds {args.rounds} holds blocks of {g}, the drafter drafts {drafter.config.block_size}")
    # [n, G] conditional confidences, calibrated as the engine calibrates them
    temps = confidence_calibration(drafter, drafter.config, "temperatures") or (1.0,) * g
    shifts = confidence_calibration(drafter, drafter.config, "shifts") or (0.0,) * g
    conf = np.asarray(confidence_probs(jnp.asarray(z, jnp.float32), jnp.asarray(temps), jnp.asarray(shifts)))
    order = np.random.default_rng(args.seed).permutation(len(z))[: len(z) // args.batch * args.batch]
    groups = order.reshape(-1, args.batch)  # [batches, R]
    sps = np.asarray(table.table, np.float64)
    level = jax.jit(jax.vmap(lambda c: sched.level_schedule(c, jnp.asarray(table.table, jnp.float32))))
    plain = args.batch * table.plain_steps_per_second
    print(f"{len(z)} rounds in {len(groups)} batches of {args.batch}; plain {plain:.1f} tokens/s by the table")
    for depth in args.depths:
        cut = np.where(np.arange(g) < depth, conf, 0.0).astype(np.float32)
        lengths = np.asarray(level(cut[groups]))  # [batches, R]
        tokens = (1 + np.minimum(accepted[groups], lengths)).sum()
        width = lengths.max(axis=1)  # the dense forward verifies every row at the longest length
        seconds = (1.0 / sps[args.batch * (1 + width)]).sum()
        share = np.bincount(width, minlength=g + 1) / len(groups)
        print(f"depth {depth}: {tokens / seconds:7.1f} tokens/s, {tokens / seconds / plain:.3f}x plain; "
              f"rounds verifying 0..{g} levels: " + " ".join(f"{x:.2f}" for x in share))


if __name__ == "__main__":
    main()
