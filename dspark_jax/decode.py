"""Plain autoregressive decoding on the device: prefill, then one lax.while_loop for all steps.

Both entry points are pure functions (params, state, ...) -> state; `generate` compiles them ahead
for each bucketed shape and donates the state so the KV cache is updated in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.models.config import ModelConfig
from dspark_jax.models.transformer import KVCache, forward, init_cache, logits_from_hidden
from dspark_jax.sampling import SamplingConfig, sample_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-batch decoding state; every field lives on the device."""

    cache: KVCache  # lengths = tokens already fed through the target per row
    pending: jax.Array  # [batch] int32, the last sampled token, not yet fed to the target
    out: jax.Array  # [batch, out_len] int32, generated tokens (EOS included when produced)
    num_out: jax.Array  # [batch] int32, valid entries of `out`
    budget: jax.Array  # [batch] int32, max new tokens per row (0 for padding rows)
    done: jax.Array  # [batch] bool
    key: jax.Array  # PRNG key
    forwards: jax.Array  # [] int32, target forward passes so far (prefill counts one)


def is_eos(tokens: jax.Array, config: ModelConfig) -> jax.Array:
    if not config.eos_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(config.eos_token_ids, jnp.int32))


def prefill_target(
    params: dict,
    prompt_tokens: jax.Array,  # [b, p] int32, right-padded
    prompt_lens: jax.Array,  # [b] int32
    key: jax.Array,
    *,
    config: ModelConfig,
    sampling: SamplingConfig,
    cache_len: int,
    feature_layers: tuple[int, ...] = (),
):
    """Prompt through the target: (cache with lengths = prompt_lens, first sampled token [b],
    features [b, p, m, e] or None, key)."""
    b, p = prompt_tokens.shape
    cache = init_cache(config, b, cache_len, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache, features = forward(params, config, prompt_tokens, positions, cache, feature_layers)
    last = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]  # [b, e]
    key, sub = jax.random.split(key)
    first = sample_tokens(logits_from_hidden(params, last), sub, sampling)
    cache = dataclasses.replace(cache, lengths=prompt_lens.astype(jnp.int32))
    return cache, first, features, key


def first_outputs(first: jax.Array, budget: jax.Array, out_len: int, config: ModelConfig):
    """Output buffer, counts and done flags after the prefill's token: (out, num_out, done)."""
    active = budget > 0
    out = jnp.zeros((first.shape[0], out_len), jnp.int32).at[:, 0].set(jnp.where(active, first, 0))
    num_out = active.astype(jnp.int32)
    done = ~active | is_eos(first, config) | (num_out >= budget)
    return out, num_out, done


def prefill(
    params: dict,
    prompt_tokens: jax.Array,  # [b, p] int32, right-padded
    prompt_lens: jax.Array,  # [b] int32
    budget: jax.Array,  # [b] int32
    key: jax.Array,
    *,
    config: ModelConfig,
    sampling: SamplingConfig,
    cache_len: int,
    out_len: int,
) -> DecodeState:
    """Run the prompt through the target, fill the cache and sample the first new token."""
    cache, first, _, key = prefill_target(params, prompt_tokens, prompt_lens, key, config=config,
                                          sampling=sampling, cache_len=cache_len)
    out, num_out, done = first_outputs(first, budget, out_len, config)
    return DecodeState(cache=cache, pending=first, out=out, num_out=num_out, budget=budget, done=done,
                       key=key, forwards=jnp.ones((), jnp.int32))


def decode_step(params: dict, state: DecodeState, *, config: ModelConfig, sampling: SamplingConfig) -> DecodeState:
    """Feed every row's pending token, sample the next one; finished rows stay frozen."""
    cache = state.cache
    positions = cache.lengths[:, None]  # [b, 1]
    hidden, cache, _ = forward(params, config, state.pending[:, None], positions, cache)
    key, sub = jax.random.split(state.key)
    token = sample_tokens(logits_from_hidden(params, hidden[:, 0]), sub, sampling)
    live = ~state.done
    b = token.shape[0]
    write_at = jnp.where(live, state.num_out, state.out.shape[1])  # out of range -> dropped
    out = state.out.at[jnp.arange(b), write_at].set(token, mode="drop")
    num_out = state.num_out + live
    done = state.done | (live & (is_eos(token, config) | (num_out >= state.budget)))
    cache = dataclasses.replace(cache, lengths=cache.lengths + live)
    return DecodeState(cache=cache, pending=jnp.where(live, token, state.pending), out=out, num_out=num_out,
                       budget=state.budget, done=done, key=key, forwards=state.forwards + 1)


def decode_loop(params: dict, state: DecodeState, *, config: ModelConfig, sampling: SamplingConfig) -> DecodeState:
    """All remaining steps in one lax.while_loop: runs until every row is done."""

    def cond(s: DecodeState):
        return jnp.any(~s.done)

    def body(s: DecodeState):
        return decode_step(params, s, config=config, sampling=sampling)

    return jax.lax.while_loop(cond, body, state)
