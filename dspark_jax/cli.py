"""The `dspark` command line."""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax import xla_cache
from dspark_jax.schedule import POLICIES


def _generate(args: argparse.Namespace) -> int:
    from dspark_jax import generate, load_target

    target = load_target(args.model, dtype=args.dtype)
    drafter = None
    if args.drafter:
        from dspark_jax.drafters import init_drafter, load_drafter

        if args.drafter.startswith("random-"):  # an untrained drafter: a cost probe, not a speed-up
            drafter = init_drafter(target, args.drafter.removeprefix("random-"), seed=args.seed)
        else:
            drafter = load_drafter(args.drafter, target)
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, chat=not args.no_chat)
    spec = dict(drafter=drafter, block_size=args.block_size, verifier=args.verifier, policy=args.policy,
                sps_table=args.sps_table)
    result = generate(target, args.prompts, **common, **spec)
    for i, text in enumerate(result.texts):
        if len(result.texts) > 1:
            print(f"--- [{i}]")
        print(text)
    print("--- stats", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.stats.items()}))
    if args.compare_plain:
        # Plain once to compile and warm it, then both alternating; each keeps its best run (noise
        # on a shared machine only ever adds time).
        generate(target, args.prompts, **common)
        best = {"plain": 0.0, "speculative": 0.0}
        for _ in range(args.repeats):
            for name, extra in (("plain", {}), ("speculative", spec)):
                rate = generate(target, args.prompts, **common, **extra).stats["tokens_per_second"]
                best[name] = max(best[name], rate)
        print(f"--- speed: plain {best['plain']:.1f} tok/s, speculative {best['speculative']:.1f} tok/s, "
              f"speedup {best['speculative'] / best['plain']:.2f}x (best of {args.repeats}, compile excluded)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF folder")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, no chat template")
    gen.add_argument("--drafter", default=None,
                     help="speculative decoding: 'ngram' (prompt lookup), a drafter checkpoint folder, or "
                          "random-dspark / random-dflash / random-eagle3 (untrained, for cost checks)")
    gen.add_argument("--block-size", type=int, default=None, help="drafted tokens per round (default: the drafter's)")
    gen.add_argument("--verifier", default="jnp", choices=["jnp", "pallas"])
    gen.add_argument("--policy", default="fixed", choices=list(POLICIES),
                     help="draft tokens verified per round: the whole block (fixed), DSpark's load-aware scheduler "
                          "(dspark, dspark-lagged), a survival threshold, or none (plain decoding)")
    gen.add_argument("--compare-plain", action="store_true",
                     help="also time plain generation of the same prompts and print the speedup")
    gen.add_argument("--repeats", type=int, default=2, help="timed runs per side with --compare-plain")
    gen.add_argument("--sps-table", default=None,
                     help="cost table JSON from python -m dspark_jax.schedule (dspark policies; default: profile)")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="run the gRPC server (the same as python -m serve)")
    try:
        from serve.config import add_arguments
    except ImportError:  # the serving extra is not installed: say so when the command is used
        srv.set_defaults(func=_serve_missing)
    else:
        add_arguments(srv)
        srv.set_defaults(func=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from serve.config import config_from_args
    from serve.server import serve

    return serve(config_from_args(args))


def _serve_missing(args: argparse.Namespace) -> int:
    raise ValueError("dspark serve needs the serving extra: pip install -e '.[serve]' from the checkout")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    xla_cache.enable()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:  # user errors: one clear line, no traceback
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
