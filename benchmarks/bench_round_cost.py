"""What one decode round costs, by kind of round, side by side in one process.

Cases, each an R-round step program of an engine over the same prompts and the same attention
span (the one a fixed-policy step of R rounds needs), every timed step starting from the same
freshly inserted prompts:
- `plain`: an engine without a drafter (what policy "none" is measured against);
- `none+drafter`: policy "none" over the drafter (plain rounds plus the drafter's context upkeep);
- `fixed ml=L`: policy "fixed" with max_length L, so every round drafts (at the smallest compiled
  depth holding L) and verifies up to L draft tokens a row: the price of a drafted round against
  a plain one, the number the dspark gate weighs against the accepted tokens.
All cases run interleaved, repeat by repeat; the table gives median ms per round and the ratio
to `plain`. With --profile, one profiled step per case (jax.profiler) adds the XLA operations
executed per round and their summed thread time (both CPU threads count), split into matrix
products and the rest: on a CPU a round's fixed cost is largely the count of small operations.

    .venv/bin/python benchmarks/bench_round_cost.py [--batches 1 4] [--rounds 8] [--max-lengths 0 1 3 7]
        [--repeats 8] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import tempfile
import time


def profile_step(run, steps: int) -> tuple[float, float, float]:
    """(XLA ops, op thread-ms, of which matrix products) per step, from a jax.profiler trace."""
    import glob

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            run()
        jax.profiler.stop_trace()
        data = ProfileData.from_file(sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True))[-1])
    ops, total, products = 0, 0.0, 0.0
    skip = ("ThunkExecutor", "SlinkyThreadPool", "cond", "while", "conditional")
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):  # the XLA:CPU worker threads
                continue
            for event in line.events:
                if event.name.startswith(skip):  # containers: their contents are counted
                    continue
                ops += 1
                total += event.duration_ns / 1e6
                products += event.duration_ns / 1e6 if event.name.startswith("ynn_fusion") else 0.0
    return ops / steps, total / steps, products / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="smollm2-135m-dspark")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per step program")
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[0, 1, 3, 7])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="also count the XLA operations per round")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from bench_schedule import prompt_ids

    from dspark_jax import Engine, SamplingParams, load_drafter, load_target

    target = load_target(args.model)
    drafter = load_drafter(args.drafter, target)
    sampling = SamplingParams(max_new_tokens=512, ignore_eos=True, temperature=0.0, seed=1)
    R = args.rounds
    print(f"{args.drafter} on {args.model}, {jax.devices()[0].device_kind}, {R}-round steps, greedy")
    print("| batch | round | ms / round | / plain |" + (" XLA ops / round | op thread-ms / round (products) |"
                                                         if args.profile else ""))
    print("|--:|---|--:|--:|" + ("--:|--:|" if args.profile else ""))
    for b in args.batches:
        prompts = prompt_ids(target.tokenizer, b)
        span = None
        cases = {}
        for name, dr, policy, ml in ([("plain", None, "none", None), ("none+drafter", drafter, "none", None)]
                                     + [(f"fixed ml={m}", drafter, "fixed", m) for m in args.max_lengths]):
            engine = Engine(target, dr, slots=b, max_len=1024, policy=policy)
            state = engine.insert_many(engine.new_state(), [(i, p, sampling) for i, p in enumerate(prompts)])
            rows = engine.rows_for(state)
            span = span or engine.span_for(state, R, "fixed")  # room for R full blocks
            schedule = engine._schedule_for(rows)
            if ml is not None:
                schedule = dataclasses.replace(schedule, max_length=jnp.asarray(ml, jnp.int32))
            cases[name] = (engine._step_program(R, span, policy, rows), engine.weights, schedule, state)

        def step(case):  # one step from the inserted prompts (the program donates its state: a copy)
            program, weights, schedule, state = case
            state = jax.block_until_ready(jax.tree.map(jnp.copy, state))
            start = time.perf_counter()
            jax.block_until_ready(program(*weights, state, schedule))
            return (time.perf_counter() - start) * 1e3 / R

        for case in cases.values():  # an untimed step each
            step(case)
        times = collections.defaultdict(list)
        for _ in range(args.repeats):
            for name, case in cases.items():
                times[name].append(step(case))
        plain = statistics.median(times["plain"])
        for name, case in cases.items():
            ms = statistics.median(times[name])
            row = f"| {b} | {name} | {ms:.2f} | {ms / plain:.3f} |"
            if args.profile:
                program, weights, schedule, state = case
                copies = [jax.block_until_ready(jax.tree.map(jnp.copy, state)) for _ in range(2)]
                ops, thread_ms, products = profile_step(
                    lambda: jax.block_until_ready(program(*weights, copies.pop(), schedule)), 2)
                row += f" {ops / R:.0f} | {thread_ms / R:.2f} ({products / R:.2f}) |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
