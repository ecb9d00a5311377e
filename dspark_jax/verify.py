"""Lossless speculative-decoding block verification (jnp), for the decode loop.

The sampled rule and its arithmetic live in ``pallas_kernels.verify_block_ref`` (beside the
Pallas kernels that reproduce it bit for bit); this module re-exports them and adds the
greedy rule, which needs no kernel.  See DESIGN.md section 6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.sampling import argmax_last
from pallas_kernels.verify_block_ref import (  # noqa: F401  (re-exported)
    DEFAULT_CHUNK,
    effective_chunk,
    num_accepted,
    sample_from_probs,
)
from pallas_kernels.verify_block_ref import verify_block_reference as verify_block

__all__ = ["DEFAULT_CHUNK", "effective_chunk", "sample_from_probs", "verify_block",
           "verify_greedy"]


@jax.jit
def verify_greedy(draft_tokens, target_logits, lengths):
    """Greedy verification: accept while d_k == argmax(target_logits[:, k]).

    draft_tokens [B, G], target_logits [B, G+1, V], lengths [B].  next_token is
    the target argmax at the first mismatch (or at position l if all accepted).
    """
    g = draft_tokens.shape[1]
    best = argmax_last(target_logits)  # [B, G+1]
    n = num_accepted(draft_tokens.astype(jnp.int32) == best[:, :g],
                     lengths.astype(jnp.int32))
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
