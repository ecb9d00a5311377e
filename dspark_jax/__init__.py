"""dspark-jax: confidence-scheduled speculative decoding (DSpark) in JAX."""

from dspark_jax.drafters import Drafter, init_drafter, load_drafter, save_drafter
from dspark_jax.engine import Engine, StepOutput
from dspark_jax.generate import GenerateResult, generate
from dspark_jax.sampling import SamplingParams
from dspark_jax.target import Target, load_target

__all__ = ["Drafter", "Engine", "GenerateResult", "SamplingParams", "StepOutput", "Target", "generate",
           "init_drafter", "load_drafter", "load_target", "save_drafter"]
