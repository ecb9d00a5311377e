"""EAGLE-3 for smollm2-135m: one layer, training-time-test unroll of 7 steps, draft vocabulary 8192."""
from train.fit import FitConfig

config = FitConfig(drafter="eagle3", out="runs/eagle3", draft_vocab_size=8192, batch_size=16, seq_len=384,
                   eagle_steps=7, steps=500, warmup_steps=25, lr=6e-4)
