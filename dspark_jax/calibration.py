"""Sequential Temperature Scaling (DESIGN.md section 5) and the calibration metrics.

The confidence head gives a raw logit z_k per drafted position; the calibrated probability that
position k survives verification (every draft token up to k accepted) is

    c_k = prod_{i <= k} sigmoid(z_i / T_i + b_i),

with one temperature per position fitted post hoc, left to right: T_k minimises the ECE of c_k
against the realised survival indicators s_k = 1[accepted length >= k], earlier temperatures
fixed (the paper's STS: every b_i = 0).

A temperature alone cannot move a head whose logits are mostly positive below a mean of 0.5, nor
fix any bias: a head trained many epochs on little data says "accepted" more often than held-out
verification does (ours: 0.57 against 0.45 at position 1, and STS ran to the end of its grid).
`fit_sts(..., shift=True)` therefore fits a shift b_k with T_k (sequential Platt scaling) by the
log loss of c_k, a proper scoring rule: ECE itself has a degenerate minimum once a shift is free
(every row at the base rate, calibrated and useless to the scheduler), the log loss rewards
keeping the ranking. The fit and the metrics are host-side numpy (they run once, offline);
`confidence_probs` is the jnp form the Engine applies inside its step (dspark_jax.schedule takes
the cumprod).
"""

from __future__ import annotations

import numpy as np

TEMPERATURE_GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))  # log-spaced, 0.05 .. 20
SHIFT_GRID = np.linspace(-4.0, 4.0, 161)  # b_k, step 0.05
ECE_BINS = 15


def confidence_probs(z, temperatures, shifts=None):
    """Per-position confidences sigmoid(z / T + b) [..., G] (jnp; temperatures, shifts [G]): the
    probability that position k is accepted given that every earlier one was. Their cumprod is c_k."""
    import jax

    return jax.nn.sigmoid(z / temperatures + (0.0 if shifts is None else shifts))


def sigmoid_np(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow for very negative x (a position past a shallow draft's
    depth has logit drafters.dflash.NO_CONFIDENCE)."""
    return np.exp(-np.logaddexp(0.0, -x))


def survival_probs_np(z: np.ndarray, temperatures: np.ndarray, shifts: np.ndarray | None = None) -> np.ndarray:
    shifts = np.zeros_like(np.asarray(temperatures, np.float64)) if shifts is None else shifts
    return np.cumprod(sigmoid_np(z / temperatures + shifts), axis=-1)


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error with equal-width bins: sum_b (n_b / n) |mean(p) - mean(y)|."""
    probs, labels = np.asarray(probs, np.float64), np.asarray(labels, np.float64)
    if probs.size == 0:
        return float("nan")
    which = np.minimum((probs * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * abs(probs[sel].mean() - labels[sel].mean())
    return float(total / probs.size)


def auroc(probs: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic, ties averaged); nan with one class only."""
    probs, labels = np.asarray(probs, np.float64), np.asarray(labels, bool)
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(probs, kind="mergesort")
    ranks = np.empty(len(probs))
    sorted_p = probs[order]
    i = 0
    while i < len(sorted_p):  # average ranks over ties
        j = i
        while j + 1 < len(sorted_p) and sorted_p[j + 1] == sorted_p[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean((np.asarray(probs, np.float64) - np.asarray(labels, np.float64)) ** 2))


def survival_labels(accepted: np.ndarray, block_size: int) -> np.ndarray:
    """s [n, G] = 1[accepted length >= k] for k = 1..G, from accepted lengths [n]."""
    return (np.asarray(accepted)[:, None] >= np.arange(1, block_size + 1)[None, :]).astype(np.float64)


MIN_EVENTS = 20


def fit_sts(z: np.ndarray, survival: np.ndarray, grid: np.ndarray = TEMPERATURE_GRID,
            min_events: int = MIN_EVENTS, shift: bool = False,
            shift_grid: np.ndarray = SHIFT_GRID) -> tuple[np.ndarray, np.ndarray]:
    """(temperatures [G], shifts [G]) fitted left to right (z, survival: [n, G]).

    shift=False: the paper's STS, T_k by ECE over `grid`, every shift 0. shift=True: (T_k, b_k) by
    the log loss over `grid` x `shift_grid` (module docstring says why not by ECE).
    A position with fewer than `min_events` survivals (or fewer than that many failures) keeps the
    parameters of the position before it (T = 1, b = 0 at the first): with a handful of events
    the minimum is noise, and the fit used to land on the grid's ends there.
    """
    z = np.asarray(z, np.float64)
    survival = np.asarray(survival, np.float64)
    g = z.shape[1]
    temps, shifts = np.ones(g), np.zeros(g)
    prefix = np.ones(len(z))  # prod_{i < k} sigmoid(z_i / T_i + b_i) with the fitted T_i, b_i
    for k in range(g):
        events = survival[:, k].sum()
        if min(events, len(z) - events) < min_events:
            temps[k], shifts[k] = (temps[k - 1], shifts[k - 1]) if k else (1.0, 0.0)
        elif shift:
            temps[k], shifts[k] = _fit_log_loss(prefix, z[:, k], survival[:, k], grid, shift_grid)
        else:
            scores = [ece(prefix * sigmoid_np(z[:, k] / t), survival[:, k]) for t in grid]
            temps[k] = grid[int(np.argmin(scores))]
        prefix = prefix * sigmoid_np(z[:, k] / temps[k] + shifts[k])
    return temps, shifts


def _fit_log_loss(prefix: np.ndarray, z: np.ndarray, s: np.ndarray, grid: np.ndarray,
                  shift_grid: np.ndarray) -> tuple[float, float]:
    """argmin over the grid of the mean log loss of prefix * sigmoid(z / T + b) against s [n]."""
    best, best_loss = (1.0, 0.0), np.inf
    for t in grid:
        c = prefix[None, :] * sigmoid_np(z[None, :] / t + shift_grid[:, None])  # [shifts, n]
        c = np.clip(c, 1e-7, 1 - 1e-7)
        loss = -(s * np.log(c) + (1 - s) * np.log1p(-c)).mean(axis=1)  # [shifts]
        i = int(np.argmin(loss))
        if loss[i] < best_loss:
            best, best_loss = (float(t), float(shift_grid[i])), float(loss[i])
    return best


def ece_floor(probs: np.ndarray, draws: int = 50, seed: int = 0) -> float:
    """The ECE a perfectly calibrated head with these confidences [n] would measure: the mean
    ECE of labels drawn as Bernoulli(probs). Binned ECE is biased upwards by sampling noise
    (about 0.4 sqrt(occupied bins / n) for p near 1/2), so a measured ECE is only as small as this floor
    allows; more rounds lower it. Rounds of one prompt are correlated, so the real floor is
    higher still."""
    rng = np.random.default_rng(seed)
    probs = np.asarray(probs, np.float64)
    return float(np.mean([ece(probs, rng.random(probs.shape) < probs) for _ in range(draws)]))


def metrics_per_position(probs: np.ndarray, survival: np.ndarray) -> list[dict]:
    """[{"ece", "auroc", "brier", "rate", "mean_conf"}] per position."""
    return [dict(ece=ece(probs[:, k], survival[:, k]), auroc=auroc(probs[:, k], survival[:, k]),
                 brier=brier(probs[:, k], survival[:, k]), rate=float(survival[:, k].mean()),
                 mean_conf=float(probs[:, k].mean())) for k in range(probs.shape[1])]
