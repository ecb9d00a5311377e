"""Load benchmark for the gRPC server, in the manner of vLLM's benchmark_serving.

    python -m serve.bench --policies none fixed dspark --concurrency 1 4 8 --rates 0.5 1 --requests 32

For each policy it starts the same server binary (`python -m serve --policy P ...`), waits for
health SERVING, sends warm-up requests (discarded), then runs closed-loop concurrency levels and
Poisson arrival rates with prompts from MT-Bench and held-out ShareGPT, and stops the server with
SIGTERM. `--address` benchmarks a server that is already running instead.

Per level: request throughput, output tokens per second, TTFT, TPOT = (latency - TTFT) / (tokens
- 1), inter-token latency (a message carrying k tokens counts k gaps of dt/k), end-to-end latency
(mean, p50, p90, p99), goodput (requests per second meeting both latency targets), errors and
rejections (counted, never retried), and acceptance from the server's own Prometheus counters.
Writes results.json, results.md and a plot of system throughput against per-user speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve import protos
from serve.config import ServeConfig

pb2, pb2_grpc = protos.load()

SPEC_COUNTERS = ("dspark:spec_decode_num_drafts_total", "dspark:spec_decode_num_draft_tokens_total",
                 "dspark:spec_decode_num_accepted_tokens_total", "dspark:generation_tokens_total")


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it (times in seconds from its send)."""

    ok: bool
    code: str = "OK"  # gRPC status name
    tokens: int = 0
    ttft: float = float("nan")
    latency: float = float("nan")
    gaps: list[float] = dataclasses.field(default_factory=list)  # inter-token gaps
    start: float = 0.0  # perf_counter at send
    end: float = 0.0


def load_prompts(datasets: list[str], limit: int, max_chars: int, seed: int = 0) -> list[str]:
    """Prompts interleaved from the datasets: MT-Bench first turns, held-out ShareGPT first turns."""
    from train.sources import is_validation, mtbench_first_turns, sharegpt_first_turns

    pools = []
    for name in datasets:
        if name == "mtbench":
            pool = mtbench_first_turns()
        elif name == "sharegpt":
            pool = [c.prompt for c in itertools.islice(
                (c for c in sharegpt_first_turns() if is_validation(c.conversation_id, 0.05)), 4 * limit)]
        else:
            raise SystemExit(f"--datasets: unknown dataset {name!r} (mtbench, sharegpt)")
        pool = [p for p in pool if len(p) <= max_chars]
        random.Random(seed).shuffle(pool)
        pools.append(pool)
    mixed = [p for group in itertools.zip_longest(*pools) for p in group if p is not None]
    if not mixed:
        raise SystemExit("no prompts: every prompt is longer than --max-prompt-chars")
    return mixed[:limit]


def one_request(stub, prompt: str, args, timeout: float) -> Outcome:
    request = pb2.GenerateRequest(prompt=prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  ignore_eos=args.ignore_eos, seed=random.getrandbits(31))
    out = Outcome(ok=False, start=time.perf_counter())
    last = out.start
    try:
        for response in stub.GenerateStream(request, timeout=timeout):
            now = time.perf_counter()
            k = len(response.token_ids)
            if k:
                if out.tokens == 0:
                    out.ttft = now - out.start
                else:
                    out.gaps.extend([(now - last) / k] * k)
                out.tokens += k
                last = now
        out.ok = True
    except grpc.RpcError as err:
        out.code = err.code().name
    out.end = time.perf_counter()
    out.latency = last - out.start if out.ok else out.end - out.start
    return out


def closed_loop(stub, prompts: list[str], concurrency: int, n: int, args) -> list[Outcome]:
    """`concurrency` users, each sending its next request when the last one ends, n requests in all."""
    feed = iter(list(itertools.islice(itertools.cycle(prompts), n)))
    lock, outcomes = threading.Lock(), []

    def user():
        while True:
            with lock:
                prompt = next(feed, None)
            if prompt is None:
                return
            result = one_request(stub, prompt, args, args.timeout)
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=user) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def poisson(stub, prompts: list[str], rate: float, n: int, args) -> list[Outcome]:
    """n requests with exponential gaps (mean 1/rate), each sent whatever the server's state."""
    rng = np.random.default_rng(args.seed)
    outcomes, threads, lock = [], [], threading.Lock()

    def send(prompt):
        result = one_request(stub, prompt, args, args.timeout)
        with lock:
            outcomes.append(result)

    for prompt in itertools.islice(itertools.cycle(prompts), n):
        t = threading.Thread(target=send, args=(prompt,))
        t.start()
        threads.append(t)
        time.sleep(rng.exponential(1.0 / rate))
    for t in threads:
        t.join()
    return outcomes


def stats(values) -> dict:
    values = np.asarray([v for v in values if np.isfinite(v)], float)
    if not values.size:
        return {k: None for k in ("mean", "p50", "p90", "p99")}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99))}


def summarize(outcomes: list[Outcome], args) -> dict:
    done = [o for o in outcomes if o.ok]
    span = (max(o.end for o in outcomes) - min(o.start for o in outcomes)) if outcomes else float("nan")
    tpots = [(o.latency - o.ttft) / (o.tokens - 1) for o in done if o.tokens > 1]
    good = [o for o in done if o.ttft <= args.goodput_ttft
            and (o.latency - o.ttft) / max(o.tokens - 1, 1) <= args.goodput_tpot]
    tokens = sum(o.tokens for o in done)
    codes = {}
    for o in outcomes:
        if not o.ok:
            codes[o.code] = codes.get(o.code, 0) + 1
    per_user = [(o.tokens - 1) / (o.latency - o.ttft) for o in done if o.tokens > 1 and o.latency > o.ttft]
    return {
        "requests": len(outcomes), "completed": len(done), "rejected": codes.get("RESOURCE_EXHAUSTED", 0),
        "errors": sum(v for k, v in codes.items() if k != "RESOURCE_EXHAUSTED"), "error_codes": codes,
        "duration_s": span, "request_throughput": len(done) / span, "output_tokens_per_s": tokens / span,
        "per_user_tokens_per_s": float(np.median(per_user)) if per_user else None,
        "goodput": len(good) / span, "ttft_s": stats(o.ttft for o in done), "tpot_s": stats(tpots),
        "itl_s": stats(g for o in done for g in o.gaps), "e2e_s": stats(o.latency for o in done),
    }


def scrape(url: str | None) -> dict[str, float]:
    if not url:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SPEC_COUNTERS:
                values[sample.name] = sample.value
    return values


def acceptance(before: dict, after: dict) -> dict:
    diff = {k.removeprefix("dspark:").removesuffix("_total"): after.get(k, 0.0) - before.get(k, 0.0)
            for k in SPEC_COUNTERS}
    drafts, draft_tokens = diff["spec_decode_num_drafts"], diff["spec_decode_num_draft_tokens"]
    accepted = diff["spec_decode_num_accepted_tokens"]
    return {**diff, "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "accepted_per_draft": accepted / drafts if drafts else None}


def wait_serving(address: str, timeout: float, process=None) -> None:
    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            if process is not None and process.poll() is not None:
                raise SystemExit(f"the server exited with status {process.returncode} during start-up")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"the server at {address} was not SERVING within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_levels(address: str, metrics_url: str | None, prompts: list[str], args) -> list[dict]:
    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.DSparkStub(channel)
        info = stub.GetModelInfo(pb2.ModelInfoRequest(), timeout=10)
        closed_loop(stub, prompts, 1, args.warmup, args)  # warm-up: discarded
        levels = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]
        for kind, value in levels:
            before = scrape(metrics_url)
            if kind == "concurrency":
                outcomes = closed_loop(stub, prompts, int(value), args.requests, args)
            else:
                outcomes = poisson(stub, prompts, float(value), args.requests, args)
            row = {"policy": info.policy, "drafter": info.drafter, "load": kind, "value": value,
                   **summarize(outcomes, args)}
            if metrics_url:
                row["server"] = acceptance(before, scrape(metrics_url))
            rows.append(row)
            print(line(row), flush=True)
    return rows


def line(row: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    acc = row.get("server", {}).get("accepted_per_draft")
    return (f"{row['policy']:>13} {row['load']:>11}={row['value']:<5} done {row['completed']}/{row['requests']} "
            f"rej {row['rejected']} err {row['errors']} | {row['request_throughput']:.2f} req/s "
            f"{row['output_tokens_per_s']:.1f} tok/s, per user {fmt(row['per_user_tokens_per_s'])} tok/s | "
            f"TTFT p50 {fmt(row['ttft_s']['p50'])} TPOT p50 {fmt(row['tpot_s']['p50'])} "
            f"E2E p99 {fmt(row['e2e_s']['p99'])} | goodput {row['goodput']:.2f} | accepted/draft {fmt(acc)}")


def launch(policy: str, args) -> tuple[subprocess.Popen, str, str]:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "serve", "--model", args.model, "--drafter", args.drafter, "--policy", policy,
           "--slots", str(args.slots), "--max-len", str(args.max_len), "--port", str(port),
           "--metrics-port", str(metrics_port), "--queue-size", str(args.queue_size), "--rounds", str(args.rounds)]
    if args.sps_table:
        cmd += ["--sps-table", args.sps_table]
    log = open(Path(args.out) / f"server-{policy}.log", "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    address = f"localhost:{port}"
    wait_serving(address, args.startup_timeout, process)
    return process, address, f"http://localhost:{metrics_port}/metrics"


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()


RATIO_METRICS = ("output_tokens_per_s", "per_user_tokens_per_s")


def paired_ratios(rows: list[dict]) -> list[dict]:
    """Each policy's throughput over `none`'s at each load level, paired by repeat (the two ran
    back to back): the per-repeat ratios, their median, min and max. Empty without a `none` run."""
    key = lambda r: (r["load"], r["value"], r.get("repeat", 0))  # noqa: E731
    base = {key(r): r for r in rows if r["policy"] == "none"}
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "none"):
        for load, value in dict.fromkeys((r["load"], r["value"]) for r in rows if r["policy"] == policy):
            pairs = [(r, base[key(r)]) for r in rows
                     if r["policy"] == policy and (r["load"], r["value"]) == (load, value) and key(r) in base]
            for metric in RATIO_METRICS:
                values = [a[metric] / b[metric] for a, b in pairs if a[metric] and b[metric]]
                if values:
                    out.append({"policy": policy, "load": load, "value": value, "metric": metric, "ratios": values,
                                "median": float(np.median(values)), "min": min(values), "max": max(values)})
    return out


def ratio_line(r: dict) -> str:
    each = ", ".join(f"{v:.3f}" for v in r["ratios"])
    return (f"{r['policy']:>13} / none {r['load']:>11}={r['value']:<5} {r['metric']:<22} median {r['median']:.3f} "
            f"(min {r['min']:.3f}, max {r['max']:.3f}; repeats {each})")


def write_report(rows: list[dict], args, ratios: list[dict] = ()) -> None:
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows, "ratios": list(ratios)},
                                                 indent=1))
    head = ("| policy | load | repeat | req/s | output tok/s | per-user tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | "
            "ITL p50 (s) | E2E p50 / p99 (s) | goodput (req/s) | done / rejected / errors | accepted per draft |")
    lines = [head, "|---|---|--:|" + "--:|" * 10]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        acc = r.get("server", {}).get("accepted_per_draft")
        lines.append(
            f"| {r['policy']} | {r['load']} {r['value']} | {r.get('repeat', 0)} | {r['request_throughput']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {fmt(r['per_user_tokens_per_s'])} | "
            f"{fmt(r['ttft_s']['p50'])} / {fmt(r['ttft_s']['p99'])} | {fmt(r['tpot_s']['p50'])} / "
            f"{fmt(r['tpot_s']['p99'])} | {fmt(r['itl_s']['p50'])} | {fmt(r['e2e_s']['p50'])} / "
            f"{fmt(r['e2e_s']['p99'])} | {r['goodput']:.2f} | {r['completed']} / {r['rejected']} / {r['errors']} | "
            f"{fmt(acc)} |")
    if ratios:
        lines += ["", "| policy / none | load | metric | median | min | max | per repeat |", "|---|---|---|--:|--:|--:|---|"]
        lines += [f"| {r['policy']} | {r['load']} {r['value']} | {r['metric']} | {r['median']:.3f} | {r['min']:.3f} | "
                  f"{r['max']:.3f} | {', '.join(f'{v:.3f}' for v in r['ratios'])} |" for r in ratios]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        levels = dict.fromkeys(r["value"] for r in rows if r["policy"] == policy and r["load"] == "concurrency")
        pts = []
        for c in levels:  # the median over repeats at each level
            runs = [r for r in rows if r["policy"] == policy and r["load"] == "concurrency" and r["value"] == c
                    and r["per_user_tokens_per_s"]]
            if runs:
                pts.append((float(np.median([r["per_user_tokens_per_s"] for r in runs])),
                            float(np.median([r["output_tokens_per_s"] for r in runs])), c))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=policy)
            for x, y, c in pts:
                ax.annotate(f"c={c}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("per-user speed (tokens/s, median)")
    ax.set_ylabel("system throughput (output tokens/s)")
    ax.set_title("serve.bench: closed-loop concurrency levels")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="benchmark this running server instead of launching")
    parser.add_argument("--metrics-url", default=None, help="its Prometheus endpoint (with --address)")
    parser.add_argument("--policies", nargs="+", default=["none", "fixed", "dspark"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--sps-table", default=None, help="cost table JSON for the dspark policies (else profiled)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--queue-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=ServeConfig().rounds,
                        help="decoding rounds per engine step of the launched servers, at most (tokens stream once "
                             "per step)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson arrival rates (requests/s)")
    parser.add_argument("--requests", type=int, default=32, help="requests per load level")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first and discarded")
    parser.add_argument("--datasets", nargs="+", default=["mtbench", "sharegpt"])
    parser.add_argument("--max-prompt-chars", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline per request (s)")
    parser.add_argument("--goodput-ttft", type=float, default=2.0, help="goodput: TTFT at most this (s)")
    parser.add_argument("--goodput-tpot", type=float, default=0.2, help="goodput: TPOT at most this (s)")
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over every policy and load level, the servers kept up, the order alternated: "
                             "the report gives each policy / none ratio per repeat, median and range")
    parser.add_argument("--out", default="runs/serve-bench")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    prompts = load_prompts(args.datasets, max(args.requests, 64), args.max_prompt_chars, args.seed)
    rows = []
    if args.address:
        for repeat in range(args.repeats):
            rows += [dict(r, repeat=repeat) for r in run_levels(args.address, args.metrics_url, prompts, args)]
    else:
        # Every policy's server stays up (an idle one waits on a condition) and the repeats
        # alternate the order, so the machine's drift hits each policy alike.
        servers = {}
        try:
            for policy in args.policies:
                servers[policy] = launch(policy, args)
            for repeat in range(args.repeats):
                order = args.policies if repeat % 2 == 0 else args.policies[::-1]
                for policy in order:
                    _, address, metrics_url = servers[policy]
                    rows += [dict(r, repeat=repeat) for r in run_levels(address, metrics_url, prompts, args)]
        finally:
            for process, _, _ in servers.values():
                stop(process)
    ratios = paired_ratios(rows)
    for r in ratios:
        print(ratio_line(r), flush=True)
    write_report(rows, args, ratios)
    print(f"wrote {args.out}/results.md, results.json, throughput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
