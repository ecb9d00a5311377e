"""Target model families, their weights and their KV cache."""
