"""Tokenizers: built from GGUF metadata with the `tokenizers` package (no torch), or read from an
HF folder. Both are wrapped in transformers' fast-tokenizer class so chat templates work."""

from __future__ import annotations

import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
    """Byte-level pre-tokenizer for a llama.cpp `tokenizer.ggml.pre` name.

    "smollm" (SmolLM / SmolLM2) splits every digit on its own before the GPT-2 split, as the
    original tokenizer.json of those models does.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2"):
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: smollm, gpt2, default")


def tokenizer_from_gguf_fields(fields: dict):
    """Build a transformers fast tokenizer from already-read GGUF metadata values."""
    from transformers import PreTrainedTokenizerFast

    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE)")
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )

    def token(key: str):
        idx = fields.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=fields.get("tokenizer.chat_template"),
    )


def save_tokenizer(tokenizer, directory: str) -> None:
    tokenizer.save_pretrained(directory)


def load_tokenizer_dir(directory: str):
    """The tokenizer saved in an HF folder, or None when the folder has none."""
    if not any(os.path.exists(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
