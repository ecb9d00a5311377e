"""Decoding over slots on the device: batched prefill into slots, and draft / verify / commit
rounds for every live slot (DESIGN.md sections 6.1 and 8.2).

Every function here is pure, (params, state, ...) -> state; `dspark_jax.engine.Engine` compiles
them ahead and donates the state. A round, per slot r at its own position P_r (all slots at once):

  draft   the drafter proposes d_1..d_G after the anchor a (the last sampled token, not yet fed
          to the target), or only d_1..d_D where no row may verify more (draft_round); without a
          drafter G = 0 and a round is one plain decoding step;
  length  l_r in [0, G] tokens go to verification, chosen on the device by the engine's policy
          (dspark_jax.schedule: DSpark's load-aware prefix scheduler, its lagged variant, a
          threshold, or the whole block) from the calibrated confidences, cut by the budget;
  verify  one target forward over [a, d_1..d_l] at positions P..P+l (at the smallest compiled
          width that holds every row's l + 1) writes KV and gives p_1..p_{l+1} and the features of
          those positions; verification accepts n_r <= l_r and gives the next token t_r;
  commit  a, d_1..d_n are committed (cache length += n+1; stale KV past it is masked by position),
          the drafter's context gets their features, t becomes the next anchor; the emitted tokens
          d_1..d_n, t are cut at the first EOS (unless the slot ignores EOS) and at the budget.

Sampling settings, budgets and seeds are per-slot data. Each slot's random numbers come from its
own seed key and the position (sampling.row_keys), so its output never depends on other slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import schedule as sched
from dspark_jax.calibration import confidence_probs
from dspark_jax.drafters.config import DraftOutput, DrafterConfig
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.transformer import KVCache, forward, forward_chunk, init_cache, logits_from_hidden
from dspark_jax.sampling import RowSampling, all_greedy, filtered_probs, row_keys, sample_tokens
from dspark_jax.verify import verify_block, verify_greedy

# Finish reasons as stored on the device (StepOutput turns them into strings).
NOT_FINISHED, FINISHED_EOS, FINISHED_LENGTH = 0, 1, 2
# Purposes folded into a slot's key with the position, so no two uses share random numbers.
KEY_FIRST_TOKEN, KEY_DRAFT, KEY_VERIFY = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """Decode state of every slot of an engine; every field lives on the device.

    A free slot is `done` and not `occupied`; a finished request stays occupied (and done) until
    it is freed, so its last tokens can be reported.
    """

    cache: KVCache  # target KV cache; lengths [slots] = tokens fed to the target (the anchor excluded)
    drafter: Any  # the drafter's inference state for every slot (None without a drafter)
    anchor: jax.Array  # [slots] int32 last sampled token, not yet fed to the target
    occupied: jax.Array  # [slots] bool, holds a request (inserted, not yet freed)
    done: jax.Array  # [slots] bool, decodes no more (finished, or free)
    finish_reason: jax.Array  # [slots] int32 NOT_FINISHED / FINISHED_EOS / FINISHED_LENGTH
    unreported: jax.Array  # [slots] bool, the anchor is the request's first token, not yet returned
    emitted: jax.Array  # [slots] int32 tokens generated so far (the first one included)
    budget: jax.Array  # [slots] int32 max new tokens
    ignore_eos: jax.Array  # [slots] bool
    sampling: RowSampling  # per-slot temperature / top-k / top-p
    seed_key: jax.Array  # [slots, 2] uint32, jax.random.PRNGKey(seed) of the slot's request
    drafted: jax.Array  # [slots] int32 draft tokens sent to verification for this request
    accepted: jax.Array  # [slots] int32 ... of which the target accepted
    forwards: jax.Array  # [] int32 target forward passes of the engine (prefills count one each)
    row_rounds: jax.Array  # [] int32 sum over rounds of live slots
    committed: jax.Array  # [] int32 sum of n+1 over live slot-rounds (bonus included)
    tried: jax.Array  # [G] int32 live slot-rounds that verified position k having accepted 0..k-1
    accepted_at: jax.Array  # [G] int32 ... of which position k was accepted
    # Calibrated confidences [slots, 2, G] of the last two rounds ([:, 0] the last one, [:, 1] the
    # one before): the "dspark-lagged" policy sizes its batch budget from [:, 1]. A new engine
    # starts from ones (no history: the budget is what the cost table alone allows).
    lagged_confidences: jax.Array
    # An exponential average [slots, G] of each slot's calibrated confidences over the rounds it
    # drafted (sched.gate_average): the dspark policies' drafting gate reads it, so one unlucky
    # round does not switch drafting off. A new request starts from the measured slots' mean
    # (sched.gate_prior; on a fresh engine DecodeSettings.gate_start).
    gate_confidences: jax.Array
    gate_rounds: jax.Array  # [slots] int32 drafted rounds in that average (0: the next one replaces it)
    probe_gap: jax.Array  # [] int32 rounds from the last drafted round to the next probe (sched.next_probe_gap)
    drafted_rounds: jax.Array  # [] int32 rounds the drafter ran (every DEPTH_PROBE_EVERY-th drafts deep)
    next_probe: jax.Array  # [] int32 the value of `forwards` from which the next round probes
    # Serving-time correction of the calibration (sched.online_ratio): decayed sums [G], over the
    # draft positions verification tested, of their calibrated confidence and of their accept
    # indicator. The policies that read confidences read them times their ratio (sched.corrected).
    online_predicted: jax.Array
    online_accepted: jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Static settings of an engine's compiled programs (shapes and kinds, never request values)."""

    config: ModelConfig
    dconfig: DrafterConfig | None  # None: plain decoding
    slots: int
    max_len: int  # KV-cache slots per row
    verifier: str = "jnp"  # "jnp" reference or "pallas" kernel
    # Cache slots a step's attention reads ([0, kv_len)); None = max_len. The Engine compiles a
    # step per span bucket and picks the smallest that holds every live row through the step.
    kv_len: int | None = None
    # STS temperatures and shifts of the drafter's confidence head (DESIGN 5; dspark_jax.calibration),
    # one per drafted position; None: uncalibrated (T = 1, b = 0). Fixed per drafter checkpoint, so static.
    confidence_temperatures: tuple[float, ...] | None = None
    confidence_shifts: tuple[float, ...] | None = None
    policy: str = "fixed"  # verification-length policy (dspark_jax.schedule.POLICIES)
    # A fresh engine's gate average [G] (schedule.gate_prior): the drafter's measured per-position
    # acceptance (engine.confidence_prior); None: ones (drafting looks free until measured).
    gate_start: tuple[float, ...] | None = None

    @property
    def block_size(self) -> int:
        return 0 if self.dconfig is None else self.dconfig.block_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return () if self.dconfig is None else self.dconfig.target_layer_ids


def drafter_module(s: DecodeSettings):
    from dspark_jax.drafters import drafter_module as module_of

    return None if s.dconfig is None else module_of(s.dconfig.kind)


def is_eos(tokens: jax.Array, config: ModelConfig, ignore: jax.Array) -> jax.Array:
    """tokens [b, ...] that end their row; `ignore` [b] rows never stop at EOS."""
    if not config.eos_token_ids:
        return jnp.zeros(tokens.shape, bool)
    eos = jnp.isin(tokens, jnp.asarray(config.eos_token_ids, jnp.int32))
    return eos & ~ignore.reshape(ignore.shape + (1,) * (tokens.ndim - 1))


def new_state(params: dict, dparams, s: DecodeSettings) -> SlotState:
    """Every slot free, buffers allocated."""
    n, g = s.slots, s.block_size
    mod = drafter_module(s)
    dstate = None if mod is None else mod.init_state(dparams, s.config, s.dconfig, n, s.max_len)
    zeros = jnp.zeros((n,), jnp.int32)
    return SlotState(
        cache=init_cache(s.config, n, s.max_len, params["embed"].dtype), drafter=dstate, anchor=zeros,
        occupied=jnp.zeros((n,), bool), done=jnp.ones((n,), bool), finish_reason=zeros,
        unreported=jnp.zeros((n,), bool), emitted=zeros, budget=zeros, ignore_eos=jnp.zeros((n,), bool),
        sampling=RowSampling(temperature=jnp.zeros((n,), jnp.float32), top_k=zeros,
                             top_p=jnp.ones((n,), jnp.float32)),
        seed_key=jnp.zeros((n, 2), jnp.uint32), drafted=zeros, accepted=zeros,
        forwards=jnp.zeros((), jnp.int32), row_rounds=jnp.zeros((), jnp.int32),
        committed=jnp.zeros((), jnp.int32), tried=jnp.zeros((g,), jnp.int32), accepted_at=jnp.zeros((g,), jnp.int32),
        lagged_confidences=jnp.ones((n, 2, g), jnp.float32),
        gate_confidences=jnp.broadcast_to(gate_start(s), (n, g)),
        gate_rounds=zeros,
        probe_gap=jnp.asarray(sched.PROBE_EVERY, jnp.int32), drafted_rounds=jnp.zeros((), jnp.int32),
        next_probe=jnp.asarray(sched.PROBE_EVERY, jnp.int32),
        online_predicted=jnp.zeros((g,), jnp.float32), online_accepted=jnp.zeros((g,), jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Requests:
    """A batch of requests to insert (host arrays; padding entries have slot = -1)."""

    tokens: jax.Array  # [n, p] int32 prompts, right-padded to the prefill bucket
    lengths: jax.Array  # [n] int32 prompt lengths (>= 1; padding entries copy a real one)
    slots: jax.Array  # [n] int32 target slot, -1 for padding entries
    budget: jax.Array  # [n] int32 max new tokens
    ignore_eos: jax.Array  # [n] bool
    sampling: RowSampling  # [n] each
    seed_key: jax.Array  # [n, 2] uint32


def batch_axes(make_state):
    """Per leaf of the pytree `make_state(batch)`, the axis that grows with the batch (None if
    none): found by comparing abstract states of 1 and 2 rows, so no layout is declared twice."""
    one, two = jax.eval_shape(lambda: make_state(1)), jax.eval_shape(lambda: make_state(2))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return diff[0] if diff else None

    return jax.tree.map(axis, one, two)


def take_rows(tree, axes, rows: jax.Array):
    """Rows `rows` [n] (clipped into range) of every batched leaf."""
    def take(leaf, axis):
        return leaf if axis is None else jnp.take(leaf, rows, axis=axis, mode="clip")
    return jax.tree.map(take, tree, axes)


def put_rows(tree, axes, rows: jax.Array, values):
    """Write `values` into rows `rows` [n] of every batched leaf; rows out of range are dropped."""
    def put(leaf, axis, value):
        if axis is None:
            return leaf
        index = (slice(None),) * axis + (rows,)
        return leaf.at[index].set(value.astype(leaf.dtype), mode="drop")
    return jax.tree.map(put, tree, axes, values)


def insert(params: dict, dparams, state: SlotState, req: Requests, *, s: DecodeSettings) -> SlotState:
    """Prefill a batch of requests into their slots and sample each one's first token.

    The prompts run through the target on their own (causal attention over the bucketed prompt,
    never over the engine's full max_len cache); their K/V are then written into the slots' rows.
    The first token becomes the slot's anchor and is reported by the next step.
    """
    n, p = req.tokens.shape
    cfg = s.config
    slots = jnp.where(req.slots >= 0, req.slots, s.slots)  # padding -> out of range -> dropped
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
    hidden, chunk, features = forward_chunk(params, cfg, req.tokens, positions, s.feature_layers)
    last = jnp.take_along_axis(hidden, (req.lengths - 1)[:, None, None], axis=1)[:, 0]  # [n, e]
    keys = row_keys(req.seed_key, req.lengths, KEY_FIRST_TOKEN)
    first = sample_tokens(logits_from_hidden(params, last), keys, req.sampling)  # [n]
    def into_slots(big, part):  # part [n, p, kv, d] -> the first p slots of rows `slots` of big
        return big.at[slots, :, :p].set(jnp.swapaxes(part, 1, 2).astype(big.dtype), mode="drop")

    cache = KVCache(k=tuple(map(into_slots, state.cache.k, chunk.k)), v=tuple(map(into_slots, state.cache.v, chunk.v)),
                    lengths=state.cache.lengths.at[slots].set(req.lengths, mode="drop"))

    dstate = state.drafter
    mod = drafter_module(s)
    if mod is not None:
        axes = batch_axes(lambda b: mod.init_state(dparams, cfg, s.dconfig, b, s.max_len))
        rows = take_rows(dstate, axes, slots)
        rows = mod.extend(dparams, params, cfg, s.dconfig, rows, req.tokens, features, positions,
                          positions < req.lengths[:, None])
        dstate = put_rows(dstate, axes, slots, rows)

    eos = is_eos(first, cfg, req.ignore_eos)
    full = req.budget <= 1
    set_ = lambda field, value: field.at[slots].set(value, mode="drop")  # noqa: E731
    sampling = jax.tree.map(set_, state.sampling, req.sampling)
    prior = sched.gate_prior(state.gate_confidences, state.gate_rounds, gate_start(s))  # [G]
    return dataclasses.replace(
        state, cache=cache, drafter=dstate, anchor=set_(state.anchor, first),
        occupied=set_(state.occupied, True), done=set_(state.done, eos | full),
        finish_reason=set_(state.finish_reason, jnp.where(eos, FINISHED_EOS,
                                                           jnp.where(full, FINISHED_LENGTH, NOT_FINISHED))),
        unreported=set_(state.unreported, True), emitted=set_(state.emitted, 1), budget=set_(state.budget, req.budget),
        ignore_eos=set_(state.ignore_eos, req.ignore_eos), sampling=sampling,
        seed_key=set_(state.seed_key, req.seed_key), drafted=set_(state.drafted, 0),
        accepted=set_(state.accepted, 0),
        gate_confidences=set_(state.gate_confidences, prior),
        gate_rounds=set_(state.gate_rounds, 0),
        # The lagged policy's history starts from the same prior: a reused slot held the zeros
        # its freed row was given, which stopped the new request's first two drafted rounds.
        lagged_confidences=set_(state.lagged_confidences,
                                jnp.broadcast_to(prior, (n,) + state.lagged_confidences.shape[1:])),
        forwards=state.forwards + 1)


def free(state: SlotState, slot: jax.Array) -> SlotState:
    """Slot `slot` becomes free: it stops decoding; its stale cache is masked by position."""
    return dataclasses.replace(
        state, occupied=state.occupied.at[slot].set(False), done=state.done.at[slot].set(True),
        finish_reason=state.finish_reason.at[slot].set(NOT_FINISHED), unreported=state.unreported.at[slot].set(False))


def length_caps(state: SlotState, block_size: int) -> jax.Array:
    """[slots] the most draft tokens each row may verify: the block, but never more than the row
    can still emit (finished rows verify nothing, so they never widen the verification forward)."""
    remaining = jnp.where(state.done, 0, state.budget - state.emitted)  # tokens the row may still emit
    return jnp.clip(remaining - 1, 0, block_size).astype(jnp.int32)


def round_caps(state: SlotState, s: DecodeSettings, rounds_left: jax.Array) -> jax.Array:
    """[slots] length_caps, also cut so the step's attention span (s.kv_len) holds this round's
    verified positions and one position for each of the step's `rounds_left` - 1 later rounds:
    the Engine may pick a span that plans for fewer drafts than G per round (Engine.span_for).
    A row whose whole remaining budget fits the span needs no cut: every position it can still
    write lies below length + remaining (its cache grows with what it emits), and cutting it
    for rounds it cannot run left the last rounds of a request in a tight span without drafts."""
    caps = length_caps(state, s.block_size)
    if s.kv_len is None:
        return caps
    room = s.kv_len - state.cache.lengths  # [slots]
    fits = room >= state.budget - state.emitted
    return jnp.where(fits, caps, jnp.clip(jnp.minimum(caps, room - rounds_left), 0, None)).astype(jnp.int32)


def verify_widths(block_size: int) -> tuple[int, ...]:
    """Compiled widths of the verification forward: powers of two below G+1, then G+1."""
    widths, w = [], 1
    while w < block_size + 1:
        widths.append(w)
        w *= 2
    return tuple(widths) + (block_size + 1,)


class Verified(NamedTuple):
    """What a round's verification returns."""

    num_accepted: jax.Array  # [b] int32
    next_token: jax.Array  # [b] int32
    cache: KVCache  # the block's K/V written at positions onwards (lengths unchanged)
    features: jax.Array | None  # [b, G+1, m, e], zero past the verified width


def verify(params, cache: KVCache, draft: DraftOutput, block, positions, lengths, keys, rs: RowSampling, *,
           s: DecodeSettings) -> Verified:
    """Target forward over the first w columns of block [b, G+1] and the verification rule on
    those columns, w the smallest compiled width >= max(lengths) + 1 (verify_widths).

    Everything that scales with the width (forward, LM head, the rule over [b, w, V]) runs at
    that width only, so a round that verifies little neither pays for nor writes G+1 columns of
    logits. Each width is a while loop that runs once or not at all, chosen on the device
    (run_once), and its forward writes the chunk's K/V into the cache first and attends to the
    updated buffer, as plain decoding does: XLA updates a loop-carried cache in place. (A
    lax.switch over the widths copied any cache its branches wrote, so its branches read the
    cache and attended to the chunk as a second softmax part; XLA:CPU then copied the cache's
    attention span in every layer: a round verifying one draft token cost 1.27x a plain round at
    4 rows, 1.14x written first, benchmarks/bench_round_cost.py.) Columns past a row's verified
    length land in slots past its committed length, which hold nothing that is read.
    """
    g1 = block.shape[1]
    widths = verify_widths(g1 - 1)

    def run(width, cache) -> Verified:
        hidden, cache, feats = forward(params, s.config, block[:, :width], positions[:, :width], cache,
                                       s.feature_layers, kv_len=s.kv_len)
        # Drafts past every row's l are never read.
        n_acc, next_token = verify_rule(draft.first(width - 1), logits_from_hidden(params, hidden), lengths, keys,
                                        rs, s=s)
        if feats is not None:
            feats = jnp.pad(feats, [(0, 0), (0, g1 - width), (0, 0), (0, 0)])
        return Verified(n_acc, next_token, cache, feats)

    if len(widths) == 1:  # one width (plain decoding): no choice to make
        return run(widths[0], cache)
    shape = jax.eval_shape(functools.partial(run, widths[-1]), cache)
    zeros = lambda x: None if x is None else jnp.zeros(x.shape, x.dtype)  # noqa: E731
    out = Verified(zeros(shape.num_accepted), zeros(shape.next_token), cache, zeros(shape.features))
    index = jnp.searchsorted(jnp.asarray(widths), jnp.max(lengths) + 1)
    for k, width in enumerate(widths):
        out = run_once(index == k, lambda v, width=width: run(width, v.cache), out)
    return out


def run_once(pred: jax.Array, fn, operand):
    """fn(operand) when pred (a [] bool), else operand (fn keeps its structure): a while loop of
    one trip or none, whose carried arrays (a cache) XLA updates in place, where a lax.cond
    copied them."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros((), bool), fn(c[1])), (pred, operand))[1]


def verify_rule(draft: DraftOutput, target_logits: jax.Array, lengths: jax.Array, keys: jax.Array,
                rs: RowSampling, *, s: DecodeSettings):
    """(num_accepted [b], next_token [b]): the greedy rule when every row is greedy, else
    lossless rejection sampling (jnp reference or Pallas kernel) on the filtered distributions,
    where a greedy row's one-hot distributions make the same rule exact greedy decoding."""
    b, g1, v = target_logits.shape  # g1: the verified width, at most G+1

    def greedy(logits):
        return verify_greedy(draft.tokens, logits, lengths)

    def sampled(logits):
        flat = RowSampling(*(jnp.repeat(x, g1) for x in (rs.temperature, rs.top_k, rs.top_p)))
        target_probs = filtered_probs(logits.reshape(b * g1, v), flat).reshape(b, g1, v)
        # Drawn for all G+1 positions whatever the width, so a row's draws do not depend on it
        # (nor on its neighbours, who set the width): the accept tests read positions < w - 1,
        # the correction / bonus sample always the last one.
        drawn = jax.vmap(lambda key: jax.random.uniform(key, (s.block_size + 1,), jnp.float32))(keys)
        uniforms = jnp.concatenate([drawn[:, :g1 - 1], drawn[:, -1:]], axis=1)  # [b, g1]
        draft_probs = draft.full_probs(v)  # [b, g1 - 1, V]: only this branch reads q
        if s.verifier == "pallas":
            import pallas_kernels

            return pallas_kernels.verify_block(draft.tokens, draft_probs, target_probs, lengths, uniforms)
        return verify_block(draft.tokens, draft_probs, target_probs, lengths, uniforms)

    return jax.lax.cond(all_greedy(rs), greedy, sampled, target_logits)


def no_draft(b: int, vocab: int) -> DraftOutput:
    """The empty draft of plain decoding (G = 0)."""
    return DraftOutput(tokens=jnp.zeros((b, 0), jnp.int32), probs=jnp.zeros((b, 0, vocab), jnp.float32),
                       confidence_logits=jnp.zeros((b, 0), jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundTrace:
    """Per round and row: raw confidence logits [b, G], the survival the policy read [b, G]
    (STS-calibrated; times the online correction under the policies that read it), verified
    lengths [b] and accepted lengths [b] (-1 for a row that was not live)."""

    confidence_logits: jax.Array
    survival: jax.Array
    lengths: jax.Array
    accepted: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundLoad:
    """Per round: the tokens verification needs (B = slots + verified drafts; the dense forward
    itself carries slots * (1 + the longest row's drafts)), and the policy's predicted tau (live
    rows + the survivals of the verified drafts) and throughput at the forward's real width
    (schedule.Schedule; 0 for rounds not run)."""

    tokens: jax.Array
    predicted_tau: jax.Array
    predicted_throughput: jax.Array


class ContextColumns(NamedTuple):
    """Committed columns whose drafter context upkeep (the drafter's `extend`) is still to do:
    tokens [b, n] int32, features [b, n, m, e] (None for a drafter that reads none), positions
    [b, n] int32, valid [b, n] bool. A step of plain rounds only gathers one column per round and
    extends the context once at its end (step): the drafter's context weights are then read
    once per step instead of once per round."""

    tokens: jax.Array
    features: jax.Array | None
    positions: jax.Array
    valid: jax.Array


def decode_round(params: dict, dparams, state: SlotState, sp: sched.ScheduleParams, rounds_left: jax.Array, *,
                 s: DecodeSettings, plain: bool, defer_context: bool = False):
    """One draft / verify / commit round for every live slot.

    Returns (state, emitted [b, G+1] int32, keep [b, G+1] bool, trace, load, deferred): row r
    emitted emitted[r, keep[r]] this round (keep is a prefix mask); trace (RoundTrace) and load
    (RoundLoad) describe the round for calibration, the scheduler's statistics and monitoring.
    rounds_left [] int32: this round and the step's later ones (round_caps). With `defer_context`
    (plain rounds only) the drafter's context is left as it was and `deferred` holds the round's
    ContextColumns for the caller to extend it with later; otherwise `deferred` is None.

    A plain round (always without a drafter; under policy "none" with one; under the dspark
    policies while their gate is closed, see `step`) sends the anchor alone through the
    write-first forward (no width switch, no draft) and gives the drafter's context that one
    column, so it costs what a round of plain decoding costs plus the context upkeep. Any other
    round drafts.
    """
    mod = drafter_module(s)
    g = s.block_size
    b = state.anchor.shape[0]
    live = ~state.done
    anchor_pos = state.cache.lengths  # [b]
    # Finished rows count as greedy, so a batch whose live rows are all greedy skips sampling.
    rs = dataclasses.replace(state.sampling, temperature=jnp.where(live, state.sampling.temperature, 0.0))
    caps = round_caps(state, s, rounds_left)  # [b]
    dstate = state.drafter
    if plain:
        draft = no_draft(b, s.config.vocab_size)
        z = jnp.zeros((b, g), jnp.float32)
        depth = jnp.zeros((), jnp.int32)
    else:
        draft, dstate, depth = draft_round(params, dparams, state, sp, caps, live, rs, s=s)
        if draft.proposed is not None:
            caps = jnp.minimum(caps, draft.proposed)
        z = draft.confidence_logits.astype(jnp.float32)  # [b, G] (zeros without a confidence head)
    calibrated = jnp.where(live[:, None], confidence_probs(z, *confidence_calibration(s, g)), 0.0)  # [b, G]
    # [b, G] what the policy reads: the policies that read confidences get them corrected
    conf = sched.corrected(calibrated, online_ratio(state)) if s.policy in sched.CONFIDENCE_POLICIES else calibrated
    plan = sched.schedule("none" if plain else s.policy, conf, state.lagged_confidences[:, 1], caps, sp, live)
    lengths = plan.lengths  # [b]

    w = draft.tokens.shape[1] + 1  # columns of this round's block: G+1, or 1 for a plain round
    block = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)  # [b, w]
    positions = anchor_pos[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [b, w]
    n_acc, next_token, cache, features = verify(params, state.cache, draft, block, positions, lengths,
                                                row_keys(state.seed_key, anchor_pos, KEY_VERIFY), rs, s=s)

    # Emitted tokens this round: d_1..d_n then t, cut after the first EOS and at the budget.
    j = jnp.arange(w, dtype=jnp.int32)[None, :]  # [1, w]
    drafted_next = jnp.concatenate([draft.tokens, next_token[:, None]], axis=1)  # [b, w]
    emitted = jnp.where(j < n_acc[:, None], drafted_next, next_token[:, None])  # [b, w]
    in_round = j <= n_acc[:, None]
    eos_here = in_round & is_eos(emitted, s.config, state.ignore_eos)
    eos_before = jnp.cumsum(eos_here, axis=1) - eos_here  # EOS strictly before j
    keep = in_round & (eos_before == 0) & (j < (state.budget - state.emitted)[:, None]) & live[:, None]
    emitted_now = state.emitted + keep.sum(axis=1).astype(jnp.int32)
    hit_eos = (keep & eos_here).any(axis=1)
    # A row also stops before a next round could write past its cache.
    hit_length = (emitted_now >= state.budget) | (anchor_pos + n_acc + 1 + g + 1 > s.max_len)
    finished = live & (hit_eos | hit_length)
    reason = jnp.where(hit_eos, FINISHED_EOS, FINISHED_LENGTH)

    # Commit: anchor and accepted drafts are now in the target cache and the drafter context.
    committed_len = jnp.where(live, n_acc + 1, 0)
    cache = dataclasses.replace(cache, lengths=anchor_pos + committed_len)
    deferred = None
    if defer_context:
        if not plain or mod is None:
            raise ValueError("only a plain round with a drafter defers its context upkeep")
        deferred = ContextColumns(tokens=block, features=features, positions=positions,
                                  valid=j < committed_len[:, None])
    elif mod is not None:
        # All w columns, after the width loops: a switch whose branches update the drafter's
        # context would make XLA copy it every round, which costs more than the few unverified
        # columns (masked by `committed`, their features are zero padding).
        dstate = mod.extend(dparams, params, s.config, s.dconfig, dstate, block, features, positions,
                            j < committed_len[:, None])

    k = jnp.arange(g, dtype=jnp.int32)[None, :]
    tried = live[:, None] & (k < lengths[:, None]) & (k <= n_acc[:, None])
    accepted = tried & (k < n_acc[:, None])
    state = dataclasses.replace(
        state, cache=cache, drafter=dstate, anchor=jnp.where(live, next_token, state.anchor),
        done=state.done | finished, finish_reason=jnp.where(finished, reason, state.finish_reason),
        emitted=emitted_now, drafted=state.drafted + jnp.where(live, lengths, 0),
        accepted=state.accepted + jnp.where(live, n_acc, 0), forwards=state.forwards + 1,
        row_rounds=state.row_rounds + live.sum(dtype=jnp.int32),
        committed=state.committed + committed_len.sum(dtype=jnp.int32),
        tried=state.tried + tried.sum(axis=0, dtype=jnp.int32),
        accepted_at=state.accepted_at + accepted.sum(axis=0, dtype=jnp.int32),
        # A round without a draft learns nothing about the confidences, a shallow draft nothing
        # about the positions past its depth: those keep their last values.
        lagged_confidences=(state.lagged_confidences if plain
                            else jnp.stack([jnp.where(k < depth, conf, state.lagged_confidences[:, 0]),
                                            state.lagged_confidences[:, 0]], axis=1)),
        gate_confidences=(state.gate_confidences if plain
                          else jnp.where(k < depth, sched.gate_average(state.gate_confidences, state.gate_rounds,
                                                                       calibrated, live), state.gate_confidences)),
        gate_rounds=state.gate_rounds if plain else state.gate_rounds + live.astype(jnp.int32),
        drafted_rounds=state.drafted_rounds + (0 if plain else 1))
    # Every round ages the sums, a plain one included (sched.online_update).
    predicted, hits = sched.online_update(state.online_predicted, state.online_accepted, calibrated, tried, accepted)
    state = dataclasses.replace(state, online_predicted=predicted, online_accepted=hits)
    trace = RoundTrace(confidence_logits=z, survival=sched.survival(conf), lengths=jnp.where(live, lengths, 0),
                       accepted=jnp.where(live, n_acc, -1).astype(jnp.int32))
    load = RoundLoad(tokens=plan.tokens, predicted_tau=plan.predicted_tau,
                     predicted_throughput=plan.predicted_throughput)
    pad = [(0, 0), (0, g + 1 - w)]  # a plain round's one column, to the G+1 of a drafted one
    return state, jnp.pad(emitted, pad), jnp.pad(keep, pad), trace, load, deferred


def draft_depths(block_size: int) -> tuple[int, ...]:
    """Compiled draft depths: the most drafts each verification width holds (verify_widths - 1)."""
    return tuple(w - 1 for w in verify_widths(block_size) if w > 1) or (block_size,)


def draft_round(params: dict, dparams, state: SlotState, sp: sched.ScheduleParams, caps: jax.Array,
                live: jax.Array, rs: RowSampling, *, s: DecodeSettings):
    """(DraftOutput, drafter state, depth [] int32) of a drafted round.

    A drafter that can draft fewer than G tokens exactly (DRAFTS_AT_DEPTH) drafts the smallest
    compiled depth (draft_depths) that holds sched.draft_depth, chosen on the device (lax.switch):
    where few tokens can be verified, as at high load, a round does not pay for G. The depth reads
    only earlier rounds, and the draft's `proposed` cuts every row's length to it.
    """
    mod, g = drafter_module(s), s.block_size
    keys = row_keys(state.seed_key, state.cache.lengths, KEY_DRAFT)
    depths = draft_depths(g)
    if not getattr(mod, "DRAFTS_AT_DEPTH", False) or len(depths) == 1:
        draft, dstate = mod.draft(dparams, params, s.config, s.dconfig, state.drafter, state.anchor,
                                  state.cache.lengths, keys, rs, kv_len=s.kv_len)
        return draft, dstate, jnp.asarray(g, jnp.int32)
    probe = state.drafted_rounds % sched.DEPTH_PROBE_EVERY == 0
    need = sched.draft_depth(s.policy, recent_confidences(state), caps, sp, live, probe)
    index = jnp.searchsorted(jnp.asarray(depths, jnp.int32), need)

    def at_depth(depth, dstate):  # the state is only read: a branch that returned it would copy it
        return mod.draft(dparams, params, s.config, s.dconfig, dstate, state.anchor, state.cache.lengths, keys, rs,
                         kv_len=s.kv_len, depth=depth)[0]

    draft = jax.lax.switch(index, [functools.partial(at_depth, d) for d in depths], state.drafter)
    return draft, state.drafter, jnp.asarray(depths, jnp.int32)[index]


def gate_start(s: DecodeSettings) -> jax.Array:
    """[G] a fresh engine's gate average (s.gate_start, ones when none is known)."""
    return jnp.asarray(s.gate_start or (1.0,) * s.block_size, jnp.float32)


def online_ratio(state: SlotState) -> jax.Array:
    """[G] the serving-time correction of the calibration (sched.online_ratio)."""
    return sched.online_ratio(state.online_predicted, state.online_accepted)


def recent_confidences(state: SlotState) -> jax.Array:
    """[slots, G] what the gate and the draft depth read: the gate's averages, corrected online."""
    return sched.corrected(state.gate_confidences, online_ratio(state))


def confidence_calibration(s: DecodeSettings, g: int) -> tuple[jax.Array, jax.Array]:
    """([G] temperatures, [G] shifts) of the drafter's confidence head (1 and 0 when uncalibrated)."""
    return (jnp.asarray(s.confidence_temperatures or (1.0,) * g, jnp.float32),
            jnp.asarray(s.confidence_shifts or (0.0,) * g, jnp.float32))



def round_limit(sp: sched.ScheduleParams, rounds: int) -> jax.Array:
    """[] int32 the rounds a step program compiled for `rounds` runs at most: sp.round_limit when
    given (data, so a 1-round step runs on a warmed-up 4-round program), else all of them."""
    if sp.round_limit is None:
        return jnp.asarray(rounds, jnp.int32)
    return jnp.clip(sp.round_limit, 1, rounds).astype(jnp.int32)


def step_width(rounds: int, block_size: int) -> int:
    """Columns of a step's packed output: the first token plus G+1 per round."""
    return 1 + rounds * (block_size + 1)


def step_rows(params: dict, dparams, state: SlotState, sp: sched.ScheduleParams, *, rounds: int, rows: int,
              s: DecodeSettings, shut: bool = False):
    """`step` over the first `rows` slots only (static; every other slot must be free or done and
    reported): a server with many slots and few requests pays for the rows it uses, not for all of
    them. The outputs have every slot's rows (the others commit nothing); `sp` is the table for
    `rows` rows."""
    if rows == s.slots:
        return step(params, dparams, state, sp, rounds=rounds, s=s, shut=shut)
    axes = batch_axes(lambda b: new_state(params, dparams, dataclasses.replace(s, slots=b)))
    # The target's cache buffers stay whole (the forward uses their first rows, KVCache): slicing
    # them out and back copied every stepped row's cache each step.
    whole = (None,) * len(state.cache.k)
    axes = dataclasses.replace(axes, cache=dataclasses.replace(axes.cache, k=whole, v=whole))
    head = jax.tree.map(lambda leaf, axis: leaf if axis is None else jax.lax.slice_in_dim(leaf, 0, rows, axis=axis),
                        state, axes)
    head, tokens, counts, ran, trace, load = step(params, dparams, head, sp, rounds=rounds,
                                                  s=dataclasses.replace(s, slots=rows), shut=shut)
    state = jax.tree.map(lambda leaf, part, axis: part if axis is None
                         else jax.lax.dynamic_update_slice_in_dim(leaf, part, 0, axis=axis), state, head, axes)
    rest = s.slots - rows

    def pad(x, value=0):  # [rows, ...] -> [slots, ...]
        return jnp.pad(x, [(0, rest)] + [(0, 0)] * (x.ndim - 1), constant_values=value)

    trace = RoundTrace(confidence_logits=pad(trace.confidence_logits), survival=pad(trace.survival),
                       lengths=pad(trace.lengths), accepted=pad(trace.accepted, -1))
    return state, pad(tokens), pad(counts), ran, trace, load


def probe_due_at(state: SlotState, sp: sched.ScheduleParams) -> jax.Array:
    """[] int32 the value of `forwards` from which the gate probes. next_probe counts from the
    last drafted round; the load's floor (sched.probe_floor) also holds for a fresh engine's first
    probe (its last drafted round is "forward 0"). Under max_length 0 no probe can run, so none
    is ever due (a shut step that waited for one ran no round)."""
    due = jnp.maximum(state.next_probe, sched.probe_floor(sp, state.done.shape[0]))
    return jnp.where(sp.max_length > 0, due, jnp.iinfo(jnp.int32).max)


def gate_drafts(state: SlotState, sp: sched.ScheduleParams, rounds_left: jax.Array, *, s: DecodeSettings,
                probes: bool = True, measured_only: bool = False) -> jax.Array:
    """[] bool: whether the dspark gate (sched.drafting_pays) drafts the next round, a probe
    included when one is due (`probes`). With `measured_only`, rows whose average holds no
    drafted round yet carry no evidence. Reads only the gate's fields, the rows' budgets and
    cache lengths (gate_at_start runs it on those fields alone)."""
    due = probes & (state.forwards >= probe_due_at(state, sp))
    live, caps = ~state.done, round_caps(state, s, rounds_left)
    if measured_only:
        live = live & (state.gate_rounds > 0)
        caps = jnp.where(live, caps, 0)
    return sched.drafting_pays(recent_confidences(state), caps, sp, live, due)


def gate_at_start(state: SlotState, sp: sched.ScheduleParams, *, rounds: int, rows: int, s: DecodeSettings):
    """[] bool: whether a dspark step over the first `rows` slots drafts in its first round. The
    Engine asks before each step and runs the step with `shut` when it does not (see `step`).
    Only the fields gate_drafts reads are sliced: the caches are not touched."""
    head = lambda x: x[:rows]  # noqa: E731
    part = dataclasses.replace(
        state, cache=dataclasses.replace(state.cache, lengths=head(state.cache.lengths)), done=head(state.done),
        budget=head(state.budget), emitted=head(state.emitted), gate_confidences=head(state.gate_confidences),
        gate_rounds=head(state.gate_rounds))
    return gate_drafts(part, sp, round_limit(sp, rounds), s=dataclasses.replace(s, slots=rows))


def step(params: dict, dparams, state: SlotState, sp: sched.ScheduleParams, *, rounds: int, s: DecodeSettings,
         shut: bool = False):
    """Up to `rounds` rounds (sp.round_limit fewer; fewer when every slot is done) in one lax.while_loop.

    `shut` (static; the dspark policies only): the gate is closed at the step's start
    (gate_at_start). The step then runs plain rounds in one flat loop until a probe is due or a
    row leaves (what can open the gate, but for the online ratio's slow drift) and ends there;
    the engine asks the gate before the next step. At high load, where the gate stays closed, such a step costs what plain
    decoding costs: the nested loops of a step that may draft cost ~5 ms more per step at 16 rows
    here (39 vs 42-46 ms per one-round step) even when it drafts nothing, and its drafter context
    upkeep is one `extend` at the end (ContextColumns).

    Returns (state, tokens [slots, step_width] int32, counts [slots] int32, rounds run [] int32,
    trace, load): slot r committed tokens[r, :counts[r]] in this call, its first token (from
    insert) included when unreported; trace is a RoundTrace with a rounds axis after the slots
    ([slots, rounds, G] / [slots, rounds]; accepted -1 for rounds not run or rows not live) and
    load a RoundLoad of [rounds] arrays.
    """
    b = state.anchor.shape[0]
    width = step_width(rounds, s.block_size)
    out = jnp.zeros((b, width), jnp.int32).at[:, 0].set(jnp.where(state.unreported, state.anchor, 0))
    counts = state.unreported.astype(jnp.int32)
    state = dataclasses.replace(state, unreported=jnp.zeros_like(state.unreported))
    rows = jnp.arange(b)[:, None]
    g = s.block_size
    trace = RoundTrace(confidence_logits=jnp.zeros((b, rounds, g), jnp.float32),
                       survival=jnp.zeros((b, rounds, g), jnp.float32), lengths=jnp.zeros((b, rounds), jnp.int32),
                       accepted=jnp.full((b, rounds), -1, jnp.int32))
    load = RoundLoad(tokens=jnp.zeros((rounds,), jnp.int32), predicted_tau=jnp.zeros((rounds,), jnp.float32),
                     predicted_throughput=jnp.zeros((rounds,), jnp.float32))
    limit = round_limit(sp, rounds)  # the rounds this call may run (data: one program serves every step size up to it)

    def going(carry):
        i, st = carry[:2]
        return (i < limit) & jnp.any(~st.done)

    def body(plain, carry, defer=False):
        i, st, out, counts, trace, load, deferred = carry
        st, emitted, keep, now, now_load, columns = decode_round(params, dparams, st, sp, limit - i, s=s,
                                                                 plain=plain, defer_context=defer)
        j = jnp.arange(emitted.shape[1], dtype=jnp.int32)[None, :]
        at = jnp.where(keep, counts[:, None] + j, width)  # width: out of range, dropped
        out = out.at[rows, at].set(emitted, mode="drop")
        trace = jax.tree.map(lambda buf, x: buf.at[:, i].set(x), trace, now)
        load = jax.tree.map(lambda buf, x: buf.at[i].set(x), load, now_load)
        if defer:  # round i's one column, at column i of the step's buffer
            deferred = jax.tree.map(lambda buf, x: buf.at[:, i].set(x[:, 0]), deferred, columns)
        return i + 1, st, out, counts + keep.sum(axis=1, dtype=jnp.int32), trace, load, deferred

    mod = drafter_module(s)
    # A step of plain rounds only (policy "none" over a drafter, or the dspark gate shut at the
    # start) defers the drafter's context upkeep to one `extend` over all its rounds at the end:
    # nothing drafts before then, and one call reads the context weights once, not once a round.
    # Measured at 4 rows on CPU, where the gate stays shut (benchmarks/bench_schedule.py, paired
    # repeats): dspark / none 0.968 (0.962-0.975) with an extend per round, 0.979 (0.973-0.987).
    defer = mod is not None and (s.policy == "none" or (shut and s.policy in sched.TABLE_POLICIES))
    deferred = None
    if defer:
        shapes = jax.eval_shape(lambda st: decode_round(params, dparams, st, sp, jnp.asarray(rounds, jnp.int32), s=s,
                                                        plain=True, defer_context=True)[-1], state)
        deferred = jax.tree.map(lambda x: jnp.zeros((x.shape[0], rounds) + x.shape[2:], x.dtype), shapes)
    carry = (jnp.zeros((), jnp.int32), state, out, counts, trace, load, deferred)

    def drafts(carry, probes=True, measured_only=False):
        i, st = carry[:2]
        return gate_drafts(st, sp, limit - i, s=s, probes=probes, measured_only=measured_only)

    def plain_until_event(carry, defer=False):
        # Plain rounds while the gate is closed, until it could open: plain rounds leave its
        # confidences as they are and only shrink the rows' caps, so only a due probe or a row
        # leaving can open it (the online ratio's slow drift back to 1 waits for one of those, or
        # for the step's end). Those two scalar tests replace the gate itself (asked every round it
        # cost ~3 % of a plain round at 4 rows on CPU). The gate was closed when asked, so the first
        # round runs whatever the tests say.
        start, probe_at = carry[0], probe_due_at(carry[1], sp)
        rows_live = jnp.sum(~carry[1].done)

        def closed(c):
            st = c[1]
            return going(c) & ((c[0] == start) | ((st.forwards < probe_at) & (jnp.sum(~st.done) == rows_live)))

        return jax.lax.while_loop(closed, functools.partial(body, True, defer=defer), carry)

    def plain_while_shut(carry):  # the gate asked once per event, not once per round
        return jax.lax.while_loop(lambda c: going(c) & ~drafts(c), plain_until_event, carry)

    if mod is None or s.policy not in sched.TABLE_POLICIES:
        carry = jax.lax.while_loop(going, functools.partial(body, mod is None or s.policy == "none", defer=defer),
                                   carry)
    elif shut:
        # The step ends at the first event; the engine asks the gate before the next.
        carry = plain_until_event(carry, defer=True)
    else:
        # The dspark gate decides each round whether to draft at all. Its two kinds of round run
        # in two inner loops, plain rounds while the gate is closed and then one drafted round: a
        # lax.cond between them made XLA copy the caches every round, a loop updates them in place.
        floor = sched.probe_floor(sp, b)  # the shortest probe gap at this load

        def plain_then_one_drafted(carry):
            carry = plain_while_shut(carry)
            start, st = carry[:2]
            averaged = st.gate_rounds
            # Drafting paid when the measured rows alone open the gate; a round opened by a start
            # value (a fresh engine's ones, a new request's prior) is a probe like a due one.
            paid = drafts(carry, probes=False, measured_only=True)
            # A probe's confidences replace the stale average: they are the only fresh news.
            st = dataclasses.replace(st, gate_rounds=jnp.where(paid, averaged, 0))
            carry = jax.lax.while_loop(lambda c: going(c) & (c[0] == start), functools.partial(body, False),
                                       (start, st, *carry[2:]))
            st, ran = carry[1], carry[0] > start
            gap = jnp.where(ran, sched.next_probe_gap(st.probe_gap, paid, floor), st.probe_gap)
            st = dataclasses.replace(st, probe_gap=gap, next_probe=jnp.where(ran, st.forwards + gap, st.next_probe),
                                     gate_rounds=jnp.where(ran, st.gate_rounds, averaged))
            return (carry[0], st, *carry[2:])

        carry = jax.lax.while_loop(going, plain_then_one_drafted, carry)
    ran, state, out, counts, trace, load, deferred = carry
    if deferred is not None:  # columns of rounds not run are not valid: extend drops them
        state = dataclasses.replace(state, drafter=mod.extend(dparams, params, s.config, s.dconfig, state.drafter,
                                                              *deferred))
    return state, out, counts, ran, trace, load
