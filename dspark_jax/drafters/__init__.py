"""Drafters: DSpark / DFlash (parallel backbone + sequential heads), EAGLE-3, prompt lookup.

A `Drafter` bundles a static config, a params pytree and the fingerprint of the target it was
made for. Checkpoints are an orbax params tree beside a `drafter.json` with the config and the
target fingerprint, so loading refuses a drafter made for another target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.drafters.config import (
    DRAFTER_KINDS,
    DraftOutput,
    DrafterConfig,
    DrafterConfigError,
    default_config,
)
from dspark_jax.models.config import ModelConfig

_MODULES = {"dspark": "dflash", "dflash": "dflash", "eagle3": "eagle3", "ngram": "ngram"}
CHECKPOINT_FORMAT = 1
# Drafters trained by this project's own programs (train/), committed with the package and
# loadable by folder name, e.g. load_drafter("smollm2-135m-dspark").
TRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trained")


def trained_drafters() -> list[str]:
    """Names of the drafter checkpoints shipped with the package."""
    if not os.path.isdir(TRAINED_DIR):
        return []
    return sorted(n for n in os.listdir(TRAINED_DIR) if os.path.isfile(os.path.join(TRAINED_DIR, n, "drafter.json")))


def resolve_drafter_path(name_or_path: str) -> str:
    """A checkpoint folder as given, else a shipped drafter of that name (unchanged when neither)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    shipped = os.path.join(TRAINED_DIR, name_or_path)
    return shipped if os.path.isdir(shipped) else name_or_path


class DrafterMismatchError(ValueError):
    """A drafter used with (or loaded for) a target it was not made for."""


def drafter_module(kind: str):
    """The module implementing the drafter interface of `kind` (see drafters/config.py)."""
    if kind not in _MODULES:
        raise DrafterConfigError(f"unknown drafter kind {kind!r}; supported: {', '.join(DRAFTER_KINDS)}")
    return importlib.import_module(f"dspark_jax.drafters.{_MODULES[kind]}")


def target_fingerprint(tcfg: ModelConfig) -> str:
    """Identifies the target architecture a drafter's weights depend on (shape-level identity)."""
    keys = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim")
    text = json.dumps({k: getattr(tcfg, k) for k in keys}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class Drafter:
    config: DrafterConfig
    params: Any  # pytree of arrays ({} for the n-gram drafter)
    target_fingerprint: str | None  # None: works with any target (n-gram)
    target_description: str = ""
    calibration: dict | None = None  # fitted confidence temperatures etc. (calibration issue)

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def module(self):
        return drafter_module(self.config.kind)

    def check_target(self, tcfg: ModelConfig) -> None:
        if self.target_fingerprint is not None and self.target_fingerprint != target_fingerprint(tcfg):
            raise DrafterMismatchError(
                f"this {self.kind} drafter was made for another target ({self.target_description or 'unknown'}); "
                f"the given target is {tcfg.family} with {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, "
                f"vocab {tcfg.vocab_size}"
            )
        for layer in self.config.target_layer_ids:
            if not -1 <= layer < tcfg.num_layers:
                raise DrafterMismatchError(f"drafter reads target layer {layer}, target has {tcfg.num_layers} layers")


def _describe(tcfg: ModelConfig) -> str:
    return f"{tcfg.family}, {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}"


def _place(params, config: DrafterConfig, tcfg: ModelConfig | None, mesh, rules):
    """Drafter params placed on `mesh` by the logical partition rules (unchanged without a mesh)."""
    if mesh is None or not params:
        return params
    from dspark_jax import sharding

    return sharding.shard_tree(params, sharding.drafter_param_axes(params, config, tcfg), mesh, rules)


def cast_floats(params, dtype):
    """The floating-point leaves of `params` in `dtype` (the target's compute dtype): a drafter
    stored in bf16 and run beside an f32 target would otherwise convert its weights every step."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


def init_drafter(target, kind: str, seed: int = 0, *, mesh=None, rules=None, **overrides) -> Drafter:
    """A randomly initialised drafter of `kind` (dspark | dflash | eagle3 | ngram) for `target`.

    `overrides` replace fields of the kind's default DrafterConfig (block_size, num_layers, ...).
    The params are placed on `mesh` (default: the target's, `target.mesh`) by the logical
    partition `rules` (default: dspark_jax.sharding.SERVE_RULES).
    """
    tcfg = target.config
    config = default_config(kind, tcfg.num_layers, **overrides)
    params = drafter_module(kind).init_params(jax.random.PRNGKey(seed), tcfg, config)
    params = cast_floats(params, target.dtype)
    # Initialised as without a mesh (same values bit for bit), then placed.
    params = _place(params, config, tcfg, mesh if mesh is not None else getattr(target, "mesh", None), rules)
    fingerprint = None if kind == "ngram" else target_fingerprint(tcfg)
    return Drafter(config=config, params=params, target_fingerprint=fingerprint, target_description=_describe(tcfg))


def save_drafter(drafter: Drafter, path: str) -> None:
    """Write `drafter.json` and an orbax checkpoint of the params under the folder `path`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    meta = {
        "format": CHECKPOINT_FORMAT,
        "config": json.loads(drafter.config.to_json()),
        "target_fingerprint": drafter.target_fingerprint,
        "target_description": drafter.target_description,
        "calibration": drafter.calibration,
    }
    if drafter.params:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(path, "params"), drafter.params, force=True)
    with open(os.path.join(path, "drafter.json"), "w") as f:
        json.dump(meta, f, indent=2)


def load_drafter(path: str, target=None, *, mesh=None, rules=None) -> Drafter:
    """Load a drafter checkpoint folder, a shipped trained drafter by name (`trained_drafters()`),
    or the name "ngram" for the prompt-lookup drafter.

    With `target`, refuses a drafter made for another target (generate checks this too).
    The params are placed on `mesh` (default: `target.mesh` when a target is given) by the
    logical partition `rules` (default: dspark_jax.sharding.SERVE_RULES).
    """
    if path == "ngram":
        return Drafter(config=default_config("ngram", 1), params={}, target_fingerprint=None)
    path = resolve_drafter_path(path)
    meta_path = os.path.join(path, "drafter.json")
    if not os.path.isdir(path):
        names = ", ".join(["ngram"] + trained_drafters())
        raise FileNotFoundError(f"{path}: no such drafter checkpoint folder or shipped drafter name (names: {names})")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path}: not a drafter checkpoint (no drafter.json)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        config = DrafterConfig.from_json(json.dumps(meta["config"]))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DrafterConfigError(f"{meta_path}: malformed drafter metadata ({err})") from err
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise DrafterConfigError(f"{meta_path}: unsupported checkpoint format {meta.get('format')!r}")
    drafter = Drafter(config=config, params={}, target_fingerprint=meta.get("target_fingerprint"),
                      target_description=meta.get("target_description", ""), calibration=meta.get("calibration"))
    if target is not None:
        drafter.check_target(target.config)
    params_path = os.path.join(os.path.abspath(path), "params")
    if os.path.isdir(params_path):
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            drafter.params = jax.device_put(ckptr.restore(params_path))  # orbax gives host (numpy) arrays
    if mesh is None and target is not None:
        mesh = getattr(target, "mesh", None)
    drafter.params = _place(drafter.params, config, None if target is None else target.config, mesh, rules)
    return drafter


__all__ = ["Drafter", "DraftOutput", "DrafterConfig", "DrafterMismatchError", "drafter_module", "init_drafter",
           "load_drafter", "save_drafter", "target_fingerprint", "trained_drafters"]
