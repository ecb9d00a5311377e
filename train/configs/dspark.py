"""DSpark for smollm2-135m: one backbone layer, Markov head (rank 128) and confidence head,
draft vocabulary of 8192 ids. The same backbone, vocabulary, data and token budget as dflash.py."""
from train.fit import FitConfig

config = FitConfig(drafter="dspark", out="runs/dspark", num_layers=1, head_type="markov", head_rank=128,
                   draft_vocab_size=8192, batch_size=16, seq_len=384, anchors=32, steps=500, warmup_steps=25, lr=6e-4)
