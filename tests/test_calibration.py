"""STS and the calibration metrics (dspark_jax/calibration.py) on synthetic data with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax import calibration as cal
from dspark_jax.schedule import survival


def _miscalibrated(n=20000, g=4, scale=(0.4, 2.5, 1.0, 3.0), bias=(0.0, 0.0, 0.0, 0.0), seed=0):
    """Rounds whose true per-position acceptance is sigmoid(u_k); the head reports
    z_k = (u_k + d_k) * s_k, so T*_k = s_k and b*_k = -d_k calibrate it exactly
    (sigmoid(z_k / T*_k + b*_k) = sigmoid(u_k))."""
    rng = np.random.default_rng(seed)
    u = rng.normal(1.0, 1.5, size=(n, g))
    accept = rng.random((n, g)) < 1 / (1 + np.exp(-u))
    accepted = np.argmin(np.concatenate([accept, np.zeros((n, 1), bool)], axis=1), axis=1)  # first rejection
    z = (u + np.asarray(bias)) * np.asarray(scale)
    return z, accepted, np.asarray(scale)


def test_sts_recovers_known_temperatures_and_lowers_ece():
    z, accepted, true_t = _miscalibrated()
    survival = cal.survival_labels(accepted, z.shape[1])
    temps, shifts = cal.fit_sts(z, survival)
    np.testing.assert_allclose(temps, true_t, rtol=0.15)
    assert not shifts.any()  # the paper's STS: temperatures only
    before = cal.metrics_per_position(cal.survival_probs_np(z, np.ones(4)), survival)
    after = cal.metrics_per_position(cal.survival_probs_np(z, temps), survival)
    assert all(a["ece"] < 0.02 for a in after)
    assert all(a["ece"] < b["ece"] for a, b in zip(after, before) if b["ece"] > 0.02)
    assert all(a["brier"] <= b["brier"] + 1e-4 for a, b in zip(after, before))


def test_sts_keeps_the_previous_temperature_where_events_are_too_few():
    """Position 4 survives in 5 of 20000 rounds: its fit would be noise, so it inherits T_3."""
    z, accepted, true_t = _miscalibrated()
    accepted = np.minimum(accepted, 3)
    accepted[:5] = 4
    survival = cal.survival_labels(accepted, z.shape[1])
    temps, _ = cal.fit_sts(z, survival)
    np.testing.assert_allclose(temps[:3], true_t[:3], rtol=0.15)
    assert temps[3] == temps[2]
    assert cal.fit_sts(z, survival, min_events=0)[0][3] != temps[2]  # the unguarded fit goes elsewhere


def test_shifted_sts_corrects_an_over_confident_head_that_temperatures_cannot():
    """A head biased towards "accepted" (d = +2.5 at position 1: its logits are nearly all
    positive, so no temperature takes its mean below 0.5 while the true rate is lower) is
    calibrated by the shifted fit, which finds T* and b* = -d, keeps the ranking, and beats the
    temperature-only fit's ECE and Brier on fresh rounds."""
    scale, bias = (1.0, 2.0, 0.5, 1.0), (2.5, 1.0, -1.0, 0.5)
    z, accepted, true_t = _miscalibrated(n=12000, scale=scale, bias=bias)
    survival = cal.survival_labels(accepted, 4)
    temps, shifts = cal.fit_sts(z, survival, shift=True)
    np.testing.assert_allclose(temps, true_t, rtol=0.15)
    np.testing.assert_allclose(shifts, -np.asarray(bias), atol=0.2)
    z2, accepted2, _ = _miscalibrated(n=12000, scale=scale, bias=bias, seed=1)
    survival2 = cal.survival_labels(accepted2, 4)
    shifted = cal.metrics_per_position(cal.survival_probs_np(z2, temps, shifts), survival2)
    plain = cal.metrics_per_position(cal.survival_probs_np(z2, *cal.fit_sts(z, survival)), survival2)
    raw = cal.metrics_per_position(cal.survival_probs_np(z2, np.ones(4)), survival2)
    assert all(m["ece"] < 0.02 for m in shifted)
    assert plain[0]["ece"] > 0.04 and shifted[0]["ece"] < plain[0]["ece"] / 2
    assert all(s["brier"] <= p["brier"] + 1e-4 for s, p in zip(shifted, plain))
    assert shifted[0]["auroc"] == pytest.approx(raw[0]["auroc"])  # a monotone map keeps the ranking


def test_survival_labels_and_jnp_form():
    np.testing.assert_array_equal(cal.survival_labels(np.array([0, 2, 3]), 3),
                                  [[0, 0, 0], [1, 1, 0], [1, 1, 1]])
    z = np.array([[0.3, -1.0, 2.0]])
    t = np.array([0.5, 2.0, 1.0])
    b = np.array([-0.4, 0.0, 1.1])
    surv = survival(cal.confidence_probs(z, t, b))  # the engine's form: per-position, then the scheduler's cumprod
    np.testing.assert_allclose(np.asarray(surv), cal.survival_probs_np(z, t, b), rtol=1e-6)
    np.testing.assert_allclose(cal.survival_probs_np(z, t, b)[0, 0], 1 / (1 + np.exp(-(0.3 / 0.5 - 0.4))))


def test_metrics_against_direct_definitions():
    rng = np.random.default_rng(1)
    p = np.round(rng.random(300), 2)  # ties on purpose
    y = rng.random(300) < p
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a in p[y] for b in p[~y]]
    assert cal.auroc(p, y) == pytest.approx(np.mean(pairs))
    assert cal.brier(p, y) == pytest.approx(np.mean((p - y) ** 2))
    bins = np.minimum((p * 15).astype(int), 14)
    want = sum((bins == b).sum() / len(p) * abs(p[bins == b].mean() - y[bins == b].mean())
               for b in range(15) if (bins == b).any())
    assert cal.ece(p, y) == pytest.approx(want)
    assert np.isnan(cal.auroc(p, np.ones(300, bool)))


def test_ece_over_prompt_halves_draws_whole_prompts():
    """Ten prompts at confidence 0.5, the even ones' drafts always survive and the odd ones' never:
    over all rounds the head is calibrated (ECE 0), but a half of the prompts with k even ones of
    five has ECE |k / 5 - 0.5|, which a split of single rounds would hide."""
    from train.calibrate import ece_over_prompt_halves

    request = np.repeat(np.arange(10), 30)
    survival = (request % 2 == 0).astype(np.float32)[:, None]  # [rounds, 1]
    probs = np.full_like(survival, 0.5)
    assert cal.ece(probs[:, 0], survival[:, 0]) == pytest.approx(0.0)
    lo, mean, hi = ece_over_prompt_halves(probs, survival, request, draws=50)[0]
    possible = {abs(k / 5 - 0.5) for k in range(6)}
    assert min(abs(lo - p) for p in possible) < 1e-6 and min(abs(hi - p) for p in possible) < 1e-6
    assert hi >= 0.3 and 0.0 < mean < hi


def test_ece_floor_is_what_a_calibrated_head_measures_and_shrinks_with_rounds():
    """Labels drawn from the confidences themselves (a perfectly calibrated head) measure an ECE
    near the floor, not zero; the floor is the normal approximation of each bin's binomial noise
    and falls as 1 / sqrt(n); a head off by 0.05 everywhere measures far above it."""
    rng = np.random.default_rng(5)
    floors = {}
    for n in (2000, 32000):
        p = rng.uniform(0.2, 0.8, n)
        floors[n] = cal.ece_floor(p, draws=40, seed=1)
        measured = [cal.ece(p, rng.random(n) < p) for _ in range(40)]
        assert abs(np.mean(measured) - floors[n]) < 0.2 * floors[n]
        assert cal.ece(np.clip(p + 0.05, 0, 1), rng.random(n) < p) > floors[n] + 0.03
        # Independent estimate: per bin, E|mean(y) - mean(p)| of a normal with the bin's binomial spread.
        which = np.minimum((p * cal.ECE_BINS).astype(int), cal.ECE_BINS - 1)
        normal = sum(np.sqrt(2 / np.pi) * np.sqrt(np.sum(p[which == b] * (1 - p[which == b]))) / n
                     for b in np.unique(which))
        assert floors[n] == pytest.approx(normal, rel=0.1)
    assert floors[2000] / floors[32000] == pytest.approx(4.0, rel=0.2)
