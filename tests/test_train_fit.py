"""The training programs on a tiny target: every drafter kind trains, resume is exact, sharding is
transparent, and a trained drafter goes through calibrate and evaluate (end to end)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import json

import numpy as np
import pytest

from train import calibrate, evaluate, fit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(data, out, **overrides):
    base = dict(drafter="dspark", data=data, out=str(out), feature_layers=(0, 1), draft_vocab_size=64,
                num_layers=1, head_rank=8, block_size=3, seq_len=128, batch_size=4, anchors=4, eagle_steps=3,
                steps=4, warmup_steps=1, save_every=2, log_every=1, export_dtype="float32", lr=3e-3)
    base.update(overrides)
    return fit.FitConfig(**base)


def _exported(path):
    """The exported drafter's params by path name."""
    import jax

    from dspark_jax.drafters import load_drafter

    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
            jax.tree_util.tree_leaves_with_path(load_drafter(path).params)}


@pytest.fixture(scope="module")
def dspark_run(tiny_train_data, tmp_path_factory):
    """One uninterrupted 4-step DSpark run (checkpoints every 2 steps), shared by the tests below."""
    out = tmp_path_factory.mktemp("dspark_run") / "whole"
    return fit.run(_cfg(tiny_train_data, out, eval_every=2)), out


def _check_run(out, summary, kind, steps, evaluated=None):
    rows = fit.read_log(os.path.join(out, "log.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(np.isfinite(r["loss"]) for r in rows)
    # Validation terms at every eval_every-th step and the last one, beside the training terms.
    assert [r["step"] for r in rows if "val_loss" in r] == (evaluated or [steps])
    for r in rows:
        if "val_loss" in r:
            assert np.isfinite(r["val_loss"]) and {k for k in r if k.startswith("val_")} == \
                {f"val_{k}" for k in r if k not in ("grad_norm", "lr", "step", "seconds", "tokens")
                 and not k.startswith("val_")}
            v = np.asarray(r["val_accept_top1_per_pos"])
            assert v.shape == (3,) and ((0 <= v) & (v <= 1)).all()
    assert rows[-1]["loss"] < rows[0]["loss"]  # a few steps at a high rate on a tiny set
    per_pos = np.asarray(rows[-1]["accept_top1_per_pos"])
    assert per_pos.shape == (3,) and ((0 <= per_pos) & (per_pos <= 1)).all()
    if kind == "dspark":
        assert {"ce", "tv", "bce", "accept_tv_per_pos"} <= set(rows[-1])
    assert os.path.isfile(os.path.join(out, "curves.png"))
    params = _exported(summary["drafter"])
    assert "['draft_vocab']" in params and params["['draft_vocab']"].dtype == np.int32


def test_dspark_trains_and_exports(dspark_run):
    summary, out = dspark_run
    _check_run(out, summary, "dspark", 4, evaluated=[2, 4])


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_other_drafters_train_and_export(tiny_train_data, tmp_path, kind):
    out = tmp_path / kind
    _check_run(out, fit.run(_cfg(tiny_train_data, out, drafter=kind, save_every=100)), kind, 4)


def test_interrupted_run_resumes_to_the_same_parameters(tiny_train_data, tmp_path, dspark_run, monkeypatch):
    from train import data as data_lib

    whole, whole_out = dspark_run
    # The first half validates at every step, the whole run every other one: evaluating must
    # not change training, and the same step's validation terms must be the same numbers.
    cfg = _cfg(tiny_train_data, tmp_path / "split", stop_after=2, eval_every=1)
    first = fit.run(cfg)
    assert first["step"] == 2 and "drafter" not in first
    # A run killed after logging step 3 but before its next checkpoint: the resumed run logs
    # step 3 again, and the log keeps one row per step.
    with open(tmp_path / "split" / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n")
    # The data changed under the checkpoint (a rebuilt draft vocabulary): refused, not resumed.
    real = data_lib.load_draft_vocab
    monkeypatch.setattr(data_lib, "load_draft_vocab", lambda *a: real(*a)[::-1].copy())
    with pytest.raises(SystemExit, match="data changed"):
        fit.run(_cfg(tiny_train_data, tmp_path / "split", eval_every=2))
    monkeypatch.setattr(data_lib, "load_draft_vocab", real)
    second = fit.run(_cfg(tiny_train_data, tmp_path / "split", eval_every=2))
    assert second["step"] == 4
    a, b = _exported(whole["drafter"]), _exported(second["drafter"])
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # The logged losses of the resumed steps equal the uninterrupted run's.
    la = fit.read_log(os.path.join(whole_out, "log.jsonl"))
    lb = fit.read_log(os.path.join(tmp_path / "split", "log.jsonl"))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    assert [r["step"] for r in lb if "val_loss" in r] == [1, 2, 4]
    assert [r["val_loss"] for r in la if "val_loss" in r] == [r["val_loss"] for r in lb if r["step"] in (2, 4)]
    # Other settings into the same run folder are refused.
    with pytest.raises(SystemExit, match="other settings"):
        fit.run(_cfg(tiny_train_data, tmp_path / "split", lr=1e-3, steps=6))


SHARDED = """
import sys
from train import fit
data, root = sys.argv[1:3]
for mesh in ("data=1", "data=2,fsdp=2"):
    fit.run(fit.FitConfig(drafter="dspark", data=data, out=f"{root}/{mesh}", feature_layers=(0, 1),
                          draft_vocab_size=64, num_layers=1, head_rank=8, block_size=3, seq_len=128, batch_size=4,
                          anchors=4, steps=5, warmup_steps=1, save_every=100, log_every=1, export_dtype="float32",
                          lr=3e-3, mesh=mesh))
"""


def test_four_way_sharded_training_matches_one_device(tiny_train_data, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               JAX_DEFAULT_MATMUL_PRECISION="highest", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SHARDED, tiny_train_data, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {mesh: [r["loss"] for r in fit.read_log(os.path.join(tmp_path, mesh, "log.jsonl"))]
              for mesh in ("data=1", "data=2,fsdp=2")}
    assert len(losses["data=1"]) == 5
    np.testing.assert_allclose(losses["data=2,fsdp=2"], losses["data=1"], rtol=2e-4)


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("from train.fit import FitConfig\nconfig = FitConfig(drafter='dflash', steps=7)\n")
    cfg = fit.load_config(["--config", str(path), "--steps", "9", "--mesh", "data=1,fsdp=1"])
    assert (cfg.drafter, cfg.steps, cfg.mesh) == ("dflash", 9, "data=1,fsdp=1")
    with pytest.raises(SystemExit, match="no such config"):
        fit.load_config(["--config", str(tmp_path / "missing.py")])
    with pytest.raises(SystemExit, match="--mesh"):
        fit.parse_mesh("data=two")
    with pytest.raises(SystemExit, match="drafter"):
        fit.check_config(fit.FitConfig(drafter="medusa"))


def test_fit_then_calibrate_then_evaluate(tiny_train_data, tmp_path, monkeypatch, dspark_run):
    """The tail of the tiny end-to-end run (data and features are the tiny_train_data fixture)."""
    import shutil

    from dspark_jax import Engine, drafters, load_target
    from dspark_jax.drafters import load_drafter

    summary = dict(dspark_run[0])
    summary["drafter"] = str(tmp_path / "dspark" / "drafter")
    shutil.copytree(dspark_run[0]["drafter"], summary["drafter"])  # calibrate writes into the checkpoint
    report = calibrate.run(calibrate.CalibrateConfig(drafter=summary["drafter"], data=tiny_train_data, max_prompts=4,
                                                     max_new_tokens=12, slots=4))
    temps = report["temperatures"]
    assert len(temps) == 3 and all(t > 0 for t in temps) and report["rounds"] > 0
    assert len(report["before"]) == len(report["after"]) == len(report["ece_floor_after"]) == 3
    assert os.path.isfile(os.path.join(summary["drafter"], "reliability.png"))
    with open(os.path.join(summary["drafter"], "calibration.md")) as f:
        assert "ECE floor" in f.read()
    # In waves (a full batch at a time over one row bucket, for accelerators) the same rounds are
    # verified with the same outcomes.
    shutil.copytree(dspark_run[0]["drafter"], tmp_path / "waves")
    waves = calibrate.run(calibrate.CalibrateConfig(drafter=str(tmp_path / "waves"), data=tiny_train_data,
                                                    max_prompts=4, max_new_tokens=12, slots=4, waves=True))
    assert waves["rounds"] == report["rounds"]
    assert [m["rate"] for m in waves["before"]] == [m["rate"] for m in report["before"]]
    # The collected rounds are saved: a refit from them (here temperatures only) runs no verification.
    refit = calibrate.run(calibrate.CalibrateConfig(
        drafter=str(tmp_path / "waves"), data=tiny_train_data, shift=False,
        rounds=os.path.join(summary["drafter"], calibrate.ROUNDS_FILE)))
    assert refit["rounds"] == report["rounds"] and refit["shifts"] == [0.0] * 3
    assert [m["ece"] for m in refit["before"]] == pytest.approx([m["ece"] for m in report["before"]])
    with pytest.raises(SystemExit, match="no such file"):
        calibrate.run(calibrate.CalibrateConfig(drafter=str(tmp_path / "waves"), data=tiny_train_data,
                                                rounds=str(tmp_path / "missing.npz")))
    # The temperatures ship with the checkpoint, and an Engine made from it applies them.
    with open(os.path.join(tiny_train_data, "meta.json")) as f:
        target = load_target(json.load(f)["generation"]["model"])
    drafter = load_drafter(summary["drafter"], target)
    assert drafter.calibration["temperatures"] == temps
    settings = Engine(target, drafter, slots=1, max_len=128).settings
    assert settings.confidence_temperatures == tuple(temps)
    assert settings.confidence_shifts == tuple(drafter.calibration["shifts"]) and len(settings.confidence_shifts) == 3
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
                                                   speed_datasets=("sharegpt",), speed_policies=("fixed",),
                                                   speed_new_tokens=8, speed_prompts=2, repeats=1,
                                                   out=str(tmp_path / "eval")))
    (row,) = results["acceptance"]
    assert row["drafter"] == "dspark" and 1.0 <= row["tau"] <= 4.0 and len(row["acceptance_per_position"]) == 3
    assert row["tau_ci95"][0] <= row["tau"] <= row["tau_ci95"][1]
    (speed,) = results["speed"]
    assert speed["plain_tok_s"] > 0 and speed["spec_tok_s"] > 0 and speed["policy"] == "fixed"
    assert speed["prompts"] == 2 and 1.0 <= speed["tau"] <= 4.0  # both prompts timed alone at batch 1
    assert "| dspark | sharegpt | 0 | 3 |" in (tmp_path / "eval" / "results.md").read_text()
    assert np.isfinite(speed["speedup"])


def test_config_file_through_the_command(tmp_path):
    """`python -m train.fit --config FILE` accepts a config made with train.fit.FitConfig (the
    command runs the module as __main__, a different copy of the class)."""
    path = tmp_path / "c.py"
    path.write_text("from train.fit import FitConfig\nconfig = FitConfig(drafter='dflash')\n")
    proc = subprocess.run([sys.executable, "-m", "train.fit", "--config", str(path), "--steps", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode != 0 and "--steps must be >= 1" in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_block_targets_past_the_end_stay_in_range():
    """A block that runs past a (cropped) sequence's end is unsupervised there, and its teacher
    positions stay inside the sequence (a gather past the end would be NaN)."""
    import jax.numpy as jnp

    from train.fit import block_targets

    tokens = jnp.arange(10, dtype=jnp.int32)[None, :]
    mask = jnp.ones((1, 10), bool)
    targets, supervised, src = block_targets(tokens, mask, jnp.asarray([[7]], jnp.int32), jnp.ones((1, 1), bool), 4)
    assert supervised.tolist() == [[[True, True, False, False]]]
    assert targets[0, 0, :2].tolist() == [8, 9]
    assert src.tolist() == [[[7, 8, 9, 9]]]


def test_cached_teacher_normaliser_is_the_logsumexp_of_the_lm_head(tiny_train_data):
    """Each shard's *.lse.npy is logsumexp over all V of the target's LM-head logits at the cached
    (bf16) final hidden state, in numpy float64: what lets the DSpark step build the teacher over
    the draft ids only."""
    import ml_dtypes

    from train import data as data_lib
    from train import features as features_lib

    target = data_lib.data_target(tiny_train_data, None)
    head = np.asarray(target.params.get("lm_head", target.params["embed"]), np.float64)  # [V, e]
    shard = data_lib.shard_paths(tiny_train_data, "train")[0]
    bits = np.load(features_lib.feature_path(tiny_train_data, (0, 1), "train", shard))
    lse = np.load(features_lib.lse_path(tiny_train_data, (0, 1), "train", shard))
    assert lse.shape == (bits.shape[0],) and lse.dtype == np.float32
    hidden = bits[:, -1].view(ml_dtypes.bfloat16).astype(np.float64)  # [tokens, e]
    logits = hidden @ head.T
    top = logits.max(-1)
    want = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)


def test_cached_features_equal_each_rows_own_forward(tiny_train_data):
    """Rows batched at a padded length give the features of an unpadded forward of the row alone
    (padding sits after the row, where causal attention keeps it out); short rows pad to multiples of 64."""
    import jax.numpy as jnp
    import ml_dtypes

    from dspark_jax.models.transformer import forward
    from train import data as data_lib
    from train import features as features_lib

    assert [features_lib.length_bucket(n) for n in (1, 64, 65, 300, 448)] == [64, 64, 128, 320, 448]
    target = data_lib.data_target(tiny_train_data, None)
    shard = data_lib.shard_paths(tiny_train_data, "train")[0]
    bits = np.load(features_lib.feature_path(tiny_train_data, (0, 1), "train", shard))
    start = 0
    for row in data_lib.read_shard(shard):
        toks = jnp.asarray(row["tokens"], jnp.int32)[None, :]
        hidden, _, feats = forward(target.params, target.config, toks, jnp.arange(toks.shape[1])[None, :], None, (0, 1))
        want = np.concatenate([np.asarray(feats[0]), np.asarray(hidden[0])[:, None, :]], axis=1)  # [n, m+1, e]
        got = bits[start:start + toks.shape[1]].view(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # bf16 storage
        start += toks.shape[1]
    assert start == bits.shape[0]


def test_fixed_row_batches_give_the_same_features_and_train_shards_limits_the_pass(tiny_train_data, tmp_path):
    """--fixed-rows (every batch padded to its bucket's full row count: one compile per length)
    stores the same bits as power-of-two batches; --train-shards K computes the first K train
    shards only, and K < 1 is refused by name."""
    import shutil

    from train import data as data_lib
    from train import features as features_lib

    target = data_lib.data_target(tiny_train_data, None)
    rows = data_lib.read_shard(data_lib.shard_paths(tiny_train_data, "train")[0])
    plain = features_lib.shard_features(target, rows, (0, 1), batch_tokens=1024)
    fixed = features_lib.shard_features(target, rows, (0, 1), batch_tokens=1024, fixed_rows=True)
    np.testing.assert_array_equal(fixed, plain)

    copy = str(tmp_path / "data")
    shutil.copytree(tiny_train_data, copy, ignore=shutil.ignore_patterns("features"))
    features_lib.run(features_lib.FeaturesConfig(data=copy, layers=(0, 1), splits=("train",), train_shards=1))
    done = [os.path.isfile(features_lib.feature_path(copy, (0, 1), "train", p))
            for p in data_lib.shard_paths(copy, "train")]
    assert done[0] and not any(done[1:])
    # --first-shard S --train-shards 1: shard S alone (the shards a fine-tune reads).
    features_lib.run(features_lib.FeaturesConfig(data=copy, layers=(0, 1), splits=("train",), first_shard=1,
                                                 train_shards=1))
    done = [os.path.isfile(features_lib.feature_path(copy, (0, 1), "train", p))
            for p in data_lib.shard_paths(copy, "train")]
    assert done[:2] == [True, True] and not any(done[2:])
    with pytest.raises(SystemExit, match="train-shards"):
        features_lib.run(features_lib.FeaturesConfig(data=copy, layers=(0, 1), train_shards=0))

    # --parts: processes split the shards still to do between them, and together they write
    # what one process writes (here: everything after the first train shard).
    for part in (1, 0):
        features_lib.run(features_lib.FeaturesConfig(data=copy, layers=(0, 1), parts=2, part=part))
        if part == 1:
            assert not all(features_lib.shard_done(copy, (0, 1), s, p) for s in ("train", "validation")
                           for p in data_lib.shard_paths(copy, s))
    for split in ("train", "validation"):
        for p in data_lib.shard_paths(copy, split):
            np.testing.assert_array_equal(np.load(features_lib.feature_path(copy, (0, 1), split, p)),
                                          np.load(features_lib.feature_path(tiny_train_data, (0, 1), split, p)))
    with pytest.raises(SystemExit, match="--part"):
        features_lib.run(features_lib.FeaturesConfig(data=copy, layers=(0, 1), parts=2, part=2))

    # A shard rewritten with other rows (train.data redoes a partial last shard when a folder is
    # extended) has stale features: not done, and the next pass makes them again.
    shard = data_lib.shard_paths(copy, "train")[-1]
    kept = data_lib.read_shard(shard)[:-1]
    data_lib.write_shard(shard, [r["tokens"] for r in kept], [r["prompt_len"] for r in kept],
                         [r["conversation_id"] for r in kept], [r["finish_reason"] for r in kept])
    assert not features_lib.shard_done(copy, (0, 1), "train", shard)
    features_lib.run(features_lib.FeaturesConfig(data=copy, layers=(0, 1), splits=("train",)))
    assert features_lib.shard_done(copy, (0, 1), "train", shard)
    np.testing.assert_array_equal(np.load(features_lib.feature_path(copy, (0, 1), "train", shard)),
                                  features_lib.shard_features(target, kept, (0, 1), batch_tokens=1024))


def test_train_shards_limits_the_rows_and_names_the_run(tiny_train_data):
    """--train-shards K reads the split's first K shards only (their rows, in order), and a run
    with it is a different run from one over all shards (resume key)."""
    from train import data as data_lib
    from train.loader import SequenceData

    shards = data_lib.shard_paths(tiny_train_data, "train")
    assert len(shards) >= 2
    first = SequenceData(tiny_train_data, (0, 1), "train", 64, max_shards=1)
    whole = SequenceData(tiny_train_data, (0, 1), "train", 64)
    assert len(first) == len(data_lib.read_shard(shards[0])) < len(whole)
    for a, b in zip(first.rows, whole.rows):
        np.testing.assert_array_equal(a[0], b[0])
    for bad in (0, len(shards) + 1):
        with pytest.raises(ValueError, match="max_shards"):
            SequenceData(tiny_train_data, (0, 1), "train", 64, max_shards=bad)
    rest = SequenceData(tiny_train_data, (0, 1), "train", 64, first_shard=1)
    assert len(rest) == len(whole) - len(first)
    for a, b in zip(rest.rows, whole.rows[len(first):]):
        np.testing.assert_array_equal(a[0], b[0])
    with pytest.raises(ValueError, match="first_shard"):
        SequenceData(tiny_train_data, (0, 1), "train", 64, first_shard=len(shards))
    base = _cfg(tiny_train_data, "unused")
    assert fit._config_key(base) != fit._config_key(dataclasses.replace(base, train_shards=1))
    assert "train_shards" not in fit._config_key(base)  # runs saved before the field still resume


def test_extra_data_joins_the_train_rows_and_names_the_run(tiny_train_data):
    """--extra-data F appends F's train rows after --data's (mixing other layers or crops is
    refused), and is part of the resume key only when given."""
    from train.loader import SequenceData

    rows = SequenceData(tiny_train_data, (0, 1), "train", 64)
    first = SequenceData(tiny_train_data, (0, 1), "train", 64, max_shards=1)
    n = len(rows)
    rows.add(first)
    assert len(rows) == n + len(first)
    np.testing.assert_array_equal(rows.rows[n][0], first.rows[0][0])
    with pytest.raises(ValueError, match="layers"):
        rows.add(SequenceData(tiny_train_data, (0, 1), "train", 32))
    base = _cfg(tiny_train_data, "unused")
    assert "extra_data" not in fit._config_key(base)
    assert fit._config_key(dataclasses.replace(base, extra_data=("other",)))["extra_data"] == ["other"]


def test_extra_data_with_another_split_is_refused(tiny_train_data, tmp_path):
    """An extra folder split with another val_fraction would train on --data's validation
    conversations: refused by name before training."""
    import shutil

    copy = tmp_path / "extra"
    shutil.copytree(tiny_train_data, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["generation"]["val_fraction"] = 0.05
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="val_fraction"):
        fit.run(_cfg(tiny_train_data, tmp_path / "run", extra_data=(str(copy),)))


def test_fine_tune_trains_only_the_named_groups_from_a_drafter(tiny_train_data, tmp_path, dspark_run):
    """--init-from D --train-only confidence: starts from D's params (its config and vocabulary,
    whatever the data's), changes the confidence head alone, and exports without D's calibration
    (the temperatures were fitted to the old head). Unknown groups and a kind mismatch are refused
    by name."""
    from dspark_jax.drafters import load_drafter

    summary, _ = dspark_run
    start = _exported(summary["drafter"])
    # A config that disagrees with the init drafter everywhere the init decides.
    cfg = _cfg(tiny_train_data, tmp_path / "tune", init_from=summary["drafter"], train_only=("confidence",),
               first_shard=1, head_rank=4, draft_vocab_size=32, eval_every=2)
    tuned = fit.run(cfg)
    with open(tmp_path / "tune" / "init_validation.json") as f:
        init_val = json.load(f)
    rows = fit.read_log(os.path.join(tmp_path / "tune", "log.jsonl"))
    # Frozen backbone: the validation drafts, hence their agreement, are the start's.
    assert rows[-1]["val_accept_top1_per_pos"] == pytest.approx(init_val["val_accept_top1_per_pos"], abs=1e-6)
    assert rows[-1]["val_bce"] != init_val["val_bce"]
    after = _exported(tuned["drafter"])
    assert after.keys() == start.keys()
    changed = {k for k in start if not np.array_equal(start[k], after[k])}
    assert changed and all(k.startswith("['confidence']") for k in changed)
    assert load_drafter(tuned["drafter"]).calibration is None
    assert rows[-1]["bce"] < rows[0]["bce"]
    assert fit._config_key(cfg) != fit._config_key(dataclasses.replace(cfg, train_only=()))

    with pytest.raises(SystemExit, match="--train-only heads: not a trainable parameter group"):
        fit.run(dataclasses.replace(cfg, out=str(tmp_path / "bad"), train_only=("heads",)))
    with pytest.raises(SystemExit, match="is a dspark drafter, not dflash"):
        fit.run(dataclasses.replace(cfg, out=str(tmp_path / "bad2"), drafter="dflash"))


def test_a_larger_num_layers_grows_the_init_drafters_backbone(tiny_train_data, tmp_path, dspark_run):
    """--init-from D --num-layers 2 (D has 1): training starts from D's drafts exactly (its
    validation equals D's own last one), the export has 2 layers, and both layers train.
    Shrinking is refused by name."""
    from dspark_jax.drafters import load_drafter

    summary, out = dspark_run
    start = _exported(summary["drafter"])
    cfg = _cfg(tiny_train_data, tmp_path / "grow", init_from=summary["drafter"], num_layers=2, eval_every=2)
    grown = fit.run(cfg)
    with open(tmp_path / "grow" / "init_validation.json") as f:
        init_val = json.load(f)
    last = [r for r in fit.read_log(os.path.join(out, "log.jsonl")) if "val_loss" in r][-1]
    assert init_val["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    assert init_val["val_accept_top1_per_pos"] == pytest.approx(last["val_accept_top1_per_pos"], abs=1e-6)
    assert load_drafter(grown["drafter"]).config.num_layers == 2
    after = _exported(grown["drafter"])
    for name in ("wo", "w_down"):
        key = f"['layers']['{name}']"
        assert after[key].shape[0] == 2 and np.abs(after[key][1]).max() > 0, name  # the new layer moved off zero
        assert not np.array_equal(after[key][:1], start[key]), name  # the old one trained too

    with pytest.raises(SystemExit, match="cannot grow a 2-layer drafter to 1 layers"):
        fit.run(dataclasses.replace(cfg, out=str(tmp_path / "shrink"), init_from=grown["drafter"], num_layers=1))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_the_step_trains_on_the_drafters_own_layers_out_of_a_wider_cache(tiny_train_data, kind):
    """A drafter that reads a subset of the cached layers (EAGLE-3's 1, 14, 27 out of the cache's
    1, 8, 14, 20, 27) trains on exactly those: the loader's batch holds the target's features of
    them, the step's loss depends on each, and EAGLE-3's loss equals the one computed from the
    target's own forward. Until 2026-12-07 the step picked the layers a second time out of the
    loader's already-picked ones and JAX clamped the index past the end: every EAGLE-3 drafter
    trained on layers (1, 27, 27) while the engine drafted from (1, 14, 27)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.drafters import drafter_module, eagle3
    from dspark_jax.models.transformer import forward
    from train import data as data_lib
    from train import features as features_lib
    from train.loader import SequenceData

    cached = (0, 1, 2)  # all three layers of the tiny target; the drafter reads the last two
    features_lib.run(features_lib.FeaturesConfig(data=tiny_train_data, layers=cached, splits=("validation",)))
    target = data_lib.data_target(tiny_train_data, None)
    tcfg = target.config
    cfg = _cfg(tiny_train_data, "unused", drafter=kind, feature_layers=cached, target_layer_ids=(1, 2))
    dcfg = fit.drafter_config(cfg, tcfg)
    data = SequenceData(tiny_train_data, cached, "validation", cfg.seq_len)
    batch = {k: jnp.asarray(v) for k, v in vars(data.batch(np.arange(len(data)), dcfg.target_layer_ids)).items()}

    own = np.zeros(batch["features"].shape, np.float32)  # [b, T, 2, e]: each row's own forward
    for r, (toks, _, _, _) in enumerate(data.rows):
        n = min(len(toks), cfg.seq_len)
        _, _, feats = forward(target.params, tcfg, jnp.asarray(toks[None, :n]), jnp.arange(n)[None], None, (1, 2))
        own[r, :n] = np.asarray(feats[0])
    np.testing.assert_allclose(np.asarray(batch["features"], np.float32), own, rtol=2e-2, atol=2e-2)  # bf16 cache

    params = {**drafter_module(kind).init_params(jax.random.PRNGKey(0), tcfg, dcfg),
              "draft_vocab": jnp.asarray(data_lib.load_draft_vocab(tiny_train_data, 64), jnp.int32)}
    loss_fn = jax.jit(fit.make_loss_fn(kind, tcfg, dcfg, cfg))
    key = jax.random.PRNGKey(3)
    loss = float(loss_fn(params, {}, target.params, batch, key)[0])
    assert loss > 0
    for layer in range(2):  # each layer the drafter reads moves its loss
        blanked = {**batch, "features": batch["features"].at[:, :, layer].set(0.0)}
        assert abs(float(loss_fn(params, {}, target.params, blanked, key)[0]) - loss) > 1e-5, layer
    if kind == "eagle3":
        mask = batch["mask"]
        rows, row_valid = fit.sample_anchors(key, jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1),
                                             cfg.anchors)
        logits = eagle3.train_draft_logits(params, target.params, tcfg, dcfg, batch["tokens"], jnp.asarray(own),
                                           cfg.eagle_steps, rows)
        want = eagle3.eagle3_loss(logits, batch["tokens"], mask, draft_vocab=params["draft_vocab"],
                                  vocab_size=tcfg.vocab_size, rows=rows, row_valid=row_valid)
        np.testing.assert_allclose(loss, float(want), rtol=2e-3)


def test_tau_interval_over_prompts_covers_the_population_tau():
    """Each prompt has its own acceptance rate, so its rounds are correlated; the interval
    resamples whole prompts and covers the population's tau in about 95 % of draws of 40 prompts
    (0.90 here: the percentile bootstrap of a ratio over 40 clusters runs a little short), while
    the same interval over rounds, as if they were independent, covers about half the time."""
    rng = np.random.default_rng(0)
    G = 7

    def draw(prompts):  # per prompt, the tokens each whole-block round committed
        rate = rng.beta(1.5, 2.5, size=prompts)
        rounds = rng.integers(3, 30, size=prompts)
        return [1 + np.minimum(rng.geometric(1 - p, size=n) - 1, G) for p, n in zip(rate, rounds)]

    big = draw(200_000)
    truth = sum(x.sum() for x in big) / sum(len(x) for x in big)
    by_prompt, by_round = [], []
    for trial in range(300):
        per = draw(40)
        c, r = np.array([x.sum() for x in per], float), np.array([len(x) for x in per], float)
        lo, hi = evaluate.prompt_bootstrap_interval(c, r, seed=trial, resamples=1000)
        assert lo <= c.sum() / r.sum() <= hi
        by_prompt.append(lo <= truth <= hi)
        each = np.concatenate(per).astype(float)
        lo, hi = evaluate.prompt_bootstrap_interval(each, np.ones_like(each), seed=trial, resamples=1000)
        by_round.append(lo <= truth <= hi)
    assert 0.85 <= np.mean(by_prompt) <= 0.99 and np.mean(by_round) <= 0.7, (np.mean(by_prompt), np.mean(by_round))
    assert np.isnan(evaluate.prompt_bootstrap_interval(np.zeros(3), np.zeros(3))).all()  # no whole-block rounds
