"""Evaluate trained drafters: accepted length tau, acceptance per position, end-to-end speedup.

    python -m train.evaluate runs/dspark/drafter runs/dflash/drafter runs/eagle3/drafter \
        [--data data/smollm2-135m] [--datasets mtbench humaneval sharegpt] [--temperatures 0 1] \
        [--block-sizes 7 15] [--max-prompts 40] [--speed-batches 1 8] [--out runs/eval]

tau is the mean number of tokens a verification round commits (accepted drafts + 1), over the
rounds that verified the whole block, for every prompt of a dataset, through the Engine at the
given temperature and block size, with a 95 % bootstrap interval over the prompts. The speedup
is plain generate against speculative generate on the same prompts (greedy, batch 1 and 8,
tokens per second excluding compilation; the first --speed-prompts prompts in groups of the
batch size, best of --repeats alternating runs each), on --speed-datasets, under each of
--speed-policies ("fixed": every round verifies G; "dspark": the load-aware scheduler, which
also decides when drafting does not pay). Writes `results.md` (the tables), `results.json` and
`tau.png` under --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
import tyro

DATASETS = ("mtbench", "humaneval", "sharegpt")


@dataclasses.dataclass
class EvaluateConfig:
    drafters: tyro.conf.Positional[tuple[str, ...]] = ("runs/dspark/drafter",)
    """Drafter checkpoint folders."""
    data: str = "data/smollm2-135m"
    """train.data folder: its validation split is the held-out ShareGPT set and names the model."""
    model: str | None = None
    datasets: tuple[str, ...] = DATASETS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    block_sizes: tuple[int, ...] = (7, 15)
    max_prompts: int = 40
    max_new_tokens: int = 128
    slots: int = 8
    speed_batches: tuple[int, ...] = (1, 8)
    speed_datasets: tuple[str, ...] = ("humaneval", "mtbench")
    """Datasets the speedup is measured on (their prompts are loaded even when not in --datasets)."""
    speed_policies: tuple[str, ...] = ("fixed", "dspark")
    """Verification-length policies of the speculative side (dspark_jax.schedule)."""
    speed_new_tokens: int = 64
    speed_prompts: int = 8
    """Prompts timed at each speed batch size (at least the batch), in groups of the batch size."""
    repeats: int = 2
    seed: int = 0
    out: str = "runs/eval"


def dataset_prompts(name: str, cfg: EvaluateConfig, tokenizer) -> list[list[int]]:
    """Chat-templated token ids of a dataset's first max_prompts prompts."""
    from dspark_jax.prompts import encode_prompts
    from train import data as data_lib
    from train import sources

    if name == "mtbench":
        texts = sources.mtbench_first_turns()
    elif name == "humaneval":
        texts = sources.humaneval_prompts()
    elif name == "sharegpt":
        rows = data_lib.read_split(cfg.data, "validation")[:cfg.max_prompts]
        return [r["tokens"][:r["prompt_len"]].tolist() for r in rows]
    else:
        raise SystemExit(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return encode_prompts(tokenizer, texts[:cfg.max_prompts], chat=True)


def acceptance(engine, prompts, temperature: float, cfg: EvaluateConfig) -> dict:
    """tau over the rounds that verified the whole block, and acceptance per position over the
    positions verification tested. A request's last rounds verify fewer drafts (its budget caps
    them): counting them as whole blocks made tau low and positions past a cut look rejected
    (until 2026-12-07; at 64 new tokens about 5-13 % of rounds are cut)."""
    from dspark_jax.batch import run_requests
    from dspark_jax.sampling import SamplingParams

    block_size = engine.block_size
    params = [SamplingParams(temperature=temperature, seed=cfg.seed + i, max_new_tokens=cfg.max_new_tokens)
              for i in range(len(prompts))]
    results = run_requests(engine, prompts, params)
    per_prompt = [(np.asarray(r.round_accepted, np.int64), np.asarray(r.round_lengths, np.int64)) for r in results]
    accepted = np.concatenate([a for a, _ in per_prompt])
    lengths = np.concatenate([l for _, l in per_prompt])
    k = np.arange(block_size)[None, :]
    reached = (accepted[:, None] >= k) & (lengths[:, None] > k)  # position k+1 tested: k accepted, l > k
    took = accepted[:, None] > k
    whole = accepted[lengths == block_size]
    # Per prompt: whole-block rounds and the tokens they committed, for the interval over prompts.
    rounds = np.array([np.sum(l == block_size) for _, l in per_prompt], np.float64)
    committed = np.array([np.sum(a[l == block_size] + 1) for a, l in per_prompt], np.float64)
    return {"tau": float(np.mean(whole + 1)) if len(whole) else float("nan"), "rounds": int(len(whole)),
            "tau_ci95": prompt_bootstrap_interval(committed, rounds, seed=cfg.seed),
            "acceptance_per_position": (took.sum(0) / np.maximum(reached.sum(0), 1)).tolist()}


def prompt_bootstrap_interval(committed: np.ndarray, rounds: np.ndarray, seed: int = 0, resamples: int = 2000,
                              level: float = 0.95) -> list[float]:
    """Percentile-bootstrap interval of tau = sum(committed) / sum(rounds), resampling whole
    prompts [P] (a prompt's rounds are not independent: an easy prompt accepts long runs
    throughout). How far tau would move with another draw of prompts of the same kind: the
    comparisons in the README differ by a few percent at 8 prompts a set."""
    committed, rounds = np.asarray(committed, np.float64), np.asarray(rounds, np.float64)
    if rounds.sum() == 0:
        return [float("nan"), float("nan")]
    pick = np.random.default_rng(seed).integers(0, len(rounds), size=(resamples, len(rounds)))  # [B, P]
    totals = rounds[pick].sum(1)
    taus = committed[pick].sum(1)[totals > 0] / totals[totals > 0]
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(taus, tail)), float(np.percentile(taus, 100 - tail))]


def speedup(target, drafter, prompts, batch: int, cfg: EvaluateConfig, policy: str = "fixed") -> dict:
    """Greedy tokens per second, plain and speculative (under `policy`), over the first
    max(batch, cfg.speed_prompts) prompts in consecutive groups of `batch` (at batch 1 every prompt
    alone: one prompt's acceptance says little about a dataset's). Per group the two alternate,
    best of cfg.repeats each; the rates are total new tokens over total seconds."""
    from dspark_jax import generate

    n = max(batch, cfg.speed_prompts)
    pool = (prompts * n)[:n]
    kwargs = dict(max_new_tokens=cfg.speed_new_tokens, chat=False)
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}  # [new tokens, seconds]
    committed = rounds = 0.0
    for i in range(0, n - batch + 1, batch):
        rows = pool[i:i + batch]
        runs = {"plain": lambda: generate(target, rows, **kwargs),
                "spec": lambda: generate(target, rows, drafter=drafter, policy=policy, **kwargs)}
        for run in runs.values():
            run()  # compile once per shape (a table policy also profiles its cost table)
        best = {}
        for _ in range(cfg.repeats):
            for side, run in runs.items():
                stats = run().stats
                if side not in best or stats["wall_seconds"] < best[side]["wall_seconds"]:
                    best[side] = stats
        for side, stats in best.items():
            totals[side][0] += stats["new_tokens"]
            totals[side][1] += stats["wall_seconds"]
        committed += best["spec"]["tau"] * best["spec"]["row_rounds"]
        rounds += best["spec"]["row_rounds"]
    plain, spec = (t / s if s > 0 else float("inf") for t, s in totals.values())
    return {"plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain if plain else float("nan"),
            "tau": committed / max(rounds, 1), "prompts": n}


def markdown(results: dict) -> str:
    lines = ["| drafter | dataset | T | G | tau | tau 95 % CI (prompts) | acceptance per position |",
             "|---|---|--:|--:|--:|--:|---|"]
    for r in results["acceptance"]:
        per = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lo, hi = r["tau_ci95"]
        lines.append(f"| {r['drafter']} | {r['dataset']} | {r['temperature']:g} | {r['block_size']} | {r['tau']:.3f} | "
                     f"{lo:.3f}-{hi:.3f} | {per} |")
    if results["speed"]:
        lines += ["", "| drafter | dataset | policy | batch | prompts | plain tok/s | spec tok/s | speedup | tau |",
                  "|---|---|---|--:|--:|--:|--:|--:|--:|"]
        for r in results["speed"]:
            lines.append(f"| {r['drafter']} | {r['dataset']} | {r['policy']} | {r['batch']} | {r['prompts']} | "
                         f"{r['plain_tok_s']:.1f} | "
                         f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.3f} |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["acceptance"] if r["temperature"] == 0.0]
    if not rows:
        return
    names = sorted({r["drafter"] for r in rows})
    sets = sorted({(r["dataset"], r["block_size"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(sets) * len(names)), 3.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [next((r["tau"] for r in rows if r["drafter"] == name and (r["dataset"], r["block_size"]) == s),
                     np.nan) for s in sets]
        ax.bar(np.arange(len(sets)) + i * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(sets)) + width * (len(names) - 1) / 2, [f"{d}\nG={g}" for d, g in sets])
    ax.set_ylabel("tau (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: EvaluateConfig) -> dict:
    from tqdm import tqdm

    from dspark_jax import Engine, schedule
    from dspark_jax.drafters import load_drafter
    from dspark_jax.prompts import bucket
    from train import data as data_lib

    target = data_lib.data_target(cfg.data, cfg.model)
    drafters = {path: load_drafter(path, target) for path in cfg.drafters}
    prompts = {name: dataset_prompts(name, cfg, target.tokenizer)
               for name in dict.fromkeys(cfg.datasets + cfg.speed_datasets)}
    results = {"acceptance": [], "speed": []}
    jobs = [(p, d, t, g) for p in drafters for g in cfg.block_sizes for d in cfg.datasets for t in cfg.temperatures]
    # One engine per (drafter, G), sized for the longest prompt of any dataset: temperatures and
    # datasets are data for its compiled programs, so the whole table compiles 2 x drafters engines.
    longest = max(len(p) for name in cfg.datasets for p in prompts[name])
    engines: dict = {}
    for path, dataset, temperature, g in tqdm(jobs, desc="acceptance", unit="run"):
        if (path, g) not in engines:
            engines.clear()  # free the previous engine's programs and buffers
            max_len = min(bucket(longest + cfg.max_new_tokens + g + 1, minimum=128),
                          target.config.max_position_embeddings)
            engines[(path, g)] = Engine(target, drafters[path], slots=cfg.slots, max_len=max_len, block_size=g)
        r = acceptance(engines[(path, g)], prompts[dataset], temperature, cfg)
        results["acceptance"].append({"drafter": label(path), "dataset": dataset, "temperature": temperature,
                                      "block_size": g, **r})
    for path in tqdm(list(drafters), desc="speedup", unit="drafter"):
        # The load-aware policies read the confidence head: a drafter without one runs the others.
        policies = [p for p in cfg.speed_policies
                    if drafters[path].config.confidence_head or p not in schedule.TABLE_POLICIES]
        for dataset in cfg.speed_datasets:
            for policy in policies:
                for batch in cfg.speed_batches:
                    r = speedup(target, drafters[path], prompts[dataset], batch, cfg, policy)
                    results["speed"].append({"drafter": label(path), "dataset": dataset, "policy": policy,
                                             "batch": batch, **r})
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(cfg.out, "results.md"), "w") as f:
        f.write(markdown(results) + "\n")
    plot(results, os.path.join(cfg.out, "tau.png"))
    return results


def label(path: str) -> str:
    """A drafter's name in the tables: its folder, without a trailing "/drafter"."""
    path = os.path.normpath(path)
    return os.path.basename(os.path.dirname(path)) if os.path.basename(path) == "drafter" else os.path.basename(path)


def main(argv: Sequence[str] | None = None) -> None:
    from dspark_jax import xla_cache

    cfg = tyro.cli(EvaluateConfig, args=argv)
    xla_cache.enable()
    results = run(cfg)
    print(markdown(results))


if __name__ == "__main__":
    main()
