"""train/data.py and train/sources.py: record parsing, the split, resumable self-distillation."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from train import data, sources


def _sharegpt_file(path, n, truncate=True):
    """A ShareGPT-format file of n chats in two parts each, the last record cut mid-way."""
    records = []
    for i in range(n):
        for part in range(2):
            records.append({"id": f"c{i}_{part}", "conversations": [
                {"from": "human", "value": f"Question {i} part {part}: name a colour."},
                {"from": "gpt", "value": "Blue."}]})
    records.insert(1, {"id": "gpt_first_0", "conversations": [{"from": "gpt", "value": "hi"}]})
    records.insert(2, {"id": "empty_0", "conversations": [{"from": "human", "value": "  "}]})
    text = json.dumps(records, indent=1)
    if truncate:
        text = text[:-40]  # the packaged file ends mid-record too
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_records_parse_one_by_one_and_skip_unusable(tmp_path):
    path = _sharegpt_file(tmp_path / "sg.json", 3)
    convs = list(sources.sharegpt_first_turns(path))
    # 6 usable records, the last one truncated away; the gpt-first and empty ones are skipped.
    assert [c.record_id for c in convs] == ["c0_0", "c0_1", "c1_0", "c1_1", "c2_0"]
    assert [c.conversation_id for c in convs] == ["c0", "c0", "c1", "c1", "c2"]
    assert convs[2].prompt == "Question 1 part 0: name a colour."


def test_split_is_by_conversation_and_near_the_fraction():
    ids = [f"conv{i}" for i in range(4000)]
    val = [sources.is_validation(c, 0.1) for c in ids]
    assert 0.08 < np.mean(val) < 0.12
    assert val == [sources.is_validation(c, 0.1) for c in ids]  # deterministic
    assert not any(sources.is_validation(c, 0.0) for c in ids)


def test_evaluation_prompts_from_packages():
    assert len(sources.mtbench_first_turns()) == 80
    humaneval = sources.humaneval_prompts()
    assert len(humaneval) == 164 and "def " in humaneval[0]


def test_code_prompts_are_the_documented_public_functions_of_the_standard_library(tmp_path):
    """stdlib_function_stubs over a fake standard library: public documented functions and
    methods become HumanEval-style stubs (signature + docstring, no body) in HumanEval's wording;
    private, undocumented, briefly documented and test-folder functions do not."""
    import ast

    doc = "Return the running total of the given numbers, starting from zero each time."
    (tmp_path / "mathy.py").write_text(
        f"import os\n\ndef total(xs: list[int], start: int = 0) -> int:\n    \"\"\"{doc}\"\"\"\n"
        "    return sum(xs, start)\n\n"
        f"def _hidden(x):\n    \"\"\"{doc}\"\"\"\n    return x\n\n"
        "def bare(x):\n    return x\n\n"
        "def terse(x):\n    \"\"\"Short.\"\"\"\n    return x\n\n"
        f"class Box:\n    def open(self, how='wide'):\n        \"\"\"{doc}\"\"\"\n        return how\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "helpers.py").write_text(f"def check(x):\n    \"\"\"{doc}\"\"\"\n    return x\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    convs = {c.conversation_id: c for c in sources.stdlib_function_stubs(str(tmp_path))}
    assert sorted(convs) == ["stdlib:mathy.Box.open", "stdlib:mathy.total"]
    prompt = convs["stdlib:mathy.total"].prompt
    assert prompt.startswith("Complete the following Python function.\n\n```python\n")
    assert prompt == sources.CODE_REQUEST.format(stub=prompt.split("```python\n")[1][:-3])
    stub = prompt.split("```python\n")[1][:-3]
    assert stub.splitlines()[0] == "def total(xs: list[int], start: int=0) -> int:"
    assert "return" not in stub
    fn = ast.parse(stub + "    pass\n").body[0]  # the stub is a function header awaiting its body
    assert ast.get_docstring(fn) == doc
    assert convs["stdlib:mathy.Box.open"].prompt.split("```python\n")[1].startswith("def open(self, how='wide'):")
    assert sources.humaneval_prompts()[0].startswith(sources.CODE_REQUEST.split("{stub}")[0])


def test_selfdistilled_data_is_the_targets_greedy_output_and_resumes(tiny_chat_dir, tmp_path):
    from dspark_jax import generate, load_target

    sharegpt = _sharegpt_file(tmp_path / "sg.json", 6, truncate=False)
    cfg = data.DataConfig(out=str(tmp_path / "out"), model=tiny_chat_dir, sharegpt=sharegpt, conversations=10,
                          shard_size=3, val_fraction=0.3, max_prompt_tokens=64, max_new_tokens=12, slots=4,
                          rounds_per_step=4, vocab_sizes=(50, 100))
    summary = data.run(cfg)
    train, val = data.read_split(cfg.out, "train"), data.read_split(cfg.out, "validation")
    assert len(train) + len(val) == 10
    assert not {r["conversation_id"] for r in train} & {r["conversation_id"] for r in val}

    # Responses are the target's own greedy continuation of the chat-templated first turn.
    target = load_target(tiny_chat_dir)
    rows = train[:4]
    prompts = [r["tokens"][:r["prompt_len"]].tolist() for r in rows]
    ref = generate(target, prompts, max_new_tokens=cfg.max_new_tokens)
    for row, want in zip(rows, ref.token_ids):
        assert row["tokens"][row["prompt_len"]:].tolist() == want
    assert target.tokenizer.decode(rows[0]["tokens"][:rows[0]["prompt_len"]]).rstrip().endswith("assistant")

    # Draft vocabularies: most frequent assistant ids first, with their coverage.
    ids = data.load_draft_vocab(cfg.out, 50)
    counts = np.bincount(np.concatenate([r["tokens"][r["prompt_len"]:] for r in train]), minlength=49152)
    assert counts[ids[0]] == counts.max() and len(set(ids.tolist())) == 50
    coverage = summary["draft_vocab_coverage"]
    assert coverage["50"]["train"] == pytest.approx(counts[ids].sum() / counts.sum())
    assert coverage["100"]["train"] >= coverage["50"]["train"]
    held = np.bincount(np.concatenate([r["tokens"][r["prompt_len"]:] for r in val]), minlength=49152)
    assert coverage["50"]["validation"] == pytest.approx(held[ids].sum() / held.sum())

    # Resume: only the missing shard is regenerated, to the same content.
    paths = data.shard_paths(cfg.out, "train")
    before = {p: os.stat(p).st_mtime_ns for p in paths}
    missing = paths[-1]
    expected = data.read_shard(missing)
    os.remove(missing)
    data.run(cfg)
    assert all(os.stat(p).st_mtime_ns == before[p] for p in paths if p != missing)
    again = data.read_shard(missing)
    assert [r["tokens"].tolist() for r in again] == [r["tokens"].tolist() for r in expected]

    # Waves (a whole batch inserted once every slot is free, programs compiled ahead) make the
    # same data as refilling each slot at once.
    waves = dataclasses.replace(cfg, out=str(tmp_path / "waves"), waves=True)
    data.run(waves)
    for split in data.SPLITS:
        assert ([r["tokens"].tolist() for r in data.read_split(waves.out, split)]
                == [r["tokens"].tolist() for r in data.read_split(cfg.out, split)])

    # Other settings into the same folder are refused.
    with pytest.raises(SystemExit, match="max_new_tokens"):
        data.run(data.DataConfig(**{**cfg.__dict__, "max_new_tokens": 13}))


def _multi_turn_file(path):
    """Chats of three user turns (one with a long middle answer), plus records later turns skip."""
    def turn(speaker, text):
        return {"from": speaker, "value": text}

    records = [
        {"id": "m0_0", "conversations": [turn("human", "Name a colour."), turn("gpt", "Blue."),
                                         turn("human", "Another one?"), turn("gpt", "Green."),
                                         turn("human", "And a third?"), turn("gpt", "Red.")]},
        {"id": "m1_0", "conversations": [turn("human", "Say hi."), turn("gpt", "hi " * 200),
                                         turn("human", "Shorter please.")]},
        {"id": "sys_0", "conversations": [turn("system", "Be brief."), turn("human", "Hi"), turn("gpt", "Hello"),
                                          turn("human", "Bye")]},
        {"id": "gap_0", "conversations": [turn("human", "Hi"), turn("gpt", " "), turn("human", "Bye")]},
        {"id": "one_0", "conversations": [turn("human", "Only one turn.")]},
    ]
    path.write_text(json.dumps(records))
    return str(path)


def test_later_turns_come_with_their_records_earlier_turns(tmp_path):
    convs = list(sources.sharegpt_later_turns(_multi_turn_file(tmp_path / "mt.json")))
    # Two later turns of m0, one of m1; the record with a system turn, the one with an empty
    # answer and the single-turn one give none.
    assert [c.record_id for c in convs] == ["m0_0#1", "m0_0#2", "m1_0#1"]
    assert [c.conversation_id for c in convs] == ["m0", "m0", "m1"]
    assert convs[1].prompt == "And a third?"
    assert convs[1].messages() == [{"role": "user", "content": "Name a colour."},
                                   {"role": "assistant", "content": "Blue."},
                                   {"role": "user", "content": "Another one?"},
                                   {"role": "assistant", "content": "Green."},
                                   {"role": "user", "content": "And a third?"}]


def test_a_later_turn_keeps_its_last_pairs_that_fit(tmp_path):
    from dspark_jax import load_target
    from dspark_jax.prompts import encode_chat

    tokenizer = load_target("smollm2-135m").tokenizer
    third, shorter = [c for c in sources.sharegpt_later_turns(_multi_turn_file(tmp_path / "mt.json"))
                      if c.record_id in ("m0_0#2", "m1_0#1")]
    whole = encode_chat(tokenizer, third.messages())
    assert data.fitted_prompt(tokenizer, third, len(whole)) == whole
    # One token short of the whole chat: the first pair goes, the last pair stays.
    last_pair = encode_chat(tokenizer, third.messages()[2:])
    assert data.fitted_prompt(tokenizer, third, len(whole) - 1) == last_pair
    # Shorter than the prompt with its last pair: nothing (never the bare "And a third?").
    assert data.fitted_prompt(tokenizer, third, len(last_pair) - 1) is None
    # A 200-word answer before "Shorter please." does not fit 64 tokens: the turn is skipped.
    assert data.fitted_prompt(tokenizer, shorter, 64) is None
    first = sources.Conversation(conversation_id="c", record_id="c_0", prompt="Name a colour.")
    assert data.fitted_prompt(tokenizer, first, 64) == encode_chat(tokenizer, first.messages())


def test_later_turn_data_is_made_and_a_folder_keeps_its_turns(tiny_chat_dir, tmp_path):
    from dspark_jax import load_target

    sharegpt = _multi_turn_file(tmp_path / "mt.json")
    cfg = data.DataConfig(out=str(tmp_path / "later"), model=tiny_chat_dir, sharegpt=sharegpt, turns="later",
                          conversations=8, shard_size=8, val_fraction=0.0, max_prompt_tokens=128, max_new_tokens=6,
                          slots=4, rounds_per_step=4, vocab_sizes=(16,))
    summary = data.run(cfg)
    assert summary["sequences"]["train"] == 2  # m0's two later turns; m1's does not fit 128 tokens
    rows = data.read_split(cfg.out, "train")
    text = load_target(tiny_chat_dir).tokenizer.decode(rows[1]["tokens"][:rows[1]["prompt_len"]])
    assert "Green." in text and "And a third?" in text and text.index("Green.") < text.index("And a third?")
    # A folder made before `turns` existed holds first turns: resuming it as such is accepted,
    # as later turns refused.
    first = dataclasses.replace(cfg, out=str(tmp_path / "first"), turns="first", sharegpt=_sharegpt_file(
        tmp_path / "sg.json", 2, truncate=False), conversations=2)
    data.run(first)
    meta = os.path.join(first.out, data.META)
    with open(meta) as f:
        summary = json.load(f)
    del summary["generation"]["turns"]
    with open(meta, "w") as f:
        json.dump(summary, f)
    data.check_meta(first)
    with pytest.raises(SystemExit, match="turns"):
        data.check_meta(dataclasses.replace(first, turns="later"))


def test_an_interrupted_first_run_keeps_its_settings(tiny_chat_dir, tmp_path, monkeypatch):
    """The folder records its generation settings before the first shard: a first run stopped
    part-way is resumed only with the same settings (it took any, and its meta.json then named
    the second run's settings for the first run's shards)."""
    cfg = data.DataConfig(out=str(tmp_path / "out"), model=tiny_chat_dir,
                          sharegpt=_sharegpt_file(tmp_path / "sg.json", 6, truncate=False), conversations=10,
                          shard_size=3, val_fraction=0.3, max_prompt_tokens=64, max_new_tokens=6, slots=4,
                          rounds_per_step=4, vocab_sizes=(50,))
    real = data.write_shard

    def first_shard_only(path, *args):
        if data.shard_paths(cfg.out, "train") + data.shard_paths(cfg.out, "validation"):
            raise KeyboardInterrupt  # the process is stopped after its first shard
        real(path, *args)

    monkeypatch.setattr(data, "write_shard", first_shard_only)
    with pytest.raises(KeyboardInterrupt):
        data.run(cfg)
    monkeypatch.setattr(data, "write_shard", real)
    with pytest.raises(SystemExit, match="temperature"):
        data.run(dataclasses.replace(cfg, temperature=1.0))
    assert data.run(cfg)["sequences"]["train"] + data.run(cfg)["sequences"]["validation"] == 10


def test_a_prompt_length_window_takes_exactly_the_prompts_a_shorter_limit_left(tmp_path):
    """--min-prompt-tokens (last --max-prompt-tokens + 1) selects the prompts an earlier run skipped
    and none it took, so a new folder's conversations are unseen by drafters trained on the old."""
    from dspark_jax import load_target

    tokenizer = load_target("smollm2-135m").tokenizer
    convs = [sources.Conversation(conversation_id=f"c{i}", record_id=f"c{i}_0", prompt="word " * (4 * i + 1))
             for i in range(12)]

    def chosen(**kw):
        cfg = data.DataConfig(conversations=100, val_fraction=0.0, **kw)
        return {e.conversation_id: len(e.prompt_ids) for e in data.select_examples(cfg, tokenizer, convs)["train"]}

    short, window, both = chosen(max_prompt_tokens=32), chosen(min_prompt_tokens=33, max_prompt_tokens=48), \
        chosen(max_prompt_tokens=48)
    assert short and window and not set(short) & set(window)
    assert {**short, **window} == both
    assert all(33 <= n <= 48 for n in window.values())
    with pytest.raises(SystemExit, match="--min-prompt-tokens 49"):
        data.run(data.DataConfig(out=str(tmp_path / "d"), min_prompt_tokens=49, max_prompt_tokens=48))
