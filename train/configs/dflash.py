"""DFlash for smollm2-135m: DSpark's backbone without the sequential head (CE only)."""
from train.fit import FitConfig

config = FitConfig(drafter="dflash", out="runs/dflash", num_layers=1, head_type="none", head_rank=0,
                   draft_vocab_size=8192, batch_size=16, seq_len=384, anchors=32, steps=500, warmup_steps=25, lr=6e-4)
