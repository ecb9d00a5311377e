"""What the dspark gate costs where drafting does not pay: `none`, `dspark` with the gate shut
(`step(..., max_length=0)`: plain rounds plus the drafter's context upkeep, never a draft) and
`dspark` as it runs (probes included), side by side in one process, repeats interleaved.

Same requests as benchmarks/bench_schedule.py (greedy, MT-Bench and HumanEval prompts, EOS
ignored, one slot per request, 8 rounds per step); prints system tokens per second per run and
the ratios to `none`.

    .venv/bin/python benchmarks/bench_gate.py [--batch 16] [--sps-table sps.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_schedule
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # train.sources


def run(engine, prompts, new_tokens: int, rounds: int, max_length) -> float:
    """System tokens per second of one batch, inserted at once and stepped to the end."""
    from dspark_jax import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    state = engine.insert_many(engine.new_state(), [(i, p, params) for i, p in enumerate(prompts)])
    tokens = 0
    while True:
        state, out = engine.step(state, rounds=rounds, max_length=max_length)
        tokens += sum(len(t) for t in out.tokens)
        if all(out.finished):
            return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="smollm2-135m-dspark")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sps-table", default=None, help="a saved CostTable (default: profiled here)")
    args = parser.parse_args()

    from bench_schedule import prompt_ids

    from dspark_jax import Engine, load_drafter, load_target
    from dspark_jax.prompts import bucket

    target = load_target(args.model)
    drafter = load_drafter(args.drafter, target)
    prompts = prompt_ids(target.tokenizer, args.batch)
    max_len = bucket(max(len(p) for p in prompts) + args.new_tokens + drafter.config.block_size + 1, minimum=128)
    plain = Engine(target, drafter, slots=args.batch, max_len=max_len, policy="none")
    dspark = Engine(target, drafter, slots=args.batch, max_len=max_len, policy="dspark")
    dspark.sps_table = args.sps_table if args.sps_table else dspark.profile()
    cases = {"none": (plain, None), "dspark, gate shut": (dspark, 0), "dspark": (dspark, None)}
    for engine, max_length in cases.values():  # untimed: compiles what the runs use
        run(engine, prompts, args.new_tokens, args.rounds, max_length)
    runs = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (engine, max_length) in cases.items():
            runs[name].append(run(engine, prompts, args.new_tokens, args.rounds, max_length))
    base = statistics.mean(runs["none"])
    for name, values in runs.items():
        mean = statistics.mean(values)
        print(f"batch {args.batch:3d}  {name:>17}  {mean:7.1f} tok/s  (runs {' '.join(f'{v:.1f}' for v in values)})"
              f"  {mean / base:.3f}x none", flush=True)


if __name__ == "__main__":
    main()
