"""generate(): batching, determinism, sampling filters and user errors, on tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import make_tiny_hf_model
from dspark_jax import generate, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.models.loading import ModelNotFoundError
from dspark_jax.prompts import PromptError
from dspark_jax.sampling import RowSampling, SamplingParams, filtered_probs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_hf_model(str(path), "llama", False, eos_token_id=95)
    return load_target(str(path)), hf


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


def test_greedy_matches_transformers_generate(tiny):
    import torch

    target, hf = tiny
    prompts = _prompts(3)
    result = generate(target, prompts, max_new_tokens=12)
    for ids, got in zip(prompts, result.token_ids):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=95,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert got == ref


def test_batch_equals_rows_alone(tiny):
    target, _ = tiny
    prompts = _prompts(5, seed=1)
    batched = generate(target, prompts, max_new_tokens=10)
    for i, ids in enumerate(prompts):
        assert generate(target, [ids], max_new_tokens=10).token_ids[0] == batched.token_ids[i]
    assert batched.stats["new_tokens"] == sum(len(t) for t in batched.token_ids)
    assert batched.stats["target_forward_passes"] >= max(len(t) for t in batched.token_ids)


def test_rows_stop_at_their_own_eos(tiny):
    target, _ = tiny
    prompts = _prompts(6, seed=2)
    free = generate(target, prompts, max_new_tokens=16)
    eos = free.token_ids[0][3]  # pretend a token row 0 produces is EOS
    target_eos = type(target)(config=__import__("dataclasses").replace(target.config, eos_token_ids=(eos,)),
                              params=target.params, tokenizer=None, name="tiny-eos")
    stopped = generate(target_eos, prompts, max_new_tokens=16)
    for row, full in zip(stopped.token_ids, free.token_ids):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert row == expected
    assert len(stopped.token_ids[0]) == 4


def test_same_seed_same_output_and_seeds_differ(tiny):
    target, _ = tiny
    prompts = _prompts(4, seed=3)
    a = generate(target, prompts, max_new_tokens=12, temperature=1.0, seed=7)
    b = generate(target, prompts, max_new_tokens=12, temperature=1.0, seed=7)
    c = generate(target, prompts, max_new_tokens=12, temperature=1.0, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_sampling_matches_target_distribution(tiny):
    """The first sampled token over many seeds follows softmax(logits / T) (chi-square)."""
    from dspark_jax.models.transformer import forward, logits_from_hidden

    target, _ = tiny
    ids = _prompts(1, seed=4)[0]
    n = 4000
    result = generate(target, [ids] * n, max_new_tokens=1, temperature=0.8, seed=11)
    counts = np.bincount([t[0] for t in result.token_ids], minlength=96)
    hidden, _, _ = forward(target.params, target.config, jnp.asarray([ids]), jnp.arange(len(ids))[None])
    p = np.asarray(jax.nn.softmax(logits_from_hidden(target.params, hidden)[0, -1] / 0.8))
    expected = n * p
    keep = expected >= 5
    chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum() + abs(counts[~keep].sum() - expected[~keep].sum())
    dof = keep.sum()
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def _numpy_filtered(row, temperature, top_k, top_p):
    """Plain-numpy reference of one row's sampling distribution."""
    v = row.size
    if temperature == 0:
        return np.eye(v)[np.argmax(row)]
    z = row / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(v, bool)
    if top_k is not None:
        keep[:] = False
        keep[order[:top_k]] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if top_p is not None and top_p < 1:
        sorted_p = p[order]
        before = np.cumsum(sorted_p) - sorted_p
        keep2 = np.zeros(v, bool)
        keep2[order[before < top_p]] = True
        p = p * keep2
        p /= p.sum()
    return p


def test_filtered_probs_per_row_against_numpy():
    """Rows with different settings in one batch each get their own filtered distribution."""
    rng = np.random.default_rng(5)
    settings = [(0.7, 10, 0.8), (1.3, None, None), (0.0, None, None), (0.9, 3, None), (1.0, None, 0.5),
                (0.5, 50, 1.0), (2.0, 1, None)]
    logits = rng.normal(size=(len(settings), 50)).astype(np.float32) * 3
    rs = RowSampling.from_params([SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in settings])
    got = np.asarray(jax.jit(filtered_probs)(jnp.asarray(logits), rs))
    for row, probs, (t, k, p) in zip(logits, got, settings):
        np.testing.assert_allclose(probs, _numpy_filtered(row.astype(np.float64), t, k, p), atol=1e-6)


def test_a_tiny_positive_temperature_samples_the_best_token():
    """A temperature that passes validation but overflows logits / T in float32 (1e-40) samples
    at MIN_TEMPERATURE: finite probabilities, the argmax drawn (it gave NaN and token 0)."""
    from dspark_jax.sampling import sample_tokens

    logits = jnp.asarray([[1.0, 2.0, 0.5], [0.3, -1.0, 0.2]])
    rs = RowSampling.from_params([SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-40, top_p=0.9)])
    probs = np.asarray(filtered_probs(logits, rs))
    np.testing.assert_array_equal(probs, np.eye(3, dtype=np.float32)[[1, 0]])
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    assert np.asarray(sample_tokens(logits, keys, rs)).tolist() == [1, 0]


def test_user_errors(tiny, tmp_path):
    target, _ = tiny
    with pytest.raises(ModelNotFoundError, match="unknown model name 'no-such-model'"):
        load_target("no-such-model")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        load_target(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_target(str(bad))
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="unsupported architecture.*supported: LlamaForCausalLM"):
        load_target(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_target(str(empty))
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_target(str(tmp_path), dtype="float8")
    too_long = [[5] * 250]
    with pytest.raises(PromptError, match="prompt 0 has 250 tokens.*context is 256"):
        generate(target, too_long, max_new_tokens=10)
    with pytest.raises(PromptError, match="no tokenizer"):
        generate(target, ["text"], max_new_tokens=4)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        generate(target, [[1, 2, 999]], max_new_tokens=4)
    with pytest.raises(PromptError, match="empty"):
        generate(target, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, [[1, 2]], max_new_tokens=4, temperature=-1.0)


def test_cli_reports_errors_cleanly(capsys):
    from dspark_jax.cli import main

    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    assert "unknown model name" in capsys.readouterr().err


def test_cli_compares_speculative_with_plain(tiny_chat_dir, capsys):
    from dspark_jax.cli import main

    assert main(["generate", "hi", "--model", tiny_chat_dir, "--drafter", "ngram", "--max-new-tokens", "4",
                 "--compare-plain", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert '"policy": "fixed"' in out and "--- speed: plain" in out and "x (best of 1" in out


def test_host_api_edges_a_user_can_hit(tiny):
    """From a review of the host API: a drafter named in generate loads once (its engine and
    programs are reused, not rebuilt per call); plain decoding over a drafter reserves no draft
    positions; run_requests checks every request before any runs and names it by its index;
    numpy scalars and rows are taken as numbers and ids; warmup refuses rounds < 1."""
    from dspark_jax import Engine, init_drafter
    from dspark_jax.batch import run_requests

    target, _ = tiny
    prompts = _prompts(2, seed=9)
    first = generate(target, prompts, max_new_tokens=6, drafter="ngram")
    engines = len(target.engines)
    again = generate(target, prompts, max_new_tokens=6, drafter="ngram")
    assert len(target.engines) == engines and again.stats["compile_seconds"] == 0.0
    assert again.token_ids == first.token_ids

    drafter = init_drafter(target, "dspark", seed=1, block_size=3)
    long = [list(range(3, 90)) * 3][0][:250]  # 250 + 6 = the context (256): no room for a block
    plain = generate(target, [long], max_new_tokens=6)
    assert generate(target, [long], max_new_tokens=6, drafter=drafter, policy="none").token_ids == plain.token_ids

    engine = Engine(target, None, slots=2, max_len=128)
    rows = _prompts(5, seed=2)
    rows[3] = rows[3] + [999]
    with pytest.raises(PromptError, match="prompt 3 .*outside the vocabulary"):
        run_requests(engine, rows, [SamplingParams(max_new_tokens=4)] * 5)
    with pytest.raises(ValueError, match="rounds must be"):
        engine.warmup(rounds=(0,))

    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(2**40), top_p=np.float32(0.9),
                            max_new_tokens=np.int64(4), seed=np.uint32(3))
    assert (type(params.temperature), params.top_k, type(params.max_new_tokens)) == (float, 2**31 - 1, int)
    RowSampling.from_params([params])  # a top_k past int32 no longer overflows
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=True)
    out = generate(target, [np.asarray(prompts[0])], max_new_tokens=np.int64(4))
    assert out.token_ids == generate(target, [prompts[0]], max_new_tokens=4).token_ids
