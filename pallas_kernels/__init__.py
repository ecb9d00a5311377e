"""Pallas kernels for dspark_jax, each beside its jnp reference (this package imports nothing
from dspark_jax).

verify_block: lossless block verification (kernels for TPU and GPU); verify_block_ref holds
the arithmetic spec and the jnp reference it agrees with bit for bit.
"""

from pallas_kernels.verify_block import BACKENDS, tpu_chunk_totals, verify_block
from pallas_kernels.verify_block_ref import (
    DEFAULT_CHUNK,
    effective_chunk,
    num_accepted,
    sample_from_probs,
    verify_block_reference,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK",
    "effective_chunk",
    "num_accepted",
    "sample_from_probs",
    "tpu_chunk_totals",
    "verify_block",
    "verify_block_reference",
]
