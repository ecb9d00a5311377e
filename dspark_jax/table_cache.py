"""An on-disk cache of profiled cost tables, keyed by everything the measured figures depend on.

Profiling runs the engine's own step at every verification width and row bucket: about four of
the ten minutes a 16-slot dspark server took to start on a 2-core CPU (serve/README.md), paid
again at every restart. The figures measure programs on hardware, so the same engine shapes, the
same code and software, and the same machine give the same table: a restarted server reads it
back. The key holds the target's and drafter's configs and array shapes (values do not change a
step's cost), the engine's slots, context, row buckets, verifier and mesh, this package's source,
the JAX and jaxlib versions, the devices, and the host. Like the XLA cache it is opt-in: the
server passes a directory; the library and the benchmarks profile afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import socket
import tempfile

import jax
import numpy as np

from dspark_jax.schedule import CostTable

log = logging.getLogger(__name__)


def default_dir() -> str | None:
    """DSPARK_CACHE_DIR/sps (~/.cache/dspark_jax/sps), or None when DSPARK_SPS_CACHE=0."""
    if os.environ.get("DSPARK_SPS_CACHE", "1") == "0":
        return None
    from dspark_jax.models.loading import cache_dir

    return os.path.join(cache_dir(), "sps")


@functools.cache
def _source_digest() -> str:
    """sha256 of this package's Python sources: a change to the step's code changes its cost."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _shapes(tree) -> list:
    """[(path, shape, dtype)] of a pytree's arrays."""
    return [(jax.tree_util.keystr(path), tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__)))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def fingerprint(engine) -> str:
    """A hex key for `engine`'s cost table on this machine (see the module docstring)."""
    import jaxlib

    s = engine.settings
    params, dparams = engine.weights
    identity = {
        "target": engine.target.name, "target_config": dataclasses.asdict(s.config),
        "drafter_config": None if s.dconfig is None else dataclasses.asdict(s.dconfig),
        "target_arrays": _shapes(params), "drafter_arrays": None if dparams is None else _shapes(dparams),
        "slots": s.slots, "max_len": s.max_len, "row_buckets": list(engine.row_buckets), "verifier": s.verifier,
        "mesh": None if engine.mesh is None else {str(k): int(v) for k, v in dict(engine.mesh.shape).items()},
        "source": _source_digest(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
        "host": socket.gethostname(), "cpus": os.cpu_count(), "machine": platform.machine(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


def path_for(engine, directory: str) -> str:
    return os.path.join(directory, f"{fingerprint(engine)}.json")


def load(engine, directory: str) -> tuple[CostTable, str] | None:
    """(table, path) when `directory` holds a table for `engine`, else None. A file that does not
    read as one for this engine is reported and ignored (the caller profiles and overwrites it)."""
    path = path_for(engine, directory)
    if not os.path.exists(path):
        return None
    try:
        table = CostTable.load(path)
    except (OSError, ValueError, TypeError) as err:
        log.warning("ignoring the cached cost table %s: %s", path, err)
        return None
    buckets = sorted(t.slots for t in table.row_buckets) + [table.slots]
    if table.slots != engine.slots or table.block_size != engine.block_size or buckets != sorted(engine.row_buckets):
        log.warning("ignoring the cached cost table %s: made for %d slots, block %d, row buckets %s", path,
                    table.slots, table.block_size, buckets)
        return None
    return table, path


def save(engine, table: CostTable, directory: str) -> str:
    """Write `table` as `engine`'s cached table (atomically: a reader never sees half a file)."""
    os.makedirs(directory, exist_ok=True)
    path = path_for(engine, directory)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    try:
        table.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
