"""The "halves swapped" row of this folder's README: STS fitted on the odd prompts' rounds and
measured on the even ones (train.calibrate does the reverse), and a check that the refit head's
rounds have the 2026-12-07f rounds' accepted lengths (the drafts are unchanged).

    .venv/bin/python train/results/2026-12-07g-confidence-unseen/swap_halves.py
"""
import os

import numpy as np

from dspark_jax import calibration as cal

here = os.path.dirname(os.path.abspath(__file__))
old = np.load(os.path.join(here, "..", "2026-12-07f-calibration", "calibration-rounds.npz"))
new = np.load(os.path.join(here, "calibration-rounds.npz"))
print("accepted lengths equal round for round:", np.array_equal(old["accepted"], new["accepted"]))
z, request = new["z"].astype(np.float64), new["request"]
survival = cal.survival_labels(new["accepted"], z.shape[1])
fit, test = request % 2 == 1, request % 2 == 0
temps, shifts = cal.fit_sts(z[fit], survival[fit], shift=True)
after = cal.survival_probs_np(z[test], temps, shifts)
print("ECE % held out, halves swapped:",
      " / ".join(f"{100 * cal.ece(after[:, k], survival[test][:, k]):.2f}" for k in range(z.shape[1])))
