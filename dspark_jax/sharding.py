"""The one owner of partition rules: logical axis names, rule sets, meshes and placement.

Every array the library keeps on the device has its dimensions named with *logical* axes, declared
here once per parameter layout (target, DFlash/DSpark and EAGLE-3 drafters, DSpark heads) and per
state layout (KV cache, drafter states, per-slot vectors). The layout functions return a pytree of
tuples of names with exactly the structure of the arrays they describe. A *rule set* maps logical
names to the mesh axes ``data``, ``fsdp`` and ``tensor``; flax's logical partitioning
(`flax.linen.logical_to_mesh_axes`, as MaxText uses it) turns names into a PartitionSpec: rules
are tried in order, the first rule for a dimension whose mesh axes are still free in that array
wins, and a name without a rule is replicated.

Logical axes (a dimension of size ``n`` per array):

    batch        rows of a training or prefill batch
    cache_batch  decode slots: rows of the KV cache, of drafter states and of per-slot vectors
    cache_seq    positions of a cache (slot s = position s)
    seq          positions of a training batch
    layers       the leading layer axis of stacked (checkpoint / training) layer weights
    embed        the model width e
    features     concatenated input widths: DFlash/EAGLE-3 fused target features (m*e), EAGLE-3's
                 [E ; x] attention input (2e)
    vocab        vocabulary: embedding rows, LM-head columns, draft-head columns
    q_heads      query heads; in weights the flattened heads*head_dim dim (unit head_dim)
    kv_heads     KV heads; flattened kv_heads*head_dim in wk/wv/bk/bv (unit head_dim), plain in caches
    head_dim     features of one head (q_norm / k_norm scales, caches)
    mlp          the MLP hidden width f
    norm         RMSNorm scales (always replicated: tiny, read by every shard)
    head_rank    DSpark sequential-head rank r (and the rnn head's 3r gates, the confidence emb rank)
    head_in      concatenated inputs of the DSpark heads ([e + r], [2r + e], [e + r_c])
    draft_vocab  the id table of a reduced draft vocabulary (replicated)

Divisibility. A dimension is split only in whole *units*: a flattened heads dimension
(wq [heads*head_dim, e]) may be split over ``tensor`` only when the head COUNT divides evenly,
never through the middle of a head. The unit is carried by the name itself: `LogicalAxis` is a
``str`` (so flax and the rules see the plain name ``"q_heads"``) with a ``unit`` attribute, the
number of elements per indivisible unit (head_dim for a flattened heads dim, 1 by default). After
flax resolves the rules, a dimension of size n with unit u assigned mesh axes (a1, a2, ...) keeps
the longest leading run of those axes whose size product divides n / u; if none divides, the
dimension is replicated. For SmolLM2-135M (9 query heads, 3 KV heads) on tensor=4 this replicates
wq / wk / wv / wo and the KV cache's head axis, while the MLP (1536 = 4 x 384) and the vocabulary
(49152) split 4-way; tests/golden/partition_specs.json shows every such decision (with its reason
under "replicated_dims").

Rule sets (see TRAIN_RULES and SERVE_RULES below):
    SERVE_RULES  tensor parallel: vocab, q_heads, kv_heads and mlp over ``tensor``; decode slots
                 (cache_batch) and batches over ``data``; everything else replicated.
    TRAIN_RULES  FSDP + data parallel (+ tensor where ``tensor`` > 1): batches over
                 (``data``, ``fsdp``); the embed dim of every weight (or, where it has none,
                 features / head_in / head_rank) over ``fsdp``, so params and the optimizer state
                 that mirrors them are split over ``fsdp``; heads, MLP and vocab over ``tensor``.

Placement API (what the Engine, load_target, init_drafter and load_drafter call):
    make_mesh(data=1, fsdp=1, tensor=1, devices=None) -> Mesh
    target_param_axes(params, config)   drafter_param_axes(params, dcfg, tcfg=None)
    kv_cache_axes(cache)   drafter_state_axes(state)   slot_axes(x)   slot_tree_axes(tree)
    slot_state_axes(state)              (the Engine's whole decode.SlotState)
    partition_spec(shape, axes, mesh, rules) / logical_sharding(shape, axes, mesh, rules)
    tree_partition_specs / tree_shardings(tree, axes, mesh, rules) / shard_tree(...)

The library never calls `jax.distributed.initialize()`: a multi-host program calls it first, then
make_mesh sees every host's devices.

Regenerate the golden table after an intended change of rules or layouts:

    python -m dspark_jax.sharding --golden tests/golden/partition_specs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from dspark_jax.models.config import ModelConfig

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXES = ("batch", "cache_batch", "cache_seq", "seq", "layers", "embed", "features", "vocab", "q_heads",
                "kv_heads", "head_dim", "mlp", "norm", "head_rank", "head_in", "draft_vocab")

# Names replicated by both rule sets (small, or read whole by every shard).
_REPLICATED = (("head_dim", None), ("norm", None), ("layers", None), ("cache_seq", None), ("seq", None),
               ("draft_vocab", None))

# Order matters (flax): earlier rules claim mesh axes first within one array. Every logical axis
# has an entry so the tables read as complete; a None entry means replicated.
SERVE_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("cache_batch", "data"),
    ("batch", "data"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", None),
    ("features", None),
    ("head_in", None),
    ("head_rank", None),
    *_REPLICATED,
)

TRAIN_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("cache_batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("features", "fsdp"),
    ("head_in", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_rank", "fsdp"),  # DSpark head tables [V, r] / [r, N] have no embed dim to put fsdp on
    *_REPLICATED,
)

RULE_SETS = {"serve": SERVE_RULES, "train": TRAIN_RULES}


# ----------------------------------------------------------------------------- names with units
class LogicalAxis(str):
    """A logical axis name that splits only in whole units of `unit` elements.

    It is a ``str`` equal to its name, so flax's rule matching sees ``"q_heads"``; `unit` is the
    size of one indivisible unit (head_dim for a flattened heads dim). ``unit=None`` means the
    whole dimension is one unit (never split), used where the unit size is unknown.
    """

    unit: int | None

    def __new__(cls, name: str, unit: int | None = 1):
        obj = super().__new__(cls, name)
        obj.unit = unit
        return obj

    def __repr__(self) -> str:
        return f"LogicalAxis({str(self)!r}, unit={self.unit})"

    def __reduce__(self):
        return (LogicalAxis, (str(self), self.unit))


def heads_axis(name: str, head_dim: int | None) -> LogicalAxis:
    """The flattened heads*head_dim dimension `name` ("q_heads" or "kv_heads"): unit head_dim."""
    return LogicalAxis(name, head_dim)


def axis_unit(name) -> int | None:
    return getattr(name, "unit", 1)


def describe_axis(name) -> str | None:
    """A name for tables: "q_heads(64)" for a unit of 64 elements, the plain name otherwise."""
    if name is None:
        return None
    unit = axis_unit(name)
    if unit == 1:
        return str(name)
    return f"{name}({'whole' if unit is None else unit})"


def is_axes_leaf(x) -> bool:
    """Whether `x` is the logical axes of one array (a tuple of names or None, or a PartitionSpec)."""
    if isinstance(x, PartitionSpec):
        return True
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


# ----------------------------------------------------------------------------- layouts: target
# Declared beside models/transformer.py's layout docstring (same names, same order).
def target_top_axes(config: ModelConfig) -> dict[str, tuple]:
    """Top-level target params: embed [vocab, e], final_norm [e], lm_head [vocab, e]."""
    del config
    return {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("vocab", "embed")}


def target_layer_axes(config: ModelConfig | None) -> dict[str, tuple]:
    """One target layer (unstacked shapes; linear weights [out, in]); drafters with target-shaped
    layers reuse it."""
    d = None if config is None else config.head_dim
    q, kv = heads_axis("q_heads", d), heads_axis("kv_heads", d)
    return {
        "attn_norm": ("norm",), "mlp_norm": ("norm",),
        "wq": (q, "embed"), "wk": (kv, "embed"), "wv": (kv, "embed"), "wo": ("embed", q),
        "bq": (q,), "bk": (kv,), "bv": (kv,),
        "q_norm": ("head_dim",), "k_norm": ("head_dim",),
        "w_gate": ("mlp", "embed"), "w_up": ("mlp", "embed"), "w_down": ("embed", "mlp"),
    }


def _pick(table: Mapping[str, tuple], tree: Mapping, where: str, prefix: tuple = ()) -> dict:
    out = {}
    for key in tree:
        if key not in table:
            raise ValueError(f"no logical axes declared for {where} param {key!r}; declare it in dspark_jax/sharding.py")
        out[key] = prefix + tuple(table[key])
    return out


def _layers_axes(layers, table: Mapping[str, tuple], where: str):
    """Axes of `layers`: a tuple/list of per-layer dicts, or one dict stacked on a leading axis."""
    if isinstance(layers, (list, tuple)):
        return type(layers)(_pick(table, lp, f"{where} layer") for lp in layers)
    return _pick(table, layers, f"{where} stacked layer", prefix=("layers",))


def target_param_axes(params: Mapping, config: ModelConfig) -> dict:
    """Logical axes of target params, loaded (layers a tuple of dicts) or stacked ([L, ...] layers)."""
    top = target_top_axes(config)
    out = {}
    for key, value in params.items():
        if key == "layers":
            out[key] = _layers_axes(value, target_layer_axes(config), "target")
        else:
            out.update(_pick(top, {key: value}, "target"))
    return out


# ----------------------------------------------------------------------------- layouts: drafters
def head_axes() -> dict[str, tuple]:
    """drafters/heads.py: w1 [V, r], w2 [r, N], w_g [e + r, r], w_z [2r + e, 3r], b_z [3r]."""
    return {"w1": ("vocab", "head_rank"), "w2": ("head_rank", "vocab"), "w_g": ("head_in", "head_rank"),
            "w_z": ("head_in", "head_rank"), "b_z": ("head_rank",)}


def confidence_axes() -> dict[str, tuple]:
    """drafters/heads.py: confidence w [e + r_c], b [], emb [V, r_c]."""
    return {"w": ("head_in",), "b": (), "emb": ("vocab", "head_rank")}


def dflash_param_axes(params: Mapping, tcfg: ModelConfig | None) -> dict:
    """drafters/dflash.py: w_c [m*e, e], ctx_norm [e], layers stacked like the target's,
    final_norm [e], mask_embed [e], head, confidence, draft_vocab [N], draft_head [N, e] (when bound)."""
    top = {"w_c": ("features", "embed"), "ctx_norm": ("norm",), "final_norm": ("norm",), "mask_embed": ("embed",),
           "draft_vocab": ("draft_vocab",), "draft_head": ("vocab", "embed")}
    out = {}
    for key, value in params.items():
        if key == "layers":
            out[key] = _layers_axes(value, target_layer_axes(tcfg), "dflash")
        elif key == "head":
            out[key] = _pick(head_axes(), value, "dspark head")
        elif key == "confidence":
            out[key] = _pick(confidence_axes(), value, "dspark confidence")
        else:
            out.update(_pick(top, {key: value}, "dflash"))
    return out


def eagle3_param_axes(params: Mapping, tcfg: ModelConfig | None) -> dict:
    """drafters/eagle3.py: fc [m*e, e], layer (wq/wk/wv read the 2e-wide [E ; x]), final_norm [e]."""
    layer = dict(target_layer_axes(tcfg))
    for name in ("wq", "wk", "wv"):
        layer[name] = layer[name][:-1] + ("features",)
    layer.update(embed_norm=("norm",), hidden_norm=("norm",))
    top = {"fc": ("features", "embed"), "final_norm": ("norm",), "draft_vocab": ("draft_vocab",),
           "draft_head": ("vocab", "embed")}
    out = {}
    for key, value in params.items():
        if key == "layer":
            out[key] = _pick(layer, value, "eagle3 layer")
        else:
            out.update(_pick(top, {key: value}, "eagle3"))
    return out


def drafter_param_axes(params: Mapping, dcfg, tcfg: ModelConfig | None = None) -> Any:
    """Logical axes of a drafter's params (kind from `dcfg`). Pass the target config `tcfg`: without
    it the flattened heads dims cannot know their head size and are never split."""
    kind = dcfg.kind
    if kind in ("dspark", "dflash"):
        return dflash_param_axes(params, tcfg)
    if kind == "eagle3":
        return eagle3_param_axes(params, tcfg)
    if kind == "ngram":
        if params:
            raise ValueError("the n-gram drafter has no params")
        return {}
    raise ValueError(f"no parameter layout for drafter kind {kind!r}")


# ----------------------------------------------------------------------------- layouts: state
KV_AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")  # KVCache: [batch, kv_heads, max_len, head_dim]


def kv_cache_axes(cache):
    """models/transformer.KVCache: k, v per layer [batch, kv_heads, max_len, head_dim], lengths [batch]."""
    return type(cache)(k=tuple(KV_AXES for _ in cache.k), v=tuple(KV_AXES for _ in cache.v),
                       lengths=("cache_batch",))


def drafter_state_axes(state):
    """DFlashState k, v [layers, b, kv, S, d]; Eagle3State k, v [b, S, kv, d], pending [b, e];
    NgramState history [b, S]. None for None."""
    if state is None:
        return None
    name = type(state).__name__
    if name == "DFlashState":
        axes = ("layers", "cache_batch", "kv_heads", "cache_seq", "head_dim")
        return type(state)(k=axes, v=axes)
    if name == "Eagle3State":
        axes = ("cache_batch", "cache_seq", "kv_heads", "head_dim")
        return type(state)(k=axes, v=axes, pending=("cache_batch", "embed"))
    if name == "NgramState":
        return type(state)(history=("cache_batch", "cache_seq"))
    raise TypeError(f"no logical axes for drafter state {name}; supported: DFlashState, Eagle3State, NgramState")


def slot_axes(x) -> tuple:
    """A per-slot array [slots] / [slots, n, ...]: ("cache_batch", None, ...); () for a scalar."""
    ndim = len(np.shape(x))
    return () if ndim == 0 else ("cache_batch",) + (None,) * (ndim - 1)


def slot_tree_axes(tree):
    """slot_axes for every leaf of `tree` (per-slot vectors of a decode state, scalars replicated)."""
    return jax.tree.map(slot_axes, tree)


def slot_state_axes(state):
    """Axes of the Engine's decode state (decode.SlotState): the KV cache and drafter state by
    their layouts, per-slot fields over cache_batch, the engine-wide counters replicated."""
    per_slot = slot_tree_axes(state)
    return dataclasses.replace(per_slot, cache=kv_cache_axes(state.cache), drafter=drafter_state_axes(state.drafter),
                               forwards=(), row_rounds=(), committed=(), probe_gap=(), drafted_rounds=(), next_probe=(),
                               tried=replicated_axes(state.tried),
                               accepted_at=replicated_axes(state.accepted_at),
                               online_predicted=replicated_axes(state.online_predicted),
                               online_accepted=replicated_axes(state.online_accepted))


def replicated_axes(tree):
    """Axes that replicate every leaf of `tree` (PRNG keys, counters)."""
    return jax.tree.map(lambda x: (None,) * len(np.shape(x)), tree)


# ----------------------------------------------------------------------------- resolution
def _axis_sizes(mesh) -> dict[str, int]:
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return dict(mesh.shape)
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    raise TypeError(f"expected a jax Mesh, AbstractMesh or a mapping of axis sizes, got {type(mesh).__name__}")


def _resolve(shape: Sequence[int], axes, sizes: Mapping[str, int], rules) -> tuple[PartitionSpec, list[str]]:
    """(PartitionSpec, notes on dims replicated or narrowed for divisibility)."""
    names = tuple(axes)
    if len(names) != len(shape):
        raise ValueError(f"logical axes {names} name {len(names)} dims, the array has shape {tuple(shape)}")
    rules = SERVE_RULES if rules is None else rules
    assigned = nn.logical_to_mesh_axes(names, rules)
    spec, notes = [], []
    for size, name, mesh_axes in zip(shape, names, tuple(assigned)):
        if mesh_axes is None:
            spec.append(None)
            continue
        group = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        group = tuple(a for a in group if a in sizes)  # a user mesh may lack an axis: replicate over it
        unit = axis_unit(name)
        units = 1 if unit is None else (size // unit if size % unit == 0 else 0)
        keep = ()
        for i in range(len(group), 0, -1):
            n = math.prod(sizes[a] for a in group[:i])
            if units and units % n == 0:
                keep = group[:i]
                break
        if keep != group:
            what = ("one unit (unit size unknown)" if unit is None
                    else f"size {size}" if unit == 1 else f"{units} units of {unit}")
            notes.append(f"{describe_axis(name)}: {what} not divisible by "
                         + "x".join(f"{a}={sizes[a]}" for a in group)
                         + (f", kept {'x'.join(keep)}" if keep else ", replicated"))
        spec.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*spec), notes


def partition_spec(shape: Sequence[int], axes, mesh, rules=None) -> PartitionSpec:
    """The PartitionSpec of one array of `shape` with logical `axes` under `rules` (SERVE_RULES by
    default). `mesh` is a Mesh, an AbstractMesh or a mapping {axis name: size}: no devices needed."""
    return _resolve(tuple(shape), axes, _axis_sizes(mesh), rules)[0]


def logical_sharding(shape: Sequence[int], axes, mesh: Mesh, rules=None) -> NamedSharding:
    """The NamedSharding on `mesh` of one array of `shape` with logical `axes` under `rules`."""
    return NamedSharding(mesh, partition_spec(shape, axes, mesh, rules))


def _map_tree(fn, tree, axes):
    """fn(path, leaf, leaf_axes) over `tree`, whose structure `axes` must share (axes tuples as leaves)."""
    try:
        return jax.tree_util.tree_map_with_path(fn, tree, axes)
    except ValueError as err:
        raise ValueError(f"the logical axes tree does not match the array tree: {err}") from err


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _leaf_spec(path, leaf, leaf_axes, sizes, rules) -> PartitionSpec:
    if not is_axes_leaf(leaf_axes):
        raise ValueError(f"{_path_str(path)}: expected a tuple of logical axis names, got {leaf_axes!r}")
    try:
        return _resolve(np.shape(leaf), leaf_axes, sizes, rules)[0]
    except ValueError as err:
        raise ValueError(f"{_path_str(path)}: {err}") from err


def tree_partition_specs(tree, axes, mesh, rules=None):
    """PartitionSpecs for every leaf of `tree` (arrays, numpy arrays or jax.ShapeDtypeStruct)."""
    sizes = _axis_sizes(mesh)
    return _map_tree(lambda p, x, a: _leaf_spec(p, x, a, sizes, rules), tree, axes)


def tree_shardings(tree, axes, mesh: Mesh, rules=None):
    """NamedShardings on `mesh` for every leaf of `tree` (for jit in/out_shardings or device_put)."""
    sizes = _axis_sizes(mesh)
    return _map_tree(lambda p, x, a: NamedSharding(mesh, _leaf_spec(p, x, a, sizes, rules)), tree, axes)


def shard_tree(tree, axes, mesh: Mesh, rules=None):
    """Place `tree` (device or host arrays) on `mesh` by its logical `axes` under `rules`."""
    return jax.device_put(tree, tree_shardings(tree, axes, mesh, rules))


def abstract_tree(tree, axes, mesh: Mesh, rules=None):
    """jax.ShapeDtypeStructs with the shardings the rules give (for `jit(...).lower` ahead of time)."""
    shardings = tree_shardings(tree, axes, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


# ----------------------------------------------------------------------------- meshes
def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence | None = None) -> Mesh:
    """A Mesh with axes ("data", "fsdp", "tensor") of the given sizes.

    Uses the first data*fsdp*tensor of `devices` (default: jax.devices(), every host's devices
    after `jax.distributed.initialize()`); explicit `devices` must number exactly the product.
    Axes are `AxisType.Auto`, so jit propagates shardings from its inputs (GSPMD).
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mesh axis {name} must be a positive integer, got {value!r}")
    count = data * fsdp * tensor
    if devices is None:
        available = jax.devices()
        if count > len(available):
            raise ValueError(f"a mesh of data={data} x fsdp={fsdp} x tensor={tensor} needs {count} devices, but only "
                             f"{len(available)} {available[0].platform} device(s) are available "
                             f"(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={count} "
                             "before JAX starts)")
        devices = available[:count]
    else:
        devices = list(devices)
        if count != len(devices):
            raise ValueError(f"a mesh of data={data} x fsdp={fsdp} x tensor={tensor} needs {count} devices, "
                             f"got {len(devices)}")
    shape, types = (data, fsdp, tensor), (jax.sharding.AxisType.Auto,) * 3
    try:  # topology-aware device order where the platform knows one
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except Exception:  # e.g. a subset of a TPU slice that create_device_mesh cannot tile
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=types)


def parse_mesh(text: str) -> dict[str, int]:
    """"data=2,fsdp=4" -> {"data": 2, "fsdp": 4} (axes data, fsdp, tensor), the `--mesh` flag of
    the trainer and the server; an empty string is one device."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.strip().partition("=")
        if name not in MESH_AXES or not value.isdigit() or int(value) < 1 or name in out:
            raise ValueError(f"--mesh: expected name=size with distinct names among {', '.join(MESH_AXES)} and "
                             f"sizes >= 1; got {part!r}")
        out[name] = int(value)
    return out


def abstract_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1) -> AbstractMesh:
    """A device-free mesh of the given sizes (partition specs and golden tables)."""
    return AbstractMesh((data, fsdp, tensor), MESH_AXES)


# ----------------------------------------------------------------------------- golden table
def _shapes(fn, *args):
    return jax.eval_shape(fn, *args)


def target_param_shapes(config: ModelConfig, stacked: bool = False, dtype=np.float32) -> dict:
    """ShapeDtypeStructs of a target's params from its config alone (the layout of transformer.py)."""
    e, f, d, L = config.hidden_size, config.intermediate_size, config.head_dim, config.num_layers
    hq, hkv = config.num_heads * d, config.num_kv_heads * d
    layer = {"attn_norm": (e,), "mlp_norm": (e,), "wq": (hq, e), "wk": (hkv, e), "wv": (hkv, e), "wo": (e, hq),
             "w_gate": (f, e), "w_up": (f, e), "w_down": (e, f)}
    if config.attention_bias:
        layer.update(bq=(hq,), bk=(hkv,), bv=(hkv,))
    if config.qk_norm:
        layer.update(q_norm=(d,), k_norm=(d,))
    sds = lambda s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    params = {"embed": sds((config.vocab_size, e)), "final_norm": sds((e,))}
    if not config.tie_word_embeddings:
        params["lm_head"] = sds((config.vocab_size, e))
    if stacked:
        params["layers"] = {k: sds((L,) + s) for k, s in layer.items()}
    else:
        params["layers"] = tuple({k: sds(s) for k, s in layer.items()} for _ in range(L))
    return params


def _table(tree, axes, mesh_sizes, rules) -> dict:
    """{path: {shape, axes, spec[, replicated_dims]}}; per-layer tuples collapse to layers[*]."""
    rows: dict = {}

    def row(path, leaf, leaf_axes):
        spec, notes = _resolve(np.shape(leaf), leaf_axes, mesh_sizes, rules)
        entry = {"shape": list(np.shape(leaf)), "axes": [describe_axis(a) for a in leaf_axes],
                 "spec": [list(s) if isinstance(s, tuple) else s for s in spec]}
        if notes:
            entry["replicated_dims"] = notes
        key = _path_str(path)
        parts = key.split(".")
        if len(parts) > 2 and parts[-3] in ("layers", "k", "v") and parts[-2].isdigit():
            parts[-2] = "*"  # per-layer tuples: one row, which every layer must share
        elif len(parts) > 1 and parts[-2] in ("k", "v") and parts[-1].isdigit():
            parts[-1] = "*"
        key = ".".join(parts)
        if key in rows and rows[key] != entry:
            raise AssertionError(f"{key}: layers resolve differently: {rows[key]} vs {entry}")
        rows[key] = entry
        return None

    _map_tree(row, tree, axes)
    return rows


def golden_tables(config: ModelConfig, dcfg) -> dict:
    """Partition-spec tables for `config` and a drafter config (computed from shapes only)."""
    from dspark_jax.drafters import drafter_module
    from dspark_jax.models.transformer import init_cache

    serve4, train4 = {"data": 1, "fsdp": 1, "tensor": 4}, {"data": 1, "fsdp": 4, "tensor": 1}
    serve22, serve24 = {"data": 2, "fsdp": 1, "tensor": 2}, {"data": 2, "fsdp": 1, "tensor": 4}
    loaded, stacked = target_param_shapes(config), target_param_shapes(config, stacked=True)
    module = drafter_module(dcfg.kind)
    dparams = _shapes(lambda k: module.init_params(k, config, dcfg), jax.random.PRNGKey(0))
    cache = _shapes(lambda: init_cache(config, 8, 256))
    dstate = _shapes(lambda p: module.init_state(p, config, dcfg, 8, 256), dparams)
    t_axes, s_axes = target_param_axes(loaded, config), target_param_axes(stacked, config)
    d_axes = drafter_param_axes(dparams, dcfg, config)
    return {
        "target, loaded layout, SERVE_RULES, tensor=4": _table(loaded, t_axes, serve4, SERVE_RULES),
        "target, loaded layout, SERVE_RULES, data=2 x tensor=2": _table(loaded, t_axes, serve22, SERVE_RULES),
        "target, stacked layout, TRAIN_RULES, fsdp=4": _table(stacked, s_axes, train4, TRAIN_RULES),
        f"{dcfg.kind} drafter, SERVE_RULES, tensor=4": _table(dparams, d_axes, serve4, SERVE_RULES),
        f"{dcfg.kind} drafter, TRAIN_RULES, fsdp=4": _table(dparams, d_axes, train4, TRAIN_RULES),
        "KV cache [8 slots, 256], SERVE_RULES, data=2 x tensor=4": _table(cache, kv_cache_axes(cache), serve24,
                                                                          SERVE_RULES),
        f"{dcfg.kind} drafter state [8 slots, 256], SERVE_RULES, data=2 x tensor=4": _table(
            dstate, drafter_state_axes(dstate), serve24, SERVE_RULES),
    }


GOLDEN_COMMAND = "python -m dspark_jax.sharding --golden tests/golden/partition_specs.json"


def golden_document(config: ModelConfig, dcfg, model: str) -> dict:
    return {
        "regenerate": GOLDEN_COMMAND,
        "model": model,
        "config": json.loads(config.to_json()),
        "drafter_config": json.loads(dcfg.to_json()),
        "rules": {"SERVE_RULES": [list(r) for r in SERVE_RULES], "TRAIN_RULES": [list(r) for r in TRAIN_RULES]},
        "tables": golden_tables(config, dcfg),
    }


def format_golden(doc: dict) -> str:
    """JSON with one line per config field, rule and table row (reviewable diffs)."""
    def block(mapping: Mapping, indent: str) -> list[str]:
        items = list(mapping.items())
        return [f"{indent}{json.dumps(k)}: {json.dumps(v)}{',' if i < len(items) - 1 else ''}"
                for i, (k, v) in enumerate(items)]

    lines = ["{"]
    keys = list(doc)
    for i, key in enumerate(keys):
        value, comma = doc[key], "," if i < len(keys) - 1 else ""
        if key == "tables":
            lines.append(' "tables": {')
            names = list(value)
            for j, name in enumerate(names):
                lines.append(f"  {json.dumps(name)}: {{")
                lines += block(value[name], "   ")
                lines.append("  }" + ("," if j < len(names) - 1 else ""))
            lines.append(" }" + comma)
        elif isinstance(value, dict):
            lines.append(f" {json.dumps(key)}: {{")
            lines += block(value, "  ")
            lines.append(" }" + comma)
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == json.loads(json.dumps(doc))
    return text


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_jax.sharding", description=__doc__.split("\n")[0])
    parser.add_argument("--golden", metavar="PATH", required=True,
                        help="write the partition-spec table of the model's params, cache and dspark drafter")
    parser.add_argument("--model", default="smollm2-135m", help="model whose config the table is for")
    args = parser.parse_args(argv)
    from dspark_jax.drafters.config import default_config
    from dspark_jax.models.loading import read_gguf, read_hf_config, resolve_model_path

    path = resolve_model_path(args.model)
    import os

    config = read_hf_config(path) if os.path.isdir(path) else read_gguf(path)[2]
    doc = golden_document(config, default_config("dspark", config.num_layers), args.model)
    with open(args.golden, "w") as f:
        f.write(format_golden(doc))
    print(f"wrote {args.golden}: {sum(len(t) for t in doc['tables'].values())} rows in {len(doc['tables'])} tables")


if __name__ == "__main__":
    _main()
