"""Soak test for a running server: `python -m serve.soak --address HOST:PORT --seconds 300`.

Several client threads send requests back to back for `--seconds`: most are ordinary streams, some
are cancelled after a random delay, some carry a deadline too short to finish, and `--malformed`
of them are invalid. Every request has its own id, and the program checks what a server must never
do under this: crash, lose a response (an ordinary stream that ends without a final message),
duplicate one (a second final message, or tokens after it), answer a malformed request with
anything but INVALID_ARGUMENT, or keep a slot or a queue place once the clients are done. With
`--pid` it samples the server's resident memory and reports its growth over the second half.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import threading
import time
import urllib.request

import grpc

from serve import protos

pb2, pb2_grpc = protos.load()

MALFORMED = (dict(prompt=""), dict(prompt="hi", top_p=1.5), dict(prompt="hi", max_new_tokens=-5),
             dict(prompt="hi", temperature=9.0), dict(messages={"messages": [{"role": "robot", "content": "x"}]}),
             dict(prompt="hi", stop=["s"] * 40), dict(prompt="word " * 5000))


@dataclasses.dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    deadline: int = 0
    rejected: int = 0
    invalid_ok: int = 0
    problems: list = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, name: str, problem: str | None = None) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)
            if problem:
                self.problems.append(problem)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one(stub, rng: random.Random, tally: Tally, args, n: int) -> None:
    rid = f"soak-{threading.get_ident()}-{n}"
    roll = rng.random()
    if roll < args.malformed:
        tally.add("sent")
        try:
            stub.Generate(pb2.GenerateRequest(request_id=rid, **rng.choice(MALFORMED)), timeout=30)
            tally.add("completed", f"{rid}: a malformed request was accepted")
        except grpc.RpcError as err:
            ok = err.code() == grpc.StatusCode.INVALID_ARGUMENT
            tally.add("invalid_ok" if ok else "completed", None if ok else f"{rid}: malformed got {err.code().name}")
        return
    kind = "cancel" if roll < args.malformed + args.cancel else "deadline" if roll < args.malformed + args.cancel + \
        args.deadline else "normal"
    budget = rng.randint(4, args.max_new_tokens)
    request = pb2.GenerateRequest(request_id=rid, prompt=rng.choice(args.prompts), max_new_tokens=budget,
                                  temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.getrandbits(31))
    timeout = rng.uniform(0.05, 1.0) if kind == "deadline" else 600
    tally.add("sent")
    stream = stub.GenerateStream(request, timeout=timeout)
    finals, tokens, after_final = 0, 0, 0
    if kind == "cancel":
        threading.Timer(rng.uniform(0.0, 2.0), stream.cancel).start()
    try:
        for response in stream:
            if finals:
                after_final += 1
            tokens += len(response.token_ids)
            if response.finish_reason != pb2.FINISH_REASON_UNSPECIFIED:
                finals += 1
        if finals != 1 or after_final:
            tally.add("completed", f"{rid}: {finals} final messages, {after_final} messages after the final one")
        elif tokens != response.usage.completion_tokens:
            tally.add("completed", f"{rid}: {tokens} tokens streamed, usage says {response.usage.completion_tokens}")
        else:
            tally.add("completed")
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.CANCELLED and kind == "cancel":
            tally.add("cancelled")
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and kind == "deadline":
            tally.add("deadline")
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tally.add("rejected")
        else:
            tally.add("completed", f"{rid} ({kind}): {code.name}: {err.details()}")


def gauges(url: str | None) -> dict[str, float]:
    if not url:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    names = ("dspark:num_requests_running", "dspark:num_requests_waiting", "dspark:slot_usage_perc")
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--metrics-url", default=None, help="the server's Prometheus endpoint (slot checks)")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id (memory samples)")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--malformed", type=float, default=0.05)
    parser.add_argument("--cancel", type=float, default=0.15)
    parser.add_argument("--deadline", type=float, default=0.10)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    args.prompts = ["Tell me about the sea.", "Write a short poem.", "What is 17 times 23?",
                    "List three fruits.", "Explain what a compiler does.", "Hello!"]
    tally, end = Tally(), time.monotonic() + args.seconds
    memory: list[tuple[float, float]] = []
    with grpc.insecure_channel(args.address) as channel:
        stub = pb2_grpc.DSparkStub(channel)

        def client(k):
            rng, n = random.Random(args.seed * 1000 + k), 0
            while time.monotonic() < end:
                one(stub, rng, tally, args, n)
                n += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            if args.pid:
                memory.append((time.monotonic(), rss_mb(args.pid)))
            time.sleep(2.0)
        for t in threads:
            t.join()
    time.sleep(1.0)  # the server frees the last cancelled slots on its next pass
    left = gauges(args.metrics_url)
    busy = {k: v for k, v in left.items() if v != 0}
    report = {f.name: getattr(tally, f.name) for f in dataclasses.fields(Tally) if f.name != "lock"}
    report["gauges_after"] = left
    if memory:
        half = [m for t, m in memory if t >= memory[0][0] + (memory[-1][0] - memory[0][0]) / 2]
        report["rss_mb_first_half_end"] = half[0]
        report["rss_mb_end"] = memory[-1][1]
        report["rss_growth_second_half_mb"] = memory[-1][1] - half[0]
    if busy:
        report["problems"].append(f"slots or queue places still in use after the clients stopped: {busy}")
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
