"""One trainer for the DSpark, DFlash and EAGLE-3 drafters.

    python -m train.fit --config train/configs/dspark.py [--steps 2000 --mesh data=1,fsdp=4 ...]

A config file defines `config = FitConfig(...)`; command-line flags (tyro) override its fields.
The run folder (`out`) holds orbax checkpoints (periodic, keep-N), `log.jsonl` (every loss term,
the estimated acceptance per position, the learning rate), `curves.png`, and at the end the
drafter in the library's checkpoint format (`out/drafter`, loadable with load_drafter).

Started again with the same command, a run resumes from its latest checkpoint to exactly the
parameters an uninterrupted run reaches: the state holds params, optimizer state and step; the
data position and the step's random key are functions of (seed, step) (train/loader.py).

Sharding: `--mesh data=N,fsdp=M` places the batch over (data, fsdp) and the drafter params and
optimizer state by sharding.TRAIN_RULES (embed dims over fsdp). On a pod slice, the same command
runs after `jax.distributed.initialize()` (`--distributed`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import time
from typing import Sequence

import numpy as np

KINDS = ("dspark", "dflash", "eagle3")


@dataclasses.dataclass
class FitConfig:
    drafter: str = "dspark"
    """dspark | dflash | eagle3."""
    data: str = "data/smollm2-135m"
    out: str = "runs/dspark"
    model: str | None = None
    """Default: the model the data was generated with."""
    feature_layers: tuple[int, ...] = (1, 8, 14, 20, 27)
    """The layers cached by train.features; the drafter reads a subset."""
    draft_vocab_size: int | None = 8192
    num_layers: int | None = None
    head_type: str | None = None
    head_rank: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    block_size: int = 7
    seq_len: int = 512
    batch_size: int = 8
    """Sequences per step (global, over every device)."""
    train_shards: int | None = None
    """Train on this many shards of the train split only, from --first-shard on (data-scaling runs); default all."""
    first_shard: int = 0
    """Skip the train split's shards before this one (a fine-tune on conversations the --init-from
    drafter never saw; their features must exist: train.features --first-shard)."""
    extra_data: tuple[str, ...] = ()
    """More train.data folders for the same target (e.g. `--turns later`), whose train splits
    (all their shards, features cached) join --data's; validation and the draft vocabulary
    stay --data's."""
    anchors: int = 32
    """Blocks per sequence (DSpark / DFlash), at random supervised positions; for EAGLE-3 the rows
    whose training-time-test chain is unrolled (row i drafts from anchor i+1: the same terms)."""
    eagle_steps: int = 7
    """EAGLE-3 training-time-test unroll length."""
    steps: int = 1000
    lr: float = 6e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    temperature: float = 1.0
    """Temperature of the teacher and draft distributions in the DSpark loss."""
    seed: int = 0
    save_every: int = 100
    keep: int = 3
    log_every: int = 10
    eval_every: int = 50
    """Validation losses every this many steps (0: never), logged as `val_*` beside the training terms."""
    eval_batches: int = 4
    """Validation batches of batch_size sequences each: the split's first rows, anchors fixed, so
    every evaluation of a run (and of a resumed run) measures the same terms."""
    mesh: str = "data=1"
    distributed: bool = False
    init_layers: str = "random"
    """random | target: DSpark / DFlash layers start as copies of the target's last layers
    (trained worse than random on smollm2-135m: train/results/2026-12-02-init-target)."""
    init_from: str | None = None
    """Start from this drafter (checkpoint folder or shipped name) instead of a random init: its
    config replaces the drafter fields above (but a larger --num-layers grows its backbone by
    layers that start as the identity) and its draft vocabulary the data's."""
    train_only: tuple[str, ...] = ()
    """Train only these top-level parameter groups (e.g. `confidence`); the others stay frozen and
    out of the optimizer state. Empty: train everything."""
    stop_after: int | None = None
    """Run at most this many steps in this invocation (resume later with the same command)."""
    export_dtype: str = "bfloat16"


# ------------------------------------------------------------------------------------ config
def load_config(argv: Sequence[str]) -> FitConfig:
    """`--config FILE` (a Python file defining `config`) as defaults, then tyro flags on top."""
    import tyro

    argv = list(argv)
    base = FitConfig()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("--config needs a file")
        path = argv[i + 1]
        del argv[i:i + 2]
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: no such config file")
        spec = importlib.util.spec_from_file_location("fit_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        base = getattr(module, "config", None)
        if not isinstance(base, FitConfig):
            raise SystemExit(f"{path}: must define `config = FitConfig(...)`")
    return tyro.cli(FitConfig, default=base, args=argv)


def parse_mesh(text: str) -> dict[str, int]:
    from dspark_jax import sharding

    try:
        return sharding.parse_mesh(text)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def check_config(cfg: FitConfig) -> None:
    if cfg.drafter not in KINDS:
        raise SystemExit(f"--drafter must be one of {', '.join(KINDS)}, got {cfg.drafter!r}")
    for name in ("steps", "batch_size", "seq_len", "anchors", "block_size", "eagle_steps", "save_every", "keep",
                 "log_every", "eval_batches", "train_shards"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.eval_every < 0:
        raise SystemExit(f"--eval-every must be >= 0 (0: no validation), got {cfg.eval_every}")
    if cfg.init_layers not in ("random", "target"):
        raise SystemExit(f"--init-layers must be random or target, got {cfg.init_layers!r}")
    if cfg.init_layers == "target" and cfg.drafter == "eagle3":
        raise SystemExit("--init-layers target is for dspark / dflash (an EAGLE-3 layer reads 2e inputs, "
                         "so no target layer has its shape)")
    if not cfg.lr > 0 or cfg.temperature <= 0:
        raise SystemExit("--lr and --temperature must be > 0")
    if cfg.first_shard < 0:
        raise SystemExit(f"--first-shard must be >= 0, got {cfg.first_shard}")
    if cfg.init_from is not None and cfg.init_layers != "random":
        raise SystemExit("--init-from and --init-layers target both say where the layers start; give one")


def load_init(cfg: FitConfig, tcfg):
    """The --init-from drafter (params in float32 for training), or None; with a larger
    --num-layers its backbone grown by layers that start as the identity (dflash.grow_layers)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.drafters import DrafterMismatchError, cast_floats, load_drafter
    from dspark_jax.drafters.config import DrafterConfigError
    from dspark_jax.drafters.dflash import grow_layers

    if cfg.init_from is None:
        return None
    try:
        init = load_drafter(cfg.init_from)
        init.check_target(tcfg)
    except (FileNotFoundError, DrafterMismatchError) as err:
        raise SystemExit(f"--init-from: {err}") from None
    if init.kind != cfg.drafter:
        raise SystemExit(f"--init-from {cfg.init_from} is a {init.kind} drafter, not {cfg.drafter}")
    missing = [l for l in init.config.target_layer_ids if l not in cfg.feature_layers]
    if missing:
        raise SystemExit(f"--init-from {cfg.init_from} reads target layers {missing}, not among --feature-layers "
                         f"{list(cfg.feature_layers)}")
    init.params = cast_floats(init.params, jnp.float32)
    if cfg.num_layers is not None and cfg.num_layers != init.config.num_layers:
        if cfg.drafter == "eagle3":
            raise SystemExit("--num-layers with --init-from grows a DSpark / DFlash backbone; EAGLE-3 has one layer")
        try:
            init.params = grow_layers(jax.random.PRNGKey(cfg.seed), init.params, tcfg, init.config, cfg.num_layers)
        except DrafterConfigError as err:
            raise SystemExit(f"--num-layers: {err}") from None
        init.config = dataclasses.replace(init.config, num_layers=cfg.num_layers)
    return init


def drafter_config(cfg: FitConfig, tcfg):
    from dspark_jax.drafters.config import default_config

    overrides = dict(block_size=cfg.block_size, draft_vocab_size=cfg.draft_vocab_size)
    for name in ("num_layers", "head_type", "head_rank", "target_layer_ids"):
        if getattr(cfg, name) is not None:
            overrides[name] = getattr(cfg, name)
    dcfg = default_config(cfg.drafter, tcfg.num_layers, **overrides)
    missing = [l for l in dcfg.target_layer_ids if l not in cfg.feature_layers]
    if missing:
        raise SystemExit(f"the {cfg.drafter} drafter reads target layers {list(dcfg.target_layer_ids)}; "
                         f"{missing} are not among --feature-layers {list(cfg.feature_layers)}")
    return dcfg


# -------------------------------------------------------------------------------- the step
def sample_anchors(key, mask, count: int):
    """[b, A] anchor positions, distinct, uniformly among positions whose next token is supervised,
    and [b, A] validity (a sequence with fewer than A such positions gets invalid extras)."""
    import jax
    import jax.numpy as jnp

    eligible = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)  # [b, T]
    scores = jnp.where(eligible, jax.random.gumbel(key, mask.shape), -jnp.inf)
    top, anchors = jax.lax.top_k(scores, count)
    return anchors.astype(jnp.int32), jnp.isfinite(top)


def block_targets(tokens, mask, anchors, valid, block_size: int):
    """Targets [b, A, G] (tokens anchor+1 .. anchor+G), their supervision mask, and the positions
    anchor .. anchor+G-1 whose target distribution predicts them (clipped into the sequence: a
    block that runs past its end is unsupervised there, and a gather past the end would be NaN)."""
    import jax.numpy as jnp

    b, T = tokens.shape
    src = anchors[:, :, None] + jnp.arange(block_size, dtype=jnp.int32)  # [b, A, G]
    tgt = src + 1
    flat = jnp.clip(tgt, 0, T - 1).reshape(b, -1)
    targets = jnp.take_along_axis(tokens, flat, axis=1).reshape(tgt.shape)
    supervised = jnp.take_along_axis(mask, flat, axis=1).reshape(tgt.shape) & (tgt < T) & valid[:, :, None]
    return targets, supervised, jnp.minimum(src, T - 1)


def per_position(values, weight):
    """Weighted mean over everything but the last axis -> [G]."""
    import jax.numpy as jnp

    axes = tuple(range(values.ndim - 1))
    return jnp.sum(values * weight, axis=axes) / jnp.maximum(jnp.sum(weight, axis=axes), 1e-9)


def make_loss_fn(kind: str, tcfg, dcfg, cfg: FitConfig):
    """loss(trainable, frozen, target_params, batch, key) -> (loss, metrics). batch["features"]
    holds the drafter's own layers (dcfg.target_layer_ids, in order), as the loader picks them."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.drafters import dflash, eagle3, vocab
    from dspark_jax.losses import dflash_loss, dspark_loss
    from dspark_jax.models.transformer import logits_from_hidden

    def loss_fn(trainable, frozen, target_params, batch, key):
        params = {**trainable, **frozen}
        draft_vocab = params.get("draft_vocab")
        tokens, mask = batch["tokens"], batch["mask"]
        if batch["features"].shape[2] != len(dcfg.target_layer_ids):  # at trace time
            raise ValueError(f"the batch holds {batch['features'].shape[2]} feature layers, the drafter reads "
                             f"{len(dcfg.target_layer_ids)} ({list(dcfg.target_layer_ids)})")
        feats = batch["features"].astype(jnp.float32)  # [b, T, m, e]
        if kind == "eagle3":
            # Rows i whose first prediction, token i+2, is supervised; the same count per sequence
            # as DSpark's anchors (row i drafts from anchor i+1), so both see the same terms.
            rows, row_valid = sample_anchors(key, jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1),
                                             cfg.anchors)
            logits = eagle3.train_draft_logits(params, target_params, tcfg, dcfg, tokens, feats, cfg.eagle_steps,
                                               rows)
            loss = eagle3.eagle3_loss(logits, tokens, mask, draft_vocab=draft_vocab, vocab_size=tcfg.vocab_size,
                                      rows=rows, row_valid=row_valid)
            # Greedy acceptance estimate per unrolled step: the argmax matches the (self-distilled) next token.
            tgt, ok = eagle3.unroll_targets(tokens, mask, logits.shape[0], rows, row_valid)  # [S, b, R]
            pred = jnp.argmax(logits, -1)
            if draft_vocab is not None:
                pred = draft_vocab[pred]
            hit = (pred == tgt).astype(jnp.float32)
            top1 = jnp.sum(hit * ok, axis=(1, 2)) / jnp.maximum(jnp.sum(ok, axis=(1, 2)), 1)
            return loss, {"ce": loss, "accept_top1_per_pos": top1}
        anchors, valid = sample_anchors(key, mask, cfg.anchors)
        out = dflash.train_forward(params, target_params, tcfg, dcfg, tokens, feats, anchors)
        targets, supervised, src = block_targets(tokens, mask, anchors, valid, dcfg.block_size)
        weight = supervised.astype(jnp.float32)
        logits = out["draft_logits"]
        pred = jnp.argmax(logits, -1)
        if draft_vocab is not None:
            pred = draft_vocab[pred]
        metrics = {"accept_top1_per_pos": per_position((pred == targets).astype(jnp.float32), weight)}
        if kind == "dflash":
            loss, m = dflash_loss(out, targets, supervised, cfg.temperature, draft_vocab, tcfg.vocab_size)
            return loss, {**m, **metrics}
        # The teacher: the target's next-token distribution at each block position, from its cached
        # final hidden state through its own LM head (no gradient: the target is frozen). Its
        # logits are needed over the draft ids only: the cached logsumexp over all V normalises
        # them (at the training temperature 1; another one recomputes it over all V).
        b = tokens.shape[0]
        flat_src = src.reshape(b, -1)
        hidden = jnp.take_along_axis(batch["hidden"], flat_src[..., None], axis=1).astype(jnp.float32)  # [b, A*G, e]
        teacher = jax.lax.stop_gradient(vocab.draft_logits(params, target_params, hidden)) / cfg.temperature  # [b, A*G, N]
        if cfg.temperature == 1.0:
            lse = jnp.take_along_axis(batch["teacher_lse"], flat_src, axis=1)  # [b, A*G]
        else:
            lse = jax.nn.logsumexp(logits_from_hidden(target_params, hidden) / cfg.temperature, axis=-1)
        p = jax.lax.stop_gradient(jnp.exp(teacher - lse[..., None])).reshape(targets.shape + (-1,))  # [b, A, G, N]
        outside = None
        if draft_vocab is not None:  # the target's mass on ids the drafter cannot emit
            outside = jnp.clip(1.0 - jnp.sum(p, axis=-1), 0.0, 1.0)  # [b, A, G]
        loss, m = dspark_loss(out, targets, p, supervised, cfg.temperature, draft_vocab, target_outside=outside,
                              vocab_size=tcfg.vocab_size)
        # Acceptance estimate per position under sampling: 1 - TV of q_k against p_k.
        q = jax.nn.softmax(logits.astype(jnp.float32) / cfg.temperature, -1)
        overlap = jnp.sum(jnp.minimum(q, p), -1)  # 1 - TV
        return loss, {**m, **metrics, "accept_tv_per_pos": per_position(overlap, weight)}

    return loss_fn


def make_optimizer(cfg: FitConfig):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup_steps, max(cfg.steps - 1, 1)),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay)), schedule


# ---------------------------------------------------------------------------------- the run
def split_params(params: dict, train_only: Sequence[str] = ()) -> tuple[dict, dict]:
    """(trainable, frozen): the draft-vocabulary table and other integer arrays stay out of the
    optimizer state, and so does every group not in `train_only` when it is given."""
    unknown = sorted(set(train_only) - set(params) - {"draft_vocab"})
    if unknown or "draft_vocab" in train_only:
        groups = sorted(k for k in params if k != "draft_vocab")
        raise SystemExit(f"--train-only {' '.join(unknown or ['draft_vocab'])}: not a trainable parameter group "
                         f"(this drafter has {', '.join(groups)})")
    frozen = {k: v for k, v in params.items() if k == "draft_vocab" or (train_only and k not in train_only)}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


@dataclasses.dataclass
class Training:
    """What a step needs, placed on the mesh: the state (params, optimizer state, step), frozen
    drafter arrays, target params, the jitted step and the shardings."""

    state: dict
    frozen: dict
    target_params: dict
    step_fn: object
    eval_fn: object
    state_shardings: dict
    batch_sharding: object
    dcfg: object


def build(cfg: FitConfig, target, mesh, draft_vocab, init=None) -> Training:
    """Initialise the drafter (draft vocabulary from the data; or `init`, a loaded drafter, whose
    params and vocabulary are kept) and its optimizer on `mesh` by the train rules, and jit the
    step: step_fn(state, frozen, target_params, batch) -> (state, metrics)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax import sharding
    from dspark_jax.drafters import drafter_module

    rules = sharding.TRAIN_RULES
    tcfg = target.config
    dcfg = drafter_config(cfg, tcfg) if init is None else init.config
    module = drafter_module(cfg.drafter)
    if init is not None:
        params = dict(init.params)
    else:
        params = module.init_params(jax.random.PRNGKey(cfg.seed), tcfg, dcfg)
        if cfg.init_layers == "target":
            params = module.copy_target_layers(params, target.params, dcfg)
        if draft_vocab is not None:
            params["draft_vocab"] = jnp.asarray(draft_vocab, jnp.int32)
    params = sharding.shard_tree(params, sharding.drafter_param_axes(params, dcfg, tcfg), mesh, rules)
    trainable, frozen = split_params(params, cfg.train_only)
    target_params = sharding.shard_tree(target.params, sharding.target_param_axes(target.params, tcfg), mesh, rules)
    optimizer, schedule = make_optimizer(cfg)
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = jax.tree.map(lambda a: a.sharding, trainable)
    opt_shape = jax.eval_shape(optimizer.init, trainable)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, param_shardings,
                                          transform_non_params=lambda _: replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(trainable)
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    state = {"params": trainable, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}
    state = jax.device_put(state, state_shardings)  # as the step returns it, so step 2 does not recompile
    loss_fn = make_loss_fn(cfg.drafter, tcfg, dcfg, cfg)

    def train_step(state, frozen, target_params, batch):
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), state["step"])
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], frozen, target_params, batch, key)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return new, {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}

    def eval_step(params, frozen, target_params, batch, index):
        # A key of its own, fixed per validation batch: the same anchors at every evaluation.
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed + 1), index)
        loss, metrics = loss_fn(params, frozen, target_params, batch, key)
        return {**metrics, "loss": loss}

    step_fn = jax.jit(train_step, donate_argnums=0, out_shardings=(state_shardings, replicated))
    eval_fn = jax.jit(eval_step, out_shardings=replicated)
    return Training(state=state, frozen=frozen, target_params=target_params, step_fn=step_fn, eval_fn=eval_fn,
                    state_shardings=state_shardings, batch_sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))),
                    dcfg=dcfg)


def time_step(cfg: FitConfig, target, rows: list[dict], feature_bits, repeats: int = 3) -> tuple[float, float]:
    """(best-of seconds, floating-point operations) of one training step on one device, on a batch
    of `rows` (token shards' rows) with their features `feature_bits` [tokens, m + 1, e]
    (benchmarks/bench_train.py). The operation count is XLA's cost analysis of the compiled step
    (0 where the backend gives none). The draft vocabulary is a placeholder of the configured
    size: same cost as a real one."""
    import numpy as np

    from dspark_jax import sharding
    from dspark_jax.profiling import best_seconds
    from train import features as features_lib

    mesh = sharding.make_mesh()
    vocab = None if cfg.draft_vocab_size is None else np.arange(cfg.draft_vocab_size)
    t = build(cfg, target, mesh, vocab)
    T, B = cfg.seq_len, cfg.batch_size
    offsets = np.concatenate([[0], np.cumsum([len(r["tokens"]) for r in rows])])
    tokens = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), bool)
    bits = np.zeros((B, T) + feature_bits.shape[1:], np.uint16)
    for i in range(B):
        r = rows[i % len(rows)]
        n = min(len(r["tokens"]), T)
        tokens[i, :n], mask[i, r["prompt_len"]:n] = r["tokens"][:n], True
        bits[i, :n] = feature_bits[offsets[i % len(rows)]:offsets[i % len(rows)] + n]
    pick = [cfg.feature_layers.index(l) for l in t.dcfg.target_layer_ids]
    lse = features_lib.teacher_lse(target, bits.reshape((B * T,) + bits.shape[2:])).reshape(B, T)
    batch = {"tokens": tokens, "mask": mask, "features": features_lib.from_bf16_bits(bits[:, :, pick]),
             "hidden": features_lib.from_bf16_bits(bits[:, :, -1]), "teacher_lse": lse}
    state = t.state
    compiled = t.step_fn.lower(state, t.frozen, t.target_params, batch).compile()  # costed and timed: one compile
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}

    def once():
        nonlocal state
        state, metrics = compiled(state, t.frozen, t.target_params, batch)
        return metrics["loss"]

    return best_seconds(once, repeats=repeats), float(cost.get("flops", 0.0))


def run(cfg: FitConfig) -> dict:
    """Train (or resume) and export the drafter; returns a summary."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from dspark_jax import sharding
    from dspark_jax.drafters import Drafter, save_drafter, target_fingerprint
    from train import data as data_lib
    from train.loader import SequenceData

    check_config(cfg)
    if cfg.distributed:
        jax.distributed.initialize()
    mesh = sharding.make_mesh(**parse_mesh(cfg.mesh))
    target = data_lib.data_target(cfg.data, cfg.model)
    tcfg = target.config
    init = load_init(cfg, tcfg)
    train_data = SequenceData(cfg.data, cfg.feature_layers, "train", cfg.seq_len, cfg.train_shards, cfg.first_shard)
    own = data_lib.data_generation(cfg.data) if cfg.extra_data else {}
    for folder in cfg.extra_data:
        # Same target, and the same split by conversation: with another val_fraction the extra
        # folder's train split holds conversations of --data's validation split.
        other = data_lib.data_generation(folder)
        for key in ("model", "val_fraction"):
            mine, theirs = own.get(key), other.get(key)
            if mine != theirs:
                raise SystemExit(f"--extra-data {folder} was generated with {key} {theirs}, --data {cfg.data} "
                                 f"with {mine}")
        train_data.add(SequenceData(folder, cfg.feature_layers, "train", cfg.seq_len))
    devices_on_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.batch_size % devices_on_batch:
        raise SystemExit(f"--batch-size {cfg.batch_size} must divide evenly over data x fsdp = {devices_on_batch}")

    draft_vocab = None
    if cfg.draft_vocab_size is not None and init is None:
        draft_vocab = data_lib.load_draft_vocab(cfg.data, cfg.draft_vocab_size)
    t = build(cfg, target, mesh, draft_vocab, init)
    dcfg = t.dcfg
    val_batches = []
    if cfg.eval_every:
        val_data = SequenceData(cfg.data, cfg.feature_layers, "validation", cfg.seq_len)
        for i in range(cfg.eval_batches):  # the split's first rows, wrapping round a small split
            host = val_data.batch(np.arange(i * cfg.batch_size, (i + 1) * cfg.batch_size) % len(val_data),
                                  dcfg.target_layer_ids)
            val_batches.append(jax.device_put(vars(host), t.batch_sharding))  # the Batch's fields by name

    def validate(params) -> dict:
        """Mean of each metric over the validation batches, keys prefixed `val_`."""
        rows = [jax.device_get(t.eval_fn(params, t.frozen, t.target_params, b, i)) for i, b in enumerate(val_batches)]
        return {f"val_{k}": np.mean([np.asarray(r[k]) for r in rows], axis=0).tolist() for k in rows[0]}

    state, frozen, target_params, step_fn, state_shardings = (t.state, t.frozen, t.target_params, t.step_fn,
                                                              t.state_shardings)
    batch_sharding = t.batch_sharding

    # Resume from the latest checkpoint, if any.
    os.makedirs(cfg.out, exist_ok=True)
    manager = ocp.CheckpointManager(os.path.abspath(os.path.join(cfg.out, "checkpoints")),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True))
    start = 0
    # What the checkpoint's arrays mean besides the settings: the rows the batches index and the
    # frozen arrays kept out of it (the draft vocabulary: train.data rebuilds it when a folder is
    # extended, and a resumed head would then map its columns to other token ids).
    frozen_bytes = b"".join(np.ascontiguousarray(a).tobytes() for a in jax.tree.leaves(jax.device_get(frozen)))
    data_key = {"train_rows": len(train_data), "frozen_sha256": hashlib.sha256(frozen_bytes).hexdigest()}
    if manager.latest_step() is not None:
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, state_shardings)
        restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        state, start = restored["state"], int(restored["meta"]["step"])
        if restored["meta"].get("config_key") != _config_key(cfg):
            raise SystemExit(f"{cfg.out} holds a run with other settings; use another --out")
        saved = restored["meta"].get("data")  # absent in checkpoints from before 2026-12-07
        if saved is not None and saved != data_key:
            raise SystemExit(f"{cfg.out}: the data changed since this run's checkpoint ({saved} then, {data_key} now: "
                             f"a folder extended or its draft vocabulary rebuilt); use another --out")

    def save(step: int) -> None:
        if manager.latest_step() == step:
            return  # the periodic save already wrote it
        meta = {"step": step, "data_position": step * cfg.batch_size, "seed": cfg.seed, "config_key": _config_key(cfg),
                "data": data_key}
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                     force=True)

    if init is not None and cfg.eval_every and start == 0:
        # The validation terms of the drafter a fine-tune starts from: the log's `val_*` rows
        # say what the fine-tune changed.
        with open(os.path.join(cfg.out, "init_validation.json"), "w") as f:
            json.dump({"init_from": cfg.init_from, **validate(state["params"])}, f, indent=1)
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    log_path = os.path.join(cfg.out, "log.jsonl")
    if os.path.isfile(log_path):  # rows past the checkpoint were logged by the run that was stopped: run again
        kept = [row for row in read_log(log_path) if row.get("step", 0) <= start]
        with open(log_path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t0 = time.perf_counter()
    with open(log_path, "a") as log, tqdm(total=cfg.steps, initial=start, desc=f"fit {cfg.drafter}", unit="step") as bar:
        for step in range(start, end):
            host = train_data.batch(train_data.indices(cfg.seed, step, cfg.batch_size), dcfg.target_layer_ids)
            batch = jax.device_put(vars(host), batch_sharding)  # the Batch's fields by name
            state, metrics = step_fn(state, frozen, target_params, batch)
            evaluate = cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps)
            if (step + 1) % cfg.log_every == 0 or step + 1 == end or evaluate:
                row = {k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
                if evaluate:
                    row.update(validate(state["params"]))
                row.update(step=step + 1, seconds=time.perf_counter() - t0, tokens=(step + 1) * tokens_per_step)
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{np.mean(row['accept_top1_per_pos']):.2f}")
            bar.update(1)
            if (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                save(step + 1)
    final = int(jax.device_get(state["step"]))
    summary = {"step": final, "steps": cfg.steps, "seconds": time.perf_counter() - t0, "tokens_per_step": tokens_per_step}
    if final >= cfg.steps:
        save(final)
        manager.wait_until_finished()
        trained = {**jax.device_get(state["params"]), **jax.device_get(frozen)}
        dtype = jnp.bfloat16 if cfg.export_dtype == "bfloat16" else jnp.float32
        trained = jax.tree.map(lambda a: np.asarray(a).astype(dtype) if np.asarray(a).dtype.kind == "f" else np.asarray(a),
                               trained)
        drafter = Drafter(config=dcfg, params=trained, target_fingerprint=target_fingerprint(tcfg),
                          target_description=f"{target.name}")
        save_drafter(drafter, os.path.join(cfg.out, "drafter"))
        summary["drafter"] = os.path.join(cfg.out, "drafter")
        plot_curves(log_path, os.path.join(cfg.out, "curves.png"))
    else:
        save(final)
        manager.wait_until_finished()
    manager.close()
    return summary


def _config_key(cfg: FitConfig) -> dict:
    """Settings a checkpoint's meaning depends on (resuming with other values would mix runs)."""
    keys = ("drafter", "data", "feature_layers", "draft_vocab_size", "num_layers", "head_type", "head_rank",
            "target_layer_ids", "block_size", "seq_len", "batch_size", "anchors", "eagle_steps", "steps", "lr",
            "warmup_steps", "min_lr_ratio", "weight_decay", "clip_norm", "temperature", "seed")
    key = {k: getattr(cfg, k) for k in keys}
    # Only when set, so runs saved before these fields existed still resume.
    for name, unset in (("train_shards", None), ("first_shard", 0), ("init_from", None), ("train_only", ()),
                        ("extra_data", ()), ("model", None)):
        if getattr(cfg, name) != unset:
            key[name] = getattr(cfg, name)
    return json.loads(json.dumps(key))


def read_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(log_path: str, png_path: str) -> None:
    """Loss terms, acceptance per position and the learning rate against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(log_path)
    if not rows:
        return
    x = [r["tokens"] for r in rows]
    terms = [k for k in ("loss", "ce", "tv", "bce") if k in rows[0]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k in terms:
        axes[0].plot(x, [r[k] for r in rows], label=k)
    val = [r for r in rows if "val_loss" in r]
    if val:
        axes[0].plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "ko-", markersize=3, label="validation loss")
    axes[0].set_title("loss terms")
    for key, style in (("accept_top1_per_pos", "-"), ("accept_tv_per_pos", "--")):
        if key in rows[0]:
            per = np.asarray([r[key] for r in rows])
            for j in range(per.shape[1]):
                axes[1].plot(x, per[:, j], style, color=f"C{j}", label=f"{key.split('_')[1]} k={j + 1}")
    if val:
        per = np.asarray([r["val_accept_top1_per_pos"] for r in val])
        for j in range(per.shape[1]):
            axes[1].plot([r["tokens"] for r in val], per[:, j], "o:", color=f"C{j}", markersize=3,
                         label=f"validation top1 k={j + 1}")
    axes[1].set_title("estimated acceptance per position")
    axes[2].plot(x, [r["lr"] for r in rows])
    axes[2].set_title("learning rate")
    for ax in axes:
        ax.set_xlabel("training tokens")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    from dspark_jax import xla_cache

    cfg = load_config(sys.argv[1:] if argv is None else argv)
    xla_cache.enable()
    print(json.dumps(run(cfg), indent=2))


if __name__ == "__main__":
    # Config files import train.fit.FitConfig; run through that module (not this __main__ copy) so
    # their config is an instance of the class load_config checks.
    from train.fit import main as importable_main

    importable_main()
