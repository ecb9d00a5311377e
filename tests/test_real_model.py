"""End-to-end checks on the real default model (SmolLM2-135M-Instruct GGUF) against transformers."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from dspark_jax import generate
from dspark_jax.models.transformer import forward, logits_from_hidden

pytestmark = pytest.mark.slow

TEXT = (
    "Speculative decoding lets a small drafter propose several tokens that the large model then checks "
    "in one forward pass. When the drafter is right, many tokens are accepted at once; when it is wrong, "
    "the target model corrects it, so the output is exactly what the target would have produced. "
    "The technique was introduced in 2022 and has since become standard in serving systems such as "
    "vLLM and SGLang, where it is combined with continuous batching and paged attention. "
) * 2


def test_tokenizer_matches_transformers_gguf_tokenizer(real_target, real_hf):
    _, hf_tok = real_hf
    ours = real_target.tokenizer
    for text in [TEXT, "Hello, world! <|im_start|>user\nhow are you?<|im_end|>", "  spaces\tand\nlines  ", "naïve café"]:
        assert ours(text)["input_ids"] == hf_tok(text)["input_ids"], text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # SmolLM2's own tokenizer (llama.cpp pre-tokenizer "smollm") splits every digit.
    digits = ours("in 2024")["input_ids"]
    assert [ours.decode([t]) for t in digits][-4:] == ["2", "0", "2", "4"]
    assert ours.decode(ours("round trip ok")["input_ids"]) == "round trip ok"


def test_logits_match_transformers_on_real_model(real_target, real_hf):
    import torch

    model, _ = real_hf
    ids = real_target.tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 150
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    hidden, _, _ = forward(real_target.params, real_target.config, jnp.asarray([ids]), jnp.arange(len(ids))[None])
    ours = np.asarray(logits_from_hidden(real_target.params, hidden))[0]
    assert np.abs(ours - expected).max() <= 1e-3
    assert (ours.argmax(-1) == expected.argmax(-1)).all()


PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Give three tips for learning a new programming language.",
]


def test_greedy_generation_matches_transformers(real_target, real_hf):
    import torch

    model, hf_tok = real_hf
    result = generate(real_target, PROMPTS, max_new_tokens=32)
    for prompt, got in zip(PROMPTS, result.token_ids):
        ids = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 pad_token_id=hf_tok.pad_token_id)[0, len(ids):].tolist()
        assert got == ref, prompt
    assert result.texts[0].strip().startswith("The capital of France is Paris")


def test_batch_of_different_lengths_equals_single_prompts(real_target):
    prompts = PROMPTS + ["Hi", "Describe, in detail, the water cycle and how clouds form over the ocean."]
    batched = generate(real_target, prompts, max_new_tokens=16)
    for prompt, row in zip(prompts, batched.token_ids):
        assert generate(real_target, [prompt], max_new_tokens=16).token_ids[0] == row


def test_prompt_longer_than_context_is_refused(real_target):
    from dspark_jax.prompts import PromptError

    with pytest.raises(PromptError, match="context is 8192"):
        generate(real_target, [[1] * 8190], max_new_tokens=8)


@pytest.mark.parametrize("name", ["smollm2-135m-dspark", "smollm2-135m-dflash", "smollm2-135m-eagle3"])
def test_greedy_speculative_equals_plain_on_real_model(real_target, name):
    """Each shipped drafter (some drafts accepted, some rejected) gives plain greedy's tokens."""
    from dspark_jax.drafters import load_drafter

    drafter = load_drafter(name, real_target)
    prompts = PROMPTS + ["Repeat after me: one two three, one two three, one two three."]
    plain = generate(real_target, prompts, max_new_tokens=32)
    spec = generate(real_target, prompts, max_new_tokens=32, drafter=drafter, profile=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["tau"] > 1.0  # the drafter really proposed accepted tokens


def test_library_runs_without_importing_torch():
    """torch is only the tests' reference: loading and (speculative) generation never import it."""
    import subprocess
    import sys

    code = ("import sys, dspark_jax; t = dspark_jax.load_target(); "
            "dspark_jax.generate(t, ['hi'], max_new_tokens=3, drafter=dspark_jax.load_drafter('ngram'), profile=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
