"""Is a drafter's first-position acceptance in the engine what its training forward predicts?

Runs the first --prompts ShareGPT validation prompts greedily through the Engine (G = 7), takes
each whole-block round's anchor from the trace, and evaluates the training forward of the same
drafter at those anchors on the generated tokens. Equal rates mean training and inference agree;
the gap to the rate over all generated positions is the anchors' selection (a round starts where
the last draft failed). --layer-pick feeds the training forward other feature slots, e.g. 0 2 2:
the layers (1, 27, 27) the trainer fed EAGLE-3 until a73c2bf.

    PYTHONPATH=. .venv/bin/python train/results/2026-12-07d-code-data/anchor_check.py smollm2-135m-eagle3 \
        [--prompts 8] [--layer-pick 0 2 2]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from dspark_jax import Engine
from dspark_jax.batch import run_requests
from dspark_jax.drafters import dflash, eagle3, load_drafter
from dspark_jax.sampling import SamplingParams
from train import data as data_lib
from train.features import _feature_program

G, NEW = 7, 64


def first_position_hits(drafter, target, tokens, features, anchors) -> np.ndarray:
    """Whether the training forward's greedy draft at position 1 of each anchor's block is the
    token that follows: tokens [1, T], features [1, T, m, e], anchors [A] -> [A] bool."""
    d, tcfg = drafter.config, target.config
    if d.kind == "eagle3":  # row a - 1 reads the anchor's token and predicts a + 1
        logits = eagle3.train_draft_logits(drafter.params, target.params, tcfg, d, tokens, features, 1,
                                           jnp.asarray(anchors - 1)[None])[0, 0]
    else:
        logits = dflash.train_forward(drafter.params, target.params, tcfg, d, tokens, features,
                                      jnp.asarray(anchors)[None])["draft_logits"][0, :, 0]
    pred = np.asarray(jnp.argmax(logits, -1))
    if "draft_vocab" in drafter.params:
        pred = np.asarray(drafter.params["draft_vocab"])[pred]
    return pred == np.asarray(tokens)[0, anchors + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--layer-pick", type=int, nargs="*", default=None)
    args = ap.parse_args()
    target = data_lib.data_target("data/smollm2-135m")
    rows = data_lib.read_split("data/smollm2-135m", "validation")[:args.prompts]
    prompts = [r["tokens"][:r["prompt_len"]].tolist() for r in rows]
    drafter = load_drafter(args.drafter, target)
    layers = tuple(drafter.config.target_layer_ids)
    engine = Engine(target, drafter, slots=8, max_len=1024, block_size=G)
    results = run_requests(engine, prompts, [SamplingParams(temperature=0.0, seed=i, max_new_tokens=NEW)
                                             for i in range(len(prompts))])
    features_of = _feature_program(target.config, layers)
    engine_hits, at_anchors, everywhere = [], [], []
    for row, res in zip(rows, results):
        start = row["prompt_len"]
        tokens = jnp.asarray(np.concatenate([row["tokens"][:start], res.tokens]).astype(np.int32))[None]
        features = features_of(target.params, tokens)[:, :, :len(layers)].astype(jnp.float32)
        if args.layer_pick:
            features = features[:, :, tuple(args.layer_pick)]
        anchors, a = [], start
        for accepted, length in zip(res.round_accepted, res.round_lengths):
            if length == G and a + 1 < tokens.shape[1]:
                anchors.append(a)
                engine_hits.append(accepted >= 1)
            a += accepted + 1
        at_anchors += list(first_position_hits(drafter, target, tokens, features, np.asarray(anchors, np.int32)))
        everywhere += list(first_position_hits(drafter, target, tokens, features,
                                               np.arange(start, tokens.shape[1] - 1, dtype=np.int32)))
    print(f"{args.drafter}: engine position-1 acceptance {np.mean(engine_hits):.3f} over {len(engine_hits)} rounds; "
          f"training forward at the same anchors {np.mean(at_anchors):.3f}; at every generated position "
          f"{np.mean(everywhere):.3f} ({len(everywhere)})")


if __name__ == "__main__":
    main()
