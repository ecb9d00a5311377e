"""Typed drafter configuration and the interface every drafter implements.

Every drafter kind is a module with these pure functions (dcfg / tcfg static, everything else
pytrees); the engine's step (`dspark_jax.decode`) only calls these:

    init_params(key, tcfg, dcfg) -> params
        Trainable drafter params. The target's embedding and LM head are NOT copied in: they are
        read from `target_params` (shared and frozen).
    init_state(params, tcfg, dcfg, batch, cache_len) -> state
        Empty inference state (context cache sized `cache_len` slots; slot s = position s).
    extend(params, target_params, tcfg, dcfg, state, tokens, features, positions, valid) -> state
        Append newly committed tokens to the drafter's context: tokens [b, t] int32 at absolute
        positions [b, t], their target features [b, t, m, e] (layers dcfg.target_layer_ids,
        None for drafters that read no features), valid [b, t] bool (only valid entries are
        written; invalid ones must leave the state unchanged).
    draft(params, target_params, tcfg, dcfg, state, anchor, anchor_pos, keys, sampling, kv_len=None)
        -> (DraftOutput, state)
        Propose dcfg.block_size tokens after the anchor [b] int32 sitting at position
        anchor_pos [b] (the anchor itself is committed but not yet in the context: its
        features do not exist yet). Only context slots < anchor_pos may influence the draft.
        `sampling` is a dspark_jax.sampling.RowSampling (per-row settings, data) and `keys`
        [b, 2] the rows' keys for this round (position k folds in k): a greedy row drafts the
        argmax with a one-hot q_k; a sampled row samples token k from its filtered draft
        distribution q_k (sample_with_probs of the corrected logits), returned in
        DraftOutput.probs (over DraftOutput.support when the drafter has a reduced vocabulary).
        `kv_len` (static, optional) is a bound the caller guarantees on every anchor_pos: a
        drafter may read only context slots below it, as the target's attention does, so a short
        context does not pay for the whole cache.
    A drafter module may also set DRAFTS_AT_DEPTH = True: its draft then takes `depth` (static,
    1..G) and drafts exactly the first `depth` tokens of the whole block's draft, leaves the state
    unchanged, and sets `proposed` to the depth (the engine drafts shallow where little can be
    verified; decode.draft_round).
"""

from __future__ import annotations

import dataclasses
import json

import jax

from dspark_jax.drafters.vocab import spread_over_vocab

DRAFTER_KINDS = ("dspark", "dflash", "eagle3", "ngram")
HEAD_TYPES = ("none", "markov", "gated", "rnn")


class DrafterConfigError(ValueError):
    """A drafter configuration that cannot work, with the reason."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftOutput:
    tokens: jax.Array  # [b, G] int32 drafted tokens d_1..d_G
    # [b, G, N] float32 draft distributions q_1..q_G over the ids in `support` (one-hot of tokens
    # when greedy); every id outside the support has probability 0.
    probs: jax.Array
    confidence_logits: jax.Array  # [b, G] float32 raw confidence logits z_k (zeros without a head)
    # [b] int32 drafted tokens the drafter actually proposes (a prompt-lookup match can run out);
    # None means all G. It may depend only on the context, never on sampled draft tokens.
    proposed: jax.Array | None = None
    # [N] int32 target ids of probs' last axis (a reduced draft vocabulary); None: all V ids in
    # order. Kept sparse so a round whose rows are all greedy (which reads only the tokens) never
    # writes [b, G, V]: at 16 rows on the default model that spread cost 3.1 ms of a 14 ms draft.
    support: jax.Array | None = None

    def full_probs(self, vocab_size: int) -> jax.Array:
        """probs spread over the whole target vocabulary -> [b, G, V]."""
        if self.support is None:
            return self.probs
        return spread_over_vocab(self.support, vocab_size, self.probs, 0.0)

    def first(self, n: int) -> "DraftOutput":
        """The first n drafted positions (verification at a narrower width reads no more)."""
        return dataclasses.replace(self, tokens=self.tokens[:, :n], probs=self.probs[:, :n],
                                   confidence_logits=self.confidence_logits[:, :n])


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static drafter settings. Hashable, stored as JSON beside the checkpoint."""

    kind: str = "dspark"  # one of DRAFTER_KINDS
    block_size: int = 7  # gamma: drafted tokens per round
    num_layers: int = 2  # drafter transformer layers (DFlash backbone; EAGLE-3 always uses 1)
    target_layer_ids: tuple[int, ...] = ()  # target layers whose outputs the drafter reads
    head_type: str = "markov"  # sequential head: none | markov | gated | rnn
    head_rank: int = 256  # r; 0 means no sequential head (plain DFlash)
    confidence_head: bool = True
    draft_vocab_size: int | None = None  # reduced draft vocabulary (top-N target ids) or None
    mask_token_id: int | None = None  # None: a learned MASK embedding
    ngram_max: int = 4  # prompt-lookup drafter: longest n-gram to match
    ngram_min: int = 2  # single-token matches propose too much noise

    def __post_init__(self):
        if self.kind not in DRAFTER_KINDS:
            raise DrafterConfigError(f"unknown drafter kind {self.kind!r}; supported: {', '.join(DRAFTER_KINDS)}")
        if self.head_type not in HEAD_TYPES:
            raise DrafterConfigError(f"unknown head type {self.head_type!r}; supported: {', '.join(HEAD_TYPES)}")
        if self.block_size < 1:
            raise DrafterConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_layers < 1:
            raise DrafterConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.head_type != "none" and self.head_rank < 1:
            raise DrafterConfigError(f"head_type {self.head_type!r} needs head_rank >= 1")
        ids = list(self.target_layer_ids)
        if ids != sorted(set(ids)):
            raise DrafterConfigError(f"target_layer_ids must be strictly increasing, got {self.target_layer_ids}")

    @property
    def has_head(self) -> bool:
        return self.head_type != "none" and self.head_rank > 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DrafterConfig":
        raw = json.loads(text)
        raw["target_layer_ids"] = tuple(raw.get("target_layer_ids", ()))
        return cls(**raw)


def default_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers spread evenly from layer 1 to L-3 (DeepSpec's choice), deduplicated."""
    lo, hi = min(1, num_target_layers - 1), max(0, num_target_layers - 3)
    if count == 1 or hi <= lo:
        return (hi,)
    ids = [round(lo + (hi - lo) * i / (count - 1)) for i in range(count)]
    return tuple(sorted(set(ids)))


def default_config(kind: str, num_target_layers: int, **overrides) -> DrafterConfig:
    """The standard configuration of each kind for a target with `num_target_layers` layers."""
    if kind == "dspark":
        base = dict(kind=kind, block_size=7, num_layers=2, head_type="markov", head_rank=256, confidence_head=True,
                    target_layer_ids=default_layer_ids(num_target_layers, 5))
    elif kind == "dflash":
        base = dict(kind=kind, block_size=7, num_layers=5, head_type="none", head_rank=0, confidence_head=False,
                    target_layer_ids=default_layer_ids(num_target_layers, 5))
    elif kind == "eagle3":
        base = dict(kind=kind, block_size=7, num_layers=1, head_type="none", head_rank=0, confidence_head=False,
                    target_layer_ids=default_layer_ids(num_target_layers, 3))
    elif kind == "ngram":
        base = dict(kind=kind, block_size=7, num_layers=1, head_type="none", head_rank=0, confidence_head=False)
    else:
        raise DrafterConfigError(f"unknown drafter kind {kind!r}; supported: {', '.join(DRAFTER_KINDS)}")
    base.update(overrides)
    return DrafterConfig(**base)
