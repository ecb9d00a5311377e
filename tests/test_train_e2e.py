"""A tiny end-to-end run of the training programs: data -> features -> fit -> calibrate -> evaluate."""

from __future__ import annotations

import json
import os

import numpy as np

from train import calibrate, evaluate, fit


def test_data_fit_calibrate_evaluate(tiny_train_data, tmp_path, monkeypatch):
    import shutil

    import pytest

    from dspark_jax import Engine, drafters, load_target
    from dspark_jax.drafters import load_drafter

    out = tmp_path / "dspark"
    summary = fit.run(fit.FitConfig(drafter="dspark", data=tiny_train_data, out=str(out), feature_layers=(0, 1),
                                    draft_vocab_size=64, num_layers=1, head_rank=8, block_size=3, seq_len=128,
                                    batch_size=4, anchors=4, steps=3, warmup_steps=1, save_every=100, log_every=1))
    report = calibrate.run(calibrate.CalibrateConfig(drafter=summary["drafter"], data=tiny_train_data, max_prompts=4,
                                                     max_new_tokens=12, slots=4))
    temps = report["temperatures"]
    assert len(temps) == 3 and all(t > 0 for t in temps) and report["rounds"] > 0
    assert len(report["before"]) == len(report["after"]) == 3
    assert os.path.isfile(os.path.join(summary["drafter"], "reliability.png"))
    # The temperatures ship with the checkpoint, and an Engine made from it applies them.
    with open(os.path.join(tiny_train_data, "meta.json")) as f:
        target = load_target(json.load(f)["generation"]["model"])
    drafter = load_drafter(summary["drafter"], target)
    assert drafter.calibration["temperatures"] == temps
    assert Engine(target, drafter, slots=1, max_len=128).settings.confidence_temperatures == tuple(temps)
    # Shipped drafters load by name; an unknown name lists the names there are.
    monkeypatch.setattr(drafters, "TRAINED_DIR", str(tmp_path / "trained"))
    shutil.copytree(summary["drafter"], tmp_path / "trained" / "tiny-dspark")
    assert drafters.trained_drafters() == ["tiny-dspark"]
    assert load_drafter("tiny-dspark", target).calibration["temperatures"] == temps
    with pytest.raises(FileNotFoundError, match="names: ngram, tiny-dspark"):
        load_drafter("smollm2-135m-nothing", target)

    results = evaluate.run(evaluate.EvaluateConfig(drafters=(summary["drafter"],), data=tiny_train_data,
                                                   datasets=("sharegpt",), temperatures=(0.0,), block_sizes=(3,),
                                                   max_prompts=3, max_new_tokens=10, slots=4, speed_batches=(1,),
                                                   speed_new_tokens=8, repeats=1, out=str(tmp_path / "eval")))
    (row,) = results["acceptance"]
    assert row["drafter"] == "dspark" and 1.0 <= row["tau"] <= 4.0 and len(row["acceptance_per_position"]) == 3
    (speed,) = results["speed"]
    assert speed["plain_tok_s"] > 0 and speed["spec_tok_s"] > 0
    assert "| dspark | sharegpt | 0 | 3 |" in (tmp_path / "eval" / "results.md").read_text()
    assert np.isfinite(speed["speedup"])
