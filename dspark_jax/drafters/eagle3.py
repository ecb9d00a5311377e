"""EAGLE-3 drafter (the baseline): one decoder layer run autoregressively on fused target features.

EAGLE-3 feeds its single layer, at position i, the pair (x_i, E(token_{i+1})), where x_i is
fc(low/mid/high target features at i) for committed positions and the drafter's own previous hidden
state for drafted ones; the pair predicts token_{i+2}. The two halves are normed separately
(embed_norm, hidden_norm) and concatenated as [E ; x] (EAGLE-3's order, so its checkpoints map
directly) into a 2e-wide attention input; the residual runs on x only.

Cache convention: slot s holds the K/V of the entry at position s, i.e. of (x_s, E(token_{s+1})).
The last committed feature cannot make its entry until its next token (the anchor) is known, so it
waits in the state as `pending`. With a single layer an entry's K/V depend only on its own input:
`extend` never needs attention, only projections.

Training ("training-time test") unrolls the layer on its own hidden states. Step j at position i
puts its query at rotary position i + j and attends to the step-0 keys at positions <= i plus its
own keys of steps 1..j (at rotary positions i+1..i+j): exactly what drafting from anchor i+1
computes, so training and inference agree to rounding (tested).

Params:
    fc           [m*e, e]          fuses the m (= 3) target features, no bias
    layer:
      embed_norm, hidden_norm [e]  (EAGLE-3's input_layernorm and hidden_norm)
      wq [heads*d, 2e]  wk, wv [kv_heads*d, 2e]  wo [e, heads*d]    (linear weights [out, in])
      bq [heads*d] bk, bv [kv_heads*d]  (only if the target has attention_bias)
      q_norm, k_norm [d]                (only if the target has qk_norm)
      mlp_norm [e]  w_gate, w_up [f, e]  w_down [e, f]
    final_norm   [e]
    draft_vocab  [N] int32         only with dcfg.draft_vocab_size (drafters/vocab.py)
The embedding and LM head are the target's (shared, frozen), read from `target_params`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dspark_jax.drafters import vocab
from dspark_jax.drafters.config import DrafterConfig, DrafterConfigError, DraftOutput
from dspark_jax.losses import draft_index
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.layers import linear, rms_norm
from dspark_jax.models.transformer import attention_out, embed, mlp_residual, project_qkv, target_rope
from dspark_jax.sampling import RowSampling, sample_with_probs

STEP_DECAY = 0.8  # EAGLE-3's weight on the loss of unrolled step j: 0.8 ** j


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3State:
    """Inference state of one batch of rows (each row at its own position)."""

    k: jax.Array  # [b, cache_len, kv_heads, d] keys of entries, slot s = position s
    v: jax.Array  # [b, cache_len, kv_heads, d]
    pending: jax.Array  # [b, e] fc feature of the last committed position; its entry awaits the anchor


def _check(dcfg: DrafterConfig, tcfg: ModelConfig) -> None:
    if dcfg.kind != "eagle3":
        raise DrafterConfigError(f"eagle3 module got a drafter config of kind {dcfg.kind!r}")
    if not dcfg.target_layer_ids:
        raise DrafterConfigError("eagle3 needs target_layer_ids (EAGLE-3 uses 3: low, mid, high)")
    problem = vocab.check_size(dcfg.draft_vocab_size, tcfg.vocab_size)
    if problem:
        raise DrafterConfigError(problem)


def init_params(key: jax.Array, tcfg: ModelConfig, dcfg: DrafterConfig, dtype=jnp.float32) -> dict:
    """Random drafter params (std 0.02 matrices, unit norms, zero biases, as HF initialises)."""
    _check(dcfg, tcfg)
    e, f, d = tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim
    qd, kvd = tcfg.num_heads * d, tcfg.num_kv_heads * d
    m = len(dcfg.target_layer_ids)
    keys = iter(jax.random.split(key, 8))

    def mat(shape):
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    ones = lambda n: jnp.ones((n,), dtype)  # noqa: E731
    layer = {
        "embed_norm": ones(e), "hidden_norm": ones(e),
        "wq": mat((qd, 2 * e)), "wk": mat((kvd, 2 * e)), "wv": mat((kvd, 2 * e)), "wo": mat((e, qd)),
        "mlp_norm": ones(e), "w_gate": mat((f, e)), "w_up": mat((f, e)), "w_down": mat((e, f)),
    }
    if tcfg.attention_bias:
        layer.update(bq=jnp.zeros((qd,), dtype), bk=jnp.zeros((kvd,), dtype), bv=jnp.zeros((kvd,), dtype))
    if tcfg.qk_norm:
        layer.update(q_norm=ones(d), k_norm=ones(d))
    return {"fc": mat((m * e, e)), "layer": layer, "final_norm": ones(e), **vocab.init_table(dcfg.draft_vocab_size)}


def init_state(params: dict, tcfg: ModelConfig, dcfg: DrafterConfig, batch: int, cache_len: int) -> Eagle3State:
    dtype = params["fc"].dtype
    shape = (batch, cache_len, tcfg.num_kv_heads, tcfg.head_dim)
    return Eagle3State(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                       pending=jnp.zeros((batch, tcfg.hidden_size), dtype))


def _fuse(params: dict, features: jax.Array) -> jax.Array:
    """Target features [b, t, m, e] -> fc(concat) [b, t, e]."""
    b, t, m, e = features.shape
    fc = params["fc"]
    return features.reshape(b, t, m * e).astype(fc.dtype) @ fc


def _layer_input(lp: dict, tcfg: ModelConfig, x: jax.Array, emb: jax.Array) -> jax.Array:
    """Hidden x [b, t, e] and token embedding [b, t, e] -> attention input [b, t, 2e]."""
    eps = tcfg.rms_norm_eps
    return jnp.concatenate([rms_norm(emb.astype(x.dtype), lp["embed_norm"], eps),
                            rms_norm(x, lp["hidden_norm"], eps)], axis=-1)


def extend(params: dict, target_params: dict, tcfg: ModelConfig, dcfg: DrafterConfig, state: Eagle3State,
           tokens: jax.Array, features: jax.Array, positions: jax.Array, valid: jax.Array) -> Eagle3State:
    """Write entries for newly committed tokens.

    tokens [b, t] int32 at positions [b, t], features [b, t, m, e], valid [b, t] bool. Valid entries
    of a row must sit at consecutive positions (any padding pattern around them). A valid token at
    position p completes the entry p - 1, whose feature is the previous valid one in this call or,
    for the first, `pending`; the last valid feature becomes the new `pending`.
    """
    b, t = tokens.shape
    cache_len = state.k.shape[1]
    lp = params["layer"]
    feat = _fuse(params, features)  # [b, t, e]
    index = jnp.arange(t, dtype=jnp.int32)
    last_upto = jax.lax.cummax(jnp.where(valid, index[None], -1), axis=1)  # [b, t] last valid index <= j
    prev = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), last_upto[:, :-1]], axis=1)  # last valid < j
    prev_feat = jnp.take_along_axis(feat, jnp.maximum(prev, 0)[..., None], axis=1)  # [b, t, e]
    prev_feat = jnp.where((prev >= 0)[..., None], prev_feat, state.pending[:, None].astype(feat.dtype))
    entry_pos = positions.astype(jnp.int32) - 1  # [b, t]
    emb = embed(target_params, tokens)
    _, k, v = project_qkv(lp, tcfg, _layer_input(lp, tcfg, prev_feat, emb), target_rope(tcfg, entry_pos))
    slot = jnp.where(valid & (entry_pos >= 0), entry_pos, cache_len)  # cache_len: dropped
    rows = jnp.arange(b)[:, None]
    new_k = state.k.at[rows, slot].set(k.astype(state.k.dtype), mode="drop")
    new_v = state.v.at[rows, slot].set(v.astype(state.v.dtype), mode="drop")
    last = last_upto[:, -1]  # [b]
    last_feat = feat[jnp.arange(b), jnp.maximum(last, 0)]  # [b, e]
    pending = jnp.where((last >= 0)[:, None], last_feat.astype(state.pending.dtype), state.pending)
    return Eagle3State(k=new_k, v=new_v, pending=pending)


def draft_with_logits(params: dict, target_params: dict, tcfg: ModelConfig, dcfg: DrafterConfig,
                      state: Eagle3State, anchor: jax.Array, anchor_pos: jax.Array, keys: jax.Array,
                      sampling: RowSampling):
    """`draft`, also returning the raw drafter logits [b, G, V] (for tests and evaluation).

    Step 1 writes the committed entry (pending, E(anchor)) at slot anchor_pos - 1; step k > 1 feeds
    (g_{k-1}, E(d_{k-1})) at position anchor_pos + k - 2. Each step writes its K/V before attending
    to slots <= its position; slots past a row's position are stale and masked.
    """
    b, cache_len = state.k.shape[:2]
    steps = dcfg.block_size
    lp = params["layer"]
    rows = jnp.arange(b)
    slots = jnp.arange(cache_len, dtype=jnp.int32)

    def step(carry, j):
        x, token, pos, cache_k, cache_v = carry  # [b, e], [b], [b], [b, S, kv, d] x2
        emb = embed(target_params, token)[:, None]  # [b, 1, e]
        q, k, v = project_qkv(lp, tcfg, _layer_input(lp, tcfg, x[:, None], emb), target_rope(tcfg, pos[:, None]))
        slot = jnp.where(pos >= 0, pos, cache_len)
        cache_k = cache_k.at[rows, slot].set(k[:, 0].astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[rows, slot].set(v[:, 0].astype(cache_v.dtype), mode="drop")
        mask = slots[None, None, :] <= pos[:, None, None]  # [b, 1, S]
        attn = attention_out(lp, q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask)  # [b, 1, e]
        g = mlp_residual(lp, tcfg, x[:, None] + attn)[:, 0]  # [b, e]
        hidden = rms_norm(g, params["final_norm"], tcfg.rms_norm_eps)
        logits = vocab.draft_logits(params, target_params, hidden)  # [b, N]
        # Sampled over the draft vocabulary: the distribution over all V ids (zero elsewhere).
        index, probs = sample_with_probs(logits, jax.vmap(jax.random.fold_in, (0, None))(keys, j), sampling)
        new_token = vocab.to_target_ids(params, index)
        return (g, new_token, pos + 1, cache_k, cache_v), (new_token, probs, logits)

    init = (state.pending, anchor.astype(jnp.int32), anchor_pos.astype(jnp.int32) - 1, state.k, state.v)
    (_, _, _, cache_k, cache_v), (tokens, probs, logits) = jax.lax.scan(step, init, jnp.arange(steps))
    out = DraftOutput(tokens=tokens.T, probs=jnp.moveaxis(probs, 0, 1),  # [b, G, N]
                      confidence_logits=jnp.zeros((b, steps), jnp.float32), support=vocab.support(params))
    logits = vocab.to_full_vocab(params, tcfg.vocab_size, jnp.moveaxis(logits, 0, 1))  # [b, G, V]
    return out, logits, Eagle3State(k=cache_k, v=cache_v, pending=state.pending)


def draft(params: dict, target_params: dict, tcfg: ModelConfig, dcfg: DrafterConfig, state: Eagle3State,
          anchor: jax.Array, anchor_pos: jax.Array, keys: jax.Array, sampling: RowSampling, kv_len=None):
    """Draft dcfg.block_size tokens after anchor [b] at anchor_pos [b] -> (DraftOutput, state).
    kv_len is not used: the draft writes its own steps into the cache, so it keeps the whole buffer."""
    del kv_len
    out, _, state = draft_with_logits(params, target_params, tcfg, dcfg, state, anchor, anchor_pos, keys, sampling)
    return out, state


def _attend_ctx_diag(q, ctx_k, ctx_v, diag_k, diag_v, mask):
    """One softmax over context keys and a query's own keys of later unrolled steps.

    q [b, t, heads, d]; ctx_k, ctx_v [b, s, kv, d] with mask [b, t, s]; diag_k, diag_v [b, t, j, kv, d]
    (j may be 0): key j of query t sits at the query's own position. Returns [b, t, heads, d].
    """
    b, t, num_heads, d = q.shape
    kv_heads, s = ctx_k.shape[2], ctx_k.shape[1]
    qg = q.reshape(b, t, kv_heads, num_heads // kv_heads, d)
    scale = 1.0 / math.sqrt(d)
    ctx = jnp.einsum("btkgd,bskd->bkgts", qg, ctx_k, preferred_element_type=jnp.float32) * scale
    ctx = jnp.where(mask[:, None, None], ctx, jnp.finfo(jnp.float32).min)
    own = jnp.einsum("btkgd,btjkd->bkgtj", qg, diag_k, preferred_element_type=jnp.float32) * scale
    weights = jax.nn.softmax(jnp.concatenate([ctx, own], axis=-1), axis=-1).astype(ctx_v.dtype)
    out = (jnp.einsum("bkgts,bskd->btkgd", weights[..., :s], ctx_v)
           + jnp.einsum("bkgtj,btjkd->btkgd", weights[..., s:], diag_v))
    return out.reshape(b, t, num_heads, d)


def train_hidden(params: dict, target_params: dict, tcfg: ModelConfig, dcfg: DrafterConfig,
                 tokens: jax.Array, features: jax.Array, num_steps: int | None = None,
                 rows: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states [num_steps, b, R, e] of the training-time-test unroll.

    Kept separate from the LM head so a trainer with a large vocabulary can compute the loss in
    chunks instead of holding [num_steps, b, R, V] logits. tokens [b, T] and features [b, T, m, e]
    start at position 0. Step j at row i reads token i+1+j (clipped at T-1; those positions
    are masked by the loss) and predicts token i+2+j.

    rows [b, R] int32: the positions whose chains are unrolled (None: all T). Step 0 runs over
    every position, since its keys are every later step's context; a chain past step 0 reads only
    its own row's keys, so steps 1.. run on the R rows alone, with the same result at those rows
    as the full unroll and about R / T of its cost (the trainer samples R anchors per sequence).
    """
    steps = dcfg.block_size if num_steps is None else num_steps
    b, total = tokens.shape
    lp = params["layer"]
    positions = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (b, total))
    rows = positions if rows is None else rows.astype(jnp.int32)  # [b, R]
    diag_k = diag_v = None  # [b, R, j, kv, d] once step 1 has run

    def rows_of(a):  # [b, T, ...] -> [b, R, ...]
        return jnp.take_along_axis(a, rows.reshape(rows.shape + (1,) * (a.ndim - 2)), axis=1)

    # Step 0 over all positions: its K/V are the context of every later step.
    x = _fuse(params, features)  # [b, T, e]
    emb = embed(target_params, tokens[:, jnp.minimum(jnp.arange(total) + 1, total - 1)])
    q, ctx_k, ctx_v = project_qkv(lp, tcfg, _layer_input(lp, tcfg, x, emb), target_rope(tcfg, positions))
    causal = positions[:, None, :] <= positions[:, :, None]  # [b, T, T]
    empty = jnp.zeros((b, total, 0, tcfg.num_kv_heads, tcfg.head_dim), x.dtype)  # no own keys yet
    attn = linear(_attend_ctx_diag(q, ctx_k, ctx_v, empty, empty, causal).reshape(b, total, -1), lp["wo"])
    x = rows_of(mlp_residual(lp, tcfg, x + attn))  # [b, R, e]
    outs = [rms_norm(x, params["final_norm"], tcfg.rms_norm_eps)]
    seen = positions[:, None, :] <= rows[:, :, None]  # [b, R, T]: context a row's query may read
    for j in range(1, steps):  # static unroll over the (few) drafted steps, not over tokens
        emb = embed(target_params, jnp.take_along_axis(tokens, jnp.minimum(rows + 1 + j, total - 1), axis=1))
        q, k, v = project_qkv(lp, tcfg, _layer_input(lp, tcfg, x, emb), target_rope(tcfg, rows + j))
        diag_k = k[:, :, None] if diag_k is None else jnp.concatenate([diag_k, k[:, :, None]], axis=2)
        diag_v = v[:, :, None] if diag_v is None else jnp.concatenate([diag_v, v[:, :, None]], axis=2)
        attn = linear(_attend_ctx_diag(q, ctx_k, ctx_v, diag_k, diag_v, seen).reshape(b, rows.shape[1], -1),
                      lp["wo"])
        x = mlp_residual(lp, tcfg, x + attn)
        outs.append(rms_norm(x, params["final_norm"], tcfg.rms_norm_eps))
    return jnp.stack(outs)


def train_forward(params: dict, target_params: dict, tcfg: ModelConfig, dcfg: DrafterConfig,
                  tokens: jax.Array, features: jax.Array, num_steps: int | None = None,
                  rows: jax.Array | None = None) -> jax.Array:
    """Training-time-test logits [num_steps, b, R, V]: step j at row i predicts tokens[i+2+j]
    (-inf outside a reduced draft vocabulary)."""
    return vocab.to_full_vocab(params, tcfg.vocab_size,
                               train_draft_logits(params, target_params, tcfg, dcfg, tokens, features, num_steps,
                                                  rows))


def train_draft_logits(params: dict, target_params: dict, tcfg: ModelConfig, dcfg: DrafterConfig,
                       tokens: jax.Array, features: jax.Array, num_steps: int | None = None,
                       rows: jax.Array | None = None) -> jax.Array:
    """train_forward's logits over the draft ids only: [num_steps, b, R, N] (what the trainer
    uses with eagle3_loss(..., draft_vocab=...), keeping [.., V] arrays out of the backward pass)."""
    hidden = train_hidden(params, target_params, tcfg, dcfg, tokens, features, num_steps, rows)
    return vocab.draft_logits(params, target_params, hidden)


def unroll_targets(tokens: jax.Array, mask: jax.Array, steps: int, rows: jax.Array | None = None,
                   row_valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """What step j at row i is trained to predict, tokens[i+2+j], and whether that term counts:
    ([S, b, R] ids, [S, b, R] bool). tokens, mask [b, T]; rows [b, R] (None: all T positions);
    row_valid [b, R] drops whole rows (a sequence with fewer eligible rows than R)."""
    b, total = tokens.shape
    if rows is None:
        rows = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (b, total))
    target_index = rows[None] + 2 + jnp.arange(steps, dtype=jnp.int32)[:, None, None]  # [S, b, R]
    clipped = jnp.minimum(target_index, total - 1)
    pick = jax.vmap(lambda a, idx: jnp.take_along_axis(a, idx, axis=1), in_axes=(None, 0))
    valid = pick(mask, clipped) & (target_index < total)
    if row_valid is not None:
        valid = valid & row_valid[None]
    return pick(tokens, clipped), valid


def eagle3_loss(logits: jax.Array, tokens: jax.Array, mask: jax.Array, decay: float = STEP_DECAY,
                draft_vocab: jax.Array | None = None, vocab_size: int | None = None,
                rows: jax.Array | None = None, row_valid: jax.Array | None = None) -> jax.Array:
    """sum_j decay^j * mean CE(logits[j, :, r], tokens[rows[r]+2+j]) over supervised targets.

    logits [S, b, R, V], or [S, b, R, N] over `draft_vocab` [N] (then `vocab_size` is needed);
    tokens [b, T]; mask [b, T] marks supervised target tokens (e.g. assistant tokens); rows [b, R]
    as in train_hidden (None: all T). The term (j, r) counts when rows[r]+2+j < T, that token is
    supervised, its row is valid and it is one the drafter can emit. Each step is averaged over
    its own valid terms, then weighted.
    """
    if draft_vocab is not None:
        index = draft_index(draft_vocab, vocab_size)
        mask = mask & (index[tokens] >= 0)
        tokens = jnp.maximum(index[tokens], 0)
    steps = logits.shape[0]
    targets, valid = unroll_targets(tokens, mask, steps, rows, row_valid)  # [S, b, R]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [S, b, R]
    per_step = jnp.sum(nll * valid, axis=(1, 2)) / jnp.maximum(jnp.sum(valid, axis=(1, 2)), 1)
    return jnp.sum(decay ** jnp.arange(steps, dtype=jnp.float32) * per_step)
