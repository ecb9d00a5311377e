"""Shared test fixtures: tiny random Hugging Face models saved to disk, the real default model."""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest

# Tests compare against float32 references; keep XLA from using reduced-precision matmuls.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The suite is dominated by compiling many small programs; LLVM's lowest optimisation level
# compiles them about 2.5x faster (set before JAX starts; benchmarks keep the default).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# Many tests build Engines over the same tiny models, and each Engine's programs are new closures,
# so the in-memory jit cache misses and XLA compiles identical HLO again. A persistent cache,
# shared by the xdist workers and the subprocesses the tests start (they inherit this
# environment), compiles each program once. Keys include the JAX version and the flags above.
# The no-recompile tests count a cache retrieval as a compile.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dspark-jax-tests-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Servers the tests start profile their cost tables afresh, as benchmarks do (the table cache's
# own test passes its directory explicitly).
os.environ.setdefault("DSPARK_SPS_CACHE", "0")


# What a program that was not compiled before leaves: a backend compile, or with the persistent
# cache above, a retrieval from it (the program was traced and lowered again all the same).
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


@contextlib.contextmanager
def recorded_compiles():
    """Yields the list of compile events (COMPILE_EVENTS) that happen while the block runs."""
    import jax

    events: list[str] = []

    def listener(event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def make_tiny_hf_model(directory: str, family: str, tie: bool, seed: int = 0, **overrides):
    """Save a random tiny transformers model of `family` to `directory`; return the torch model."""
    import torch
    import transformers

    common = dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0; randomise them so they matter
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def wait_until(predicate, timeout=20.0, poll=0.02) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False): for state that
    another thread (a server's loop) changes."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll)
    return False


@pytest.fixture(scope="session")
def real_target():
    from dspark_jax import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="session")
def real_hf():
    """transformers' own load of the same GGUF file (torch, float32) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_jax.models.loading import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def random_target_params(key, cfg):
    """Random target params in the stacked layout of sharding.target_param_shapes (the one
    declaration of transformer.py's layout): norms near 1 and biases non-zero so they matter,
    linear weights [out, in] scaled by 1/sqrt(in), a unit-scale embedding."""
    import jax
    import numpy as np

    from dspark_jax.sharding import target_param_shapes

    shapes = target_param_shapes(cfg, stacked=True)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(k, leaf.shape)
        if "norm" in name:
            out.append(1.0 + 0.1 * noise)
        elif name.startswith("['embed']"):
            out.append(noise)
        elif name[-4:-2] in ("bq", "bk", "bv"):
            out.append(0.2 * noise)
        else:
            out.append(noise / np.sqrt(leaf.shape[-1]))
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama with the default model's vocabulary, tokenizer and chat template (the
    training programs' end-to-end tests need text prompts but not a real model's cost)."""
    from dspark_jax.models.loading import converted_gguf, resolve_model_path
    from dspark_jax.models.tokenizer import save_tokenizer

    path = str(tmp_path_factory.mktemp("tiny_chat"))
    make_tiny_hf_model(path, "llama", True, vocab_size=49152, max_position_embeddings=1024,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
    save_tokenizer(converted_gguf(resolve_model_path("smollm2-135m"))[2], path)
    return path


@pytest.fixture(scope="session")
def tiny_train_data(tiny_chat_dir, tmp_path_factory):
    """train.data + train.features output for the tiny chat target: 12 short self-distilled
    conversations and the features of its layers 0 and 1 (what the trainer tests read)."""
    import json

    from train import data, features

    folder = tmp_path_factory.mktemp("tiny_train_data")
    records = [{"id": f"t{i}_0", "conversations": [{"from": "human", "value": f"Tell me fact number {i}."}]}
               for i in range(12)]
    sharegpt = folder / "sharegpt.json"
    sharegpt.write_text(json.dumps(records))
    out = str(folder / "data")
    data.run(data.DataConfig(out=out, model=tiny_chat_dir, sharegpt=str(sharegpt), conversations=12, shard_size=8,
                             val_fraction=0.25, max_prompt_tokens=64, max_new_tokens=24, slots=8, rounds_per_step=8,
                             vocab_sizes=(64,)))
    features.run(features.FeaturesConfig(data=out, layers=(0, 1)))
    return out
