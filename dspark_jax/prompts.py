"""Turning user prompts into padded, bucketed token batches (host side, before the device loop)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dspark_jax.models.config import ModelConfig
from dspark_jax.sampling import is_integer


class PromptError(ValueError):
    """A prompt the model cannot take (empty, too long for the context, not text or ids)."""


def encode_prompts(tokenizer, prompts: Sequence, chat: bool) -> list[list[int]]:
    """Strings -> token ids (chat=True wraps each as one user message); id lists pass through."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise PromptError("prompts must be a list of strings (or of token-id lists), not a single value")
    if not prompts:
        raise PromptError("prompts is empty")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise PromptError("this target has no tokenizer; pass prompts as lists of token ids")
            if chat:
                ids = encode_chat(tokenizer, [{"role": "user", "content": prompt}])
            else:
                ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (Sequence, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = prompt
        else:
            raise PromptError(f"prompt {i} is neither a string nor a list of token ids")
        ids = [int(t) for t in ids]
        if not ids:
            raise PromptError(f"prompt {i} is empty")
        encoded.append(ids)
    return encoded


def encode_chat(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Messages [{"role", "content"}] through the tokenizer's chat template, ending with the
    prompt of the assistant's turn (what a chat model answers)."""
    if tokenizer.chat_template is None:
        raise PromptError("the tokenizer has no chat template; pass the prompt as plain text (chat=False)")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def bucket(n: int, minimum: int = 16) -> int:
    """Round n up to a bucket so compiled shapes stay few: multiples of `minimum` up to 8x it,
    then steps of an eighth of the enclosing power of two (at most ~12% padding waste)."""
    if n <= minimum:
        return minimum
    step = max(minimum, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step) * step


def check_prompts(ids: list[list[int]], config: ModelConfig, max_new_tokens: int, extra_slots: int = 0) -> None:
    """Every row fits the model's context with its budget, and every id is in the vocabulary."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    limit = config.max_position_embeddings
    for i, row in enumerate(ids):
        need = len(row) + max_new_tokens + extra_slots
        if need > limit:
            raise PromptError(
                f"prompt {i} has {len(row)} tokens; with max_new_tokens={max_new_tokens} it needs {need} "
                f"positions but the model's context is {limit}"
            )
        bad = [t for t in row if not 0 <= t < config.vocab_size]
        if bad:
            raise PromptError(f"prompt {i} has token ids outside the vocabulary [0, {config.vocab_size}): {bad[:5]}")
