"""Load-aware verification length (DESIGN.md section 7): the cost table and the policies.

Every round, each live row r has calibrated confidences c_{r,1..G} from the drafter's confidence
head (sigmoid of the logit over its STS temperature): c_{r,j} is the probability that draft token
j is accepted given that 1..j-1 were. Its survival a_{r,j} = prod_{k<=j} c_{r,k} is the
probability that token j is accepted. Verifying l_r tokens of row r costs one target forward
over B = sum_r (1 + l_r) tokens and is expected to commit tau = sum_r (1 + sum_{j<=l_r} a_{r,j})
tokens (the engine's forward is dense over its slots, so a free slot adds its 1 to B but commits
nothing: tau's first term counts live rows); the hardware runs SPS(B) such steps per second (the profiled cost table), so the
expected throughput is Theta = tau * SPS(B). The policies, all jnp code that runs inside the
engine's step (no host round trip; load, table and threshold are data, never compile keys):

  dspark         Algorithm 1 of the paper: admit candidates in order of survival while Theta
                 rises, and stop at the first admission that does not raise it. The stop is what
                 keeps it lossless: whether token j of row r is verified depends only on
                 survivals up to j (section 7's counterexample shows a global search is biased).
  dspark-lagged  the production variant: the budget comes from a global search over the
                 confidences of two rounds earlier (which cannot see this round's tokens), then
                 the best current candidates are verified (prefixes by construction; in the
                 engine's level form, every row up to the chosen level).
  threshold      l_r = the largest j with a_{r,j} >= theta.
  fixed          l_r = G (every row verifies the whole block).
  none           no drafting: plain decoding through the same engine.

Two forms of the dspark policies. `prefix_schedule` and `lagged_schedule` are the paper's, for a
packed forward whose cost depends on B alone (candidates are single tokens (r, j)). The engine's
verification forward is dense: every slot runs at the width of the longest row, so it costs
SPS(R * (1 + max l)) and a token under that width is free. Pricing such a forward by B sends a
few confident rows deep and makes every slot pay for their width (measured: at batch 8 the
B-priced schedule verified 1 token per row per round at the width-8 rate, below plain decoding).
The engine therefore runs the same algorithm over whole levels (`level_schedule`,
`lagged_level_schedule`): level j is every row's token j, its gain the column sum of survivals,
its cost the step from width j to j + 1. With one row the two forms coincide.

Every policy is cut by the row's cap (budget left, the drafter's proposal, `max_length`). The two
dspark policies also skip the drafter altogether in a round where the slots' recent confidences
say drafting would not beat a plain round at this load (`drafting_pays`; the table holds the
drafter's cost and `plain_sps` the rate of a round without it), so at a load where speculation
does not pay a round costs what plain decoding costs, not plain decoding plus a useless draft:
such a round is a plain one (decode.step runs plain rounds in an inner loop while the gate is
closed: the write-first forward of the anchor alone, plus one column of drafter context).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("dspark", "dspark-lagged", "threshold", "fixed", "none")
# Policies that read the cost table (an engine without one profiles it at warmup).
TABLE_POLICIES = ("dspark", "dspark-lagged")
# Policies that read the confidences (they get them with the online correction, `corrected`).
CONFIDENCE_POLICIES = ("dspark", "dspark-lagged", "threshold")
DEFAULT_THRESHOLD = 0.5
# The dspark policies skip the drafter in rounds where recent confidences say no draft token would
# be admitted; a probe round drafts anyway to measure them again, PROBE_EVERY rounds after a round
# where drafting paid, the gap doubling (up to MAX_PROBE_EVERY) after each probe that found it does
# not. A probe verifies next to nothing, so it costs the drafter's forward on top of a plain round:
# at high load that is a large part of one (measured at 16 slots on CPU: 0.43 plain rounds), so the
# gap is never shorter than what keeps the probes under PROBE_BUDGET of the rounds (probe_floor).
# The confidences the gate reads are averaged over a slot's drafted rounds (gate_average: one low
# round does not close it); a new request starts from the other slots' (gate_prior), a fresh
# engine from the drafter's measured acceptance (calibration), and a request's first drafted
# round and a probe's replace the average.
PROBE_EVERY = 16
# A round drafts only as deep as it may verify (draft_depth): for the table policies, at most this
# many levels past the one the gate's recent confidences make best. A round's own confidences
# spread around the average, so the per-round schedule often verifies deeper than the average's
# best level: replaying the shipped DSpark drafter's 14097 calibration rounds through this CPU's
# one-row table (benchmarks/replay_schedule.py), the schedule verified 3 tokens in 53 % of them
# when it could, 1.42x plain by the table, against 1.29x when drafts stop at depth 1. With the
# rule before (no deeper than the best level itself) one row drafted depth 1 in nearly every
# round; twice the level lost at batch 4 (0.912 of none against 0.952, README 2026-12-06), where
# level 2 made it draft all 7. A draft deeper than the verified width costs only the drafter's
# extra positions (benchmarks/bench_draft_depth.py: depth 3 over depth 1, 0.1 ms at one row and
# 2.5 ms at 16, against rounds of 30-60 ms on CPU).
DEPTH_HEADROOM = 1
# Every DEPTH_PROBE_EVERY-th drafted round of an engine (its first included) drafts as deep as the
# caps allow where drafting pays (the averages' best level is not 0): a shallow draft leaves the gate averages of the positions past its depth as they
# were, so a depth chosen low from one early round's confidences stayed low for good (measured at
# one row: the first round's position-2 confidence of 0.19 held every later round at depth 1,
# while the positions' real average of about 0.4 makes depth 3 the best one).
DEPTH_PROBE_EVERY = 8
MAX_PROBE_EVERY = 256
PROBE_BUDGET = 0.01
GATE_DECAY = 0.75
# The gate drafts only where the best level's Theta beats a plain round by this fraction. The
# table prices single rounds; a step that may draft also pays what the table does not hold (its
# nested loops, the gate's question before each step), and the acceptance it expects comes from
# confidences measured on other prompts. Without a margin, cheaper drafted rounds opened the gate
# at 4 rows on a predicted gain of a few percent and lost 8 % to plain decoding (README,
# "Scheduler benchmark (2026-12-06c)"); with 0.1 the gate stays shut there and batch 1 is unchanged.
GATE_MARGIN = 0.1
# Serving-time correction of the calibration (online_ratio): STS is fitted offline on one
# distribution, and served prompts differ (measured: the shipped drafter's position-1 confidence
# 0.45 on the rows the schedule verified at batch 4 on MT-Bench + HumanEval, 0.32 accepted).
# Every verified draft position adds its calibrated conditional confidence and its accept
# indicator to per-position sums that forget at ONLINE_DECAY per event, and per round at least
# once; the policies read confidences times their ratio, in which ONLINE_PRIOR pseudo-events at
# ratio 1 never fade. So where a low ratio stops every draft (no new events), the ratio drifts
# back to 1 and drafting is tried again, instead of staying shut for good.
ONLINE_PRIOR = 4.0
ONLINE_DECAY = 0.99
ONLINE_RATIO_RANGE = (0.25, 2.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ScheduleParams:
    """The scheduler's runtime inputs (device arrays passed to every step; new values never
    compile anything)."""

    sps_table: jax.Array  # [Bmax + 1] float32 verification steps per second at B total tokens
    threshold: jax.Array  # [] float32 survival threshold of the "threshold" policy
    max_length: jax.Array  # [] int32 most draft tokens any row verifies in a round (<= G)
    plain_sps: jax.Array  # [] float32 steps per second of a round that does not draft (the gate's other choice)
    # [] int32 rounds a step runs at most, below its program's static count (decode.round_limit);
    # None: all of them. The Engine always passes one, so every step size shares one program.
    round_limit: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Schedule:
    """One round's decision: lengths per row and what the cost model expects of it."""

    lengths: jax.Array  # [R] int32 draft tokens each row verifies
    tokens: jax.Array  # [] int32 B = sum_r (1 + l_r) (the dense forward carries R * (1 + max l))
    predicted_tau: jax.Array  # [] float32 expected committed tokens, sum_r (1 + sum_{j<=l_r} a_{r,j})
    predicted_throughput: jax.Array  # [] float32 predicted_tau * SPS(B), tokens per second


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


# ----------------------------------------------------------------------------- pieces
def survival(confidences: jax.Array) -> jax.Array:
    """a [R, G] = cumprod of the per-position confidences [R, G] (clipped to [0, 1])."""
    return jnp.cumprod(jnp.clip(confidences.astype(jnp.float32), 0.0, 1.0), axis=-1)


def sps_at(sps_table: jax.Array, tokens: jax.Array) -> jax.Array:
    """SPS(B) for int B [...]; 0 past the end of the table (such a batch cannot be run)."""
    inside = tokens < sps_table.shape[0]
    return jnp.where(inside, sps_table[jnp.clip(tokens, 0, sps_table.shape[0] - 1)], 0.0)


def candidates(surv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every (r, j) in admission order: survival descending, then row, then position (a stable
    sort of the row-major flattening). Returns (flat indices [R*G], their survivals [R*G])."""
    flat = surv.reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    return order, flat[order]


def lengths_of(order: jax.Array, admitted: jax.Array, rows: int, block: int) -> jax.Array:
    """l [R] int32: admitted candidates per row (they are prefixes, so the count is the length)."""
    return jnp.zeros((rows,), jnp.int32).at[order // block].add(admitted.astype(jnp.int32))


def base_tau(rows: int, live: jax.Array | None) -> jax.Array:
    """Tokens a round commits with no draft verified: one per live row (all R when live is None;
    a free slot still runs in the forward, so B always starts at R)."""
    return jnp.float32(rows) if live is None else jnp.sum(live).astype(jnp.float32)


def _path(sorted_surv: jax.Array, sps_table: jax.Array, rows: int, live: jax.Array | None = None) -> jax.Array:
    """Theta_k [N + 1] for k = 0..N admitted candidates of the sorted path (float32 sums)."""
    tau = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(sorted_surv)]) + base_tau(rows, live)
    tokens = rows + jnp.arange(sorted_surv.shape[0] + 1, dtype=jnp.int32)
    return tau * sps_at(sps_table, tokens)


def schedule_of(lengths: jax.Array, surv: jax.Array, sps_table: jax.Array, live: jax.Array | None = None) -> Schedule:
    """The Schedule of given lengths: B, the expected tau, and the throughput the engine's dense
    forward gets: it runs every slot at the width of the longest row, so it is priced at
    B = R * (1 + max l) tokens, whatever the shorter rows verify."""
    rows, block = surv.shape
    verified = jnp.arange(block)[None, :] < lengths[:, None]  # [R, G]
    tau = base_tau(rows, live) + jnp.sum(jnp.where(verified, surv, 0.0))
    tokens = (rows + jnp.sum(lengths)).astype(jnp.int32)
    dense = (rows * (1 + jnp.max(lengths))).astype(jnp.int32)
    return Schedule(lengths=lengths.astype(jnp.int32), tokens=tokens, predicted_tau=tau,
                    predicted_throughput=tau * sps_at(sps_table, dense))


# ----------------------------------------------------------------------------- policies
def prefix_schedule(confidences: jax.Array, sps_table: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """DSpark's Algorithm 1 with its early stop, vectorised.

    confidences [R, G] calibrated c_{r,j} (rows of free slots all zero); sps_table [Bmax + 1]
    steps per second indexed by total tokens B; live [R] bool (optional): rows that commit a
    token this round (default all), so free slots add cost but no tokens. Returns lengths [R] int32.
    """
    rows, block = confidences.shape
    order, ranked = candidates(survival(confidences))
    theta = _path(ranked, sps_table, rows, live)  # [N + 1]
    # Admission i (0-based) moves Theta from theta[i] to theta[i + 1]; the first one that does not
    # raise it, or that has nothing to gain (survival 0), stops the scan.
    stop = (theta[1:] <= theta[:-1]) | (ranked <= 0.0)
    count = jnp.where(stop.any(), jnp.argmax(stop), ranked.shape[0])
    return lengths_of(order, jnp.arange(ranked.shape[0]) < count, rows, block)


def best_budget(confidences: jax.Array, sps_table: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """[] int32: the number of candidates whose admission maximises Theta over the whole sorted
    path (a global search: only safe on confidences that cannot see this round's tokens)."""
    rows = confidences.shape[0]
    _, ranked = candidates(survival(confidences))
    theta = _path(ranked, sps_table, rows, live)
    useful = jnp.concatenate([jnp.ones((1,), bool), ranked > 0.0])  # no admission of a zero
    return jnp.argmax(jnp.where(useful, theta, -1.0)).astype(jnp.int32)  # the first maximum


def lagged_schedule(confidences: jax.Array, lagged_confidences: jax.Array, sps_table: jax.Array,
                    live: jax.Array | None = None) -> jax.Array:
    """The production variant: K = the best number of admitted candidates by a global search over
    `lagged_confidences` [R, G] (two rounds old), then the K best current candidates."""
    rows, block = confidences.shape
    budget = best_budget(lagged_confidences, sps_table, live)
    order, ranked = candidates(survival(confidences))
    admitted = (jnp.arange(ranked.shape[0]) < budget) & (ranked > 0.0)
    return lengths_of(order, admitted, rows, block)


def level_gains(surv: jax.Array) -> jax.Array:
    """[G]: the expected tokens level j adds when every row verifies its token j (the column sums
    of the survivals [R, G]; non-increasing in j, since each row's survival is)."""
    return jnp.sum(surv, axis=0)


def _level_path(gains: jax.Array, sps_table: jax.Array, rows: int, live: jax.Array | None = None) -> jax.Array:
    """Theta_L [G + 1] when levels 1..L are verified: the dense forward carries R * (1 + L) tokens."""
    tau = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(gains)]) + base_tau(rows, live)
    tokens = rows * (1 + jnp.arange(gains.shape[0] + 1, dtype=jnp.int32))
    return tau * sps_at(sps_table, tokens)


def _rows_up_to(level: jax.Array, surv: jax.Array) -> jax.Array:
    """l [R] int32 = min(level, the row's positions with survival > 0): a row verifies the chosen
    levels but never a position that cannot be accepted (a free slot, past its cap)."""
    return jnp.minimum(level, jnp.sum(surv > 0.0, axis=-1)).astype(jnp.int32)


def level_schedule(confidences: jax.Array, sps_table: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """Algorithm 1 for the engine's dense verification forward, with its early stop.

    The engine verifies every slot at one width (the longest row's l + 1), so a round costs
    SPS(R * (1 + max_r l_r)) whatever the shorter rows verify: once some row verifies j tokens,
    every other row's tokens up to j are free. The candidates are therefore whole levels: level j
    (every row's token j) gains sum_r a_{r,j} expected tokens and moves B from R * j to
    R * (j + 1). Levels are admitted in order (their gains are already sorted) while Theta rises,
    stopping at the first that does not raise it, so whether token j is verified still depends
    only on survivals up to j (the early stop's losslessness argument holds unchanged). With one
    row this is prefix_schedule. confidences [R, G], sps_table [Bmax + 1], live [R] bool or None.
    Returns lengths [R] int32.
    """
    surv = survival(confidences)
    gains = level_gains(surv)
    theta = _level_path(gains, sps_table, confidences.shape[0], live)  # [G + 1]
    stop = (theta[1:] <= theta[:-1]) | (gains <= 0.0)
    level = jnp.where(stop.any(), jnp.argmax(stop), gains.shape[0])
    return _rows_up_to(level, surv)


def _level_thetas(confidences: jax.Array, sps_table: jax.Array, live: jax.Array | None) -> jax.Array:
    """Theta_L [G + 1] of every level L, with -1 for levels that would admit nothing (gain 0)."""
    gains = level_gains(survival(confidences))
    theta = _level_path(gains, sps_table, confidences.shape[0], live)
    return jnp.where(jnp.concatenate([jnp.ones((1,), bool), gains > 0.0]), theta, -1.0)


def best_level(confidences: jax.Array, sps_table: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """[] int32: the level L that maximises Theta over all of them (a global search: only safe on
    confidences that cannot see this round's tokens)."""
    return jnp.argmax(_level_thetas(confidences, sps_table, live)).astype(jnp.int32)  # the first maximum


def lagged_level_schedule(confidences: jax.Array, lagged_confidences: jax.Array, sps_table: jax.Array,
                          live: jax.Array | None = None) -> jax.Array:
    """The production variant for the dense forward: the level L by a global search over
    `lagged_confidences` [R, G] (two rounds old), then every row verifies up to L."""
    return _rows_up_to(best_level(lagged_confidences, sps_table, live), survival(confidences))


def threshold_lengths(confidences: jax.Array, threshold: jax.Array) -> jax.Array:
    """l_r = the largest j with a_{r,j} >= threshold (survival is non-increasing in j)."""
    surv = survival(confidences)
    return jnp.sum((surv >= threshold) & (surv > 0.0), axis=-1).astype(jnp.int32)


def drafting_pays(recent_confidences: jax.Array, caps: jax.Array, params: ScheduleParams, live: jax.Array,
                  probe_due: jax.Array | bool = False) -> jax.Array:
    """[] bool: whether this round runs the drafter at all (the dspark policies). It does when the
    slots' recent confidences [R, G] (an average over past drafted rounds, so the decision cannot
    see this round's tokens and cannot bias the output) say the best level, drafter's cost
    included (the table), beats a round without a draft (params.plain_sps) by GATE_MARGIN; else the round is
    plain decoding. A round where `probe_due` drafts anyway (unless max_length is 0), so
    confidences that were low are measured again."""
    caps = jnp.minimum(caps, params.max_length)
    conf = cap_confidences(recent_confidences, caps)
    best = jnp.max(_level_thetas(conf, params.sps_table, live))
    pays = best > (1.0 + GATE_MARGIN) * base_tau(conf.shape[0], live) * params.plain_sps
    return (pays | probe_due) & (params.max_length > 0)


def draft_depth(policy: str, recent_confidences: jax.Array, caps: jax.Array, params: ScheduleParams,
                live: jax.Array, probe: jax.Array | bool = False) -> jax.Array:
    """[] int32 in [1, G]: how many tokens a round needs drafted (the engine rounds it up to a
    depth it compiles), decided before drafting from what earlier rounds showed, so the depth never
    sees this round's tokens. Nobody verifies past the rows' caps [R] (or max_length); the table
    policies also look no deeper than DEPTH_HEADROOM levels past the best level of the recent
    confidences [R, G] (the gate's averages): a round's own confidences may go deeper than the
    average, not arbitrarily deeper. A deep draft costs little more than a shallow one where the
    drafter is memory-bound (one row), and up to G times as much where it is compute-bound (many
    rows), which is where the level is low. A depth `probe` [] bool ignores a level above 0 (only
    the caps bound it): see DEPTH_PROBE_EVERY."""
    caps = jnp.minimum(caps, params.max_length)
    deepest = jnp.max(jnp.where(live, caps, 0))
    if policy in TABLE_POLICIES:
        level = best_level(cap_confidences(recent_confidences, caps), params.sps_table, live)
        # A depth probe only where drafting pays at all (level > 0): a closed gate's probes
        # measure position 1, which is what opens it.
        deepest = jnp.where(probe & (level > 0), deepest, jnp.minimum(deepest, level + DEPTH_HEADROOM))
    return jnp.clip(deepest, 1, recent_confidences.shape[-1]).astype(jnp.int32)


def gate_average(average: jax.Array, rounds: jax.Array, confidences: jax.Array, live: jax.Array) -> jax.Array:
    """The gate's average [R, G] after a drafted round with `confidences` [R, G], for rows that
    have `rounds` [R] drafted rounds in it: the new round weighs 1 / (rounds + 1), at least
    1 - GATE_DECAY (a running mean that becomes an exponential one), so the first round replaces
    the start value instead of decaying from it round after round. Rows not live keep theirs."""
    weight = jnp.maximum(1.0 / (rounds + 1.0), 1.0 - GATE_DECAY)[:, None]
    return jnp.where(live[:, None], (1.0 - weight) * average + weight * confidences, average)


def gate_prior(average: jax.Array, rounds: jax.Array, start: jax.Array | float = 1.0) -> jax.Array:
    """[G] the start value of a new request's gate average: the mean over slots whose average
    holds measurements (`rounds` [R] > 0; a freed slot keeps its last request's), else `start`
    [G] (a fresh engine's: the drafter's measured acceptance, or ones). A request starting from
    ones drafts its first round whatever the load; from the workload's recent confidences it
    waits for the next probe where drafting has not been paying. Its own first drafted round
    replaces the prior (the slot starts at rounds 0)."""
    measured = (rounds > 0)[:, None]
    count = jnp.sum(measured)
    mean = jnp.sum(jnp.where(measured, average, 0.0), axis=0) / jnp.maximum(count, 1)
    return jnp.where(count > 0, mean, jnp.broadcast_to(jnp.asarray(start, jnp.float32), mean.shape))


def probe_floor(params: ScheduleParams, rows: int) -> jax.Array:
    """[] int32 the shortest gap between probes at this load: a probe that verifies nothing costs
    1 / SPS(rows) against a plain round's 1 / plain_sps, and the gap is long enough that this
    extra stays under PROBE_BUDGET of the plain rounds between probes (PROBE_EVERY where the
    drafter is nearly free, MAX_PROBE_EVERY at most). Data, like the table: no recompile."""
    drafted = sps_at(params.sps_table, jnp.asarray(rows, jnp.int32))
    extra = jnp.where(drafted > 0, params.plain_sps / jnp.maximum(drafted, 1e-9) - 1.0, 0.0)  # plain rounds
    gap = jnp.ceil(jnp.maximum(extra, 0.0) / PROBE_BUDGET)
    return jnp.clip(gap, PROBE_EVERY, MAX_PROBE_EVERY).astype(jnp.int32)


def next_probe_gap(gap: jax.Array, paid: jax.Array, floor: jax.Array | int = PROBE_EVERY) -> jax.Array:
    """[] int32 rounds until the next probe after a drafted round: `floor` (probe_floor) when
    drafting paid (the gate was open), else twice the last gap, at least `floor` and at most
    MAX_PROBE_EVERY."""
    doubled = jnp.minimum(jnp.maximum(2 * gap, floor), MAX_PROBE_EVERY)
    return jnp.where(paid, floor, doubled).astype(jnp.int32)


def online_update(predicted: jax.Array, accepted: jax.Array, confidences: jax.Array, tried: jax.Array,
                  hit: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The sums [G] after a round where `tried` [R, G] marks the positions verification tested
    (verified, every earlier one accepted), `hit` [R, G] those it accepted and `confidences`
    [R, G] the calibrated conditional confidences they had: each event weighs 1 and ages the
    older ones by ONLINE_DECAY (a round with none at a position ages it as one would), so the
    ratio follows the last ~1 / (1 - ONLINE_DECAY) events or rounds."""
    events = jnp.sum(tried, axis=0, dtype=jnp.float32)  # [G]
    age = ONLINE_DECAY ** jnp.maximum(events, 1.0)
    predicted = age * predicted + jnp.sum(jnp.where(tried, confidences, 0.0), axis=0)
    accepted = age * accepted + jnp.sum(tried & hit, axis=0, dtype=jnp.float32)
    return predicted, accepted


def online_ratio(predicted: jax.Array, accepted: jax.Array) -> jax.Array:
    """[G] accepted over predicted, ONLINE_PRIOR pseudo-events at ratio 1 included, clipped to
    ONLINE_RATIO_RANGE: what the served prompts make of the offline calibration at each position."""
    return jnp.clip((accepted + ONLINE_PRIOR) / (predicted + ONLINE_PRIOR), *ONLINE_RATIO_RANGE)


def corrected(confidences: jax.Array, ratio: jax.Array) -> jax.Array:
    """Confidences [..., G] times the online ratio [G], kept in [0, 1]. A ratio made from earlier
    rounds only keeps every policy's decision for token j a function of positions <= j."""
    return jnp.clip(confidences * ratio, 0.0, 1.0)


def cap_confidences(confidences: jax.Array, caps: jax.Array) -> jax.Array:
    """Zero the confidences of positions past each row's cap [R] (they cannot be verified)."""
    j = jnp.arange(confidences.shape[-1])[None, :]
    return jnp.where(j < caps[:, None], confidences, 0.0)


def schedule(policy: str, confidences: jax.Array, lagged_confidences: jax.Array, caps: jax.Array,
             params: ScheduleParams, live: jax.Array | None = None) -> Schedule:
    """The round's Schedule under `policy` (static) for confidences [R, G], the confidences of
    two rounds earlier [R, G] (dspark-lagged), per-row caps [R] (0 for rows not decoding) and
    the live rows [R] (None: all)."""
    caps = jnp.minimum(caps, params.max_length)
    conf = cap_confidences(confidences, caps)
    if policy == "dspark":
        lengths = level_schedule(conf, params.sps_table, live)
    elif policy == "dspark-lagged":
        lengths = lagged_level_schedule(conf, cap_confidences(lagged_confidences, caps), params.sps_table, live)
    elif policy == "threshold":
        lengths = threshold_lengths(conf, params.threshold)
    elif policy == "fixed":
        lengths = jnp.full(caps.shape, confidences.shape[-1], jnp.int32)
    elif policy == "none":
        lengths = jnp.zeros(caps.shape, jnp.int32)
    else:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return schedule_of(jnp.minimum(lengths, caps), survival(conf), params.sps_table, live)


# ----------------------------------------------------------------------------- the cost table
def table_size(slots: int, block_size: int) -> int:
    """Entries of an engine's table: B = 0 .. slots * (G + 1)."""
    return slots * (block_size + 1) + 1


def staircase(slots: int, widths: Sequence[int], steps_per_second: Sequence[float], size: int) -> np.ndarray:
    """The table [size] from steps per second measured at each compiled width: a forward of B
    tokens runs at the smallest compiled width w with slots * w >= B (the engine's forward is
    dense over slots x width), and B past the widest is 0 (it cannot run)."""
    table = np.zeros((size,), np.float32)
    totals = [slots * w for w in widths]
    for b in range(size):
        fit = [i for i, t in enumerate(totals) if t >= b]
        if fit:
            table[b] = steps_per_second[fit[0]]
    return table


@dataclasses.dataclass
class CostTable:
    """A profiled cost table with what it was measured on (saved as JSON, so a server does not
    re-profile)."""

    slots: int
    block_size: int
    widths: list[int]  # compiled verification widths (tokens per row)
    steps_per_second: list[float]  # measured at each width, every slot live and drafting
    table: list[float]  # [slots * (G + 1) + 1] SPS(B)
    model: str = ""
    drafter: str = ""
    device: str = ""
    plain_steps_per_second: float = 0.0  # a round that does not draft (0: unknown, taken as the width-1 entry)
    # Tables of the engine's smaller row buckets (each with its own `slots`: the rows it steps).
    row_buckets: list["CostTable"] = dataclasses.field(default_factory=list)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostTable":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no cost table there (python -m dspark_jax.schedule --out {path})") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a cost table ({err})") from None
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{path}: not a cost table (missing {', '.join(missing)})")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "CostTable":
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        fields["row_buckets"] = [cls.from_dict(t) for t in fields.get("row_buckets", [])]
        return cls(**fields)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for part in (*self.row_buckets, self):
            line, = ax.step(np.arange(len(part.table)), part.table, where="post", label=f"SPS(B), {part.slots} rows")
            ax.plot([part.slots * w for w in part.widths], part.steps_per_second, "o", color=line.get_color())
        ax.set_xscale("symlog")
        ax.set_xlabel("tokens in the verification forward (B)")
        ax.set_ylabel("verification steps per second")
        ax.set_title(f"{self.model} + {self.drafter or 'no drafter'}, {self.slots} slots")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def profile_sps(engine, max_tokens: int | None = None, *, rows: int | None = None, rounds: int = 8,
                repeats: int = 3, prompt_len: int = 16) -> CostTable:
    """Measure verification steps per second of `engine` at each width it compiles, with the
    first `rows` slots (one of engine.row_buckets; default all) live and drafting (the drafter's
    cost included): SPS(B) for B = rows * w, as a staircase table over B = 0 .. max_tokens
    (default rows * (G + 1)); and the rate of a round that does not draft (the dspark gate's
    other choice). Runs the engine's own step program ("fixed" with
    max_length = w - 1; "none" for the plain round the gate falls back to), best of `repeats` timed
    calls, all variants interleaved so the machine's noise hits them alike; every call starts
    from freshly inserted slots, so each is timed at the same context length."""
    from dspark_jax.decode import verify_widths
    from dspark_jax.sampling import SamplingParams

    for name, value in (("rounds", rounds), ("repeats", repeats)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    g = engine.block_size
    rows = engine.slots if rows is None else rows
    if rows not in engine.row_buckets:
        raise ValueError(f"rows must be one of the engine's row buckets {engine.row_buckets}, got {rows!r}")
    size = table_size(rows, g)
    if max_tokens is not None:
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens < engine.slots:
            raise ValueError(f"max_tokens must be an integer >= the slot count {engine.slots}, got {max_tokens!r}")
        size = min(size, int(max_tokens) + 1)
    widths = [w for w in verify_widths(g) if rows * w < size] if g else [1]
    room = engine.max_len - prompt_len - engine.extra_positions
    steps = min(int(rounds), room // (max(widths) + 1))
    if steps < 1:
        raise ValueError(f"max_len {engine.max_len} leaves no room to profile a round of width {max(widths)}")
    ids = engine.placeholder_prompt(prompt_len)
    params = SamplingParams(max_new_tokens=room, ignore_eos=True)
    variants = [("fixed", w - 1) for w in widths] + ([("none", None)] if g else [])
    best = {v: float("inf") for v in variants}
    for call in range(repeats + 1):  # the first call of each variant may compile: untimed
        for policy, cap in variants:
            state = None  # one state alive at a time
            state = engine.insert_many(engine.new_state(), [(slot, ids, params) for slot in range(rows)])
            # The insert's prefill runs asynchronously: timed inside the step it would add the same
            # time to every variant and hide how much more a drafted round costs than a plain one.
            state = jax.block_until_ready(state)
            start = time.perf_counter()
            state, out = engine.step(state, rounds=steps, policy=policy, max_length=cap)
            seconds = time.perf_counter() - start
            if call > 0 and out.rounds > 0:
                best[(policy, cap)] = min(best[(policy, cap)], seconds / out.rounds)
    measured = [float(np.float32(1.0 / best[("fixed", w - 1)])) for w in widths]  # as the table holds it
    plain = float(np.float32(1.0 / best[("none", None)])) if g else measured[0]
    return CostTable(slots=rows, block_size=g, widths=list(widths), steps_per_second=measured,
                     table=staircase(rows, widths, measured, size).tolist(),
                     device=jax.devices()[0].device_kind, plain_steps_per_second=plain)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dspark_jax.schedule`: profile an engine's cost table, print it, save and plot it."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dspark_jax.schedule", description=main.__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF folder")
    parser.add_argument("--drafter", default=None, help="drafter name or checkpoint folder (default: none)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=None, help="largest B in the table")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default="sps.json", help="where the table is saved (JSON)")
    parser.add_argument("--plot", default=None, help="PNG of the table (default: --out with .png)")
    args = parser.parse_args(argv)
    from dspark_jax import load_target, xla_cache

    xla_cache.enable()
    from dspark_jax.engine import Engine

    target = load_target(args.model, dtype=args.dtype)
    engine = Engine(target, args.drafter, slots=args.slots, max_len=args.max_len)
    table = engine.profile(args.max_tokens)
    table.model, table.drafter = args.model, args.drafter or ""
    for part in (*table.row_buckets, table):
        print(f"{part.slots:3d} rows  no draft   B = {part.slots:5d}  {part.plain_steps_per_second:8.2f} steps/s")
        for w, sps in zip(part.widths, part.steps_per_second):
            print(f"{part.slots:3d} rows  width {w:3d}  B = {part.slots * w:5d}  {sps:8.2f} steps/s  "
                  f"{sps * part.slots * w:9.1f} tokens/s")
    table.save(args.out)
    plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    table.plot(plot)
    print(f"saved {args.out} and {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
