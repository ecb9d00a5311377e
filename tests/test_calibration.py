"""STS and the calibration metrics (dspark_jax/calibration.py) on synthetic data with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax import calibration as cal
from dspark_jax.schedule import survival


def _miscalibrated(n=20000, g=4, scale=(0.4, 2.5, 1.0, 3.0), seed=0):
    """Rounds whose true per-position acceptance is sigmoid(u_k); the head reports z_k = u_k * s_k,
    so T*_k = s_k is the temperature that calibrates it exactly (sigmoid(z_k / T*_k) = sigmoid(u_k))."""
    rng = np.random.default_rng(seed)
    u = rng.normal(1.0, 1.5, size=(n, g))
    accept = rng.random((n, g)) < 1 / (1 + np.exp(-u))
    accepted = np.argmin(np.concatenate([accept, np.zeros((n, 1), bool)], axis=1), axis=1)  # first rejection
    z = u * np.asarray(scale)
    return z, accepted, np.asarray(scale)


def test_sts_recovers_known_temperatures_and_lowers_ece():
    z, accepted, true_t = _miscalibrated()
    survival = cal.survival_labels(accepted, z.shape[1])
    temps = cal.fit_sts(z, survival)
    np.testing.assert_allclose(temps, true_t, rtol=0.15)
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
    temps = cal.fit_sts(z, survival)
    np.testing.assert_allclose(temps[:3], true_t[:3], rtol=0.15)
    assert temps[3] == temps[2]
    assert cal.fit_sts(z, survival, min_events=0)[3] != temps[2]  # the unguarded fit goes elsewhere


def test_survival_labels_and_jnp_form():
    np.testing.assert_array_equal(cal.survival_labels(np.array([0, 2, 3]), 3),
                                  [[0, 0, 0], [1, 1, 0], [1, 1, 1]])
    z = np.array([[0.3, -1.0, 2.0]])
    t = np.array([0.5, 2.0, 1.0])
    surv = survival(cal.confidence_probs(z, t))  # the engine's form: per-position, then the scheduler's cumprod
    np.testing.assert_allclose(np.asarray(surv), cal.survival_probs_np(z, t), rtol=1e-6)


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
