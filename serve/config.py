"""The server's settings and its command-line flags (no gRPC import: `dspark --help` stays light)."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass
class ServeConfig:
    """Everything `python -m serve` takes (one flag per field)."""

    model: str = "smollm2-135m"
    drafter: str = "auto"  # "auto": the model's trained DSpark drafter when one ships, else none
    port: int = 50051
    host: str = "[::]"
    slots: int = 8
    max_len: int = 2048
    policy: str | None = None  # default: "dspark" with a drafter, else "none"
    sps_table: str | None = None
    reprofile: bool = False  # profile the cost table even when the cache holds one for this engine
    block_size: int | None = None
    mesh: str = ""
    metrics_port: int | None = None
    queue_size: int = 64
    rounds: int = 4  # per engine step, at most (orchestrator); serve/README.md "Rounds per step"
    dtype: str = "float32"
    verifier: str = "jnp"
    max_message_mb: int = 16
    drain_seconds: float = 600.0


def check_config(config: ServeConfig) -> None:
    for name in ("slots", "queue_size", "rounds", "max_message_mb", "port"):
        value, low = getattr(config, name), 0 if name in ("queue_size", "port") else 1
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark_jax.schedule import POLICIES

    d = ServeConfig()
    parser.add_argument("--model", default=d.model, help="model name, .gguf file or HF folder")
    parser.add_argument("--drafter", default=d.drafter,
                        help="drafter name or folder, 'ngram', or 'none'; 'auto' takes the model's trained DSpark "
                             "drafter when one ships with the package")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--slots", type=int, default=d.slots, help="requests decoded at once")
    parser.add_argument("--max-len", type=int, default=d.max_len, help="context per request (prompt + new tokens)")
    parser.add_argument("--policy", default=None, choices=list(POLICIES),
                        help="verification-length policy (default: dspark with a drafter, none without)")
    parser.add_argument("--sps-table", default=None, help="cost table JSON (python -m dspark_jax.schedule); "
                        "default: profiled at start-up for the dspark policies, then kept in "
                        "DSPARK_CACHE_DIR/sps and read back by a later start of the same engine on this "
                        "machine (DSPARK_SPS_CACHE=0 turns that off)")
    parser.add_argument("--reprofile", action="store_true",
                        help="profile the cost table at start-up even when a cached one matches")
    parser.add_argument("--block-size", type=int, default=None, help="draft tokens per round (default: the drafter's)")
    parser.add_argument("--mesh", default=d.mesh, help="device mesh, e.g. data=1,tensor=4 (default: one device)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint port (default: off)")
    parser.add_argument("--queue-size", type=int, default=d.queue_size,
                        help="requests that may wait for a slot; past it, RESOURCE_EXHAUSTED")
    parser.add_argument("--rounds", type=int, default=d.rounds,
                        help="decoding rounds per engine step, at most (one round while a new request awaits its "
                             "first token): more rounds pay the step's fixed host cost less often, and a request "
                             "that arrives mid-step waits for the step's end")
    parser.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--verifier", default=d.verifier, choices=["jnp", "pallas"])
    parser.add_argument("--max-message-mb", type=int, default=d.max_message_mb)
    parser.add_argument("--drain-seconds", type=float, default=d.drain_seconds,
                        help="on SIGTERM, how long accepted requests may take to finish")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)})
