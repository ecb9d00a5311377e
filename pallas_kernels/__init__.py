"""Pallas kernels for dspark_jax."""

from pallas_kernels.verify_block import verify_block

__all__ = ["verify_block"]
