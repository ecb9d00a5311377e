"""Per-request sampling settings and the filtered distributions they define.

Settings are data, not program constants: every row of a batch carries its own temperature,
top-k, top-p and random key (`RowSampling`, arrays on the device), so requests with different
settings share one compiled program and a new value never recompiles. A row with temperature 0
is greedy: its distribution is the one-hot of the argmax, which makes greedy decoding an exact
special case of lossless verification.

Speculative verification must preserve exactly the distribution plain sampling draws from, so
both get their probabilities from `filtered_probs` here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np



def argmax_last(x: jax.Array) -> jax.Array:
    """argmax over the last axis (first index of the maximum) -> int32.

    Written as max + masked min-index: two plain reductions, which XLA on CPU vectorises, instead
    of one variadic (value, index) reduction, which it does not (about 2x faster at [64, 49152]).
    NaN rows give the last index.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: sampling filters, its random seed, its token budget."""

    temperature: float = 0.0  # 0 means greedy; values in (0, MIN_TEMPERATURE) sample at MIN_TEMPERATURE
    top_k: int | None = None  # keep the k most likely tokens (None: all)
    top_p: float | None = None  # keep the smallest prefix of mass >= top_p (None: all)
    seed: int = 0  # the request's random stream depends only on this and the token position
    max_new_tokens: int = 128
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)

    def __post_init__(self):
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not is_integer(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and (not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not is_integer(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        # numpy scalars in, Python numbers out; a top_k past int32 keeps every token, as any k >= V does
        normal = dict(temperature=float(self.temperature), max_new_tokens=int(self.max_new_tokens), seed=int(self.seed),
                      top_k=None if self.top_k is None else min(int(self.top_k), 2**31 - 1),
                      top_p=None if self.top_p is None else float(self.top_p))
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def is_integer(x) -> bool:
    """A Python or numpy integer that is not a bool (what counts, budgets and seeds accept)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return is_integer(x) or isinstance(x, (float, np.floating))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """Sampling settings of every row, as device arrays (data of the compiled program)."""

    temperature: jax.Array  # [b] float32, 0 = greedy row
    top_k: jax.Array  # [b] int32, 0 = no top-k filter
    top_p: jax.Array  # [b] float32, 1 = no top-p filter

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> "RowSampling":
        """Host-side arrays for a list of requests (numpy, so building them needs no device work)."""
        return cls(temperature=np.asarray([p.temperature for p in params], np.float32),
                   top_k=np.asarray([p.top_k or 0 for p in params], np.int32),
                   top_p=np.asarray([1.0 if p.top_p is None else p.top_p for p in params], np.float32))

    @classmethod
    def uniform(cls, batch: int, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None) -> "RowSampling":
        """Every row with the same settings."""
        return cls.from_params([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * batch)


def row_keys(base_keys: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
    """Per-row keys [b, 2] for one use at one position: a function of the row's own seed key
    [b, 2], the position [b] and a purpose id only, so a row's random stream never depends on
    the other rows of the batch."""
    fold = lambda key, pos: jax.random.fold_in(jax.random.fold_in(key, pos), purpose)  # noqa: E731
    return jax.vmap(fold)(base_keys, positions.astype(jnp.uint32))


# The smallest temperature a row samples at: a smaller one (1e-40 passes validation) overflowed
# logits / T to inf in float32 and made the distribution NaN. At 1e-6 it is already one-hot unless
# the two best logits are within about 1e-4 of each other.
MIN_TEMPERATURE = 1e-6


def _filter_rows(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p exclusions (-inf) per row on temperature-scaled logits [b, V].

    One descending sort serves both filters: the top-k cut-off is the k-th sorted value, and
    masking values below it keeps the sorted order, so top-p reads the same sorted array. Ties
    with a cut-off value are kept.
    """
    v = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # [b, V] descending
    use_k = (top_k > 0) & (top_k < v)
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)  # [b, 1]
    kth = jnp.where(use_k[:, None], kth, -jnp.inf)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass before it
    # is below top_p. Its logit is the cut-off.
    keep = mass_before < top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where((top_p < 1.0)[:, None], cutoff, -jnp.inf)
    return jnp.where((scaled < kth) | (scaled < cutoff), -jnp.inf, scaled)


def filtered_logits(logits: jax.Array, rs: RowSampling) -> jax.Array:
    """Temperature-scaled float32 logits [b, V] with each row's top-k / top-p exclusions at -inf
    (greedy rows are scaled by 1: callers treat them as one-hot). The sort behind the filters
    runs only when some row asks for a filter."""
    temperature = jnp.where(rs.temperature > 0, jnp.maximum(rs.temperature, MIN_TEMPERATURE), 1.0)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    wants = jnp.any((rs.top_k > 0) | (rs.top_p < 1.0))
    return jax.lax.cond(wants, _filter_rows, lambda x, k, p: x, scaled, rs.top_k, rs.top_p)


def filtered_probs(logits: jax.Array, rs: RowSampling) -> jax.Array:
    """The distribution each row samples from [b, V] float32: softmax of `filtered_logits`, or
    the one-hot of the argmax for a greedy row."""
    probs = jax.nn.softmax(filtered_logits(logits, rs), axis=-1)
    onehot = jax.nn.one_hot(argmax_last(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((rs.temperature > 0)[:, None], probs, onehot)


def all_greedy(rs: RowSampling) -> jax.Array:
    """True when every row is greedy: programs then skip softmax, sort and sampling."""
    return jnp.all(rs.temperature <= 0)


def sample_tokens(logits: jax.Array, keys: jax.Array, rs: RowSampling) -> jax.Array:
    """One token per row from logits [b, V] with per-row keys [b, 2] -> [b] int32."""

    def sampled(logits):
        drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, rs)).astype(jnp.int32)
        return jnp.where(rs.temperature > 0, drawn, argmax_last(logits))

    return jax.lax.cond(all_greedy(rs), argmax_last, sampled, logits)


def sample_with_probs(logits: jax.Array, keys: jax.Array, rs: RowSampling) -> tuple[jax.Array, jax.Array]:
    """(token [b] int32, its distribution [b, V] float32) per row: what a drafter proposes and
    what verification reads as q (one-hot for greedy rows)."""

    def greedy(logits):
        token = argmax_last(logits)
        return token, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32)

    def sampled(logits):
        drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, rs)).astype(jnp.int32)
        return jnp.where(rs.temperature > 0, drawn, argmax_last(logits)), filtered_probs(logits, rs)

    return jax.lax.cond(all_greedy(rs), greedy, sampled, logits)
