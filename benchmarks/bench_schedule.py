"""Verification-length policies side by side under load (dspark_jax.schedule).

For each batch size, every policy runs the same greedy requests (MT-Bench first turns and
HumanEval prompts, alternating; `--new-tokens` each, EOS ignored) through an Engine with one
slot per request, in the same process, repeat after repeat (policies interleaved, so machine
noise hits them alike). Reports system throughput (committed tokens per second), per-request
speed (a request's tokens over its own latency, mean over requests), each policy's ratio to
"none" paired repeat by repeat (median and range), the mean draft tokens verified per request
per round and tau; "threshold" is the best of a small theta sweep.
The dspark policies share one cost table per batch size, profiled on this machine (or loaded
with --sps-dir). Several --drafter values run the drafting policies once per drafter, interleaved
with the rest (the first drafter's table serves drafters of the same architecture; a drafter of
another shape is refused): two versions of one drafter compared side by side. Writes results.json, results.md and a plot of throughput against per-request
speed (one curve per policy) to --out.

    .venv/bin/python benchmarks/bench_schedule.py [--drafter smollm2-135m-dspark] [--batches 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # train.sources

POLICIES = ("none", "fixed", "threshold", "dspark", "dspark-lagged")


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    """MT-Bench and HumanEval prompts, alternating, chat-templated."""
    from dspark_jax.prompts import encode_prompts
    from train import sources

    mt, he = sources.mtbench_first_turns(), sources.humaneval_prompts()
    texts = [(mt if i % 2 == 0 else he)[i // 2 % min(len(mt), len(he))] for i in range(count)]
    return encode_prompts(tokenizer, texts, chat=True)


def run_batch(engine, prompts, new_tokens: int, rounds: int) -> dict:
    """All requests inserted at once, stepped to the end; per-request latency from the start."""
    from dspark_jax import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    state = engine.insert_many(engine.new_state(), [(i, p, params) for i, p in enumerate(prompts)])
    tokens = [0] * len(prompts)
    done_at = [0.0] * len(prompts)
    verified = row_rounds = 0
    while not all(done_at):
        state, out = engine.step(state, rounds=rounds)
        now = time.perf_counter() - start
        for i in range(len(prompts)):
            tokens[i] += len(out.tokens[i])
            verified += sum(out.round_lengths[i])
            row_rounds += len(out.round_lengths[i])
            if out.finished[i] and not done_at[i]:
                done_at[i] = now
    wall = max(done_at)
    return {"throughput": sum(tokens) / wall, "per_request": statistics.mean(t / d for t, d in zip(tokens, done_at)),
            "verified_per_round": verified / max(row_rounds, 1),
            "tau": (sum(tokens) - len(prompts)) / max(row_rounds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", nargs="+", default=["smollm2-135m-dspark"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="rounds per engine step (one host sync each)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sps-dir", default=None, help="load cost tables sps-b{batch}.json from here")
    parser.add_argument("--out", default="runs/bench_schedule")
    args = parser.parse_args()

    from dspark_jax import Engine, load_drafter, load_target
    from dspark_jax.prompts import bucket

    target = load_target(args.model)
    drafters = {name: load_drafter(name, target) for name in args.drafter}
    first = drafters[args.drafter[0]]
    for name, d in drafters.items():
        if d.config != first.config:
            parser.error(f"--drafter {name}: another architecture than {args.drafter[0]} (one cost table serves all)")
    os.makedirs(args.out, exist_ok=True)
    g = first.config.block_size
    results = []
    for batch in args.batches:
        prompts = prompt_ids(target.tokenizer, batch)
        max_len = bucket(max(len(p) for p in prompts) + args.new_tokens + g + 1, minimum=128)
        configs = []  # (policy, theta, drafter name, engine)
        for policy in args.policies:
            for name in (args.drafter[:1] if policy == "none" else args.drafter):
                for theta in (args.thresholds if policy == "threshold" else [None]):
                    extra = {} if theta is None else {"threshold": theta}
                    configs.append((policy, theta, name, Engine(target, drafters[name], slots=batch, max_len=max_len,
                                                                policy=policy, **extra)))
        table = None
        sps_path = os.path.join(args.sps_dir or args.out, f"sps-b{batch}.json")
        if args.sps_dir:
            from dspark_jax.schedule import CostTable

            table = CostTable.load(sps_path)
        for policy, _, _, engine in configs:
            if table is None and policy.startswith("dspark"):
                table = engine.profile()  # every slot live: each compiled width drafting, and a plain round
                table.model, table.drafter = args.model, args.drafter[0]
                table.save(sps_path)
                print(f"batch {batch:3d}  cost table: no draft {table.plain_steps_per_second:.2f} rounds/s, " + ", ".join(
                    f"width {w}: {x:.2f}" for w, x in zip(table.widths, table.steps_per_second)), flush=True)
            if table is not None and policy.startswith("dspark"):
                engine.sps_table = table
            run_batch(engine, prompts, args.new_tokens, args.rounds)  # untimed: compiles what the runs use
        runs = {(policy, theta, name): [] for policy, theta, name, _ in configs}
        for repeat in range(args.repeats):
            # The order alternates, so no policy always runs right after the same neighbour.
            for policy, theta, name, engine in (configs if repeat % 2 == 0 else configs[::-1]):
                runs[(policy, theta, name)].append(run_batch(engine, prompts, args.new_tokens, args.rounds))
        base = runs.get(("none", None, args.drafter[0]))
        for (policy, theta, drafter_name), reps in runs.items():
            row = {"batch": batch, "policy": policy, "threshold": theta,
                   "drafter": None if policy == "none" else drafter_name,
                   **{k: statistics.mean(r[k] for r in reps) for k in reps[0]},
                   "throughput_runs": [r["throughput"] for r in reps],
                   # Each repeat's ratio to the "none" run beside it: machine drift cancels in pairs.
                   "vs_none_runs": [r["throughput"] / b["throughput"] for r, b in zip(reps, base)] if base else []}
            results.append(row)
            spread = f"{min(row['throughput_runs']):.1f}-{max(row['throughput_runs']):.1f}"
            name = label(row, len(args.drafter) > 1)
            paired = (f"  vs none {statistics.median(row['vs_none_runs']):.3f} "
                      f"({min(row['vs_none_runs']):.3f}-{max(row['vs_none_runs']):.3f})" if base else "")
            print(f"batch {batch:3d}  {name:>15}  {row['throughput']:7.1f} tok/s (runs {spread}){paired}  "
                  f"{row['per_request']:6.2f} tok/s/request  verified {row['verified_per_round']:.2f}  "
                  f"tau {row['tau']:.2f}", flush=True)
        write(results, args)  # after every batch size: a run cut short keeps what it measured
    print(markdown(results))


def write(results: list[dict], args) -> None:
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(results))
    plot(results, os.path.join(args.out, "throughput.png"))


def label(row: dict, with_drafter: bool) -> str:
    """The policy (its threshold; the drafter when several ran)."""
    name = row["policy"] if row["threshold"] is None else f"threshold ({row['threshold']:g})"
    return f"{name} [{row['drafter']}]" if with_drafter and row.get("drafter") else name


def best_rows(results: list[dict]) -> list[dict]:
    """One row per (batch, policy, drafter): the best threshold of the sweep stands for "threshold"."""
    best: dict = {}
    for r in results:
        key = (r["batch"], r["policy"], r.get("drafter"))
        if key not in best or r["throughput"] > best[key]["throughput"]:
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["batch"], POLICIES.index(r["policy"])))


def several_drafters(results: list[dict]) -> bool:
    return len({r.get("drafter") for r in results if r.get("drafter")}) > 1


def markdown(results: list[dict]) -> str:
    lines = ["| batch | policy | tokens/s (system) | runs | / none, paired median (range) | tokens/s per request "
             "| verified / round | tau |",
             "|--:|---|--:|---|---|--:|--:|--:|"]
    for r in best_rows(results):
        name = label(r, several_drafters(results))
        runs = " ".join(f"{x:.1f}" for x in r["throughput_runs"])
        ratios = r.get("vs_none_runs") or []
        paired = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else ""
        lines.append(f"| {r['batch']} | {name} | {r['throughput']:.1f} | {runs} | {paired} | {r['per_request']:.2f} | "
                     f"{r['verified_per_round']:.2f} | {r['tau']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    rows = best_rows(results)
    curves = dict.fromkeys((r["policy"], r.get("drafter")) for r in rows)
    for policy, drafter in curves:
        mine = [r for r in rows if (r["policy"], r.get("drafter")) == (policy, drafter)]
        if mine:
            ax.plot([r["per_request"] for r in mine], [r["throughput"] for r in mine], "o-",
                    label=label({**mine[0], "threshold": None}, several_drafters(results)))
            for r in mine:
                ax.annotate(str(r["batch"]), (r["per_request"], r["throughput"]), fontsize=7)
    ax.set_xlabel("tokens per second per request")
    ax.set_ylabel("system tokens per second")
    ax.set_title("verification-length policies (labels: batch size)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
