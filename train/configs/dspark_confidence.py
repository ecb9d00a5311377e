"""Refit the shipped DSpark drafter's confidence head on conversations it never saw.

The GPU-budget drafter saw its 783k training tokens 32 times; its confidence head learned how
often drafts survive on those (train BCE 0.46, validation 0.78; mean survival estimate 0.57 at
position 1 on held-out prompts where 0.45 survive). Train shards 31-40 were generated after it
was trained: here the backbone, heads and vocabulary stay frozen and only the head's 705
weights learn, so the drafts (and tau) are exactly the shipped drafter's. Calibrate afterwards
(train.calibrate): the old temperatures belong to the old head.

    python -m train.features --data data/smollm2-135m --splits train --first-shard 31 --train-shards 10
    python -m train.features --data data/smollm2-135m --splits validation
    python -m train.fit --config train/configs/dspark_confidence.py

The shipped head was last refit with this config on 2026-12-07g, on unseen conversations from
another folder (`--data data/smollm2-135m-long --first-shard 0 --train-shards None --seq-len 640
--steps 200`): train/results/2026-12-07g-confidence-unseen/run.sh.
"""
from train.fit import FitConfig

config = FitConfig(drafter="dspark", out="runs/dspark-confidence", init_from="smollm2-135m-dspark",
                   train_only=("confidence",), first_shard=31, train_shards=10, batch_size=16, seq_len=384,
                   anchors=32, steps=400, warmup_steps=20, lr=2e-3, eval_every=50, save_every=100)
