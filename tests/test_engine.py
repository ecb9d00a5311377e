"""The Engine: slots that take requests between steps, per-request sampling as data, no compile
after warmup, slot reuse, and user errors. Tiny random models, plus the real model for staggered
arrival with every drafter."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import make_tiny_hf_model, recorded_compiles
from dspark_jax import Engine, SamplingParams, generate, init_drafter, load_drafter, load_target
from dspark_jax.engine import SlotError
from dspark_jax.prompts import PromptError, encode_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine")
    make_tiny_hf_model(str(path), "llama", False, eos_token_id=95)
    return load_target(str(path))


@pytest.fixture(scope="module")
def engines(tiny):
    """Engines shared by the tests (they hold compiled programs, never request state)."""
    return {None: Engine(tiny, slots=4, max_len=128),
            "ngram": Engine(tiny, load_drafter("ngram"), slots=4, max_len=128),
            "dspark": Engine(tiny, init_drafter(tiny, "dspark", seed=1, block_size=3), slots=4, max_len=128)}


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


def _run_to_end(engine, state, slots, limit=200):
    """Step until every slot in `slots` finished; their tokens and finish reasons."""
    tokens = {s: [] for s in slots}
    reasons = {}
    for _ in range(limit):
        state, out = engine.step(state, rounds=2)
        for s in slots:
            tokens[s] += out.tokens[s]
            if out.finished[s]:
                reasons[s] = out.finish_reason[s]
        if all(out.finished[s] for s in slots):
            return state, tokens, reasons
    raise AssertionError("requests did not finish")


def _solo(engine, prompt, params, slot=0):
    state = engine.insert(engine.new_state(), slot, prompt, params)
    _, tokens, reasons = _run_to_end(engine, state, [slot])
    return tokens[slot], reasons[slot]


def test_engine_equals_generate_and_reports_every_token(tiny, engines):
    engine = engines[None]
    prompt = _prompts(1)[0]
    params = SamplingParams(max_new_tokens=10)
    tokens, reason = _solo(engine, prompt, params)
    assert tokens == generate(tiny, [prompt], max_new_tokens=10).token_ids[0]
    assert len(tokens) == 10 and reason == "length"
    # A step after insert reports the first token even when no round runs for the slot.
    state = engine.insert(engine.new_state(), 2, prompt, SamplingParams(max_new_tokens=1))
    state, out = engine.step(state, rounds=2)
    assert out.tokens[2] == tokens[:1] and out.finished[2] and out.finish_reason[2] == "length"
    assert out.tokens[0] == [] and not out.finished[0] and out.rounds == 0


def test_eos_finish_reason(tiny, engines):
    engine = engines[None]
    prompt = _prompts(1, seed=2)[0]
    free_run, _ = _solo(engine, prompt, SamplingParams(max_new_tokens=16))
    eos = free_run[3]
    target_eos = type(tiny)(config=__import__("dataclasses").replace(tiny.config, eos_token_ids=(eos,)),
                            params=tiny.params, tokenizer=None, name="tiny-eos")
    engine_eos = Engine(target_eos, slots=2, max_len=128)
    tokens, reason = _solo(engine_eos, prompt, SamplingParams(max_new_tokens=16))
    assert tokens == free_run[:free_run.index(eos) + 1] and reason == "eos"
    tokens, reason = _solo(engine_eos, prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert tokens == free_run and reason == "length"


@pytest.mark.parametrize("kind", [None, "ngram", "dspark"])
def test_mixed_batch_and_independent_random_streams(engines, kind):
    """Greedy and sampled requests share a batch: the greedy one is unchanged, and a sampled
    request's tokens depend only on its seed (not on its neighbours or its slot)."""
    engine = engines[kind]
    p_greedy, p_sampled, p_other = _prompts(3, seed=4)
    greedy = SamplingParams(max_new_tokens=12)
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=5, max_new_tokens=12)
    greedy_solo, _ = _solo(engine, p_greedy, greedy)
    sampled_solo, _ = _solo(engine, p_sampled, sampled, slot=3)

    state = engine.new_state()
    state = engine.insert(state, 0, p_greedy, greedy)
    state = engine.insert(state, 1, p_sampled, sampled)
    state = engine.insert(state, 2, p_other, SamplingParams(temperature=0.7, top_p=0.9, seed=9, max_new_tokens=12))
    _, tokens, _ = _run_to_end(engine, state, [0, 1, 2])
    assert tokens[0] == greedy_solo
    assert tokens[1] == sampled_solo
    other_seed, _ = _solo(engine, p_sampled, SamplingParams(temperature=1.0, top_k=20, seed=6, max_new_tokens=12))
    assert other_seed != sampled_solo  # the seed really drives the stream


@pytest.mark.parametrize("kind", [None, "dspark"])
def test_free_and_reuse_reads_no_leftovers(engines, kind):
    engine = engines[kind]
    long_prompt, new_prompt = _prompts(2, seed=7)
    long_prompt = long_prompt + _prompts(1, seed=8)[0]  # longer than the new one: stale cache past it
    params = SamplingParams(max_new_tokens=20)
    expected, _ = _solo(engine, new_prompt, params)
    state = engine.insert(engine.new_state(), 1, long_prompt, params)
    for _ in range(2):
        state, _ = engine.step(state, rounds=2)
    state = engine.free(state, 1)
    state, out = engine.step(state, rounds=2)
    assert out.tokens[1] == [] and not out.finished[1]  # a freed slot decodes nothing
    state = engine.insert(state, 1, new_prompt, params)
    _, tokens, _ = _run_to_end(engine, state, [1])
    assert tokens[1] == expected


def test_row_bucket_sizes():
    from dspark_jax.engine import row_bucket_sizes

    assert row_bucket_sizes(16) == (1, 2, 4, 8, 16) and row_bucket_sizes(6) == (1, 2, 4, 6)
    assert row_bucket_sizes(1) == (1,) and row_bucket_sizes(8, [3]) == (3, 8)
    assert row_bucket_sizes(8, multiple=4) == (4, 8)
    with pytest.raises(ValueError, match="row_buckets must be"):
        row_bucket_sizes(8, [0, 4])


def test_a_step_visits_only_the_rows_its_slots_need(tiny, engines):
    """A step runs over the smallest row bucket that holds every slot still to visit (live, or
    with a first token to report), and leaves every other slot exactly as it was: a finished
    request's cache and result stay for the caller to read until it frees the slot."""
    engine = engines[None]
    assert engine.row_buckets == (1, 2, 4)
    first, second = _prompts(2, seed=11)
    state = engine.insert(engine.new_state(), 3, first, SamplingParams(max_new_tokens=3))
    assert engine.rows_for(state) == 4
    state, _, _ = _run_to_end(engine, state, [3])  # finished, reported, not freed
    kept = jax.device_get((state.cache.k, state.cache.v, state.cache.lengths, state.anchor, state.emitted))
    state = engine.insert(state, 0, second, SamplingParams(max_new_tokens=9))
    assert engine.rows_for(state) == 1
    state, tokens, _ = _run_to_end(engine, state, [0])
    assert tokens[0] == generate(tiny, [second], max_new_tokens=9).token_ids[0]
    after = jax.device_get((state.cache.k, state.cache.v, state.cache.lengths, state.anchor, state.emitted))
    for old, new in zip(jax.tree.leaves(kept), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(old)[3], np.asarray(new)[3])
    state = engine.insert(state, 1, first, SamplingParams(max_new_tokens=1))  # done at once, yet unreported
    state = engine.free(state, 0)
    assert engine.rows_for(state) == 2
    state, out = engine.step(state)
    assert out.finished[1] and out.finished[3] and len(out.tokens[1]) == 1 and engine.rows_for(state) == 1


def test_no_compile_after_warmup(engines):
    engine = engines["dspark"]
    seconds = engine.warmup(rounds=(2, 4))
    assert seconds > 0
    with recorded_compiles() as compiles:
        state = engine.new_state()
        settings = [SamplingParams(max_new_tokens=5), SamplingParams(temperature=0.3, seed=1, max_new_tokens=9),
                    SamplingParams(temperature=1.7, top_k=7, top_p=0.5, seed=2, max_new_tokens=3, ignore_eos=True)]
        for slot, (prompt, params) in enumerate(zip(_prompts(3, seed=9), settings)):
            state = engine.insert(state, slot, prompt, params)
        state, _ = engine.step(state, rounds=4)
        state = engine.free(state, 2)
        state = engine.insert(state, 2, _prompts(1, seed=10)[0] * 2,
                              SamplingParams(temperature=0.9, top_p=0.2, max_new_tokens=4))
        _, tokens, _ = _run_to_end(engine, state, [0, 1, 2])
    assert not compiles, compiles
    assert 1 <= len(tokens[2]) <= 4


def _copied_shapes(hlo_text: str) -> list[tuple[int, ...]]:
    """Dimensions of every copy instruction in compiled HLO text."""
    shapes = []
    for match in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\]\S* copy\(", hlo_text):
        shapes.append(tuple(int(x) for x in match.group(1).split(",") if x))
    return shapes


@pytest.mark.parametrize("kind,policy,rows", [(None, "none", 4), ("dspark", "fixed", 4), ("dspark", "dspark", 4),
                                             (None, "none", 1), ("dspark", "dspark", 1)])
def test_step_never_copies_a_cache(engines, kind, policy, rows):
    """The decode step updates the target's KV cache and the drafter's context in place: no copy
    of either (in any axis order) in the compiled program. A lax.switch over verification
    widths whose branches wrote the cache made XLA copy it every round; this pins the fix. A step
    over fewer rows than slots copies no whole buffer either, and a plain one not even its own
    rows' cache (a drafted round's read-only forward may lay out the rows' attention window
    afresh; only the drafter's one-layer context of those rows goes out and back)."""
    engine = engines[kind]
    state = engine.new_state()
    target_layer = state.cache.k[0].shape
    cache_shapes = {tuple(sorted(leaf.shape)) for leaf in jax.tree.leaves((state.cache.k, state.cache.v, state.drafter))
                    if leaf.ndim >= 3}
    if policy == "none":
        cache_shapes.add(tuple(sorted((rows, *target_layer[1:]))))
    assert cache_shapes and rows in engine.row_buckets
    text = engine._step_program(1, engine.max_len, policy, rows).as_text()
    copies = [shape for shape in _copied_shapes(text) if tuple(sorted(shape)) in cache_shapes]
    assert not copies, f"{len(copies)} cache-sized copies per step: {copies[:4]}"
    assert _copied_shapes("%c = f32[4,2,8]{2,1,0} copy(%a)") == [(4, 2, 8)]  # the parser itself


def test_the_engine_holds_every_weight_on_the_device_in_the_target_dtype(tiny):
    """A drafter restored from a checkpoint comes as host arrays, possibly bf16: the engine puts
    them on the device in the target's dtype once, so no step copies or converts weights."""
    import dataclasses

    import ml_dtypes

    drafter = init_drafter(tiny, "dspark", seed=1, block_size=3)
    on_host = dataclasses.replace(drafter, params=jax.tree.map(
        lambda a: np.asarray(a).astype(ml_dtypes.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else np.asarray(a),
        drafter.params))
    params, dparams = Engine(tiny, on_host, slots=2, max_len=128).weights
    leaves = jax.tree.leaves((params, dparams))
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(tiny.dtype)}


def test_bad_input_is_refused_and_changes_nothing(tiny, engines):
    engine = engines[None]
    prompt = _prompts(1, seed=11)[0]
    expected, _ = _solo(engine, prompt, SamplingParams(max_new_tokens=8))
    state = engine.insert(engine.new_state(), 0, prompt, SamplingParams(max_new_tokens=8))
    with pytest.raises(SlotError, match="slot 0 is busy"):
        engine.insert(state, 0, prompt, SamplingParams(max_new_tokens=8))
    with pytest.raises(SlotError, match=r"slot must be an integer in \[0, 4\)"):
        engine.insert(state, 4, prompt, SamplingParams())
    with pytest.raises(PromptError, match="prompt 0 has 130 tokens.*max_len is 128"):
        engine.insert(state, 1, [5] * 130, SamplingParams(max_new_tokens=1))
    with pytest.raises(PromptError, match="empty"):
        engine.insert(state, 1, [], SamplingParams())
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.insert(state, 1, [1, 999], SamplingParams())
    with pytest.raises(PromptError, match="must be a list of token ids"):
        engine.insert(state, 1, ["a", "b"], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-0.5)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(top_p=top_p)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        SamplingParams(top_k=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.insert(state, 1, prompt, {"temperature": 0.0})
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        engine.step(state, rounds=0)
    with pytest.raises(ValueError, match="block_size needs a drafter"):
        Engine(tiny, block_size=3)
    # The accepted request is untouched by every refusal.
    _, tokens, _ = _run_to_end(engine, state, [0])
    assert tokens[0] == expected


def test_two_engines_do_not_share_state(tiny, engines):
    a, b = engines[None], Engine(tiny, slots=4, max_len=128)
    p1, p2 = _prompts(2, seed=12)
    params = SamplingParams(max_new_tokens=6)
    solo1, _ = _solo(a, p1, params)
    solo2, _ = _solo(b, p2, params)
    state_a = a.insert(a.new_state(), 0, p1, params)
    state_b = b.insert(b.new_state(), 0, p2, params)
    got_a, got_b = [], []
    for _ in range(3):
        state_a, out_a = a.step(state_a, rounds=2)
        state_b, out_b = b.step(state_b, rounds=2)
        got_a += out_a.tokens[0]
        got_b += out_b.tokens[0]
    assert got_a == solo1 and got_b == solo2


@pytest.mark.slow
def test_staggered_arrival_on_real_model(real_target):
    """Request A decodes 3 steps (of 2 rounds) alone before B arrives in another slot; both equal
    their solo runs. With the trained DSpark drafter (plain and prompt-lookup slots are covered on
    the tiny model by test_mixed_batch_and_independent_random_streams)."""
    drafter = load_drafter("smollm2-135m-dspark", real_target)
    engine = Engine(real_target, drafter, slots=2, max_len=256)
    prompt_a, prompt_b = encode_prompts(real_target.tokenizer, ["List the planets of the solar system, one per line.",
                                                                 "What is the capital of France?"], chat=True)
    params = SamplingParams(max_new_tokens=24)
    solo_a, _ = _solo(engine, prompt_a, params)
    solo_b, _ = _solo(engine, prompt_b, params, slot=1)
    state = engine.insert(engine.new_state(), 0, prompt_a, params)
    got_a = []
    for _ in range(3):
        state, out = engine.step(state, rounds=2)
        got_a += out.tokens[0]
    state = engine.insert(state, 1, prompt_b, params)
    _, tokens, _ = _run_to_end(engine, state, [0, 1])
    assert got_a + tokens[0] == solo_a
    assert tokens[1] == solo_b


def test_round_trace_reports_acceptance_and_calibrated_confidence(tiny):
    """Each live round reports its accepted length (they add up to the slot's counter) and the
    confidence head's logits with survival = cumprod sigmoid(z / T + b) under the drafter's
    calibration (too few values: the last one repeats)."""
    drafter = init_drafter(tiny, "dspark", seed=2, block_size=3)
    drafter.calibration = {"temperatures": [0.5, 2.0], "shifts": [-0.5, 0.25, 1.0]}
    engine = Engine(tiny, drafter, slots=2, max_len=128)
    assert engine.settings.confidence_temperatures == (0.5, 2.0, 2.0)
    assert engine.settings.confidence_shifts == (-0.5, 0.25, 1.0)
    state = engine.insert_many(engine.new_state(), [(0, _prompts(1)[0], SamplingParams(max_new_tokens=20)),
                                                    (1, _prompts(1, 3)[0], SamplingParams(max_new_tokens=9))])
    accepted, logits = [[], []], []
    for _ in range(30):
        state, out = engine.step(state, rounds=3)
        for s in range(2):
            z, surv = out.round_confidence_logits[s], out.round_survival[s]
            assert z.shape == surv.shape == (len(out.round_accepted[s]), 3)
            x = z / np.array([0.5, 2.0, 2.0]) + np.array([-0.5, 0.25, 1.0])
            want = np.cumprod(np.exp(-np.logaddexp(0.0, -x)), axis=-1)  # sigmoid, finite at z = -1e9
            np.testing.assert_allclose(surv, want, rtol=1e-5, atol=1e-6)
            assert all(0 <= a <= 3 for a in out.round_accepted[s])
            accepted[s] += out.round_accepted[s]
            logits.append(z)
        if all(out.finished):
            break
    assert all(out.finished)
    assert [sum(a) for a in accepted] == out.accepted
    assert len(accepted[1]) < len(accepted[0])  # the shorter request stopped being live earlier
    assert np.abs(np.concatenate(logits)).max() > 0  # the confidence head's own logits, not zeros


def test_warmup_compiles_fewer_attention_spans_where_the_memory_maps_would_run_out(tiny, monkeypatch):
    """Where the step programs of every attention span would pass vm.max_map_count, warmup drops
    the smallest spans (measured on the first group it compiles) and the engine still decodes
    every context, through a wider span, to the same tokens."""
    from dspark_jax import memory_maps

    engine = Engine(tiny, None, slots=2, max_len=128)
    engine.attention_spans = (32, 64, 128)  # the tiny model's context holds no default spans
    maps_per_program = 100
    monkeypatch.setattr(memory_maps, "map_count", lambda: maps_per_program * len(engine._programs))
    # At the fit new_state and 4 prompt buckets are compiled; a span's step programs (rows 1 and
    # 2) take 200 maps: room for two spans, not three.
    monkeypatch.setattr(memory_maps, "map_limit", lambda: 5 * maps_per_program + memory_maps.HEADROOM + 500)
    engine.warmup(execute=False)
    assert engine.attention_spans == (64, 128)
    assert sorted({key[1] for key in engine._steps}) == [64, 128]
    monkeypatch.undo()
    reference = Engine(tiny, None, slots=2, max_len=128)
    reference.attention_spans = (32, 64, 128)
    prompt, params = _prompts(1)[0], SamplingParams(max_new_tokens=40)  # contexts from below 32 to past 64
    assert _solo(engine, prompt, params) == _solo(reference, prompt, params)
    assert {key[1] for key in engine._steps} == {64, 128}  # no program for the dropped span
    assert 32 in {key[1] for key in reference._steps}


def test_a_compile_past_the_memory_map_limit_is_refused_with_a_clear_message(tiny, monkeypatch):
    """XLA:CPU's JIT code takes ~1000 memory maps a program and LLVM aborts the process past
    vm.max_map_count: the Engine refuses the compile first, naming the limit and the ways out."""
    from dspark_jax import memory_maps

    count = memory_maps.map_count()
    if count is None or memory_maps.map_limit() is None:
        pytest.skip("no /proc here")
    monkeypatch.setattr(memory_maps, "map_limit", lambda: count + 100)
    engine = Engine(tiny, None, slots=2, max_len=64)
    with pytest.raises(RuntimeError, match=r"vm.max_map_count.*compiling 0 programs.*fewer slots"):
        engine.new_state()
    monkeypatch.setattr(memory_maps, "map_limit", lambda: count + 10 * memory_maps.HEADROOM)
    engine.warmup(execute=False)  # compiled, not yet run: the first run checks again
    state = engine.new_state()
    monkeypatch.setattr(memory_maps, "map_limit", lambda: count + 100)
    with pytest.raises(RuntimeError, match="vm.max_map_count"):
        engine.insert(state, 0, [5, 6, 7], SamplingParams(max_new_tokens=2))
    monkeypatch.setattr(memory_maps, "map_limit", lambda: count + 10 * memory_maps.HEADROOM)
    state = engine.insert(state, 0, [5, 6, 7], SamplingParams(max_new_tokens=2))
    state, out = engine.step(state)
    assert out.tokens[0]
