"""DSpark's sequential heads and confidence head (DESIGN 3.2, 3.3).

The parallel backbone drafts every block position at once, so it cannot know which token it
drafted just before; a sequential head adds a cheap low-rank bias B_k that depends on the
previous drafted token x_{k-1} (and, for the gated / rnn variants, on the backbone state h_k).
The same `head_step` serves the inference scan (one position at a time) and teacher-forced
training (all positions flattened into the batch, or a scan for the rnn head).

Head params (dict):
    w1   [V, r]          embedding of the previous token, indexed by target id (also for a
                         reduced draft vocabulary, so no id remapping is needed)
    w2   [r, N]          N = draft_vocab_size or V; zero at init so an untrained head is DFlash
    w_g  [e + r, r]      gated only
    w_z  [2r + e, 3r], b_z [3r]   rnn only (one map to gate g, candidate c, output o)
Confidence params (dict):
    w    [e + r_c]  b []   r_c = head rank, or CONF_EMBED_RANK with its own table
    emb  [V, r_c]          only when there is no sequential head to borrow w1 from
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.models.config import ModelConfig

CONF_EMBED_RANK = 64  # width of the confidence head's own token embedding when there is no head


def _normal(key: jax.Array, shape: tuple[int, ...], std: float = 0.02) -> jax.Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def head_vocab_size(tcfg: ModelConfig, dcfg: DrafterConfig) -> int:
    """Columns of the draft logits: the reduced draft vocabulary when set, else the target's."""
    return dcfg.draft_vocab_size or tcfg.vocab_size


def init_head(key: jax.Array, tcfg: ModelConfig, dcfg: DrafterConfig) -> dict:
    r, e = dcfg.head_rank, tcfg.hidden_size
    k1, k2 = jax.random.split(key)
    hp = {"w1": _normal(k1, (tcfg.vocab_size, r)),
          "w2": jnp.zeros((r, head_vocab_size(tcfg, dcfg)), jnp.float32)}
    if dcfg.head_type == "gated":
        hp["w_g"] = _normal(k2, (e + r, r))
    elif dcfg.head_type == "rnn":
        hp["w_z"] = _normal(k2, (2 * r + e, 3 * r))
        hp["b_z"] = jnp.zeros((3 * r,), jnp.float32)
    elif dcfg.head_type != "markov":
        raise ValueError(f"head type {dcfg.head_type!r} has no params")
    return hp


def head_step(hp: dict, dcfg: DrafterConfig, h_k: jax.Array, prev_token: jax.Array, rnn_state: jax.Array):
    """One position of the sequential head.

    h_k [b, e] backbone hidden, prev_token [b] int32 (the anchor for the first position),
    rnn_state [b, r] (passed through untouched by markov / gated).
    Returns (bias [b, N] float32 added to the base logits, new rnn_state [b, r]).
    """
    emb = jnp.take(hp["w1"], prev_token, axis=0)  # [b, r]
    h_k = h_k.astype(emb.dtype)
    if dcfg.head_type == "markov":
        u = emb
    elif dcfg.head_type == "gated":
        gate = jax.nn.sigmoid(jnp.concatenate([h_k, emb], axis=-1) @ hp["w_g"])  # [b, r]
        u = gate * emb
    elif dcfg.head_type == "rnn":
        z = jnp.concatenate([rnn_state.astype(emb.dtype), emb, h_k], axis=-1)  # [b, 2r + e]
        g, c, o = jnp.split(z @ hp["w_z"] + hp["b_z"], 3, axis=-1)  # each [b, r]
        keep = jax.nn.sigmoid(g)
        rnn_state = (keep * rnn_state + (1.0 - keep) * jnp.tanh(c)).astype(rnn_state.dtype)
        u = jnp.tanh(o)
    else:
        raise ValueError(f"head type {dcfg.head_type!r} has no step")
    bias = jnp.matmul(u, hp["w2"], preferred_element_type=jnp.float32)  # [b, N]
    return bias, rnn_state


def init_confidence(key: jax.Array, tcfg: ModelConfig, dcfg: DrafterConfig) -> dict:
    """Linear confidence head; borrows the sequential head's w1 when there is one."""
    k1, k2 = jax.random.split(key)
    rank = dcfg.head_rank if dcfg.has_head else CONF_EMBED_RANK
    cp = {"w": _normal(k1, (tcfg.hidden_size + rank,)), "b": jnp.zeros((), jnp.float32)}
    if not dcfg.has_head:
        cp["emb"] = _normal(k2, (tcfg.vocab_size, CONF_EMBED_RANK))
    return cp


def confidence_logit(cp: dict, hp: dict | None, h_k: jax.Array, prev_token: jax.Array) -> jax.Array:
    """z_k = w . [h_k ; W1[x_{k-1}]] + b -> [b] float32 (sigmoid(z_k) estimates acceptance)."""
    table = cp["emb"] if "emb" in cp else hp["w1"]
    emb = jnp.take(table, prev_token, axis=0)  # [b, r_c]
    x = jnp.concatenate([h_k.astype(emb.dtype), emb], axis=-1)  # [b, e + r_c]
    return (jnp.matmul(x, cp["w"], preferred_element_type=jnp.float32) + cp["b"]).astype(jnp.float32)
