"""The one chi-square goodness-of-fit helper of the test suite (statistical losslessness tests)."""

from __future__ import annotations

import numpy as np

Z = 5.0  # standard score of the rejection threshold: a correct sampler passes with fixed seeds


def chi2_threshold(df: int, z: float = Z) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at standard score z."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def chi2(samples, probs, z: float = Z) -> tuple[float, float]:
    """(stat, threshold) of a goodness-of-fit test of int samples against probs.

    Cells with expected count < 5 are pooled; any sample in a zero-probability cell makes the
    statistic infinite.
    """
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size)
    assert counts.size == probs.size
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return np.inf, 0.0
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return stat, chi2_threshold(max(obs.size - 1, 1), z)
