"""train/fit.py on a tiny target: every drafter kind trains, resume is exact, sharding is transparent."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from train import fit

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


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_each_drafter_trains_and_exports(tiny_train_data, tmp_path, kind):
    out = tmp_path / kind
    summary = fit.run(_cfg(tiny_train_data, out, drafter=kind, steps=6, save_every=100))
    rows = fit.read_log(os.path.join(out, "log.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # a few steps at a high rate on a tiny set
    per_pos = np.asarray(rows[-1]["accept_top1_per_pos"])
    assert per_pos.shape == (3,) and ((0 <= per_pos) & (per_pos <= 1)).all()
    if kind == "dspark":
        assert {"ce", "tv", "bce", "accept_tv_per_pos"} <= set(rows[-1])
    assert os.path.isfile(os.path.join(out, "curves.png"))
    params = _exported(summary["drafter"])
    assert "['draft_vocab']" in params and params["['draft_vocab']"].dtype == np.int32


def test_interrupted_run_resumes_to_the_same_parameters(tiny_train_data, tmp_path):
    whole = fit.run(_cfg(tiny_train_data, tmp_path / "whole"))
    cfg = _cfg(tiny_train_data, tmp_path / "split", stop_after=2)
    first = fit.run(cfg)
    assert first["step"] == 2 and "drafter" not in first
    second = fit.run(_cfg(tiny_train_data, tmp_path / "split"))
    assert second["step"] == 4
    a, b = _exported(whole["drafter"]), _exported(second["drafter"])
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # The logged losses of the resumed steps equal the uninterrupted run's.
    la = fit.read_log(os.path.join(tmp_path / "whole", "log.jsonl"))
    lb = fit.read_log(os.path.join(tmp_path / "split", "log.jsonl"))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    # Other settings into the same run folder are refused.
    with pytest.raises(SystemExit, match="other settings"):
        fit.run(_cfg(tiny_train_data, tmp_path / "split", lr=1e-3, steps=6))


SHARDED = """
import json, sys
from train import fit
data, out, mesh = sys.argv[1:4]
cfg = fit.FitConfig(drafter="dspark", data=data, out=out, feature_layers=(0, 1), draft_vocab_size=64, num_layers=1,
                    head_rank=8, block_size=3, seq_len=128, batch_size=4, anchors=4, steps=5, warmup_steps=1,
                    save_every=100, log_every=1, export_dtype="float32", lr=3e-3, mesh=mesh)
fit.run(cfg)
"""


def test_four_way_sharded_training_matches_one_device(tiny_train_data, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               JAX_DEFAULT_MATMUL_PRECISION="highest", PYTHONPATH=REPO)
    losses = {}
    for mesh in ("data=1", "data=2,fsdp=2"):
        out = str(tmp_path / mesh.replace(",", "_").replace("=", ""))
        proc = subprocess.run([sys.executable, "-c", SHARDED, tiny_train_data, out, mesh], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[mesh] = [r["loss"] for r in fit.read_log(os.path.join(out, "log.jsonl"))]
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
