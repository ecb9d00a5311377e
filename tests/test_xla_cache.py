"""The programs' persistent compilation cache (dspark_jax.xla_cache): where it goes, who wins."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
import jax
from dspark_jax import xla_cache
print(xla_cache.enable())
print(jax.config.jax_compilation_cache_dir)
jax.jit(lambda x: x * 2 + 1)(jax.numpy.arange(3.0)).block_until_ready()
"""


def _run(env_changes: dict, tmp_path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "DSPARK_XLA_CACHE")}
    env.update(DSPARK_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=REPO, **env_changes)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.strip().splitlines()[-2:]


def test_default_folder_is_under_the_cache_dir_and_fills(tmp_path):
    folder = str(tmp_path / "cache" / "xla")
    assert _run({}, tmp_path) == [folder, folder]
    assert os.listdir(folder)  # the compiled program was written


def test_users_folder_wins_and_the_switch_turns_it_off(tmp_path):
    theirs = str(tmp_path / "theirs")
    assert _run({"JAX_COMPILATION_CACHE_DIR": theirs}, tmp_path) == [theirs, theirs]
    assert _run({"DSPARK_XLA_CACHE": "0"}, tmp_path) == ["None", "None"]
    assert not os.path.exists(tmp_path / "cache" / "xla")
