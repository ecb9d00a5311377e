"""Speculative decoding on the device: draft, verify and commit for the whole batch in one
lax.while_loop (DESIGN.md section 6.1).

Per round and per row r (all rows at once, each at its own position P_r):
  draft   the drafter proposes d_1..d_G after the anchor a (sampled last round, not yet fed);
  length  l_r in [0, G] tokens go to verification (a fixed policy for now, cut by the row's budget);
  verify  one target forward over [a, d_1..d_G] at positions P..P+G writes KV and gives p_1..p_{G+1}
          and the features of those positions; verification accepts n_r <= l_r and gives t_r;
  commit  a, d_1..d_n are committed (cache length += n+1; stale KV past it is masked by position),
          the drafter's context gets their features, t becomes the next anchor; the emitted tokens
          d_1..d_n, t are cut at the first EOS and at the budget.
Shapes are static (every row computes G+1 positions); only masks and lengths vary per row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.decode import first_outputs, is_eos, prefill_target
from dspark_jax.drafters import drafter_module
from dspark_jax.drafters.config import DraftOutput, DrafterConfig
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.transformer import KVCache, forward, logits_from_hidden
from dspark_jax.sampling import SamplingConfig, filtered_probs
from dspark_jax.verify import verify_block, verify_greedy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """Speculative decoding state for one batch; every field lives on the device."""

    cache: KVCache  # target cache; lengths = committed tokens fed per row (the anchor excluded)
    drafter: Any  # the drafter's inference state (context cache etc.)
    anchor: jax.Array  # [b] int32 last committed token, not yet fed to the target
    out: jax.Array  # [b, out_len] int32 emitted tokens
    num_out: jax.Array  # [b] int32
    budget: jax.Array  # [b] int32
    done: jax.Array  # [b] bool
    key: jax.Array
    forwards: jax.Array  # [] int32 target forward passes (prefill counts one)
    row_rounds: jax.Array  # [] int32 sum over rounds of live rows (verification opportunities)
    committed: jax.Array  # [] int32 sum of n+1 over live row-rounds (bonus included; before EOS/budget cuts)
    tried: jax.Array  # [G] int32 live row-rounds that verified position k having accepted 0..k-1
    accepted: jax.Array  # [G] int32 ... of which position k was accepted


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Static settings of one compiled speculative program."""

    config: ModelConfig
    dconfig: DrafterConfig
    sampling: SamplingConfig
    cache_len: int
    out_len: int
    verifier: str = "jnp"  # "jnp" reference or "pallas" kernel


def target_distributions(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """What the verification rule reads: the logits when greedy, else the filtered probabilities."""
    return logits if sampling.greedy else filtered_probs(logits, sampling)


def verify_rule(draft: DraftOutput, target_dist: jax.Array, lengths: jax.Array, key: jax.Array, *,
                s: SpecSettings):
    """(num_accepted [b], next_token [b]) by the greedy rule or lossless rejection sampling
    (jnp reference or Pallas kernel); target_dist [b, G+1, V] from target_distributions."""
    if s.sampling.greedy:
        return verify_greedy(draft.tokens, target_dist, lengths)
    uniforms = jax.random.uniform(key, (lengths.shape[0], draft.tokens.shape[1] + 1), jnp.float32)
    if s.verifier == "pallas":
        import pallas_kernels

        return pallas_kernels.verify_block(draft.tokens, draft.probs, target_dist, lengths, uniforms)
    return verify_block(draft.tokens, draft.probs, target_dist, lengths, uniforms)


def spec_prefill(params, dparams, prompt_tokens, prompt_lens, budget, key, *, s: SpecSettings) -> SpecState:
    """Prompt through the target, sample the first token, feed the prompt to the drafter."""
    mod = drafter_module(s.dconfig.kind)
    layers = s.dconfig.target_layer_ids
    cache, first, features, key = prefill_target(params, prompt_tokens, prompt_lens, key, config=s.config,
                                                 sampling=s.sampling, cache_len=s.cache_len, feature_layers=layers)
    b, p = prompt_tokens.shape
    dstate = mod.init_state(dparams, s.config, s.dconfig, b, s.cache_len)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    dstate = mod.extend(dparams, params, s.config, s.dconfig, dstate, prompt_tokens, features, positions,
                        positions < prompt_lens[:, None])
    out, num_out, done = first_outputs(first, budget, s.out_len, s.config)
    g = s.dconfig.block_size
    zero = jnp.zeros((), jnp.int32)
    return SpecState(cache=cache, drafter=dstate, anchor=first, out=out, num_out=num_out, budget=budget, done=done,
                     key=key, forwards=jnp.ones((), jnp.int32), row_rounds=zero, committed=zero,
                     tried=jnp.zeros((g,), jnp.int32), accepted=jnp.zeros((g,), jnp.int32))


def schedule_lengths(state: SpecState, block_size: int) -> jax.Array:
    """Fixed policy: verify the whole block, but never more than the row can still emit
    (finished rows verify nothing, so they never widen the batch's verification forward)."""
    remaining = jnp.where(state.done, 0, state.budget - state.num_out)  # tokens the row may still emit
    return jnp.clip(remaining - 1, 0, block_size).astype(jnp.int32)


def verify_widths(block_size: int) -> tuple[int, ...]:
    """Compiled widths of the verification forward: powers of two below G+1, then G+1."""
    widths, w = [], 1
    while w < block_size + 1:
        widths.append(w)
        w *= 2
    return tuple(widths) + (block_size + 1,)


def verify_forward(params, cache: KVCache, block, positions, lengths, *, s: SpecSettings):
    """Target forward over the first w columns of block [b, G+1], w the smallest compiled width
    >= max(lengths) + 1 (lax.switch: a round where every row verifies little costs little).

    Returns (logits [b, G+1, V] float32, cache, features [b, G+1, m, e] or None); columns past w
    are zero padding that verification never reads (they lie past every row's l).
    """
    g1 = block.shape[1]
    widths = verify_widths(g1 - 1)
    layers = s.dconfig.target_layer_ids

    def branch(width):
        def run(cache):
            hidden, cache, feats = forward(params, s.config, block[:, :width], positions[:, :width], cache, layers)
            logits = logits_from_hidden(params, hidden)
            pad = [(0, 0), (0, g1 - width)]
            logits = jnp.pad(logits, pad + [(0, 0)])
            if feats is not None:
                feats = jnp.pad(feats, pad + [(0, 0), (0, 0)])
            return logits, cache, feats
        return run

    index = jnp.searchsorted(jnp.asarray(widths), jnp.max(lengths) + 1)
    return jax.lax.switch(index, [branch(w) for w in widths], cache)


def spec_round(params, dparams, state: SpecState, *, s: SpecSettings) -> SpecState:
    """One draft / verify / commit round for every row."""
    mod = drafter_module(s.dconfig.kind)
    g = s.dconfig.block_size
    b = state.anchor.shape[0]
    anchor_pos = state.cache.lengths  # [b]
    key, draft_key, verify_key = jax.random.split(state.key, 3)
    draft, dstate = mod.draft(dparams, params, s.config, s.dconfig, state.drafter, state.anchor, anchor_pos,
                              draft_key, s.sampling)
    lengths = schedule_lengths(state, g)  # [b]
    if draft.proposed is not None:
        lengths = jnp.minimum(lengths, draft.proposed)

    # Verify: one target forward over [anchor, d_1..d_l] at positions P..P+l, run at the smallest
    # compiled width that holds every row's l + 1 tokens.
    block = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)  # [b, G+1]
    positions = anchor_pos[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]  # [b, G+1]
    target_logits, cache, features = verify_forward(params, state.cache, block, positions, lengths, s=s)
    n_acc, next_token = verify_rule(draft, target_distributions(target_logits, s.sampling), lengths, verify_key, s=s)

    # Emitted tokens this round: d_1..d_n then t, cut after the first EOS and at the budget.
    live = ~state.done
    j = jnp.arange(g + 1, dtype=jnp.int32)[None, :]  # [1, G+1]
    drafted_next = jnp.concatenate([draft.tokens, draft.tokens[:, -1:]], axis=1)  # [b, G+1]
    emitted = jnp.where(j < n_acc[:, None], drafted_next, next_token[:, None])  # [b, G+1]
    in_round = j <= n_acc[:, None]
    eos_here = in_round & is_eos(emitted, s.config)
    eos_before = jnp.cumsum(eos_here, axis=1) - eos_here  # EOS strictly before j
    keep = in_round & (eos_before == 0) & (j < (state.budget - state.num_out)[:, None]) & live[:, None]
    count = keep.sum(axis=1).astype(jnp.int32)
    write_at = jnp.where(keep, state.num_out[:, None] + j, s.out_len)  # out of range -> dropped
    out = state.out.at[jnp.arange(b)[:, None], write_at].set(emitted, mode="drop")
    num_out = state.num_out + count
    finished = (keep & eos_here).any(axis=1) | (num_out >= state.budget)
    # Stop a row before a next round could write past its cache.
    finished |= anchor_pos + n_acc + 1 + g + 1 > s.cache_len

    # Commit: anchor and accepted drafts are now in the target cache and the drafter context.
    committed_len = jnp.where(live, n_acc + 1, 0)
    cache = dataclasses.replace(cache, lengths=anchor_pos + committed_len)
    dstate = mod.extend(dparams, params, s.config, s.dconfig, dstate, block, features, positions,
                        j < committed_len[:, None])

    k = jnp.arange(g, dtype=jnp.int32)[None, :]
    tried = live[:, None] & (k < lengths[:, None]) & (k <= n_acc[:, None])
    accepted = tried & (k < n_acc[:, None])
    return SpecState(
        cache=cache, drafter=dstate, anchor=jnp.where(live, next_token, state.anchor), out=out, num_out=num_out,
        budget=state.budget, done=state.done | (live & finished), key=key, forwards=state.forwards + 1,
        row_rounds=state.row_rounds + live.sum(dtype=jnp.int32),
        committed=state.committed + committed_len.sum(dtype=jnp.int32),
        tried=state.tried + tried.sum(axis=0, dtype=jnp.int32),
        accepted=state.accepted + accepted.sum(axis=0, dtype=jnp.int32),
    )


def spec_loop(params, dparams, state: SpecState, *, s: SpecSettings) -> SpecState:
    """Rounds until every row is done, in one lax.while_loop on the device."""

    def cond(st: SpecState):
        return jnp.any(~st.done)

    def body(st: SpecState):
        return spec_round(params, dparams, st, s=s)

    return jax.lax.while_loop(cond, body, state)


def _best_seconds(fn, *args, repeats: int = 3) -> float:
    import time

    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def profile_round(params, dparams, state: SpecState, *, s: SpecSettings) -> dict[str, float]:
    """Seconds of one round's parts at these shapes, each jitted and timed alone (best of 3):
    the drafter's draft, the target's verification forward (with the LM head and the filtered
    probabilities), and the verification rule itself."""
    mod = drafter_module(s.dconfig.kind)
    g = s.dconfig.block_size
    b = state.anchor.shape[0]
    key = jax.random.PRNGKey(0)

    draft_fn = jax.jit(lambda p, dp, st, a, pos: mod.draft(dp, p, s.config, s.dconfig, st, a, pos, key, s.sampling))
    draft, _ = draft_fn(params, dparams, state.drafter, state.anchor, state.cache.lengths)

    def target_part(p, cache, block, positions):
        hidden, _, feats = forward(p, s.config, block, positions, cache, s.dconfig.target_layer_ids)
        return target_distributions(logits_from_hidden(p, hidden), s.sampling), feats

    block = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)
    positions = state.cache.lengths[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]
    target_fn = jax.jit(target_part)
    target_dist, _ = target_fn(params, state.cache, block, positions)
    lengths = jnp.full((b,), g, jnp.int32)
    verify_fn = jax.jit(lambda d, dist, n: verify_rule(d, dist, n, key, s=s))
    verify_args = (draft, target_dist, lengths)
    return {
        "drafter_seconds_per_round": _best_seconds(draft_fn, params, dparams, state.drafter, state.anchor,
                                                   state.cache.lengths),
        "target_seconds_per_round": _best_seconds(target_fn, params, state.cache, block, positions),
        "verify_seconds_per_round": _best_seconds(verify_fn, *verify_args),
    }
