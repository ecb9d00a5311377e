"""dspark-jax: confidence-scheduled speculative decoding (DSpark) in JAX."""

from dspark_jax.target import Target, load_target

__all__ = ["Target", "load_target"]

from dspark_jax.generate import GenerateResult, generate  # noqa: E402

__all__ += ["GenerateResult", "generate"]
