"""Training cost per token on this machine: the teacher computed online against read from the
feature cache, and the drafters' training steps, measured side by side in one run.

    .venv/bin/python benchmarks/bench_train.py [--data data/smollm2-135m] [--sequences 16]
        [--batch-size 8] [--seq-len 512] [--repeats 3]

1. online teacher: the frozen target's forward over real training sequences, producing the
   feature layers and the final hidden state (what a step would compute under stop_gradient);
2. cached teacher: reading the same arrays for a batch from a bf16 .npy file (memory-mapped),
   as train/loader.py does;
3. one optimizer step of each drafter (the configs in train/configs) on that batch, with its
   operation count (XLA's cost analysis of the compiled step) and the rate it reached, beside
   4. a plain float32 matmul of the drafter LM head's shape: the rate this machine's matmuls reach,
   so a step near it can only get faster by doing less work.
Every figure is tokens per second of training sequence; ratios are within this one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/smollm2-135m")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 14, 20, 27])
    parser.add_argument("--json", default=None, help="also write the figures here (seconds per step per drafter)")
    args = parser.parse_args()

    import jax
    import numpy as np

    from dspark_jax import load_target
    from dspark_jax.profiling import best_seconds
    from train import data as data_lib
    from train import features as features_lib
    from train import fit

    target = load_target("smollm2-135m")
    rows = data_lib.read_split(args.data, "train")[:args.sequences]
    tokens = sum(len(r["tokens"]) for r in rows)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {len(rows)} sequences, {tokens} tokens", flush=True)

    # 1. online: the target forward that produces features + final hidden.
    feats = None

    def online():
        nonlocal feats
        feats = features_lib.shard_features(target, rows, args.layers, batch_tokens=4096)

    online_s = best_seconds(online, repeats=args.repeats)

    # 2. cached: a batch read back from a memory-mapped bf16 file.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f.npy")
        np.save(path, feats)
        offsets = np.concatenate([[0], np.cumsum([len(r["tokens"]) for r in rows])])
        T = args.seq_len

        def cached():
            bits = np.load(path, mmap_mode="r")
            out = np.zeros((len(rows), T) + bits.shape[1:], np.uint16)
            for i in range(len(rows)):
                n = min(offsets[i + 1] - offsets[i], T)
                out[i, :n] = bits[offsets[i]:offsets[i] + n]
            return features_lib.from_bf16_bits(out)

        cached_s = best_seconds(cached, repeats=args.repeats)

    # 3. drafter steps (single device) on a batch of the configs' shape.
    steps = {}
    for kind in fit.KINDS:
        cfg_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train", "configs",
                                f"{kind}.py")
        cfg = fit.load_config(["--config", cfg_path, "--data", args.data, "--batch-size", str(args.batch_size),
                               "--seq-len", str(args.seq_len)])
        steps[kind] = fit.time_step(cfg, target, rows, feats, args.repeats)
    step_tokens = args.batch_size * args.seq_len

    # 4. the matmul roofline of this machine: [b * A * G, e] @ [e, N], the draft LM head's shape
    # (`cfg` is the last config read above; the three share these fields).
    import jax.numpy as jnp

    e, n = target.config.hidden_size, cfg.draft_vocab_size or target.config.vocab_size
    x = jnp.ones((args.batch_size * cfg.anchors * cfg.block_size, e), jnp.float32)
    w = jnp.ones((e, n), jnp.float32)
    matmul = jax.jit(jnp.dot)
    matmul_s = best_seconds(matmul, x, w, repeats=args.repeats)
    matmul_rate = 2 * x.shape[0] * e * w.shape[1] / matmul_s / 1e9

    print("\n| what | seconds | tokens/s | GFLOP | GFLOP/s |\n|---|--:|--:|--:|--:|")
    print(f"| online teacher: target forward, {tokens} tokens | {online_s:.4f} | {tokens / online_s:.0f} | | |")
    print(f"| cached teacher: read the same from a bf16 file | {cached_s:.3f} | {tokens / cached_s:.0f} | | |")
    for kind, (s, flops) in steps.items():
        rate = f"{flops / s / 1e9:.0f}" if flops else "n/a"
        print(f"| {kind} training step, {step_tokens} tokens | {s:.4f} | {step_tokens / s:.0f} | {flops / 1e9:.0f} "
              f"| {rate} |")
    print(f"| f32 matmul [{x.shape[0]}, {e}] @ [{e}, {w.shape[1]}] | {matmul_s:.4f} | | | {matmul_rate:.0f} |")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "step_tokens": step_tokens,
                       "online_teacher_seconds": online_s, "teacher_tokens": tokens, "cached_read_seconds": cached_s,
                       "step_seconds": {k: s for k, (s, _) in steps.items()},
                       "step_flops": {k: f for k, (_, f) in steps.items()}, "matmul_gflops": matmul_rate}, f, indent=1)
    print(f"\nonline teacher / cached read: {online_s / cached_s:.0f}x per token; online teacher per token against "
          f"the dspark step per token: {(online_s / tokens) / (steps['dspark'][0] / step_tokens):.2f}x")
    print("command: .venv/bin/python benchmarks/bench_train.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
