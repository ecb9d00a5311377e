"""Typed configuration of a decoder-only target model (Llama, Qwen2, Qwen3 families)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


class ConfigError(ValueError):
    """A model configuration that this library cannot run, with the reason."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a target; hashable so it can be static."""

    family: str  # one of SUPPORTED_FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2; optional for Llama)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"unsupported architecture {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        raw = json.loads(text)
        if raw.get("rope_scaling"):
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
        return cls(**raw)


_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dictionary."""
    model_type = raw.get("model_type")
    family = None
    for arch in raw.get("architectures") or ():
        family = _HF_ARCHITECTURES.get(arch, family)
    if family is None and model_type in SUPPORTED_FAMILIES:
        family = model_type
    if family is None:
        raise ConfigError(
            f"unsupported architecture (model_type={model_type!r}, architectures={raw.get('architectures')!r}); "
            f"supported: {', '.join(_HF_ARCHITECTURES)}"
        )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"config.json lacks required fields: {', '.join(missing)}")
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=True is not supported")
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    rope_scaling = None
    rope_theta = raw.get("rope_theta")
    if isinstance(scaling, dict):
        rope_theta = rope_theta or scaling.get("rope_theta")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif kind not in ("default", None):
            raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: default, llama3")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )
