"""One drafted round's step program, this checkout against another one, side by side.

The step program of policy `fixed` (one round per step, every round drafting G tokens) is timed
at 1 / 4 / 16 rows, greedy and sampled, on the default model and drafter: median of --steps
steps, compiled once per case (attention span for 30 rounds) so no compile is timed. With
--against TREE (another checkout, e.g. `git worktree add /tmp/old COMMIT`) the two checkouts run
alternately, each case in a fresh process, --repeats times, and the table gives both medians and
their ratio. For a change to the step's hot path, where a one-process A/B is not possible.

    .venv/bin/python benchmarks/bench_step.py --against /tmp/old [--repeats 2] [--steps 25]

With --engine it times `Engine.step(rounds=1)` itself, host reads and gate included, at one live
row of 16 slots under `none` and `dspark` (the server's one-request step), median ms per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = (1, 4, 16)
SERVER_TABLE = os.path.join(HERE, "benchmarks", "results", "sps-cpu-2026-12-07-server-16x384.json")
TEMPERATURES = (0.0, 0.7)


def measure(tree: str, steps: int) -> dict[str, float]:
    """Median ms per case, importing dspark_jax from `tree` (a child process's job)."""
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    import statistics
    import time

    import jax

    import dspark_jax
    from bench_schedule import prompt_ids
    from dspark_jax import Engine, SamplingParams, load_drafter, load_target

    if not os.path.abspath(dspark_jax.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"dspark_jax came from {dspark_jax.__file__}, not from {tree}: run from that tree's venv")
    target = load_target("smollm2-135m")
    engine = Engine(target, load_drafter("smollm2-135m-dspark", target), slots=max(ROWS), max_len=512,
                    policy="fixed")
    prompts = prompt_ids(target.tokenizer, max(ROWS))
    medians = {}
    for temperature in TEMPERATURES:
        params = SamplingParams(max_new_tokens=300, ignore_eos=True, temperature=temperature, seed=1)
        for rows in ROWS:
            state = engine.insert_many(engine.new_state(), [(i, p, params) for i, p in enumerate(prompts[:rows])])
            bucket, span = engine.rows_for(state), engine.span_for(state, 30, "fixed")
            program, schedule = engine._step_program(1, span, "fixed", bucket), engine._schedule_for(bucket)
            for _ in range(2):
                state = program(*engine.weights, state, schedule)[0]
            jax.block_until_ready(state)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                result = jax.block_until_ready(program(*engine.weights, state, schedule))
                times.append(1e3 * (time.perf_counter() - start))
                state = result[0]
            medians[f"T {temperature}, {rows} rows, ms per step"] = statistics.median(times)
    return medians


def measure_engine(tree: str, steps: int) -> dict[str, float]:
    """Median ms per Engine.step(rounds=1) with one live row of 16 slots, policies none and dspark
    (the server's one-request step, host work included: --engine). The dspark engine reads the
    committed cost table of the 16-slot, 384-token server, so nothing is profiled."""
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    import statistics
    import time

    import dspark_jax
    from bench_schedule import prompt_ids
    from dspark_jax import Engine, SamplingParams, load_drafter, load_target

    if not os.path.abspath(dspark_jax.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"dspark_jax came from {dspark_jax.__file__}, not from {tree}: run from that tree's venv")
    target = load_target("smollm2-135m")
    drafter = load_drafter("smollm2-135m-dspark", target)
    prompt = prompt_ids(target.tokenizer, 1)[0]
    medians = {}
    for policy in ("none", "dspark"):
        engine = Engine(target, drafter, slots=16, max_len=384, policy=policy)
        if policy == "dspark":
            engine.sps_table = SERVER_TABLE
        params = SamplingParams(max_new_tokens=384 - len(prompt) - 9, ignore_eos=True)
        state = engine.insert(engine.new_state(), 0, prompt, params)
        for _ in range(3):  # compiles what the timed steps use
            state, _ = engine.step(state, rounds=1)
        times = []
        for _ in range(steps):  # a step that moves to a longer attention span compiles: medians, not sums
            start = time.perf_counter()
            state, _ = engine.step(state, rounds=1)
            times.append(1e3 * (time.perf_counter() - start))
        medians[f"{policy}, 1 row of 16, ms per step"] = statistics.median(times)
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another checkout to compare with (its venv need not differ)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--engine", action="store_true",
                    help="time Engine.step (host work included) at one live row of 16 slots, none and dspark")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the tree to measure, in a child process
    args = ap.parse_args()
    if args.child:
        print(json.dumps((measure_engine if args.engine else measure)(args.child, args.steps)))
        return
    trees = {"this": HERE} | ({"against": os.path.abspath(args.against)} if args.against else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, "--steps",
                                  str(args.steps)] + ["--engine"] * args.engine, cwd=tree, check=True,
                                 capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {repeat + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)
    print("| case | " + " | ".join(name for name in trees) + (" | this / against |" if args.against else " |"))
    print("|---|" + "--:|" * (len(trees) + bool(args.against)))
    for case in runs["this"][0]:
        cells = [" / ".join(f"{r[case]:.1f}" for r in runs[name]) for name in trees]
        if args.against:
            mean = {name: sum(r[case] for r in runs[name]) / len(runs[name]) for name in trees}
            cells.append(f"{mean['this'] / mean['against']:.3f}")
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
