"""Training batches from train.data shards and their train.features files (host side).

The batch of step s is a pure function of (seed, s): epoch e = s * B // n uses the permutation
seeded by (seed, e), so a resumed run sees exactly the batches an uninterrupted one would, and
the data position a checkpoint needs is just the step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from train import data as data_lib
from train import features as features_lib


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [B, T] int32, padding 0
    mask: np.ndarray  # [B, T] bool: supervised (assistant) tokens
    features: np.ndarray  # [B, T, m, e] bfloat16: the stored target layers
    hidden: np.ndarray  # [B, T, e] bfloat16: the target's final normed hidden state (teacher)
    teacher_lse: np.ndarray  # [B, T] float32: logsumexp of the teacher's logits at that state


class SequenceData:
    """One split's sequences with their cached features, cropped to `seq_len` tokens."""

    def __init__(self, data_dir: str, layers: Sequence[int], split: str, seq_len: int, max_shards: int | None = None,
                 first_shard: int = 0):
        """`max_shards`: only that many of the split's shards, from `first_shard` on (data-scaling
        runs, fine-tunes on unseen shards; their features are all that must exist)."""
        self.seq_len = seq_len
        self.layers = tuple(layers)
        # (tokens, prompt_len, feature bits [T, m+1, e], teacher log-normaliser [T])
        self.rows: list[tuple[np.ndarray, int, np.ndarray, np.ndarray]] = []
        shards = data_lib.shard_paths(data_dir, split)
        if not shards:
            raise FileNotFoundError(f"{data_dir}/{split}: no data shards (python -m train.data --out {data_dir})")
        if not 0 <= first_shard < len(shards):
            raise ValueError(f"first_shard must be in [0, {len(shards)}) ({data_dir}/{split} has {len(shards)} "
                             f"shards), got {first_shard}")
        shards = shards[first_shard:]
        if max_shards is not None:
            if not 1 <= max_shards <= len(shards):
                raise ValueError(f"max_shards must be in [1, {len(shards)}] ({data_dir}/{split} has "
                                 f"{len(shards)} shards from shard {first_shard}), got {max_shards}")
            shards = shards[:max_shards]
        for shard in shards:
            path = features_lib.feature_path(data_dir, layers, split, shard)
            try:
                feats = np.load(path, mmap_mode="r")
                lse = np.load(features_lib.lse_path(data_dir, layers, split, shard), mmap_mode="r")
            except FileNotFoundError as err:
                raise FileNotFoundError(
                    f"{err.filename}: no cached features for these layers (python -m train.features --data {data_dir} "
                    f"--layers {' '.join(map(str, layers))})") from None
            start = 0
            for row in data_lib.read_shard(shard):
                n = len(row["tokens"])
                self.rows.append((row["tokens"], row["prompt_len"], feats[start:start + n], lse[start:start + n]))
                start += n
            if start != feats.shape[0] or start != lse.shape[0]:
                raise ValueError(f"{path}: {feats.shape[0]} feature rows and {lse.shape[0]} log-normalisers for "
                                 f"{start} tokens (stale cache?)")
        self.width = self.rows[0][2].shape[-1]

    def add(self, other: "SequenceData") -> None:
        """Append another folder's rows (train.fit --extra-data): same layers, width and crop."""
        if (other.layers, other.width, other.seq_len) != (self.layers, self.width, self.seq_len):
            raise ValueError(f"cannot mix rows of layers {other.layers}, width {other.width}, seq_len {other.seq_len} "
                             f"into rows of layers {self.layers}, width {self.width}, seq_len {self.seq_len}")
        self.rows.extend(other.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def supervised_tokens(self) -> int:
        return sum(max(0, min(len(t), self.seq_len) - p) for t, p, _, _ in self.rows)

    def indices(self, seed: int, step: int, batch_size: int) -> np.ndarray:
        """Row indices of step `step`'s batch (epochs of seeded permutations, concatenated)."""
        n = len(self.rows)
        slots = np.arange(step * batch_size, (step + 1) * batch_size)
        epochs, offsets = np.divmod(slots, n)
        orders = {int(e): np.random.default_rng([seed, int(e)]).permutation(n) for e in np.unique(epochs)}
        return np.asarray([orders[int(e)][o] for e, o in zip(epochs, offsets)])

    def batch(self, indices: Sequence[int], layer_ids: Sequence[int]) -> Batch:
        """The rows `indices`, padded to seq_len, with the stored layers `layer_ids` (a subset)."""
        T, m = self.seq_len, len(layer_ids)
        pick = [self.layers.index(l) for l in layer_ids]
        tokens = np.zeros((len(indices), T), np.int32)
        mask = np.zeros((len(indices), T), bool)
        feats = np.zeros((len(indices), T, m, self.width), np.uint16)
        hidden = np.zeros((len(indices), T, self.width), np.uint16)
        teacher_lse = np.zeros((len(indices), T), np.float32)
        for r, i in enumerate(indices):
            toks, prompt_len, bits, lse = self.rows[int(i)]
            n = min(len(toks), T)
            tokens[r, :n] = toks[:n]
            mask[r, prompt_len:n] = True
            feats[r, :n] = bits[:n, pick]
            hidden[r, :n] = bits[:n, -1]
            teacher_lse[r, :n] = lse[:n]
        return Batch(tokens=tokens, mask=mask, features=features_lib.from_bf16_bits(feats),
                     hidden=features_lib.from_bf16_bits(hidden), teacher_lse=teacher_lse)
