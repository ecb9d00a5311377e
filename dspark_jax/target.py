"""The loaded target model: config, params on the device, tokenizer."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models.config import ModelConfig
from dspark_jax.models.loading import DEFAULT_MODEL, converted_gguf, load_hf_folder, resolve_model_path
from dspark_jax.models.tokenizer import load_tokenizer_dir
from dspark_jax.models.transformer import unstack_layers

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class Target:
    """A target model ready to run: `params` is a pytree of device arrays in `dtype`, with
    `params["layers"]` a tuple of per-layer dicts (see models.transformer.unstack_layers).

    `mesh` is the jax.sharding.Mesh the params are placed on (see dspark_jax.sharding), or None
    for one device; code that places decode state next to the params reads it from here."""

    config: ModelConfig
    params: dict
    tokenizer: Any  # transformers fast tokenizer (chat template included) or None
    name: str
    dtype: Any = jnp.float32
    mesh: Any = None
    # Engines made by `generate` for this target, by shape: repeated calls reuse their programs.
    engines: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # Drafters `generate` loaded by name for this target: a name loads once, so its engine is reused.
    drafters: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


def _as_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"unsupported dtype {dtype!r}; supported: float32, bfloat16")
    return jnp.dtype(dtype).type


def load_target(name_or_path: str = DEFAULT_MODEL, dtype="float32", *, mesh=None, rules=None) -> Target:
    """Load a target model by name (`smollm2-135m`), from a .gguf file, or from an HF folder.

    With `mesh` (from dspark_jax.sharding.make_mesh) the params go straight from the host to
    their shards on the mesh by the logical partition `rules` (default: sharding.SERVE_RULES,
    tensor parallel over heads, MLP and vocabulary); no device ever holds a full copy of a
    split weight. Without it they live on the default device.
    """
    dtype = _as_dtype(dtype)
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        config, params = load_hf_folder(path)
        tokenizer = load_tokenizer_dir(path)
    else:
        config, params, tokenizer = converted_gguf(path)
    if mesh is None:
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), unstack_layers(params))
    else:
        from dspark_jax import sharding

        host = jax.tree.map(lambda a: np.asarray(a, dtype=dtype), unstack_layers(params))
        params = sharding.shard_tree(host, sharding.target_param_axes(host, config), mesh, rules)
    return Target(config=config, params=params, tokenizer=tokenizer, name=name_or_path, dtype=dtype, mesh=mesh)
