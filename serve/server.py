"""The gRPC server: `python -m serve` (or `dspark serve`).

Start-up order: load the target and drafter, open the port with health NOT_SERVING (requests get
UNAVAILABLE), compile every program and profile the cost table, then SERVING. SIGTERM or SIGINT
drains: health NOT_SERVING, new requests UNAVAILABLE, every accepted request finishes, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dspark_jax import xla_cache
from serve import protos
from serve.config import ServeConfig, add_arguments, check_config, config_from_args
from serve.metrics import ServerMetrics
from serve.orchestrator import Chunk, Failure, Job, NotServing, Orchestrator, QueueFull
from serve.requests import InvalidRequest, Limits, prepare

log = logging.getLogger("dspark.serve")
pb2, pb2_grpc = protos.load()

FINISH = {"length": pb2.LENGTH, "stop": pb2.STOP, "eos": pb2.EOS, "abort": pb2.ABORT}
FAILURE_CODES = {"deadline": grpc.StatusCode.DEADLINE_EXCEEDED, "internal": grpc.StatusCode.INTERNAL,
                 "invalid": grpc.StatusCode.INVALID_ARGUMENT, "cancelled": grpc.StatusCode.CANCELLED}
POLL_SECONDS = 0.25  # how often a handler waiting for tokens checks that its client is still there


def resolve_drafter(config: ServeConfig) -> str | None:
    from dspark_jax.drafters import trained_drafters

    if config.drafter in ("", "none"):
        return None
    if config.drafter == "auto":
        name = f"{config.model}-dspark"
        return name if name in trained_drafters() else None
    return config.drafter


def build_engine(config: ServeConfig):
    """(target, drafter name or None, Engine) as the config says; clear errors for bad values."""
    from dspark_jax import Engine, load_target, sharding, table_cache
    from dspark_jax.drafters import load_drafter

    mesh = None
    sizes = sharding.parse_mesh(config.mesh)
    if sizes:
        mesh = sharding.make_mesh(**sizes)
    target = load_target(config.model, dtype=config.dtype, mesh=mesh)
    drafter_name = resolve_drafter(config)
    drafter = load_drafter(drafter_name, target) if drafter_name else None
    policy = config.policy or ("dspark" if drafter is not None else "none")
    sps_cache = None if config.reprofile else table_cache.default_dir()
    engine = Engine(target, drafter, slots=config.slots, max_len=config.max_len, block_size=config.block_size,
                    verifier=config.verifier, mesh=mesh, policy=policy, sps_table=config.sps_table, sps_cache=sps_cache)
    return target, drafter_name, engine


class DSparkService(pb2_grpc.DSparkServicer):
    """The dspark.v1.DSpark service over an orchestrator."""

    def __init__(self, server: "Server"):
        self.server = server

    def _start(self, request, context) -> Job:
        srv = self.server
        if not srv.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up; retry when health is SERVING")
        try:
            prepared = prepare(request, srv.tokenizer, srv.limits)
        except InvalidRequest as err:
            srv.metrics.rejected.labels(reason="invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            job = srv.orchestrator.submit(prepared, deadline)
        except QueueFull as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except NotServing as err:
            srv.metrics.rejected.labels(reason="unavailable").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except InvalidRequest as err:
            srv.metrics.rejected.labels(reason="invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        # Fires when the RPC ends for any reason; a no-op for a request that already finished.
        context.add_callback(lambda: srv.orchestrator.cancel(job))
        return job

    def _chunks(self, job: Job, context):
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not context.is_active():
                    self.server.orchestrator.cancel(job)
                    return
                continue
            if isinstance(event, Failure):
                context.abort(FAILURE_CODES.get(event.kind, grpc.StatusCode.INTERNAL), event.message)
            yield event
            if event.finish is not None:
                return

    @staticmethod
    def _response(job: Job, text: str, ids: list[int], last: Chunk | None):
        response = pb2.GenerateResponse(request_id=job.request_id, text=text, token_ids=ids)
        if last is not None and last.finish is not None:
            response.finish_reason = FINISH[last.finish]
            response.usage.CopyFrom(pb2.Usage(prompt_tokens=last.prompt_tokens,
                                              completion_tokens=last.completion_tokens,
                                              drafted_tokens=last.drafted, accepted_tokens=last.accepted))
            mean = (last.accepted + last.rounds) / last.rounds if last.rounds else 0.0
            response.speculative.CopyFrom(pb2.SpeculativeStats(rounds=last.rounds, mean_accepted_length=mean))
        return response

    def Generate(self, request, context):
        job = self._start(request, context)
        texts, ids, last = [], [], None
        for chunk in self._chunks(job, context):
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        return self._response(job, "".join(texts), ids, last)

    def GenerateStream(self, request, context):
        job = self._start(request, context)
        for chunk in self._chunks(job, context):
            yield self._response(job, chunk.text, chunk.token_ids, chunk)

    def Abort(self, request, context):
        return pb2.AbortResponse(found=self.server.orchestrator.abort(request.request_id))

    def GetModelInfo(self, request, context):
        return self.server.model_info


class Server:
    """The gRPC server, its health and reflection services, metrics and the orchestrator."""

    def __init__(self, engine, tokenizer, *, port: int = 0, host: str = "[::]", queue_size: int = 64,
                 rounds: int = 1, target_name: str = "", drafter_name: str | None = None,
                 metrics_port: int | None = None, max_message_bytes: int = 16 << 20):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics(positions=engine.block_size if engine.settings.dconfig is not None else 0)
        self.limits = Limits(vocab_size=engine.settings.config.vocab_size, max_context=engine.max_len,
                             extra_positions=engine.extra_positions)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.ready = threading.Event()
        self.orchestrator = Orchestrator(engine, tokenizer, queue_size=queue_size, rounds=rounds,
                                         metrics=self.metrics, on_fault=self._on_fault)
        spec = engine.settings.dconfig is not None
        self.model_info = pb2.ModelInfo(
            target=target_name, drafter=drafter_name or "", max_context=engine.max_len, slots=engine.slots,
            policy=engine.policy, block_size=engine.block_size if spec else 0, queue_size=queue_size,
            mesh=[f"{k}={v}" for k, v in engine.mesh.shape.items()] if engine.mesh is not None else [])
        # Each streaming call holds a worker thread; past this many calls gRPC itself answers
        # RESOURCE_EXHAUSTED instead of queueing without bound. The spare ones keep health checks,
        # Abort and GetModelInfo answerable under full load.
        workers = engine.slots + queue_size + 16
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 60_000),  # the server pings an idle connection every minute
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # clients may ping every 5 s ...
            ("grpc.http2.max_ping_strikes", 0),  # ... and are never disconnected for pinging
            ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silent second listener
        ]
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
                                       options=options, maximum_concurrent_rpcs=workers)
        pb2_grpc.add_DSparkServicer_to_server(DSparkService(self), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        names = (pb2.DESCRIPTOR.services_by_name["DSpark"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.grpc_server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{host}:{port}"
        try:
            self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as err:
            raise OSError(f"cannot listen on {address}: {err} (is the port in use?)") from None
        if not self.port:
            raise OSError(f"cannot listen on {address} (is the port in use?)")
        self.metrics_server = None
        if metrics_port is not None:
            from prometheus_client import start_http_server

            self.metrics_server, _ = start_http_server(metrics_port, registry=self.metrics.registry)

    def _set_health(self, status) -> None:
        for name in ("", protos.SERVICE_NAME):
            self.health.set(name, status)

    def _on_fault(self, message: str) -> None:
        log.error("engine fault, health NOT_SERVING: %s", message)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self, warmup: bool = True, interrupted=None) -> float:
        """Open the port, compile (health NOT_SERVING meanwhile), then serve. Returns warmup seconds.

        `interrupted()` (optional) is asked once the compiling is done: True raises
        StartupInterrupted before anything is served (see serve(): a stop signal whose exception
        a library callback swallowed)."""
        self.grpc_server.start()
        seconds = 0.0
        if warmup:
            batches = tuple(1 << i for i in range(self.engine.slots.bit_length()) if 1 << i <= self.engine.slots)
            seconds = self.engine.warmup(rounds=(self.orchestrator.rounds,), insert_batches=batches)
        if interrupted is not None and interrupted():
            raise StartupInterrupted
        self.orchestrator.start()
        self.ready.set()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return seconds

    def drain(self, timeout: float | None = None) -> bool:
        """Health NOT_SERVING, new requests UNAVAILABLE, wait for the accepted ones; True if all finished."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        return self.orchestrator.drain(timeout)

    def stop(self, grace: float = 5.0) -> None:
        self.grpc_server.stop(grace).wait()
        self.orchestrator.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()


class StartupInterrupted(BaseException):  # not Exception: no library handler may swallow it
    """SIGTERM / SIGINT before the server was serving: nothing was accepted, so it stops at once."""


def serve(config: ServeConfig) -> int:
    """Run the server until SIGTERM / SIGINT, then drain; returns the exit status.

    A signal during start-up (loading, minutes of compiling) stops it there instead of after the
    warmup: every request so far was refused as UNAVAILABLE, so there is nothing to drain, and an
    orchestrator's SIGKILL deadline (Kubernetes: 30 s) is not reached. That path ends the process
    itself with status 0 (os._exit, see there) instead of returning."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax"):  # checkpoint-reading and backend-probing chatter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    check_config(config)
    stop, started = threading.Event(), threading.Event()

    def on_signal(*_):
        stop.set()
        if not started.is_set():
            raise StartupInterrupted  # unwinds the start-up in the main thread (between compiles)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    t0 = time.perf_counter()
    server = None
    try:
        target, drafter_name, engine = build_engine(config)
        # The handler's exception can be swallowed where it lands: CI saw it raised inside JAX's
        # gc callback, which ignores exceptions, and the server went on to serve. The stop flag
        # is set all the same; these checks turn it into the interruption it should have been.
        if stop.is_set():
            raise StartupInterrupted
        server = Server(engine, target.tokenizer, port=config.port, host=config.host, queue_size=config.queue_size,
                        rounds=config.rounds, target_name=config.model, drafter_name=drafter_name,
                        metrics_port=config.metrics_port, max_message_bytes=config.max_message_mb << 20)
        log.info("listening on %s:%d (health NOT_SERVING while compiling)", config.host, server.port)
        warm = server.start(interrupted=stop.is_set)
        started.set()
    except StartupInterrupted:
        if server is not None:  # the signal may land after start() set SERVING: drain what came in
            server.drain(config.drain_seconds)
            server.stop()
        log.info("stopped during start-up after %.1f s (a signal before serving)", time.perf_counter() - t0)
        # Exit here, without the interpreter's teardown: the signal unwound the start-up between
        # compiles, and tearing down while XLA still holds that work crashed the process (SIGSEGV
        # after this line, 3 of 4 tries with JAX's persistent compilation cache on). Nothing is
        # left to finalise: no request was accepted and the server, if any, is stopped.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    log.info("SERVING: model %s, drafter %s, policy %s, %d slots, context %d; warmup %.1f s, start-up %.1f s%s",
             config.model, drafter_name, engine.policy, engine.slots, engine.max_len, warm, time.perf_counter() - t0,
             f"; cost table {engine.cost_table_source}" if engine.cost_table_source else "")
    while not stop.wait(1.0):
        pass
    log.info("draining: %d requests in flight", server.orchestrator.in_flight())
    finished = server.drain(config.drain_seconds)
    server.stop()
    log.info("stopped (%s)", "all requests finished" if finished else "drain timed out")
    return 0 if finished else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve", description="dspark gRPC server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    xla_cache.enable()
    try:
        return serve(config_from_args(args))
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"serve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
