"""Speculative against plain autoregressive generate on the default model, side by side in one run.

For each batch size and drafter: new tokens per second of plain generate and of speculative
generate on the same prompts with the same token budget (EOS ignored, so both produce exactly the
same number of tokens), tau (committed tokens per target forward, bonus included) and the speedup.
Then the cost split of one round (drafter, target verification forward, verification rule),
each jitted and timed alone at the same shapes.

    .venv/bin/python benchmarks/bench_spec.py [--new-tokens 64] [--batches 1 8] [--drafters ngram]
        [--temperature 0] [--block-size 7] [--verifier jnp|pallas]

Drafters: "ngram" (prompt lookup), "random-dspark" / "random-dflash" / "random-eagle3" (untrained
drafters: cost probes whose tokens are almost never accepted), or a checkpoint folder made by the
training programs.
"""

from __future__ import annotations

import argparse

# Prompts where the answer restates part of the prompt (editing, extraction, code), the regime in
# which prompt lookup helps, mixed with open questions where it does not.
PROMPTS = [
    "Fix the typo and return the whole sentence: 'The quick brown fox jumpd over the lazy dog near the river bank.'",
    "Convert this Python function to use a list comprehension and show the full code:\n\n"
    "def squares(numbers):\n    result = []\n    for n in numbers:\n        result.append(n * n)\n    return result",
    "Repeat this list, one item per line, in the same order: apples, bananas, cherries, dates, elderberries, figs.",
    "What is the capital of France?",
    "Rewrite in the past tense: 'She walks to the market, buys fresh bread, and talks with her neighbours.'",
    "Explain what a hash table is in two sentences.",
    "Copy the following JSON and add a field \"age\": 30 to it: {\"name\": \"Ada\", \"city\": \"London\"}",
    "Write a haiku about autumn.",
]


def _best(fn, repeats):
    results = [fn() for _ in range(repeats)]
    return max(results, key=lambda r: r.stats["new_tokens"] / r.stats["wall_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafters", nargs="+", default=["ngram"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verifier", default="jnp", choices=["jnp", "pallas"],
                        help="verification rule: jnp reference or the Pallas kernel (interpret mode on CPU: slow)")
    args = parser.parse_args()

    from dspark_jax import generate, load_target
    from dspark_jax.drafters import init_drafter, load_drafter

    target = load_target("smollm2-135m")
    drafters = {}
    for name in args.drafters:
        if name.startswith("random-"):
            drafters[name] = init_drafter(target, name.removeprefix("random-"), seed=0)
        else:
            drafters[name] = load_drafter(name, target)

    common = dict(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=args.temperature, seed=0)
    print(f"temperature {args.temperature}, block size {args.block_size}, {args.new_tokens} new tokens per row, "
          f"{args.verifier} verifier (greedy rounds use the argmax rule)")
    header = f"{'batch':>5} {'drafter':>14} {'plain tok/s':>12} {'spec tok/s':>11} {'tau':>5} {'speedup':>8}"
    splits = []
    print(header)
    for batch in args.batches:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        generate(target, prompts, **common)  # compile
        for name, drafter in drafters.items():
            spec_kw = dict(drafter=drafter, block_size=args.block_size, verifier=args.verifier)
            first = generate(target, prompts, **common, **spec_kw, profile=True)  # compile + cost split
            # Alternate plain and speculative runs so both see the same machine noise.
            plain_runs, spec_runs = [], []
            for _ in range(args.repeats):
                plain_runs.append(generate(target, prompts, **common))
                spec_runs.append(generate(target, prompts, **common, **spec_kw))
            plain = max(r.stats["tokens_per_second"] for r in plain_runs)
            best = max(spec_runs, key=lambda r: r.stats["tokens_per_second"])
            spec = best.stats["tokens_per_second"]
            print(f"{batch:>5} {name:>14} {plain:>12.1f} {spec:>11.1f} {best.stats['tau']:>5.2f} {spec / plain:>7.2f}x")
            splits.append((batch, name, first.stats))
    print("\ncost split of one round (each part jitted and timed alone, best of 3):")
    print(f"{'batch':>5} {'drafter':>14} {'drafter ms':>11} {'target ms':>10} {'verify ms':>10} {'verify share':>13}")
    for batch, name, st in splits:
        d, t, v = (st["drafter_seconds_per_round"] * 1e3, st["target_seconds_per_round"] * 1e3,
                   st["verify_seconds_per_round"] * 1e3)
        print(f"{batch:>5} {name:>14} {d:>11.2f} {t:>10.2f} {v:>10.3f} {100 * v / (d + t + v):>12.2f}%")


if __name__ == "__main__":
    main()
