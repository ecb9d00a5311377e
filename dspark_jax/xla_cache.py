"""A persistent XLA compilation cache for the project's programs (CLI, server, training programs).

The Engine compiles one program per bucket (rows, KV span, prefill length, policy); a server or a
training program started again compiled them all again. On an H200 a compile costs seconds, so a
restarted data-generation or calibration run spent its first minutes compiling
(train/results/2026-12-04-gpu-budget). With the cache a program compiled once is read back.
Benchmarks and the library itself leave JAX's default alone; only the programs' entry points call
`enable`.
"""

from __future__ import annotations

import os


def enable(path: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache at `path` (default: DSPARK_CACHE_DIR/xla, i.e.
    ~/.cache/dspark_jax/xla) and return it. A JAX_COMPILATION_CACHE_DIR the user set wins (JAX
    reads it itself; returned as is); DSPARK_XLA_CACHE=0 turns the cache off (returns None)."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if os.environ.get("DSPARK_XLA_CACHE", "1") == "0":
        return None
    from dspark_jax.models.loading import cache_dir

    path = path or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
