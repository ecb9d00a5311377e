"""Sequential Temperature Scaling of a drafter's confidence head (DESIGN.md section 5).

    python -m train.calibrate --drafter runs/dspark/drafter --data data/smollm2-135m [--temperature 0]

1. Collect: the validation split's prompts run through the Engine with the drafter at the
   serving temperature; every verification round gives the confidence head's raw logits
   z_1..z_G and the accepted length, hence the survival indicators s_k = 1[accepted >= k].
2. Fit a temperature and a shift per position, left to right (dspark_jax.calibration.fit_sts;
   --no-shift: temperatures only, the paper's STS) on half of the rounds (split by request),
   and report ECE, AUROC and Brier per position before and after on the other half.
3. Store them in the drafter checkpoint (drafter.json "calibration"); the Engine applies them to the confidences it reports and the scheduler uses. A reliability diagram
   (PNG) and the table (markdown) go next to the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from dspark_jax import calibration as cal


@dataclasses.dataclass
class CalibrateConfig:
    drafter: str = "runs/dspark/drafter"
    data: str = "data/smollm2-135m"
    model: str | None = None
    """Default: the model the data was generated with."""
    temperature: float = 0.0
    """The serving temperature the survival indicators are collected at."""
    max_prompts: int = 128
    max_new_tokens: int = 128
    slots: int = 16
    waves: bool = False
    """Run the prompts in waves of --slots over one row bucket (dspark_jax.batch.run_requests):
    a few fixed shapes, for accelerators, where a compile per insert size and row bucket set the
    pace (an H200 calibrated 4 prompts in its time limit that way)."""
    shift: bool = True
    """Fit a shift b_k with each temperature (sigmoid(z / T + b)); without it the paper's STS,
    which cannot correct a head biased towards "accepted" (dspark_jax.calibration)."""
    seed: int = 0
    rounds: str | None = None
    """A calibration-rounds.npz written by an earlier run (every run writes one next to its report):
    refit from those rounds without running verification again."""
    out: str | None = None
    """Where the report and the diagram go; default: the drafter folder."""


def collect(engine, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int, seed: int,
            progress=None, waves: bool = False):
    """(z [n, G], accepted [n], request id [n]) over the verification rounds of every prompt that
    verified the whole block. A round that verified l < G tokens (a request's last rounds, where
    its budget caps the length) tested nothing past l: counting those positions as rejected
    would bias the fit towards rejection, and which rounds are short depends on the budget, not
    on their own outcome, so leaving them out biases nothing."""
    from dspark_jax.batch import run_requests
    from dspark_jax.sampling import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=seed + i, max_new_tokens=max_new_tokens)
              for i in range(len(prompts))]
    results = run_requests(engine, prompts, params, progress=progress, waves=waves)
    z = np.concatenate([r.round_confidence_logits for r in results])
    accepted = np.concatenate([np.asarray(r.round_accepted, np.int64) for r in results])
    request = np.concatenate([np.full(len(r.round_accepted), i) for i, r in enumerate(results)])
    whole = np.concatenate([np.asarray(r.round_lengths, np.int64) for r in results]) == engine.block_size
    return z[whole], accepted[whole], request[whole]


ROUNDS_FILE = "calibration-rounds.npz"


def load_rounds(path: str, block_size: int):
    """(z, accepted, request, serving temperature) saved by an earlier collection, checked against the drafter."""
    if not os.path.isfile(path):
        raise SystemExit(f"--rounds {path}: no such file (train.calibrate writes {ROUNDS_FILE} next to its report)")
    with np.load(path) as f:
        z, accepted, request, temperature = f["z"], f["accepted"], f["request"], float(f["temperature"])
    if z.ndim != 2 or z.shape[1] != block_size:
        raise SystemExit(f"--rounds {path}: confidence logits of shape {z.shape}, but the drafter drafts "
                         f"{block_size} tokens per block")
    return z, accepted, request, temperature


def calibrate(z: np.ndarray, accepted: np.ndarray, request: np.ndarray, shift: bool = True) -> dict:
    """Fit on the even requests, evaluate on the odd ones (rounds of one request stay together)."""
    g = z.shape[1]
    survival = cal.survival_labels(accepted, g)
    fit_rows, test_rows = request % 2 == 0, request % 2 == 1
    if not test_rows.any():
        fit_rows = test_rows = np.ones(len(z), bool)
    temps, shifts = cal.fit_sts(z[fit_rows], survival[fit_rows], shift=shift)
    raw = cal.survival_probs_np(z, np.ones(g))  # [rounds, G] the head at T = 1
    before = raw[test_rows]
    after = cal.survival_probs_np(z[test_rows], temps, shifts)
    return {"temperatures": temps.tolist(), "shifts": shifts.tolist(), "rounds": int(len(z)), "rounds_fit": int(fit_rows.sum()),
            "rounds_eval": int(test_rows.sum()),
            "before": cal.metrics_per_position(before, survival[test_rows]),
            # The raw head fits nothing on these prompts, so all rounds measure it held out.
            "raw_all_rounds": cal.metrics_per_position(raw, survival),
            "raw_ece_prompt_halves": ece_over_prompt_halves(raw, survival, request),
            "after": cal.metrics_per_position(after, survival[test_rows]),
            "ece_floor_after": [cal.ece_floor(after[:, k]) for k in range(g)],
            "curves": {"before": reliability(before, survival[test_rows]), "after": reliability(after, survival[test_rows])}}


def ece_over_prompt_halves(probs: np.ndarray, survival: np.ndarray, request: np.ndarray, draws: int = 20,
                           seed: int = 0) -> list[list[float]]:
    """Per position [min, mean, max] ECE over `draws` random halves of the requests.

    Rounds of one prompt are alike (a code prompt's drafts survive more often than a chat's), so
    the ECE of one half of the prompts moves far more than its round count suggests: this spread
    says how much of a measured ECE is the draw of prompts. probs, survival [rounds, G]; request
    [rounds]."""
    rng = np.random.default_rng(seed)
    ids = np.unique(request)
    if len(ids) < 2:
        return [[float("nan")] * 3 for _ in range(probs.shape[1])]
    values = np.array([[cal.ece(probs[rows, k], survival[rows, k]) for k in range(probs.shape[1])]
                       for rows in (np.isin(request, rng.permutation(ids)[:len(ids) // 2]) for _ in range(draws))])
    return [[float(v.min()), float(v.mean()), float(v.max())] for v in values.T]  # [G, 3]


def spread_table(report: dict) -> str:
    """The raw head over every round, and its ECE over random prompt halves."""
    lines = ["| k | ECE raw, all rounds | ECE raw, prompt halves (min / mean / max) |", "|--:|--:|--|"]
    for k, (m, (lo, mean, hi)) in enumerate(zip(report["raw_all_rounds"], report["raw_ece_prompt_halves"]), 1):
        lines.append(f"| {k} | {100 * m['ece']:.2f} % | {100 * lo:.2f} / {100 * mean:.2f} / {100 * hi:.2f} % |")
    return "\n".join(lines)


def reliability(probs: np.ndarray, survival: np.ndarray, bins: int = cal.ECE_BINS) -> list[list]:
    """Per position, per bin: [mean confidence, empirical survival, count] (bins with data only)."""
    out = []
    for k in range(probs.shape[1]):
        which = np.minimum((probs[:, k] * bins).astype(int), bins - 1)
        out.append([[float(probs[which == b, k].mean()), float(survival[which == b, k].mean()), int((which == b).sum())]
                    for b in range(bins) if (which == b).any()])
    return out


def table(report: dict) -> str:
    """Per position; "ECE floor" is what a perfectly calibrated head would measure on these rounds."""
    lines = ["| k | survival rate | ECE before | ECE after | ECE floor | AUROC before | AUROC after | Brier before "
             "| Brier after | T_k | b_k |", "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    g = len(report["temperatures"])
    shifts = report.get("shifts") or [0.0] * g
    for k, (b, a, fl, t, sh) in enumerate(zip(report["before"], report["after"], report["ece_floor_after"],
                                              report["temperatures"], shifts), 1):
        lines.append(f"| {k} | {b['rate']:.3f} | {100 * b['ece']:.2f} % | {100 * a['ece']:.2f} % | {100 * fl:.2f} % | "
                     f"{b['auroc']:.3f} | {a['auroc']:.3f} | {b['brier']:.4f} | {a['brier']:.4f} | {t:.3f} | {sh:+.2f} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = len(report["temperatures"])
    fig, axes = plt.subplots(1, g, figsize=(2.6 * g, 2.8), squeeze=False)
    for k in range(g):
        ax = axes[0, k]
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
        for name, style in (("before", "o--"), ("after", "s-")):
            pts = report["curves"][name][k]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=3, label=name)
        ax.set_title(f"k={k + 1}  ECE {100 * report['before'][k]['ece']:.1f}->{100 * report['after'][k]['ece']:.1f} %",
                     fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence", fontsize=7)
    axes[0, 0].set_ylabel("empirical survival", fontsize=7)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: CalibrateConfig) -> dict:
    from tqdm import tqdm

    from dspark_jax import Engine
    from dspark_jax.drafters import load_drafter, save_drafter
    from train import data as data_lib

    target = data_lib.data_target(cfg.data, cfg.model)
    drafter = load_drafter(cfg.drafter, target)
    if not drafter.config.confidence_head:
        raise SystemExit(f"{cfg.drafter}: this {drafter.kind} drafter has no confidence head to calibrate")
    saved = drafter.calibration
    out = cfg.out or cfg.drafter
    os.makedirs(out, exist_ok=True)
    if cfg.rounds:
        z, accepted, request, temperature = load_rounds(cfg.rounds, drafter.config.block_size)
    else:
        from dspark_jax.prompts import bucket

        rows = data_lib.read_split(cfg.data, "validation")[:cfg.max_prompts]
        prompts = [r["tokens"][:r["prompt_len"]].tolist() for r in rows]
        drafter.calibration = None  # collect raw logits (the engine then reports T = 1 survival)
        max_len = bucket(max(len(p) for p in prompts) + cfg.max_new_tokens + drafter.config.block_size + 1,
                         minimum=128)
        engine = Engine(target, drafter, slots=cfg.slots, max_len=max_len,
                        row_buckets=(cfg.slots,) if cfg.waves else None)
        with tqdm(total=len(prompts), desc="verification rounds", unit="prompt") as bar:
            z, accepted, request = collect(engine, prompts, cfg.temperature, cfg.max_new_tokens, cfg.seed, bar,
                                           cfg.waves)
        temperature = cfg.temperature
        np.savez_compressed(os.path.join(out, ROUNDS_FILE), z=z.astype(np.float32), accepted=accepted,
                            request=request, temperature=cfg.temperature)
    report = calibrate(z, accepted, request, cfg.shift)
    report["serving_temperature"] = temperature
    drafter.calibration = {**(saved or {}), "temperatures": report["temperatures"], "shifts": report["shifts"],
                           "serving_temperature": temperature, "rounds": report["rounds"],
                           # The engine's gate starts a fresh engine from these (engine.confidence_prior).
                           "survival_rates": [m["rate"] for m in report["before"]],
                           "ece_before": [m["ece"] for m in report["before"]],
                           "ece_after": [m["ece"] for m in report["after"]]}
    save_drafter(drafter, cfg.drafter)
    plot(report, os.path.join(out, "reliability.png"))
    with open(os.path.join(out, "calibration.md"), "w") as f:
        f.write(f"STS on {report['rounds_fit']} rounds, evaluated on {report['rounds_eval']} others "
                f"(temperature {temperature}):\n\n{table(report)}\n\n"
                f"The raw head (T = 1) over all {report['rounds']} rounds, and over random halves of the "
                f"prompts (how far a half's ECE moves with the draw of prompts):\n\n{spread_table(report)}\n")
    with open(os.path.join(out, "calibration.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    import tyro

    from dspark_jax import xla_cache

    cfg = tyro.cli(CalibrateConfig, args=argv)
    xla_cache.enable()
    report = run(cfg)
    print(table(report))


if __name__ == "__main__":
    main()
