"""Plain generate: dspark-jax against transformers' torch `generate`, side by side in one run.

Greedy, the same chat-formatted prompts, exactly the same number of new tokens per row (EOS
ignored on both sides). Prints new tokens per second for each at every batch size and the ratio.

    .venv/bin/python benchmarks/bench_generate.py [--new-tokens 64] [--batches 1 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

SAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "Give me a tip for better sleep.",
    "What does a compiler do?",
    "Name a famous painting and its painter.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side, alternating; the best is reported")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_jax import generate, load_target
    from dspark_jax.models.loading import resolve_model_path

    target = load_target("smollm2-135m")
    path = resolve_model_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf_tok.padding_side = "left"
    print(f"torch threads: {torch.get_num_threads()}, jax backend: {__import__('jax').default_backend()}")
    print(f"{'batch':>5} {'new tok/row':>11} {'dspark tok/s':>13} {'torch tok/s':>12} {'ratio':>6}")
    for batch in args.batches:
        prompts = [SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)] for i in range(batch)]
        chats = [hf_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=False) for p in prompts]
        enc = hf_tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=hf_tok.pad_token_id)

        def run_ours():
            result = generate(target, prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
            return result.stats["new_tokens"] / result.stats["wall_seconds"]

        def run_theirs():
            with torch.inference_mode():
                start = time.perf_counter()
                out = hf.generate(**enc, **kwargs)
                elapsed = time.perf_counter() - start
            return (out.shape[1] - enc["input_ids"].shape[1]) * batch / elapsed

        run_ours(), run_theirs()  # compile / warm up
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so both sides see the same machine noise
            ours.append(run_ours())
            theirs.append(run_theirs())
        best_ours, best_theirs = max(ours), max(theirs)
        print(f"{batch:>5} {args.new_tokens:>11} {best_ours:>13.1f} {best_theirs:>12.1f} {best_ours / best_theirs:>5.2f}x")


if __name__ == "__main__":
    main()
