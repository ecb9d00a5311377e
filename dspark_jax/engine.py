"""The Engine: a fixed number of decode slots over one target (and optional drafter), with its
compiled programs (DESIGN.md section 8.2; JetStream's prefill / insert / generate split).

    engine = Engine(target, drafter, slots=8, max_len=2048)
    state = engine.new_state()
    state = engine.insert(state, slot, prompt_token_ids, SamplingParams(...))
    state, out = engine.step(state, rounds=4)   # out.tokens[slot], out.finished[slot], ...
    state = engine.free(state, slot)

The state is a pytree of device arrays (decode.SlotState) that every program donates and
returns, so the KV cache is updated in place. Sampling settings, budgets and seeds are per-slot
data: a new temperature never compiles anything. Programs are compiled ahead per bucketed shape
(`warmup`), and each engine owns its own compiled programs: two engines never share state.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import decode, host_memory, memory_maps
from dspark_jax import schedule as sched
from dspark_jax.decode import DecodeSettings, Requests, SlotState
from dspark_jax.drafters import cast_floats, vocab
from dspark_jax.prompts import PromptError
from dspark_jax.sampling import RowSampling, SamplingParams, is_integer

log = logging.getLogger(__name__)

FINISH_REASONS = {decode.NOT_FINISHED: None, decode.FINISHED_EOS: "eos", decode.FINISHED_LENGTH: "length"}
VERIFIERS = ("jnp", "pallas")


class SlotError(ValueError):
    """A request aimed at a slot that cannot take it (out of range, or busy)."""


@dataclasses.dataclass
class StepOutput:
    """What one `Engine.step` committed, per slot (host values, copied from the device once)."""

    tokens: list[list[int]]  # token ids committed in this call (the request's first one included)
    finished: list[bool]  # the slot's request is complete (it stays so until the slot is freed)
    finish_reason: list[str | None]  # "eos" | "length" | None
    drafted: list[int]  # draft tokens sent to verification for the slot's request so far
    accepted: list[int]  # ... of which the target accepted
    rounds: int  # rounds run (fewer than asked when every slot was done)
    # Per slot, one entry per round the slot was live in this call: accepted draft tokens, the
    # drafter's raw confidence logits [G] and the survival probabilities [G] the policy read
    # (STS-calibrated; under the policies that read them, times the online correction).
    round_accepted: list[list[int]] = dataclasses.field(default_factory=list)
    round_confidence_logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # [rounds_live, G]
    round_survival: list[np.ndarray] = dataclasses.field(default_factory=list)  # [rounds_live, G]
    round_lengths: list[list[int]] = dataclasses.field(default_factory=list)  # draft tokens verified
    # Per round run: tokens in the verification forward (slots + verified drafts), and what
    # the policy predicted for the round (expected committed tokens, and tokens per second).
    round_tokens: list[int] = dataclasses.field(default_factory=list)
    round_predicted_tau: list[float] = dataclasses.field(default_factory=list)
    round_predicted_throughput: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class HostView:
    """A state's small per-slot fields on the host: what the next step's shape (row bucket,
    attention span) and its gate read. A step returns them with its tokens, in the same copy, so
    the next step of that state needs no read of its own; an insert or free makes a new state,
    which is read once."""

    done: np.ndarray  # [slots] bool
    unreported: np.ndarray  # [slots] bool
    occupied: np.ndarray  # [slots] bool
    lengths: np.ndarray  # [slots] int32 cache lengths
    budget: np.ndarray  # [slots] int32
    emitted: np.ndarray  # [slots] int32
    # (step key, drafts): the dspark gate's answer for a step of that key (program rounds, rounds,
    # span, policy, rows, length cap), asked at the end of the step that made this state.
    gate: tuple[tuple, bool] | None = None


def seed_key(seed: int) -> np.ndarray:
    """jax.random.PRNGKey(seed) (threefry: the high and low 32 bits) built on the host, so an
    insert needs no device work before its own program."""
    return np.asarray([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def attention_spans(max_len: int, minimum: int = 256) -> tuple[int, ...]:
    """Attention-span buckets of the step program: powers of two from `minimum`, and max_len.
    A step attends only over the smallest span that holds its rows, so short contexts do not
    read the whole cache (at batch 8 with max_len 1024 that halved a decode step)."""
    return prefill_buckets(max_len, minimum)


def confidence_calibration(drafter, dconfig, key: str) -> tuple[float, ...] | None:
    """The drafter's calibration ("temperatures" or "shifts"; train.calibrate stores them in its
    checkpoint) for the engine's block size: positions past the calibrated ones reuse the last."""
    values = (getattr(drafter, "calibration", None) or {}).get(key)
    if not values or dconfig is None or dconfig.block_size == 0:
        return None
    values = [float(v) for v in values]
    return tuple((values + [values[-1]] * dconfig.block_size)[:dconfig.block_size])


def confidence_prior(drafter, dconfig) -> tuple[float, ...] | None:
    """A fresh engine's gate average [G]: the per-position acceptance c_j = a_j / a_{j-1} from the
    survival rates a_j that train.calibrate measured on the validation split (drafter.json
    "calibration"); positions past the measured ones reuse the last. None (ones) when unknown:
    a drafter without calibration drafts its first rounds whatever the load, as before."""
    rates = (getattr(drafter, "calibration", None) or {}).get("survival_rates")
    if not rates or dconfig is None or dconfig.block_size == 0:
        return None
    rates = np.clip(np.asarray(rates, np.float64), 0.0, 1.0)
    before = np.concatenate([[1.0], rates[:-1]])
    accept = np.where(before > 0, rates / np.maximum(before, 1e-12), 0.0).clip(0.0, 1.0).tolist()
    return tuple((accept + [accept[-1]] * dconfig.block_size)[:dconfig.block_size])


def row_bucket_sizes(slots: int, rows: Sequence[int] | None = None, multiple: int = 1) -> tuple[int, ...]:
    """Row buckets of the step program (ascending, the last = slots): a step runs over the
    smallest bucket that holds every live slot, so a server with 16 slots and one request steps
    one row. Default: powers of two below `slots`. Buckets must be multiples of `multiple` (the
    mesh's data axis, over which slots are split)."""
    if rows is None:
        rows = [1 << i for i in range(max(slots, 1).bit_length()) if (1 << i) < slots]
    rows = sorted({int(r) for r in rows} | {int(slots)})
    if any(r < 1 or r > slots for r in rows):
        raise ValueError(f"row_buckets must be integers in [1, {slots}], got {rows}")
    return tuple(r for r in rows if r % multiple == 0 or r == slots)


def prefill_buckets(max_len: int, minimum: int = 16) -> tuple[int, ...]:
    """Prompt-length buckets of the insert program: powers of two from `minimum`, and max_len."""
    buckets, b = [], minimum
    while b < max_len:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (max_len,)


class Engine:
    """Decode slots over a target and an optional drafter; see the module docstring."""

    def __init__(self, target, drafter=None, *, slots: int = 8, max_len: int = 2048, block_size: int | None = None,
                 verifier: str = "jnp", mesh=None, rules=None, policy: str = "fixed", sps_table=None,
                 threshold: float = sched.DEFAULT_THRESHOLD, row_buckets: Sequence[int] | None = None,
                 sps_cache: str | None = None):
        if not isinstance(slots, (int, np.integer)) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {', '.join(VERIFIERS)}, got {verifier!r}")
        config = target.config
        if not isinstance(max_len, (int, np.integer)) or max_len < 2:
            raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
        max_len = min(int(max_len), config.max_position_embeddings)  # never past the model's context
        dconfig = None
        if drafter is not None:
            if isinstance(drafter, str):
                from dspark_jax.drafters import load_drafter

                drafter = load_drafter(drafter, target)
            drafter.check_target(config)
            dconfig = drafter.config
            if block_size is not None:
                if not isinstance(block_size, (int, np.integer)) or block_size < 1:
                    raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
                dconfig = dataclasses.replace(dconfig, block_size=int(block_size))
        elif block_size is not None:
            raise ValueError("block_size needs a drafter (drafter=None is plain autoregressive decoding)")
        sched.check_policy(policy)
        if drafter is None:
            policy = "none"  # nothing to schedule without a drafter
        if policy == "none":
            dconfig = None  # plain decoding through the same engine: the drafter never runs
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.settings = DecodeSettings(config=config, dconfig=dconfig, slots=int(slots), max_len=max_len,
                                       verifier=verifier, policy=policy,
                                       confidence_temperatures=confidence_calibration(drafter, dconfig, "temperatures"),
                                       confidence_shifts=confidence_calibration(drafter, dconfig, "shifts"),
                                       gate_start=confidence_prior(drafter, dconfig))
        self.cost_table: sched.CostTable | None = None  # the full engine's; smaller buckets in .row_buckets
        # Where a table profiled at warmup is kept and read back (table_cache; None: always profile),
        # and where the table in use came from ("given", "profiled", or "cache PATH").
        self.sps_cache = sps_cache
        self.cost_table_source: str | None = None
        self._bucket_tables: dict[int, tuple[jax.Array, jax.Array]] = {}  # rows -> (SPS(B), plain rate)
        self._schedule = sched.ScheduleParams(
            sps_table=jnp.zeros((sched.table_size(int(slots), self.settings.block_size),), jnp.float32),
            threshold=jnp.asarray(check_threshold(threshold), jnp.float32),
            max_length=jnp.asarray(self.settings.block_size, jnp.int32), plain_sps=jnp.zeros((), jnp.float32),
            round_limit=jnp.asarray(np.iinfo(np.int32).max, jnp.int32))  # step() sets the rounds it asks for
        self._round_limits: dict[int, jax.Array] = {}  # rounds -> its device scalar, made once
        self._warm_rounds: set[int] = set()  # the rounds of the step programs warmup compiled
        self.mesh = mesh if mesh is not None else getattr(target, "mesh", None)
        split = 1 if self.mesh is None else int(dict(self.mesh.shape).get("data", 1))
        # A mesh that splits slots over `data` steps them all: a row bucket's slice of the cache
        # would cut across devices.
        self.row_buckets = row_bucket_sizes(int(slots), row_buckets) if split == 1 else (int(slots),)
        if sps_table is not None:
            self.sps_table = sps_table
        self.prefill_buckets = prefill_buckets(max_len)
        self.attention_spans = attention_spans(max_len)
        self.compile_seconds = 0.0  # total time spent compiling this engine's programs
        self._programs: dict = {}
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()[:1]
        self._on_cpu = any(d.platform == "cpu" for d in devices)  # XLA:CPU's JIT code uses memory maps
        self._steps: dict = {}  # (rounds, span, policy, rows, shut) -> the step executable, looked up every step
        self._state_spec = None  # the slot state's shapes, traced once (_state_shape)
        self._verified_drafts = True  # the last step verified a draft token (span_for's plan)
        self._view: tuple[weakref.ref, HostView] | None = None  # the last step's state and its HostView
        # Params as the programs read them: the caller's trees, or placed on the mesh by the rules.
        self._params = target.params
        # The draft vocabulary's LM-head rows are gathered once here, not in every round.
        # On the device and in the target's dtype: host (numpy) weights were copied to the device
        # at every step, and a bf16 checkpoint beside an f32 target converted its weights every step.
        self._dparams = None if dconfig is None else vocab.bind_head(
            jax.device_put(cast_floats(drafter.params, target.dtype)), target.params)
        self._state_shardings = None
        if self.mesh is not None:
            self._place_on_mesh(rules)

    def _place_on_mesh(self, rules) -> None:
        """Params and decode state by the partition rules (sharding.SERVE_RULES by default): slots
        over `data`, heads / MLP / vocabulary over `tensor` where they divide evenly."""
        from dspark_jax import sharding

        config = self.settings.config
        self._params = sharding.shard_tree(self._params, sharding.target_param_axes(self._params, config),
                                           self.mesh, rules)
        if self._dparams:
            self._dparams = sharding.shard_tree(
                self._dparams, sharding.drafter_param_axes(self._dparams, self.settings.dconfig, config),
                self.mesh, rules)
        state = self._state_shape()
        axes = sharding.slot_state_axes(state)
        self._state_shardings = sharding.tree_shardings(state, axes, self.mesh, rules)

    # ------------------------------------------------------------------ properties
    @property
    def slots(self) -> int:
        return self.settings.slots

    @property
    def max_len(self) -> int:
        return self.settings.max_len

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def extra_positions(self) -> int:
        """Cache positions a request needs beyond prompt + budget (a round verifies G+1 tokens)."""
        return 0 if self.settings.dconfig is None else self.block_size + 1

    @property
    def sps_table(self) -> np.ndarray | None:
        """SPS(B) [slots * (G + 1) + 1], the cost table the dspark policies read for a step over
        every slot (None: not yet profiled or given); smaller row buckets read their own
        (cost_table.row_buckets)."""
        return None if self.cost_table is None else np.asarray(self.cost_table.table, np.float32)

    @sps_table.setter
    def sps_table(self, table) -> None:
        """A CostTable, its JSON path, or an array SPS(B) for B = 0, 1, ...: entries past a
        bucket's largest B are dropped, missing ones are 0 (such a batch is never scheduled).
        A CostTable prices each row bucket it was profiled at (the others are profiled when first
        needed); an array prices every bucket. An array carries no rate for a round without a
        draft: its width-R entry stands for it (drafting taken as free). A new table is data for
        the compiled steps: it compiles nothing."""
        if isinstance(table, (str, os.PathLike)):
            table = sched.CostTable.load(os.fspath(table))
        if isinstance(table, sched.CostTable):
            cost = table
            per_rows = {t.slots: t for t in table.row_buckets if t.slots in self.row_buckets}
            per_rows[self.slots] = table
        else:
            cost = sched.CostTable(slots=self.slots, block_size=self.block_size, widths=[], steps_per_second=[],
                                   table=np.asarray(table, np.float32).reshape(-1).tolist())
            per_rows = {rows: cost for rows in self.row_buckets}  # an array is SPS(B) whatever the rows
            if np.ndim(table) != 1:
                per_rows = {}
        tables = {rows: self._bucket_table(rows, t, table) for rows, t in per_rows.items()}
        if not tables:
            raise ValueError("sps_table must be a non-empty 1-D array of finite steps per second >= 0, "
                             f"got shape {np.shape(table)}")
        self.cost_table = cost
        self._bucket_tables = tables
        self._view = None  # a gate answer read the old table
        self.cost_table_source = "given"  # profile() and the cache name themselves after this

    def _bucket_table(self, rows: int, cost: sched.CostTable, given) -> tuple[jax.Array, jax.Array]:
        """(SPS(B) [rows * (G + 1) + 1], plain rate) of a row bucket from its table (checked)."""
        values = np.asarray(cost.table, np.float32)
        if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError("sps_table must be a non-empty 1-D array of finite steps per second >= 0, "
                             f"got shape {np.shape(given)}")
        size = sched.table_size(rows, self.block_size)
        padded = np.zeros((size,), np.float32)
        padded[:min(size, values.size)] = values[:size]
        plain = cost.plain_steps_per_second or float(padded[min(rows, size - 1)])  # unknown: no draft cost
        if not np.isfinite(plain) or plain < 0:
            raise ValueError(f"plain_steps_per_second must be finite and >= 0, got {plain!r}")
        return jnp.asarray(padded), jnp.asarray(plain, jnp.float32)

    def _schedule_for(self, rows: int) -> sched.ScheduleParams:
        """The schedule inputs of a step over `rows` rows: its bucket's table (zeros before one is
        profiled or given: the shape the program is compiled for)."""
        table, plain = self._bucket_tables.get(
            rows, (jnp.zeros((sched.table_size(rows, self.block_size),), jnp.float32), jnp.zeros((), jnp.float32)))
        return dataclasses.replace(self._schedule, sps_table=table, plain_sps=plain)

    @property
    def threshold(self) -> float:
        """Survival threshold of the "threshold" policy (data: setting it compiles nothing)."""
        return float(self._schedule.threshold)

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._schedule = dataclasses.replace(self._schedule,
                                             threshold=jnp.asarray(check_threshold(value), jnp.float32))
        self._view = None

    def profile(self, max_tokens: int | None = None) -> sched.CostTable:
        """Measure this engine's cost table at every row bucket (schedule.profile_sps) and use it."""
        tables = [self._profile_rows(rows, max_tokens) for rows in self.row_buckets]
        table = dataclasses.replace(tables[-1], row_buckets=tables[:-1])
        self.sps_table = table
        self.cost_table_source = "profiled"
        if self.sps_cache and max_tokens is None:
            from dspark_jax import table_cache

            table_cache.save(self, table, self.sps_cache)
        return table

    def _profile_missing(self) -> None:
        """Profile the row buckets that have no table yet (a table given for the full engine only);
        with no table at all, read back this engine's cached one (sps_cache) when there is one."""
        if self.cost_table is None:
            if self.sps_cache:
                from dspark_jax import table_cache

                cached = table_cache.load(self, self.sps_cache)
                if cached is not None:
                    self.sps_table, path = cached
                    self.cost_table_source = f"cache {path}"
                    return
            self.profile()
            return
        new = [self._profile_rows(rows) for rows in self.row_buckets if rows not in self._bucket_tables]
        self.sps_table = dataclasses.replace(self.cost_table, row_buckets=[
            *[t for t in self.cost_table.row_buckets if t.slots in self.row_buckets], *new])

    def _profile_rows(self, rows: int, max_tokens: int | None = None) -> sched.CostTable:
        """schedule.profile_sps at one row bucket. The step programs it compiles for other policies
        ("fixed" at each width, "none") are dropped afterwards: on XLA:CPU each holds thousands of
        memory maps (memory_maps) that the engine's own programs need, and nothing but a step
        with an explicit other policy runs them again (it compiles them again)."""
        before = set(self._steps)
        try:
            return sched.profile_sps(self, max_tokens, rows=rows)
        finally:
            dropped = [k for k in set(self._steps) - before if self.policy not in k]
            programs = {id(self._steps.pop(k)) for k in dropped}
            for key in [k for k, p in self._programs.items() if id(p) in programs]:
                del self._programs[key]
            self._release_host_memory()  # profiling made a fresh slot state for every call

    @property
    def weights(self):
        """(target params, drafter params) as the compiled programs read them (placed on the mesh,
        the draft-vocabulary head bound)."""
        return self._params, self._dparams

    # ------------------------------------------------------------------ compiled programs
    def _program(self, name: str, fn: Callable, args: tuple, donate: tuple[int, ...] = ()):
        """The executable of fn(*weights, *args), compiled ahead once per input shapes.

        On a mesh, a SlotState argument or result keeps the state's shardings and everything
        else (requests, packed tokens) is replicated, so a step's output feeds the next step."""
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args))
        key = (name, shapes)
        if key not in self._programs:
            if self._on_cpu:
                memory_maps.check_headroom(len(self._programs))
            start = time.perf_counter()
            weights = self.weights
            options = {}
            if self.mesh is not None:
                from jax.sharding import NamedSharding, PartitionSpec

                replicated = NamedSharding(self.mesh, PartitionSpec())
                placed = lambda tree: self._state_shardings if isinstance(tree, SlotState) else replicated  # noqa: E731
                out = jax.eval_shape(fn, *weights, *args)
                options = dict(
                    in_shardings=(*jax.tree.map(lambda a: a.sharding, weights), *(placed(a) for a in args)),
                    out_shardings=tuple(placed(o) for o in out) if isinstance(out, tuple) else placed(out))
            jitted = jax.jit(fn, donate_argnums=tuple(2 + i for i in donate), **options)
            compiled = jitted.lower(*weights, *args).compile()
            if self._on_cpu:
                compiled = memory_maps.FirstRunChecked(compiled, len(self._programs))
            self._programs[key] = compiled
            self.compile_seconds += time.perf_counter() - start
        return self._programs[key]

    def _state_shape(self):
        """The slot state's shapes and dtypes, traced once: tracing new_state at every step cost
        more host time than a plain 16-row step's whole dispatch."""
        if self._state_spec is None:
            self._state_spec = jax.eval_shape(functools.partial(decode.new_state, s=self.settings), *self.weights)
        return self._state_spec

    def _run(self, name: str, fn: Callable, args: tuple, donate: tuple[int, ...] = ()):
        return self._program(name, fn, args, donate)(*self.weights, *args)

    def new_state(self) -> SlotState:
        """Every slot free; buffers allocated on the device."""
        return self._run("new_state", lambda p, dp: decode.new_state(p, dp, self.settings), ())

    def _insert_fn(self):
        s = self.settings
        return lambda p, dp, state, req: decode.insert(p, dp, state, req, s=s)

    def _step_fn(self, rounds: int, span: int, policy: str, rows: int, shut: bool = False):
        """decode.step_rows, and then, under a gated policy, the gate's question for the next step
        of the same shape (decode.gate_at_start on the new state; False otherwise): a step that
        follows it asks no gate program and waits for no answer of its own."""
        s = dataclasses.replace(self.settings, kv_len=span, policy=policy)
        gated = self._gated(policy)

        def fn(p, dp, state, sp):
            out = decode.step_rows(p, dp, state, sp, rounds=rounds, rows=rows, s=s, shut=shut)
            after = decode.gate_at_start(out[0], sp, rounds=rounds, rows=rows, s=s) if gated else jnp.zeros((), bool)
            return (*out, after)

        return fn

    def _step_program(self, rounds: int, span: int, policy: str, rows: int | None = None, shut: bool = False):
        rows = self.slots if rows is None else rows
        key = (int(rounds), int(span), policy, int(rows), bool(shut))
        if key not in self._steps:  # a row bucket's table has one shape, so the key decides the program
            args = (self._state_shape(), self._schedule_for(rows))
            self._steps[key] = self._program(f"step{rounds}@{span}x{rows}:{policy}{':shut' if shut else ''}",
                                             self._step_fn(rounds, span, policy, rows, shut), args, (0,))
        return self._steps[key]

    def _gated(self, policy: str) -> bool:
        """Whether a step under `policy` has the dspark gate (a drafter and a table policy)."""
        return policy in sched.TABLE_POLICIES and self.settings.dconfig is not None

    def _gate_program(self, rounds: int, span: int, policy: str, rows: int):
        """decode.gate_at_start for a step of this shape: one bool read before each gated step."""
        key = ("gate", int(rounds), int(span), policy, int(rows))
        if key not in self._steps:
            s = dataclasses.replace(self.settings, kv_len=span, policy=policy)
            fn = lambda p, dp, state, sp: decode.gate_at_start(state, sp, rounds=rounds, rows=rows, s=s)  # noqa: E731
            self._steps[key] = self._program(f"gate{rounds}@{span}x{rows}:{policy}", fn,
                                             (self._state_shape(), self._schedule_for(rows)))
        return self._steps[key]

    def host_view(self, state: SlotState) -> HostView:
        """`state`'s HostView: the one the last step returned when `state` is its result, else
        read from the device (a few bytes per slot)."""
        if self._view is not None and self._view[0]() is state:
            return self._view[1]
        view = HostView(*jax.device_get((state.done, state.unreported, state.occupied, state.cache.lengths,
                                         state.budget, state.emitted)))
        self._view = (weakref.ref(state), view)
        return view

    def rows_for(self, state: SlotState) -> int:
        """The smallest row bucket that holds every slot a step must visit (live, or holding a
        first token not yet reported)."""
        view = self.host_view(state)
        visit = np.flatnonzero(~view.done | view.unreported)
        need = int(visit[-1]) + 1 if visit.size else 1
        return next(rows for rows in self.row_buckets if rows >= need)

    def span_for(self, state: SlotState, rounds: int, policy: str | None = None) -> int:
        """The smallest attention span for a step of `rounds` rounds under `policy`.

        A live row needs room for one position per round, for the drafts it may verify, and never
        more than its remaining budget. The step cuts a round's drafts to what the span holds
        (decode.round_caps), so the span only trades attention cost against drafts cut: the dspark
        policies, whose rounds are mostly plain wherever drafting does not pay, plan for one full
        block on top of the plain rounds, or for plain rounds only after a step of this engine
        that verified no draft token (their gate was closed: a probe near the span's edge has its
        drafts cut rather than every step moving to the next span early); "none" for plain rounds
        only; the other policies for G+1 positions every round."""
        policy = self.policy if policy is None else policy
        view = self.host_view(state)
        lengths, budget, emitted = view.lengths, view.budget, view.emitted
        live = view.occupied & ~view.done  # on the host: an eager device op would compile after warmup
        if not live.any():
            return self.attention_spans[0]
        g = self.block_size
        if policy == "none" or g == 0:
            ahead = rounds  # plain rounds only
        elif policy in sched.TABLE_POLICIES:
            ahead = rounds + (g if self._verified_drafts else 0)
        else:
            ahead = rounds * (g + 1)
        need = int((lengths + np.minimum(ahead, budget - emitted))[live].max())
        return next((span for span in self.attention_spans if span >= need), self.max_len)

    @staticmethod
    def _free_fn(p, dp, state, slot):
        return decode.free(state, slot)

    def _abstract_requests(self, n: int, length: int) -> Requests:
        spec = jax.ShapeDtypeStruct
        vec = lambda dtype: spec((n,), dtype)  # noqa: E731
        return Requests(tokens=spec((n, length), jnp.int32), lengths=vec(jnp.int32), slots=vec(jnp.int32),
                        budget=vec(jnp.int32), ignore_eos=vec(jnp.bool_),
                        sampling=RowSampling(vec(jnp.float32), vec(jnp.int32), vec(jnp.float32)),
                        seed_key=spec((n, 2), jnp.uint32))

    def warmup(self, rounds: Sequence[int] = (1,), insert_batches: Sequence[int] = (1,), *,
               execute: bool = True) -> float:
        """Compile every program a request can need ahead: the insert program for each prompt
        bucket and each batch size in `insert_batches` (powers of two), a step for each value in
        `rounds`, each attention span and row bucket, and free. A dspark policy without a cost
        table profiles one (schedule.profile_sps) before compiling most of its step programs. On
        XLA:CPU the spans compiled are those that fit the memory-map limit (_fit_spans_to_maps).

        With `execute`, each of them then also runs once on placeholder requests, every
        verification width of a step included (`_execute_programs`): an executable's first run
        initialises its kernels (XLA's CPU runtime here: 0.4-0.7 s per program; CUDA's lazy module
        loading likewise), and without this each first use of a prompt bucket, row bucket, span or
        width (a rare probe at high load) stalls every live request that long. Returns the
        seconds it took."""
        if is_integer(rounds):
            raise ValueError(f"rounds must be a sequence of integers >= 1, got {rounds!r}")
        for r in rounds:
            check_rounds(r)
        start = time.perf_counter()
        self._warm_rounds.update(int(r) for r in rounds)
        self.new_state()
        state = self._state_shape()
        for n in insert_batches:
            for length in self.prefill_buckets:
                self._program("insert", self._insert_fn(), (state, self._abstract_requests(pow2(n), length)), (0,))
        if self._on_cpu:
            self._fit_spans_to_maps(rounds)
        if self._gated(self.policy) and len(self._bucket_tables) < len(self.row_buckets):
            # Before the other step programs: the programs profiling compiles for other policies
            # are dropped again (_profile_rows), so they never sit beside all of the engine's own.
            self._profile_missing()
        for r in rounds:
            for span in self.attention_spans:
                for rows in self.row_buckets:
                    self._compile_step_group(int(r), span, rows)
        self._program("free", self._free_fn, (state, jax.ShapeDtypeStruct((), jnp.int32)), (0,))
        if execute:
            self._execute_programs(rounds, insert_batches)
        return time.perf_counter() - start

    def _release_host_memory(self) -> None:
        """After dropping a fresh slot state on XLA:CPU, hand its freed pages back (host_memory)."""
        if self._on_cpu:
            host_memory.release()

    def _compile_step_group(self, rounds: int, span: int, rows: int) -> None:
        """The programs a step of this shape can need: the step, and under a gated policy the
        gate's question and the step that runs while the gate is shut."""
        self._step_program(rounds, span, self.policy, rows)
        if self._gated(self.policy):
            self._gate_program(rounds, span, self.policy, rows)
            self._step_program(rounds, span, self.policy, rows, shut=True)

    def _fit_spans_to_maps(self, rounds: Sequence[int]) -> None:
        """On XLA:CPU, compile fewer attention spans when the step programs of all of them would
        pass the kernel's memory-map limit (memory_maps: each step program of the default model
        takes ~2500 maps; a dspark engine of 8 slots and 2048 tokens needs 16 groups of them, more
        than the default vm.max_map_count of 65530 holds beside its insert programs).

        Compiles the group of the widest span and the most rows first, and counts its maps as
        every group's; while the rest would not fit, drops the smallest span (a context it held
        then attends over the next span, the smallest extra reading of all the spans). A step
        reads the context through the span that holds it, so nothing but attention cost changes.
        The widest span always stays: a configuration that does not fit with it alone stops at
        the memory-map guard with its message."""
        free = memory_maps.free_maps()
        spans = list(self.attention_spans)
        if free is None or len(spans) == 1:
            return
        before = memory_maps.map_count()
        for r in rounds:
            self._compile_step_group(int(r), spans[-1], self.row_buckets[-1])
        per_span = max(memory_maps.map_count() - before, 1) * len(self.row_buckets)  # every rounds value
        while len(spans) > 1 and per_span * len(spans) > free:
            spans.pop(0)
        if len(spans) < len(self.attention_spans):
            dropped = [s for s in self.attention_spans if s not in spans]
            log.warning(
                "compiling attention spans %s of %s only: all of them need ~%d memory maps and this process "
                "has %d to spare under vm.max_map_count (%s); contexts up to %d attend over %d positions. "
                "Raise the limit (sudo sysctl -w vm.max_map_count=262144) to compile them all",
                spans, list(self.attention_spans), per_span * len(self.attention_spans), free,
                memory_maps.map_limit(), dropped[-1], spans[0])
            self.attention_spans = tuple(spans)

    def _execute_programs(self, rounds: Sequence[int], insert_batches: Sequence[int]) -> None:
        """Run each insert program and each step program (at every verification width) once, on
        placeholder requests whose outputs are dropped (warmup's `execute`)."""
        placeholder = self.placeholder_prompt
        one = SamplingParams(max_new_tokens=1, ignore_eos=True)
        for n in sorted({pow2(b) for b in insert_batches if pow2(b) <= self.slots}):
            for previous in (0, *self.prefill_buckets[:-1]):
                # The shortest prompt of the next bucket, with room for one new token: a bucket no
                # request can fit is never used.
                if previous + 2 + self.extra_positions <= self.max_len:
                    jax.block_until_ready(self.insert_many(
                        self.new_state(), [(slot, placeholder(previous + 1), one) for slot in range(n)]))
                    self._release_host_memory()
        budget = self.max_len - 1 - self.extra_positions  # a placeholder row never finishes early
        if budget < 1:
            return
        widths = decode.verify_widths(self.block_size) if self.settings.dconfig is not None else (1,)
        params = SamplingParams(max_new_tokens=budget, ignore_eos=True)
        like = lambda ref, value: jnp.full(ref.shape, value, ref.dtype)  # noqa: E731 - uncommitted, as step() passes them
        repeats = 3 if self.policy == "dspark-lagged" else 1  # its budget reads confidences two rounds old
        for r in rounds:
            for span in self.attention_spans:
                for rows in self.row_buckets:
                    program = self._step_program(int(r), span, self.policy, rows)
                    state = self.new_state()
                    for slot in range(rows):  # batch-1 inserts: always compiled
                        state = self.insert(state, slot, placeholder(1), params)
                    sp = self._schedule_for(rows)
                    flat = like(sp.sps_table, 1.0)
                    # A flat table and no plain rate open every gate and admit every capped block,
                    # so max_length = w - 1 runs the width-w verification (w = 1: the dspark
                    # policies' plain round); a tiny threshold does the same for "threshold".
                    cases = [(flat, w - 1) for w in widths]
                    if self._gated(self.policy) and len(widths) > 1:
                        # A drafted round that admits nothing (a probe of low confidences): the
                        # gate opens, but any token past B = rows is priced at zero.
                        cases.append((jnp.where(jnp.arange(flat.shape[0]) <= rows, flat, 0.0), self.block_size))
                    for table, cap in cases:
                        run = dataclasses.replace(sp, sps_table=table, plain_sps=like(sp.plain_sps, 0.0),
                                                  threshold=like(sp.threshold, 1e-30), max_length=like(sp.max_length, cap))
                        for _ in range(repeats):
                            state = program(*self.weights, state, run)[0]
                    if self._gated(self.policy):  # the gate's question, then its plain-only step
                        shut = dataclasses.replace(sp, max_length=like(sp.max_length, 0))
                        jax.block_until_ready(self._gate_program(int(r), span, self.policy, rows)(
                            *self.weights, state, shut))
                        state = self._step_program(int(r), span, self.policy, rows, shut=True)(
                            *self.weights, state, shut)[0]
                    jax.block_until_ready(self.free(state, 0))
                    self._release_host_memory()  # the next group's fresh state would not reuse this one's
        self._verified_drafts = True  # as a fresh engine: the placeholders' drafts say nothing

    def placeholder_prompt(self, length: int) -> list[int]:
        """`length` fixed token ids for requests whose output is dropped (warmup, profiling)."""
        return [(7 * i + 3) % self.settings.config.vocab_size for i in range(length)]

    # ------------------------------------------------------------------ requests
    def _check_request(self, slot, ids, params: SamplingParams, index: int) -> list[int]:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise SlotError(f"slot must be an integer in [0, {self.slots}), got {slot!r}")
        return self.check_request(ids, params, index)

    def check_request(self, ids, params: SamplingParams, index: int = 0) -> list[int]:
        """The prompt's token ids as ints if this engine can take the request; else a PromptError
        (or TypeError) naming prompt `index`. Callers with many requests check them all first."""
        cfg = self.settings.config
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a dspark_jax.SamplingParams, got {type(params).__name__}")
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)) or not all(
                isinstance(t, (int, np.integer)) for t in ids):
            raise PromptError(f"prompt {index} must be a list of token ids (ints)")
        ids = [int(t) for t in ids]
        if not ids:
            raise PromptError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(f"prompt {index} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
        need = len(ids) + params.max_new_tokens + self.extra_positions
        if need > self.max_len:
            raise PromptError(
                f"prompt {index} has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} it needs {need} "
                f"positions but the engine's max_len is {self.max_len}")
        return ids

    def insert(self, state: SlotState, slot: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> SlotState:
        """Prefill one request into a free slot; its tokens (the first one included) come out of
        later `step` calls. Bad input raises before the state is touched."""
        return self.insert_many(state, [(slot, prompt_token_ids, params)])

    def insert_many(self, state: SlotState, requests: Sequence[tuple[int, Sequence[int], SamplingParams]]) -> SlotState:
        """Prefill several requests in one program (batch bucketed to a power of two): each is
        (slot, prompt_token_ids, params). Bad input raises before the state is touched."""
        if not requests:
            return state
        checked = [self._check_request(slot, ids, params, i) for i, (slot, ids, params) in enumerate(requests)]
        slots = [int(r[0]) for r in requests]
        if len(set(slots)) != len(slots):
            raise SlotError(f"a slot appears twice in one insert: {slots}")
        occupied = np.asarray(jax.device_get(state.occupied))
        busy = [s for s in slots if occupied[s]]
        if busy:
            raise SlotError(f"slot {busy[0]} is busy; free it first (engine.free(state, {busy[0]}))")
        n = pow2(len(requests))
        longest = max(len(ids) for ids in checked)
        length = next(b for b in self.prefill_buckets if b >= longest)
        pad_id = self.settings.config.pad_token_id or 0
        tokens = np.full((n, length), pad_id, np.int32)
        rows = [checked[i] if i < len(checked) else checked[0] for i in range(n)]
        for i, ids in enumerate(rows):
            tokens[i, :len(ids)] = ids
        params = [requests[i][2] if i < len(requests) else requests[0][2] for i in range(n)]
        req = Requests(
            tokens=tokens, lengths=np.asarray([len(ids) for ids in rows], np.int32),
            slots=np.asarray(slots + [-1] * (n - len(slots)), np.int32),
            budget=np.asarray([p.max_new_tokens for p in params], np.int32),
            ignore_eos=np.asarray([p.ignore_eos for p in params], bool), sampling=RowSampling.from_params(params),
            seed_key=np.stack([seed_key(p.seed) for p in params]))
        return self._run("insert", self._insert_fn(), (state, req), (0,))

    def step(self, state: SlotState, rounds: int = 1, *, policy: str | None = None,
             max_length: int | None = None) -> tuple[SlotState, StepOutput]:
        """Run up to `rounds` decoding rounds for every live slot in one device loop and copy
        the committed tokens to the host once.

        A dspark step that starts with its gate closed runs plain rounds until its gate could
        open (a probe due, a row leaving; decode.step's `shut`), so it may run fewer rounds;
        `out.rounds` says how many ran.

        `policy` overrides the engine's verification-length policy for this call (one compiled
        program per policy); `max_length` caps the draft tokens any row verifies (data: any value
        in [0, G] runs the same program). After `warmup`, a step runs on the smallest warmed-up
        program of at least `rounds` rounds, limited to `rounds` as data."""
        check_rounds(rounds)
        policy = self.policy if policy is None else sched.check_policy(policy)
        if self.settings.dconfig is None:
            policy = "none"  # plain decoding: there is nothing to schedule
        rows = self.rows_for(state)
        sp = self._schedule_for(rows)
        if max_length is not None:
            if not isinstance(max_length, (int, np.integer)) or not 0 <= max_length <= self.block_size:
                raise ValueError(f"max_length must be an integer in [0, {self.block_size}], got {max_length!r}")
            sp = dataclasses.replace(sp, max_length=jnp.asarray(max_length, jnp.int32))
        if self._gated(policy) and rows not in self._bucket_tables and max_length != 0:
            self._profile_missing()  # once, before the first step that needs it (a cap of 0 never drafts)
            sp = dataclasses.replace(self._schedule_for(rows), max_length=sp.max_length)
        # The step runs on the smallest warmed-up program of at least `rounds` rounds, limited to
        # `rounds` as data (decode.round_limit): a server warmed up for 4-round steps also runs
        # 1-round ones without a program of its own (every program costs ~1000 memory maps of
        # JIT code on XLA:CPU, and a process has 65530).
        program_rounds = min((r for r in self._warm_rounds if r >= rounds), default=int(rounds))
        if int(rounds) not in self._round_limits:
            self._round_limits[int(rounds)] = jnp.asarray(int(rounds), jnp.int32)
        sp = dataclasses.replace(sp, round_limit=self._round_limits[int(rounds)])
        span = self.span_for(state, int(rounds), policy)
        # A gated step whose first round would not draft runs the plain-only program (decode.step's
        # `shut`): the gate's nested loops cost ~5 ms a step even when they draft nothing. The
        # previous step of the same shape asked the gate already (HostView.gate); otherwise its
        # own program asks (after an insert or free, or a new span, rows or cap).
        gated = self._gated(policy)
        key = (program_rounds, int(rounds), span, policy, rows,
               self.block_size if max_length is None else int(max_length))
        known = self.host_view(state).gate
        if gated and known is not None and known[0] == key:
            shut = not known[1]
        else:
            shut = gated and not bool(self._gate_program(program_rounds, span, policy, rows)(*self.weights, state, sp))
        program = self._step_program(program_rounds, span, policy, rows, shut)
        state, tokens, counts, ran, trace, load, gate_after = program(*self.weights, state, sp)
        (tokens, counts, occupied, done, reason, drafted, accepted, ran, trace, load, gate_after, unreported, lengths,
         budget, emitted) = jax.device_get(
            (tokens, counts, state.occupied, state.done, state.finish_reason, state.drafted, state.accepted, ran,
             trace, load, gate_after, state.unreported, state.cache.lengths, state.budget, state.emitted))
        self._view = (weakref.ref(state), HostView(done=done, unreported=unreported, occupied=occupied,
                                                   lengths=lengths, budget=budget, emitted=emitted,
                                                   gate=(key, bool(gate_after)) if gated else None))
        finished = occupied & done
        self._verified_drafts = bool(np.any(trace.lengths > 0))
        live = [trace.accepted[i] >= 0 for i in range(self.slots)]  # [rounds] per slot
        out = StepOutput(
            tokens=[tokens[i, :counts[i]].tolist() for i in range(self.slots)], finished=finished.tolist(),
            finish_reason=[FINISH_REASONS[int(r)] if f else None for r, f in zip(reason, finished)],
            drafted=drafted.tolist(), accepted=accepted.tolist(), rounds=int(ran),
            round_accepted=[trace.accepted[i][live[i]].tolist() for i in range(self.slots)],
            round_confidence_logits=[trace.confidence_logits[i][live[i]] for i in range(self.slots)],
            round_survival=[trace.survival[i][live[i]] for i in range(self.slots)],
            round_lengths=[trace.lengths[i][live[i]].tolist() for i in range(self.slots)],
            round_tokens=load.tokens[:ran].tolist(), round_predicted_tau=load.predicted_tau[:ran].tolist(),
            round_predicted_throughput=load.predicted_throughput[:ran].tolist())
        return state, out

    def free(self, state: SlotState, slot: int) -> SlotState:
        """A finished or cancelled slot becomes free (freeing a free slot is a no-op)."""
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise SlotError(f"slot must be an integer in [0, {self.slots}), got {slot!r}")
        return self._run("free", self._free_fn, (state, np.int32(slot)), (0,))


def check_rounds(rounds) -> None:
    """Rounds per step (step, warmup): an integer >= 1."""
    if not is_integer(rounds) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")


def check_threshold(threshold) -> float:
    if not isinstance(threshold, (int, float, np.floating, np.integer)) or not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"threshold must be a survival probability in (0, 1], got {threshold!r}")
    return float(threshold)


def pow2(n: int) -> int:
    """The smallest power of two >= n (batch buckets)."""
    return 1 << max(0, int(n) - 1).bit_length()


__all__ = ["Engine", "SamplingParams", "SlotError", "StepOutput"]
