"""Target features for drafter training, computed once per data shard and cached on disk.

    python -m train.features --data data/smollm2-135m --layers 1 8 14 20 27

For every token of every sequence: the outputs of the chosen target layers (what DFlash / DSpark
and EAGLE-3 read) and the target's final normed hidden state (the teacher: its LM-head logits
are the target's next-token distribution), as bfloat16, `[tokens, m + 1, e]` per shard.

Why cached rather than computed in the training step: the frozen target's forward is about
2 x 135M FLOPs per token, several times a drafter step's cost per token here, and a cached
feature is read once per epoch for a few kilobytes; the teacher's distribution is recomputed
in the step from the cached hidden state by the LM head, so TV sees the exact full-vocabulary
distribution (the mass outside the draft vocabulary included) without storing [T, V] arrays.
`benchmarks/bench_train.py` measures both costs per token.

Beside each feature file, `*.lse.npy` holds the teacher's log-normaliser per token
(logsumexp of the LM-head logits of that cached hidden state, float32). With it the step needs
the teacher's logits over the N draft ids only: p_k = exp(logit - lse) over them and the mass
outside them is 1 - their sum, exactly, at N/V of the LM-head cost (for smollm2-135m, 8192 of
49152 columns: the full-vocabulary teacher head was about as costly as the drafter's own
forward and backward).

Resumable like train.data: a shard whose feature (and log-normaliser) file exists is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Sequence

import numpy as np

from train import data as data_lib


@dataclasses.dataclass
class FeaturesConfig:
    data: str = "data/smollm2-135m"
    """A folder made by train.data."""
    layers: tuple[int, ...] = (1, 8, 14, 20, 27)
    """Target layer ids to store (the union of what the drafters read; -1 = embedding output)."""
    model: str | None = None
    """Default: the model the data was generated with (meta.json)."""
    batch_tokens: int = 4096
    """Tokens per forward (rows of one length bucket are batched up to this)."""
    fixed_rows: bool = False
    """Pad every batch of a length bucket to the bucket's full row count: one compile per length
    instead of one per (length, power-of-two rows). For accelerators, where a compile costs far
    more than the padded rows (on an H200 the power-of-two shapes compiled for minutes)."""
    splits: tuple[str, ...] = ("train", "validation")
    """Splits to compute (training reads only train; calibration and evaluation need none)."""
    train_shards: int | None = None
    """Only K shards of the train split, from --first-shard on (what `train.fit --train-shards K` reads)."""
    first_shard: int = 0
    """Skip the train split's shards before this one (what `train.fit --first-shard` reads: a
    fine-tune on conversations the first run never saw)."""
    parts: int = 1
    """Split the shards still to do among this many processes (run one per --part); each writes
    whole shards, so parts never collide. On an accelerator the pass is host-bound (saving and
    the per-chunk log-normalisers), so several processes on one device finish it sooner."""
    part: int = 0
    """Which of the --parts this process computes (0 .. parts - 1): the to-do shards part, part +
    parts, part + 2 parts, ..."""


def features_dir(data: str, layers: Sequence[int]) -> str:
    return os.path.join(data, "features", "L" + "_".join(str(l) for l in layers))


def feature_path(data: str, layers: Sequence[int], split: str, shard: str) -> str:
    return os.path.join(features_dir(data, layers), split, os.path.basename(shard).replace(".npz", ".npy"))


def lse_path(data: str, layers: Sequence[int], split: str, shard: str) -> str:
    """The teacher log-normaliser file beside a shard's feature file."""
    return feature_path(data, layers, split, shard).replace(".npy", ".lse.npy")


def shard_tokens(shard: str) -> int:
    """Tokens in a train.data shard (its feature files have one row each)."""
    with np.load(shard) as z:
        return int(z["offsets"][-1])


def _rows(path: str) -> int:
    return np.load(path, mmap_mode="r").shape[0] if os.path.isfile(path) else -1


def shard_done(data: str, layers: Sequence[int], split: str, shard: str) -> bool:
    """Whether a shard's features and teacher logsumexp are both on disk, one row per token of
    the shard as it is now (train.data redoes a partial last shard when a folder is extended:
    the old files are stale then)."""
    n = shard_tokens(shard)
    return _rows(feature_path(data, layers, split, shard)) == n and _rows(lse_path(data, layers, split, shard)) == n


def to_bf16_bits(x) -> np.ndarray:
    """A float array as bfloat16 bit patterns (uint16): numpy's .npy has no bfloat16 type."""
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(bits).view(ml_dtypes.bfloat16)


def length_bucket(n: int) -> int:
    """The padded length a row of n tokens is computed at: multiples of 64 up to 512, then
    eighths of the enclosing power of two (prompts.bucket)."""
    from dspark_jax.prompts import bucket

    return bucket(n, minimum=64)


def shard_features(target, rows: list[dict], layers: Sequence[int], batch_tokens: int,
                   fixed_rows: bool = False) -> np.ndarray:
    """[sum of row lengths, m + 1, e] bf16 bits: the layers' outputs and the final hidden state of
    every token, rows in order. Rows are batched by length bucket (padding goes at the end, where
    causal attention keeps it from the real tokens)."""
    from dspark_jax.engine import pow2

    params, run = target.params, _feature_program(target.config, tuple(layers))
    out: list = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["tokens"]))
    start = 0
    while start < len(order):
        length = length_bucket(len(rows[order[start]]["tokens"]))
        # A power of two, so only the last group of a length is padded to one (the forward
        # compiles per power-of-two row count): 12 rows padded to 16 wasted a quarter.
        count = 1 << max(0, (max(1, batch_tokens // length)).bit_length() - 1)
        group = [i for i in order[start:start + count] if len(rows[i]["tokens"]) <= length]
        start += len(group)
        tokens = np.zeros((count if fixed_rows else pow2(len(group)), length), np.int32)  # rows bucketed
        for j, i in enumerate(group):
            tokens[j, :len(rows[i]["tokens"])] = rows[i]["tokens"]
        feats = np.asarray(run(params, tokens)).view(np.uint16)
        for j, i in enumerate(group):
            out[i] = feats[j, :len(rows[i]["tokens"])]
    return np.concatenate(out, axis=0)


@functools.cache
def _feature_program(cfg, layers: tuple[int, ...]):
    """One jitted forward per (model, layers) for every shard: a function made per call compiled
    every padded shape again for every shard."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.models.transformer import forward

    @jax.jit
    def run(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _, feats = forward(params, cfg, tokens, positions, None, layers)
        return jnp.concatenate([feats, hidden[:, :, None, :]], axis=2).astype(jnp.bfloat16)  # [b, T, m+1, e]

    return run


@functools.cache
def _chunk_lse():
    """One jitted program for every shard (a function made per call would compile per call)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.models.transformer import logits_from_hidden

    @jax.jit
    def lse(params, bits):
        hidden = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)  # [chunk, e]
        return jax.nn.logsumexp(logits_from_hidden(params, hidden), axis=-1)  # [chunk]

    return lse


def teacher_lse(target, feature_bits: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """[tokens] float32: logsumexp of the target's LM-head logits at each token's cached final
    hidden state (the last of the m + 1 stored vectors, in its stored bf16 precision, as the
    training step reads it)."""
    lse = _chunk_lse()
    n = feature_bits.shape[0]
    out = np.empty((n,), np.float32)
    for start in range(0, n, chunk):
        bits = np.zeros((chunk, feature_bits.shape[-1]), np.uint16)  # one shape: the tail is padded
        part = np.asarray(feature_bits[start:start + chunk, -1])
        bits[:len(part)] = part
        out[start:start + len(part)] = np.asarray(lse(target.params, bits))[:len(part)]
    return out


def _save(path: str, array: np.ndarray) -> None:
    """Written under a temporary name, then renamed: a killed run never leaves a partial file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.save(path + ".tmp.npy", array)
    os.replace(path + ".tmp.npy", path)


def run(cfg: FeaturesConfig) -> dict:
    from tqdm import tqdm

    target = data_lib.data_target(cfg.data, cfg.model)
    bad = [l for l in cfg.layers if not -1 <= l < target.config.num_layers]
    if bad or list(cfg.layers) != sorted(set(cfg.layers)):
        raise SystemExit(f"--layers must be increasing ids in [-1, {target.config.num_layers}), got {cfg.layers}")
    if cfg.train_shards is not None and cfg.train_shards < 1:
        raise SystemExit(f"--train-shards must be at least 1, got {cfg.train_shards}")
    if cfg.first_shard < 0:
        raise SystemExit(f"--first-shard must be at least 0, got {cfg.first_shard}")
    if cfg.parts < 1 or not 0 <= cfg.part < cfg.parts:
        raise SystemExit(f"--part must be in [0, --parts) with --parts >= 1, got part {cfg.part} of {cfg.parts}")

    def shards(split: str) -> list[str]:
        paths = data_lib.shard_paths(cfg.data, split)
        if split != "train":
            return paths
        if cfg.first_shard >= len(paths):
            raise SystemExit(f"--first-shard {cfg.first_shard}: {cfg.data}/train has {len(paths)} shards")
        return paths[cfg.first_shard:][:cfg.train_shards]

    # Parts split the whole list, then skip what is done: splitting what was left when each part
    # started gave parts started at different times overlapping lists, and some shards to none.
    todo = [(split, shard) for split, shard in [(split, shard) for split in cfg.splits
                                                for shard in shards(split)][cfg.part::cfg.parts]
            if not shard_done(cfg.data, cfg.layers, split, shard)]
    import time

    start, tokens = time.perf_counter(), 0
    for split, shard in tqdm(todo, desc="target features", unit="shard"):
        path = feature_path(cfg.data, cfg.layers, split, shard)
        if _rows(path) == shard_tokens(shard):  # made by a run stopped before its log-normalisers
            feats = np.load(path, mmap_mode="r")
        else:
            feats = shard_features(target, data_lib.read_shard(shard), cfg.layers, cfg.batch_tokens, cfg.fixed_rows)
            _save(path, feats)
        _save(lse_path(cfg.data, cfg.layers, split, shard), teacher_lse(target, feats))
        tokens += feats.shape[0]
    seconds = time.perf_counter() - start
    summary = {"layers": list(cfg.layers), "shards_done": len(todo), "tokens": tokens, "seconds": seconds,
               "tokens_per_second": tokens / seconds if seconds > 0 and tokens else None}
    name = "features.json" if cfg.parts == 1 else f"features-part{cfg.part}of{cfg.parts}.json"
    os.makedirs(features_dir(cfg.data, cfg.layers), exist_ok=True)
    with open(os.path.join(features_dir(cfg.data, cfg.layers), name), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    import tyro

    from dspark_jax import xla_cache

    cfg = tyro.cli(FeaturesConfig, args=argv)
    xla_cache.enable()
    print(json.dumps(run(cfg), indent=2))


if __name__ == "__main__":
    main()
