"""DFlash parallel backbone with DSpark's anchor-as-first-position layout (DESIGN 3.1-3.3).

Serves drafter kinds "dspark" and "dflash"; they differ only by config (dflash: head_type
"none", no confidence head). Implements the interface of `dspark_jax.drafters.config`.

A block of G = block_size inputs [E(anchor), MASK x (G-1)] at rotary positions p..p+G-1 runs
through drafter layers shaped exactly like the target's (so the target's project_qkv /
mlp_residual apply to one layer's slice with the target ModelConfig). Queries come from the
block; keys/values are the context (committed positions < p, built from projected target
features) plus the block itself, bidirectionally. The target's frozen embedding and LM head are
read from `target_params`, never copied into the drafter params.

Params (dict):
    w_c        [m*e, e]   ctx_norm [e]    ctx_i = RMSNorm(W_c f_i)
    layers     stacked like the target's layers: attn_norm, wq, wk, wv, wo, (bq, bk, bv),
               (q_norm, k_norm), mlp_norm, w_gate, w_up, w_down, each [num_layers, ...]
    final_norm [e]
    mask_embed [e]        only when dcfg.mask_token_id is None
    head       heads.init_head         only when dcfg.has_head
    confidence heads.init_confidence   only when dcfg.confidence_head
    draft_vocab [N] int32 only with dcfg.draft_vocab_size: target ids of the reduced vocabulary.
               Not trainable: keep it out of the optimizer (and pass allow_int=True to jax.grad
               or split it off before differentiating).

Einsum letters: b batch, a block (anchor), q / r query / key position inside a block, s context
slot, k KV head, g query heads per KV head, d head dim, e model dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dspark_jax.drafters import heads, vocab
from dspark_jax.drafters.config import DrafterConfig, DrafterConfigError, DraftOutput
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.layers import linear, rms_norm
from dspark_jax.models.transformer import embed, mlp_residual, project_qkv, target_rope, unstack_layers
from dspark_jax.sampling import RowSampling, sample_with_probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFlashState:
    """Drafter context cache: roped keys and values of ctx_i per drafter layer, slot s = position s.

    Slots at or past a row's anchor position may hold stale entries from rejected drafts; `draft`
    masks them by position, so they never need erasing.
    """

    k: jax.Array  # [layers, b, kv_heads, cache_len, head_dim] (kv-major, as the target's cache:
    v: jax.Array  # [layers, b, kv_heads, cache_len, head_dim]  attention never transposes it)


def _check(tcfg: ModelConfig, dcfg: DrafterConfig) -> None:
    if not dcfg.target_layer_ids:
        raise DrafterConfigError("a DFlash/DSpark drafter needs target_layer_ids (the features it reads)")
    problem = vocab.check_size(dcfg.draft_vocab_size, tcfg.vocab_size)
    if problem:
        raise DrafterConfigError(problem)


def init_params(key: jax.Array, tcfg: ModelConfig, dcfg: DrafterConfig) -> dict:
    _check(tcfg, dcfg)
    e, f, d = tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim
    nl, hq, hkv = dcfg.num_layers, tcfg.num_heads * d, tcfg.num_kv_heads * d
    m = len(dcfg.target_layer_ids)
    keys = iter(jax.random.split(key, 12))

    def normal(shape):
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    layers = {
        "attn_norm": jnp.ones((nl, e)), "mlp_norm": jnp.ones((nl, e)),
        "wq": normal((nl, hq, e)), "wk": normal((nl, hkv, e)), "wv": normal((nl, hkv, e)),
        "wo": normal((nl, e, hq)),
        "w_gate": normal((nl, f, e)), "w_up": normal((nl, f, e)), "w_down": normal((nl, e, f)),
    }
    if tcfg.attention_bias:
        layers.update(bq=jnp.zeros((nl, hq)), bk=jnp.zeros((nl, hkv)), bv=jnp.zeros((nl, hkv)))
    if tcfg.qk_norm:
        layers.update(q_norm=jnp.ones((nl, d)), k_norm=jnp.ones((nl, d)))
    params = {"w_c": normal((m * e, e)), "ctx_norm": jnp.ones((e,)), "layers": layers,
              "final_norm": jnp.ones((e,))}
    if dcfg.mask_token_id is None:
        params["mask_embed"] = normal((e,))
    if dcfg.has_head:
        params["head"] = heads.init_head(next(keys), tcfg, dcfg)
    if dcfg.confidence_head:
        params["confidence"] = heads.init_confidence(next(keys), tcfg, dcfg)
    params.update(vocab.init_table(dcfg.draft_vocab_size))
    return params


def copy_target_layers(params: dict, target_params: dict, dcfg: DrafterConfig) -> dict:
    """`params` with the drafter layers set to copies of the target's last num_layers layers and
    final_norm to the target's, so the output starts where the frozen LM head reads. Measured on
    smollm2-135m it trained worse than random layers (train/results/2026-12-02-init-target), so
    it is an option, not the default. The context projection w_c, mask embedding and heads stay
    as initialised. Accepts stacked or per-layer target params."""
    layers = unstack_layers(target_params)["layers"]  # per-layer dicts, whichever layout came in
    if dcfg.num_layers > len(layers):
        raise DrafterConfigError(f"cannot copy {dcfg.num_layers} layers from a target with {len(layers)}")
    last = layers[len(layers) - dcfg.num_layers:]
    copied = {}
    for name, value in params["layers"].items():
        source = jnp.stack([layer[name] for layer in last])
        if source.shape != value.shape:
            raise DrafterConfigError(f"target layer weight {name} is {source.shape}, the drafter's {value.shape}")
        copied[name] = source.astype(value.dtype)
    final_norm = target_params["final_norm"].astype(params["final_norm"].dtype)
    return {**params, "layers": copied, "final_norm": final_norm}


def grow_layers(key: jax.Array, params: dict, tcfg: ModelConfig, dcfg: DrafterConfig, num_layers: int) -> dict:
    """`params` (a trained drafter of dcfg.num_layers layers) with fresh layers appended up to
    num_layers. Each new layer's output projections (wo, w_down) start at zero, so it adds
    nothing to the residual stream and the grown drafter drafts exactly as the trained one did
    until training moves them: a deeper backbone continues from a trained one instead of
    starting over (train.fit --init-from NAME --num-layers N)."""
    have = dcfg.num_layers
    if num_layers < have:
        raise DrafterConfigError(f"cannot grow a {have}-layer drafter to {num_layers} layers")
    if num_layers == have:
        return params
    fresh = init_params(key, tcfg, dataclasses.replace(dcfg, num_layers=num_layers - have))["layers"]
    fresh = {**fresh, "wo": jnp.zeros_like(fresh["wo"]), "w_down": jnp.zeros_like(fresh["w_down"])}
    old = params["layers"]
    grown = {name: jnp.concatenate([old[name], fresh[name].astype(old[name].dtype)]) for name in old}
    return {**params, "layers": grown}


def init_state(params: dict, tcfg: ModelConfig, dcfg: DrafterConfig, batch: int, cache_len: int) -> DFlashState:
    shape = (dcfg.num_layers, batch, tcfg.num_kv_heads, cache_len, tcfg.head_dim)
    dtype = params["w_c"].dtype
    return DFlashState(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


# ----------------------------------------------------------------------------- backbone
def _context_kv(params: dict, tcfg: ModelConfig, features: jax.Array, positions: jax.Array):
    """Features [b, t, m, e] at positions [b, t] -> roped K and V [layers, b, kv_heads, t, d].

    The context enters every drafter layer through that layer's own W_K / W_V applied to
    ctx_i = RMSNorm(W_c f_i) (no per-layer input norm, as in DFlash).
    """
    b, t = features.shape[:2]
    flat = features.reshape(b, t, -1).astype(params["w_c"].dtype)  # [b, t, m*e]
    ctx = rms_norm(flat @ params["w_c"], params["ctx_norm"], tcfg.rms_norm_eps)  # [b, t, e]
    rope = target_rope(tcfg, positions)

    def layer(_, lp):
        _, k, v = project_qkv(lp, tcfg, ctx, rope)  # q is dead code under jit
        return None, (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))  # kv-major

    _, (k, v) = jax.lax.scan(layer, None, params["layers"])
    return k, v


def _block_attention(q, ctx_k, ctx_v, ctx_visible, blk_k, blk_v):
    """Joint softmax over a block's visible context slots and its own positions.

    q [b, a, G, heads, d]; ctx_k, ctx_v [b, kv, s, d] shared by all blocks of a row;
    ctx_visible [b, a, s] bool; blk_k, blk_v [b, a, G, kv, d]. Returns [b, a, G, heads * d].
    Blockwise so training never materialises scores between different blocks.
    """
    b, a, G, nh, d = q.shape
    kv = ctx_k.shape[1]
    qg = q.reshape(b, a, G, kv, nh // kv, d)
    scale = 1.0 / math.sqrt(d)
    s_ctx = jnp.einsum("baqkgd,bksd->bakgqs", qg, ctx_k.astype(q.dtype), preferred_element_type=jnp.float32)
    s_blk = jnp.einsum("baqkgd,barkd->bakgqr", qg, blk_k, preferred_element_type=jnp.float32)
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx * scale, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk * scale], axis=-1), axis=-1)
    w_ctx = weights[..., : s_ctx.shape[-1]].astype(q.dtype)  # [b, a, k, g, G, s]
    w_blk = weights[..., s_ctx.shape[-1]:].astype(q.dtype)  # [b, a, k, g, G, G]
    out = (jnp.einsum("bakgqs,bksd->baqkgd", w_ctx, ctx_v.astype(q.dtype))
           + jnp.einsum("bakgqr,barkd->baqkgd", w_blk, blk_v))
    return out.reshape(b, a, G, nh * d)


def _block_layer(lp, tcfg, h, ctx_k, ctx_v, ctx_visible, rope, queries: int):
    """One drafter layer over blocks h [b, a, G, e] -> [b, a, queries, e]: keys and values come
    from all G block positions, queries and everything after attention from the first `queries`."""
    b, a, G, _ = h.shape
    x = rms_norm(h, lp["attn_norm"], tcfg.rms_norm_eps).reshape(b, a * G, -1)
    q, k, v = project_qkv(lp, tcfg, x, rope)
    q = q.reshape(b, a, G, tcfg.num_heads, tcfg.head_dim)[:, :, :queries]
    k = k.reshape(b, a, G, tcfg.num_kv_heads, tcfg.head_dim)
    v = v.reshape(b, a, G, tcfg.num_kv_heads, tcfg.head_dim)
    h = h[:, :, :queries] + linear(_block_attention(q, ctx_k, ctx_v, ctx_visible, k, v), lp["wo"])
    return mlp_residual(lp, tcfg, h)


def _block_hidden(params, target_params, tcfg, dcfg, ctx_k, ctx_v, ctx_visible, anchor_tokens, block_pos,
                  depth: int | None = None):
    """Drafter layers over blocks [E(anchor), MASK...] -> final-normed hidden [b, a, depth, e].

    ctx_k, ctx_v [layers, b, kv, s, d]; ctx_visible [b, a, s]; anchor_tokens [b, a];
    block_pos [b, a, G] rotary positions anchor_pos + k. `depth` (static, default G): only the
    first `depth` positions' hidden states are wanted. Every layer but the last still runs all G
    positions (the last one's keys and values need them), the last one computes attention, its
    output projection and MLP for those positions only: exactly the first `depth` of the full
    block's hidden states, at about depth / G of the last layer's cost.
    """
    b, a, G = block_pos.shape
    depth = G if depth is None else depth
    # Compute in the drafter's dtype (the frozen target may be stored in a narrower one).
    first = embed(target_params, anchor_tokens).astype(params["w_c"].dtype)  # [b, a, e]
    if dcfg.mask_token_id is None:
        mask_vec = params["mask_embed"]
    else:
        mask_vec = target_params["embed"][dcfg.mask_token_id]
    masks = jnp.broadcast_to(mask_vec.astype(first.dtype), (b, a, G - 1, first.shape[-1]))
    h = jnp.concatenate([first[:, :, None, :], masks], axis=2)  # [b, a, G, e]
    rope = target_rope(tcfg, block_pos.reshape(b, a * G))

    def layer(h, xs):
        lp, ck, cv = xs
        return _block_layer(lp, tcfg, h, ck, cv, ctx_visible, rope, G), None

    layers = params["layers"]
    if depth == G:
        h, _ = jax.lax.scan(layer, h, (layers, ctx_k, ctx_v))
    else:
        h, _ = jax.lax.scan(layer, h, jax.tree.map(lambda x: x[:-1], (layers, ctx_k, ctx_v)))
        h = _block_layer(jax.tree.map(lambda x: x[-1], layers), tcfg, h, ctx_k[-1], ctx_v[-1], ctx_visible, rope,
                         depth)
    return rms_norm(h, params["final_norm"], tcfg.rms_norm_eps)


def _head_outputs(params, dcfg, h_k, prev, rnn_state):
    """Head bias [b, N] (0 without a head), confidence logit [b], new rnn state [b, r]."""
    hp = params.get("head")
    bias = 0.0
    if dcfg.has_head:
        bias, rnn_state = heads.head_step(hp, dcfg, h_k, prev, rnn_state)
    if dcfg.confidence_head:
        conf = heads.confidence_logit(params["confidence"], hp, h_k, prev)
    else:
        conf = jnp.zeros(prev.shape, jnp.float32)
    return bias, conf, rnn_state


def _rnn_zeros(dcfg: DrafterConfig, n: int) -> jax.Array:
    return jnp.zeros((n, dcfg.head_rank if dcfg.has_head else 0), jnp.float32)


# ----------------------------------------------------------------------------- inference
def extend(params, target_params, tcfg, dcfg, state: DFlashState, tokens, features, positions, valid):
    """Write the context K/V of newly committed positions (tokens unused: DFlash reads features).

    features [b, t, m, e], positions [b, t] int32, valid [b, t] bool.
    """
    del target_params, tokens
    k, v = _context_kv(params, tcfg, features, positions)  # [layers, b, kv, t, d]
    cache_len = state.k.shape[3]
    slot = jnp.where(valid, positions, cache_len)  # invalid -> out of range -> dropped
    rows = jnp.arange(slot.shape[0])[:, None]
    # The indices (rows, slot) [b, t] are split by a slice, so the indexed shape is [b, t, layers, kv, d].
    new_k = state.k.at[:, rows, :, slot].set(jnp.transpose(k, (1, 3, 0, 2, 4)).astype(state.k.dtype), mode="drop")
    new_v = state.v.at[:, rows, :, slot].set(jnp.transpose(v, (1, 3, 0, 2, 4)).astype(state.v.dtype), mode="drop")
    return DFlashState(k=new_k, v=new_v)


def _draft_hidden(params, target_params, tcfg, dcfg, state, anchor, anchor_pos, kv_len=None, depth=None):
    """Backbone hidden [b, depth, e] (depth: static, default G) of the block after `anchor` [b] at
    `anchor_pos` [b], attending to context slots [0, kv_len) only (static; every anchor_pos must
    be below it)."""
    G = dcfg.block_size
    span = state.k.shape[3] if kv_len is None else min(int(kv_len), state.k.shape[3])
    slots = jnp.arange(span, dtype=jnp.int32)
    ctx_visible = (slots[None, :] < anchor_pos[:, None])[:, None, :]  # [b, 1, s]
    block_pos = (anchor_pos[:, None] + jnp.arange(G, dtype=jnp.int32))[:, None, :]  # [b, 1, G]
    h = _block_hidden(params, target_params, tcfg, dcfg, state.k[..., :span, :], state.v[..., :span, :], ctx_visible,
                      anchor[:, None], block_pos, depth)
    return h[:, 0]


def draft_backbone(params, target_params, tcfg, dcfg, state, anchor, anchor_pos):
    """(hidden [b, G, e], base logits U [b, G, V] float32) of one draft block, without the head."""
    h = _draft_hidden(params, target_params, tcfg, dcfg, state, anchor, anchor_pos)
    return h, vocab.to_full_vocab(params, tcfg.vocab_size, vocab.draft_logits(params, target_params, h))


# Drafts of fewer than G tokens are exact (the first positions of the whole block's draft) and
# cheaper, so `decode` may ask for a depth; the state is only read, so drafting at one of several
# depths (a lax.switch) copies nothing.
DRAFTS_AT_DEPTH = True
NO_CONFIDENCE = -1e9  # confidence logit of positions past the depth: calibrated survival 0


def draft(params, target_params, tcfg, dcfg, state, anchor, anchor_pos, keys, sampling: RowSampling,
          forced_tokens=None, kv_len=None, depth=None):
    """Draft G tokens after the anchor; see the interface in drafters/config.py.

    The sequential head runs left to right in a lax.scan, each position conditioned on the token
    drafted before it. `forced_tokens` [b, G] (testing only) replaces the drafted tokens, both as
    output and as the head's previous tokens, so the scan can be compared with teacher forcing.
    `depth` (static, 1..G, default G): only the first `depth` tokens are drafted, exactly as the
    whole block drafts them; the outputs keep G columns, past the depth tokens 0, zero
    probabilities and confidence logits NO_CONFIDENCE, and `proposed` says `depth` (set
    whenever a depth is given, so drafts at different depths have one output structure).
    """
    G = dcfg.block_size
    asked, depth = depth, G if depth is None else int(depth)
    if not 1 <= depth <= G:
        raise ValueError(f"depth must be in [1, {G}], got {depth}")
    b = anchor.shape[0]
    h = _draft_hidden(params, target_params, tcfg, dcfg, state, anchor, anchor_pos, kv_len, depth)  # [b, D, e]
    base = vocab.draft_logits(params, target_params, h)  # [b, D, N]
    forced = jnp.zeros((b, G), jnp.int32) if forced_tokens is None else forced_tokens.astype(jnp.int32)

    def step(carry, xs):
        prev, rnn_state = carry
        u_k, h_k, k, forced_k = xs
        bias, conf, rnn_state = _head_outputs(params, dcfg, h_k, prev, rnn_state)
        # Sampled over the draft vocabulary [b, N]: the same distribution as over all V ids
        # (every other id has probability 0), at N/V of the cost inside the sequential scan.
        index, probs = sample_with_probs(u_k + bias, jax.vmap(jax.random.fold_in, (0, None))(keys, k), sampling)
        token = vocab.to_target_ids(params, index)
        if forced_tokens is not None:
            token = forced_k
        return (token, rnn_state), (token, probs, conf)

    xs = (jnp.moveaxis(base, 1, 0), jnp.moveaxis(h, 1, 0), jnp.arange(depth), jnp.moveaxis(forced[:, :depth], 1, 0))
    _, (tokens, probs, conf) = jax.lax.scan(step, (anchor.astype(jnp.int32), _rnn_zeros(dcfg, b)), xs)
    rest = [(0, 0), (0, G - depth)]
    out = DraftOutput(tokens=jnp.pad(jnp.moveaxis(tokens, 0, 1), rest),  # [b, G]
                      probs=jnp.pad(jnp.moveaxis(probs, 0, 1), rest + [(0, 0)]),  # [b, G, N]
                      confidence_logits=jnp.pad(jnp.moveaxis(conf, 0, 1), rest, constant_values=NO_CONFIDENCE),
                      support=vocab.support(params),
                      proposed=None if asked is None else jnp.full((b,), depth, jnp.int32))
    return out, state


# ----------------------------------------------------------------------------- training
def train_forward(params, target_params, tcfg, dcfg, tokens, features, anchors):
    """Teacher-forced forward of A blocks per sequence, all in parallel.

    tokens [b, T] int32, features [b, T, m, e], anchors [b, A] int32 positions. Block a covers
    positions anchor..anchor+G-1, sees context positions < anchor plus itself, and predicts
    tokens anchor+1..anchor+G. The head's previous tokens are the ground truth
    [tokens[anchor], .., tokens[anchor+G-1]]. Positions past T-1 give garbage (indices are
    clipped) that the caller masks.
    Returns {"base_logits" [b, A, G, V], "logits" [b, A, G, V] (base + head bias; -inf outside a
    reduced draft vocabulary), "draft_logits" [b, A, G, N] (the same over the draft ids only; a
    caller that uses only these never materialises the [.., V] ones under jit),
    "confidence_logits" [b, A, G], "hidden" [b, A, G, e]}.
    """
    b, T = tokens.shape
    A, G = anchors.shape[1], dcfg.block_size
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
    ctx_k, ctx_v = _context_kv(params, tcfg, features, positions)  # [layers, b, kv, T, d]
    anchors = anchors.astype(jnp.int32)
    ctx_visible = jnp.arange(T)[None, None, :] < anchors[:, :, None]  # [b, A, T]
    block_pos = anchors[:, :, None] + jnp.arange(G, dtype=jnp.int32)  # [b, A, G]
    anchor_tokens = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, T - 1), axis=1)  # [b, A]
    h = _block_hidden(params, target_params, tcfg, dcfg, ctx_k, ctx_v, ctx_visible, anchor_tokens, block_pos)
    base = vocab.draft_logits(params, target_params, h)  # [b, A, G, N]
    prev = jnp.take_along_axis(tokens, jnp.clip(block_pos, 0, T - 1).reshape(b, A * G), axis=1)
    prev = prev.reshape(b * A, G)  # teacher-forced previous tokens
    h_rows = h.reshape(b * A, G, -1)

    if dcfg.head_type == "rnn" and dcfg.has_head:
        # The rnn state threads through the block, so scan over positions.
        def step(state, xs):
            h_k, prev_k = xs
            bias, conf, state = _head_outputs(params, dcfg, h_k, prev_k, state)
            return state, (bias, conf)

        _, (bias, conf) = jax.lax.scan(step, _rnn_zeros(dcfg, b * A),
                                       (jnp.moveaxis(h_rows, 1, 0), jnp.moveaxis(prev, 1, 0)))
        bias, conf = jnp.moveaxis(bias, 0, 1), jnp.moveaxis(conf, 0, 1)  # [bA, G, N], [bA, G]
    else:
        # Markov / gated / none are memoryless: every position at once.
        n = b * A * G
        bias, conf, _ = _head_outputs(params, dcfg, h_rows.reshape(n, -1), prev.reshape(n), _rnn_zeros(dcfg, n))
    if dcfg.has_head:
        logits = base + bias.reshape(base.shape)
    else:
        logits = base
    return {
        "base_logits": vocab.to_full_vocab(params, tcfg.vocab_size, base),
        "logits": vocab.to_full_vocab(params, tcfg.vocab_size, logits),
        "draft_logits": logits,
        "confidence_logits": conf.reshape(b, A, G),
        "hidden": h,
    }
