"""The server's Prometheus metrics, named like vLLM's (prefix `dspark:` where vLLM has `vllm:`).

One `ServerMetrics` per server, on its own registry (no module-level state), exported over HTTP
by `prometheus_client.start_http_server(port, registry=...)`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, positions: int = 0):
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        self.running = Gauge("dspark:num_requests_running", "Requests in decode slots.", registry=registry)
        self.waiting = Gauge("dspark:num_requests_waiting", "Requests queued for a slot.", registry=registry)
        self.slot_usage = Gauge("dspark:slot_usage_perc", "Fraction of decode slots in use (0-1).",
                                registry=registry)
        self.queue_time = Histogram("dspark:request_queue_time_seconds", "Time from arrival to a slot.",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("dspark:time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("dspark:inter_token_latency_seconds",
                             "Time between tokens (a step committing n tokens counts n intervals of dt/n).",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("dspark:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.finished = Counter("dspark:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=registry)
        self.failed = Counter("dspark:request_failure", "Requests ended by an error (deadline, internal, cancelled).",
                              ["reason"], registry=registry)
        self.rejected = Counter("dspark:request_rejected", "Requests refused before admission.", ["reason"],
                                registry=registry)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prefilled prompt tokens.", registry=registry)
        self.generation_tokens = Counter("dspark:generation_tokens", "Generated tokens.", registry=registry)
        self.drafts = Counter("dspark:spec_decode_num_drafts", "Verification rounds that checked >= 1 draft token.",
                              registry=registry)
        self.draft_tokens = Counter("dspark:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                    registry=registry)
        self.accepted_tokens = Counter("dspark:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       registry=registry)
        self.accepted_per_pos = Counter("dspark:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each position of the block (1-based).",
                                        ["position"], registry=registry)
        self._positions = [self.accepted_per_pos.labels(position=str(j + 1)) for j in range(positions)]

    def observe_round(self, verified: int, accepted: int) -> None:
        """One request's verification round: `verified` draft tokens checked, the first `accepted` kept."""
        if verified > 0:
            self.drafts.inc()
            self.draft_tokens.inc(verified)
        if accepted > 0:
            self.accepted_tokens.inc(accepted)
            for j in range(min(accepted, len(self._positions))):
                self._positions[j].inc()
