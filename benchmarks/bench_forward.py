"""Where the time of one target forward goes, against this machine's own limits, in one run.

On the default model (smollm2-135m) with a KV cache holding --context committed tokens:

1. milliseconds of one forward per (batch, width), split into the decoder stack ("layers"), the
   LM head alone, and both in one jitted function ("total"); the cache is donated and fed back
   every call, so it is updated in place as in the engine;
2. the machine's limits measured in the same run: memory bandwidth (a float32 GEMV over as many
   bytes as the target's params) and compute (a 1024x1024 float32 matmul), and per row the
   floors they imply, so a reader sees when a width stops being memory-bound;
3. forward(8 tokens) / forward(1 token) at batch 1;
4. the cost of one drafter round against the verification forward it feeds (target: <= 15 %),
   for DSpark (1 and 2 layers, reduced and full draft vocabularies), DFlash and EAGLE-3,
   measured with dspark_jax.profiling.round_cost_split on a real Engine state.

    .venv/bin/python benchmarks/bench_forward.py [--batches 1 8] [--widths 1 2 4 8 16]
        [--context 200] [--max-len 1024] [--repeats 10] [--dtype float32|bfloat16]
        [--drafter-batches 1 8] [--block-size 7] [--quick] [--plain]

--quick: batch 1, widths 1 and 8, one DSpark drafter, 3 repeats (a smoke run of every part).
Every time is the best of --repeats calls after one warm-up call (perf_counter around
jax.block_until_ready).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import time

# (label, drafter kind, DrafterConfig overrides) of the drafters in part 4.
DRAFTERS = [
    ("dspark L1 V8192", "dspark", dict(num_layers=1, draft_vocab_size=8192)),
    ("dspark L1 V16384", "dspark", dict(num_layers=1, draft_vocab_size=16384)),
    ("dspark L1 full V", "dspark", dict(num_layers=1, draft_vocab_size=None)),
    ("dspark L2 V8192", "dspark", dict(num_layers=2, draft_vocab_size=8192)),
    ("dspark L2 V16384", "dspark", dict(num_layers=2, draft_vocab_size=16384)),
    ("dspark L2 full V", "dspark", dict(num_layers=2, draft_vocab_size=None)),
    ("dflash (default)", "dflash", {}),
    ("eagle3 V8192", "eagle3", dict(draft_vocab_size=8192)),
    ("eagle3 V16384", "eagle3", dict(draft_vocab_size=16384)),
    ("eagle3 full V", "eagle3", {}),
]
QUICK_DRAFTERS = DRAFTERS[:1]

PROMPT_TEXT = ("The history of computing is a story of ever smaller and faster machines, from rooms of "
               "vacuum tubes to chips with billions of transistors. ")


# ---------------------------------------------------------------------------------------- timing
def best_ms(fn, *args, repeats: int) -> float:
    """Best-of-N milliseconds of fn(*args) after one warm-up call (which also compiles).

    For functions without state to carry (LM head, GEMV, matmul); best-of rejects the noise of
    a shared machine, which only ever adds time."""
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def best_ms_with_cache(fn, args: tuple, cache, repeats: int):
    """Best-of-N milliseconds of `out, cache = fn(*args, cache)`, feeding the returned (donated)
    cache back each call, as the engine does; a cache that is not donated and returned would
    be copied whole every call and the timing would measure that copy.

    Returns (ms, the live cache, the last output)."""
    import jax

    out, cache = fn(*args, cache)
    jax.block_until_ready((out, cache))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        out, cache = fn(*args, cache)
        jax.block_until_ready((out, cache))
        best = min(best, time.perf_counter() - start)
    return best * 1e3, cache, out


# ---------------------------------------------------------------------------------------- model sizes
def param_bytes(params) -> int:
    """Bytes a forward streams from memory at least once: every param leaf."""
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def matmul_params(params, config) -> int:
    """Weights that enter a matmul: every >= 2-d layer weight (norms and biases are 1-d) plus the
    LM head (vocab * hidden, tied or not). The embedding is a gather, not a matmul."""
    import jax

    layer_weights = sum(leaf.size for leaf in jax.tree.leaves(params["layers"]) if leaf.ndim >= 2)
    return layer_weights + config.vocab_size * config.hidden_size


def kv_bytes_read(config, batch: int, slots: int, itemsize: int) -> int:
    """Bytes of K and V one forward reads when attention spans `slots` cache slots per row."""
    return 2 * config.num_layers * batch * config.num_kv_heads * slots * config.head_dim * itemsize


def pick_kv_len(context: int, width: int, max_len: int) -> int:
    """Smallest power of two >= context + width, clamped to [128, max_len] (a static size, so a
    handful of buckets is compiled rather than one program per length)."""
    need = max(128, 1 << max(0, context + width - 1).bit_length())
    return min(need, max_len)


# ---------------------------------------------------------------------------------------- part 1
def forward_fns(config, kv_len: int | None):
    """Jitted (layers, lm_head, total) for one kv_len; the cache (last argument) is donated.

    layers(params, tokens [b, w], positions [b, w], cache) -> (hidden [b, w, e], cache)
    lm_head(params, hidden [b, w, e]) -> logits [b, w, V] float32
    total(params, tokens, positions, cache) -> (logits [b, w, V], cache)
    """
    import jax

    from dspark_jax.models.transformer import forward, logits_from_hidden

    extra = {} if kv_len is None else {"kv_len": kv_len}

    def layers(params, tokens, positions, cache):
        hidden, new_cache, _ = forward(params, config, tokens, positions, cache, **extra)
        return hidden, new_cache

    def total(params, tokens, positions, cache):
        hidden, new_cache, _ = forward(params, config, tokens, positions, cache, **extra)
        return logits_from_hidden(params, hidden), new_cache

    return (jax.jit(layers, donate_argnums=(3,)), jax.jit(logits_from_hidden),
            jax.jit(total, donate_argnums=(3,)))


def filled_cache(config, batch: int, max_len: int, context: int, dtype):
    """A cache of `batch` rows with `context` committed tokens each; the K/V values are zeros
    (any values cost the same) in the target's dtype, as the engine allocates it."""
    import jax.numpy as jnp

    from dspark_jax.models.transformer import init_cache

    cache = init_cache(config, batch, max_len, dtype)
    return dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))


def time_forward(target, batch: int, widths, args) -> list[dict]:
    """Part 1 at one batch size: a row per width with layers / LM head / total ms and kv_len."""
    import jax
    import jax.numpy as jnp

    config, params = target.config, target.params
    cache = filled_cache(config, batch, args.max_len, args.context, params["embed"].dtype)
    rows = []
    for width in widths:
        kv_len = pick_kv_len(args.context, width, args.max_len)
        layers, lm_head, total = forward_fns(config, kv_len)
        key = jax.random.PRNGKey(batch * 1000 + width)
        tokens = jax.random.randint(key, (batch, width), 0, config.vocab_size, jnp.int32)  # [b, w]
        positions = jnp.broadcast_to(args.context + jnp.arange(width, dtype=jnp.int32), (batch, width))  # [b, w]
        layers_ms, cache, hidden = best_ms_with_cache(layers, (params, tokens, positions), cache, args.repeats)
        head_ms = best_ms(lm_head, params, hidden, repeats=args.repeats)
        total_ms, cache, _ = best_ms_with_cache(total, (params, tokens, positions), cache, args.repeats)
        rows.append(dict(batch=batch, width=width, kv_len=kv_len, layers=layers_ms, head=head_ms, total=total_ms))
        print(f"  measured batch {batch} width {width}: total {total_ms:.2f} ms", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------------------- part 2
def measure_bandwidth(nbytes: int, repeats: int) -> tuple[float, float]:
    """(GB/s, ms) of a jitted float32 GEMV [rows, 4096] @ [4096] over about `nbytes` bytes: a
    decode step at batch 1 streams every weight once, so this is the step's memory-bound floor."""
    import jax
    import jax.numpy as jnp

    cols = 4096
    rows = max(1, math.ceil(nbytes / (cols * 4)))
    matrix = jax.random.uniform(jax.random.PRNGKey(0), (rows, cols), jnp.float32)  # [rows, 4096]
    vector = jax.random.uniform(jax.random.PRNGKey(1), (cols,), jnp.float32)  # [4096]
    ms = best_ms(jax.jit(jnp.matmul), matrix, vector, repeats=repeats)
    return matrix.nbytes / (ms * 1e-3) / 1e9, ms


def measure_compute(repeats: int, n: int = 1024) -> float:
    """GFLOP/s of a jitted square float32 matmul [n, n] @ [n, n] (2 n^3 FLOPs): the machine's
    practical matmul peak, against which wide chunks become compute-bound."""
    import jax
    import jax.numpy as jnp

    a = jax.random.uniform(jax.random.PRNGKey(2), (n, n), jnp.float32)
    b = jax.random.uniform(jax.random.PRNGKey(3), (n, n), jnp.float32)
    ms = best_ms(jax.jit(jnp.matmul), a, b, repeats=repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------- part 4
def prompt_ids(target, length: int) -> list[int]:
    """`length` real token ids from the target's tokenizer (repeated text), or plain ids below
    the vocabulary when there is no tokenizer; the content does not change the cost."""
    ids: list[int] = []
    tokenizer = target.tokenizer
    if tokenizer is not None:
        once = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
        ids = (once * (length // max(1, len(once)) + 1))[:length]
    if len(ids) < length:
        ids = [(7 * i + 1) % target.config.vocab_size for i in range(length)]
    return ids


def drafter_round(target, kind: str, overrides: dict, batch: int, args) -> dict:
    """round_cost_split of a fresh random drafter on an Engine with one ~--context-token prompt
    per slot. Returns the helper's seconds, or {"error": why} when the drafter cannot be made."""
    from dspark_jax import Engine, SamplingParams
    from dspark_jax.drafters import init_drafter
    from dspark_jax.profiling import round_cost_split

    try:
        drafter = init_drafter(target, kind, seed=0, block_size=args.block_size, **overrides)
    except Exception as err:  # noqa: BLE001 - reported in the table, the run goes on
        return {"error": f"{type(err).__name__}: {err}"}
    engine = Engine(target, drafter, slots=batch, max_len=args.max_len)
    new_tokens = 64
    length = max(1, min(args.context, engine.max_len - new_tokens - engine.extra_positions))
    ids = prompt_ids(target, length)
    state = engine.new_state()
    for slot in range(batch):
        state = engine.insert(state, slot, ids, SamplingParams(max_new_tokens=new_tokens))
    split = round_cost_split(engine, state)
    split["prompt_len"] = length
    return split


# ---------------------------------------------------------------------------------------- output
def print_table(title: str, columns: list[str], rows: list[list[str]], plain: bool) -> None:
    """A rich table when rich is installed (and --plain is not given), else right-aligned text."""
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if not plain:
        table = Table(title=title, title_justify="left")
        for name in columns:
            table.add_column(name, justify="right")
        for row in rows:
            table.add_row(*row)
        console = Console() if sys.stdout.isatty() else Console(width=220, no_color=True)
        console.print(table)
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def header_line(target, args) -> str:
    """jax version, backend, device kind and threads: what the numbers below depend on."""
    import jax

    device = jax.devices()[0]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = os.environ.get("XLA_FLAGS", "")
    return (f"jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind} "
            f"(x{jax.device_count()}), threads: {affinity} usable of {os.cpu_count()} cpus"
            + (f", XLA_FLAGS={flags}" if flags else "")
            + f"\nmodel {target.name}, {args.dtype}, context {args.context}, max_len {args.max_len}, "
            f"best of {args.repeats}")


def forward_table(rows, limits: dict, target, plain: bool) -> None:
    """Part 1 and the floors of part 2, one line per (batch, width)."""
    config = target.config
    itemsize = target.params["embed"].dtype.itemsize
    table = []
    for r in rows:
        flops = 2 * limits["matmul_params"] * r["batch"] * r["width"]
        compute_floor = flops / (limits["gflops"] * 1e9) * 1e3
        slots = r["kv_len"] if r["kv_len"] is not None else limits["max_len"]
        mem_bytes = limits["param_bytes"] + kv_bytes_read(config, r["batch"], slots, itemsize)
        mem_floor = mem_bytes / (limits["gbps"] * 1e9) * 1e3
        table.append([str(r["batch"]), str(r["width"]), str(r["kv_len"] or f"all {limits['max_len']}"),
                      f"{r['layers']:.2f}", f"{r['head']:.2f}", f"{r['total']:.2f}",
                      f"{r['total'] / (r['batch'] * r['width']):.2f}", f"{mem_floor:.2f}", f"{compute_floor:.2f}",
                      "compute" if compute_floor > mem_floor else "memory"])
    print_table("1. one target forward with a KV cache (ms; total = layers + LM head in one jitted function)",
                ["batch", "width", "kv_len", "layers", "LM head", "total", "total/token", "mem floor",
                 "compute floor", "bound by"], table, plain)


def drafter_table(results, forward_rows, plain: bool, block_size: int) -> list[str]:
    """Part 4; returns the notes (drafters that could not be made)."""
    totals = {(r["batch"], r["width"]): r["total"] for r in forward_rows}
    table, notes = [], []
    for batch, label, split in results:
        if "error" in split:
            notes.append(f"{label} (batch {batch}): not measured, {split['error']}")
            continue
        d = split["drafter_seconds_per_round"] * 1e3
        t = split["target_seconds_per_round"] * 1e3
        v = split["verify_seconds_per_round"] * 1e3
        part1 = totals.get((batch, block_size + 1))
        table.append([str(batch), label, f"{d:.2f}", f"{t:.2f}", f"{v:.3f}", f"{100 * d / t:.1f} %",
                      "ok" if d / t <= 0.15 else "over", "-" if part1 is None else f"{part1:.2f}"])
    print_table(f"4. drafter round vs verification forward (target: drafter <= 15 % of the forward; "
                f"block {block_size}, width {block_size + 1}; round_cost_split, best of 3)",
                ["batch", "drafter", "drafter ms", "verify fwd ms", "rule ms", "drafter/fwd", "<= 15 %",
                 f"part-1 total @w{block_size + 1}"], table, plain)
    return notes


# ---------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="tokens per forward")
    parser.add_argument("--context", type=int, default=200, help="committed tokens in the cache before the chunk")
    parser.add_argument("--max-len", type=int, default=1024, help="KV-cache slots per row")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls after a warm-up; the best counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--drafter-batches", type=int, nargs="+", default=[1])
    parser.add_argument("--block-size", type=int, default=7, help="drafted tokens per round (part 4)")
    parser.add_argument("--quick", action="store_true",
                        help="batch 1, widths 1 and 8, one DSpark drafter, 3 repeats: a smoke run")
    parser.add_argument("--plain", action="store_true", help="plain text tables even when rich is installed")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.widths, args.repeats, args.drafter_batches = [1], [1, 8], 3, [1]
    if args.context + max(args.widths) > args.max_len:
        parser.error(f"--context {args.context} + width {max(args.widths)} exceeds --max-len {args.max_len}")
    return args


def main() -> None:
    args = parse_args()
    from dspark_jax import load_target

    target = load_target("smollm2-135m", dtype=args.dtype)
    print(header_line(target, args), flush=True)
    print("kv_len = smallest power of two >= context + width, in [128, max_len]", flush=True)

    forward_rows = []
    for batch in args.batches:
        forward_rows += time_forward(target, batch, args.widths, args)

    nbytes = param_bytes(target.params)
    gbps, gemv_ms = measure_bandwidth(nbytes, args.repeats)
    gflops = measure_compute(args.repeats)
    limits = dict(param_bytes=nbytes, matmul_params=matmul_params(target.params, target.config), gbps=gbps,
                  gflops=gflops, max_len=args.max_len)
    forward_table(forward_rows, limits, target, args.plain)

    print(f"\n2. machine limits: memory {gbps:.1f} GB/s (float32 GEMV over {nbytes / 1e6:.1f} MB, {gemv_ms:.2f} ms); "
          f"compute {gflops:.1f} GFLOP/s (1024x1024 float32 matmul)")
    print(f"   params {nbytes / 1e6:.1f} MB ({args.dtype}); {limits['matmul_params'] / 1e6:.1f} M of them in matmuls "
          f"(FLOPs = 2 x that x batch x width; attention over the cache not counted)")
    limit_ms = nbytes / (gbps * 1e9) * 1e3
    decode = next((r for r in forward_rows if r["batch"] == 1 and r["width"] == 1), None)
    if decode is None:
        print("   decode step (batch 1, width 1) not measured: add 1 to --batches and --widths")
    else:
        print(f"   decode step (batch 1, width 1): {decode['total']:.2f} ms vs {limit_ms:.2f} ms to stream the params "
              f"once -> {100 * limit_ms / decode['total']:.1f} % of the bandwidth limit")

    totals = {(r["batch"], r["width"]): r["total"] for r in forward_rows}
    if (1, 1) in totals and (1, 8) in totals:
        print(f"\n3. forward(8 tokens) / forward(1 token) at batch 1: {totals[(1, 8)]:.2f} / {totals[(1, 1)]:.2f} ms "
              f"= {totals[(1, 8)] / totals[(1, 1)]:.2f}x")
    else:
        print("\n3. forward(8) / forward(1) at batch 1: not measured (needs batch 1 and widths 1 and 8)")
    print(flush=True)

    results = []
    for batch in args.drafter_batches:
        for label, kind, overrides in (QUICK_DRAFTERS if args.quick else DRAFTERS):
            split = drafter_round(target, kind, overrides, batch, args)
            results.append((batch, label, split))
            status = split.get("error") or f"drafter {split['drafter_seconds_per_round'] * 1e3:.2f} ms"
            print(f"  measured batch {batch} {label}: {status}", file=sys.stderr, flush=True)
    notes = drafter_table(results, forward_rows, args.plain, args.block_size)
    prompt_lens = sorted({s["prompt_len"] for _, _, s in results if "prompt_len" in s})
    print(f"   one prompt of {', '.join(map(str, prompt_lens))} tokens per slot; verify fwd = the target's "
          f"forward over the block as round_cost_split times it (cache donated; it also returns"
          f" the drafter's feature layers, so it can exceed part 1's total)")
    for note in notes:
        print(f"   note: {note}")
    print(f"\ncommand: {shlex.join(getattr(sys, 'orig_argv', [sys.executable, *sys.argv]))}")


if __name__ == "__main__":
    main()
