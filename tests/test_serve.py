"""The gRPC server (serve/): outputs equal the library's, continuous batching, streaming, stop
strings, UTF-8 deltas, admission limits, abort / cancel / deadline, bad requests, engine faults,
and the binary itself (health, reflection, metrics, SIGTERM drain, a 4-device mesh)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

grpc = pytest.importorskip("grpc")

from conftest import make_tiny_hf_model, wait_until  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the default model's real tokenizer (byte-level BPE, chat template)."""
    from dspark_jax.models.loading import converted_gguf, resolve_model_path

    folder = str(tmp_path_factory.mktemp("tiny-serve"))
    _, _, tokenizer = converted_gguf(resolve_model_path("smollm2-135m"))
    tokenizer.save_pretrained(folder)
    make_tiny_hf_model(folder, "llama", tie=True, vocab_size=len(tokenizer), max_position_embeddings=512,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id or 0)
    return folder


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    from dspark_jax import load_target

    return load_target(tiny_model_dir)


@pytest.fixture(scope="module")
def server(target):
    """In process: prompt-lookup drafter, whole blocks verified, 2 slots, 2 waiting places."""
    from dspark_jax import Engine
    from serve.server import Server

    engine = Engine(target, "ngram", slots=2, max_len=256, policy="fixed")
    srv = Server(engine, target.tokenizer, port=0, host="localhost", queue_size=2, target_name="tiny",
                 metrics_port=0)
    srv.start(warmup=False)  # programs compile on first use; the binary test covers warmup
    yield srv
    srv.drain(10)
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    from serve.server import pb2_grpc

    with grpc.insecure_channel(f"localhost:{server.port}") as channel:
        yield pb2_grpc.DSparkStub(channel)


def request(**fields):
    from serve.server import pb2

    return pb2.GenerateRequest(**fields)


def test_outputs_equal_the_library_unary_and_streamed(stub, target):
    from dspark_jax import generate
    from serve.server import pb2

    prompt = "Name three colours."
    want = generate(target, [prompt], max_new_tokens=24, ignore_eos=True)
    got = stub.Generate(request(prompt=prompt, max_new_tokens=24, ignore_eos=True))
    assert list(got.token_ids) == want.token_ids[0]
    assert got.text == want.texts[0]
    assert got.finish_reason == pb2.LENGTH
    assert got.usage.completion_tokens == 24 and got.usage.prompt_tokens > 5
    # Lossless speculation: the prompt-lookup drafter proposed tokens, some were accepted, and the
    # output is still plain greedy's.
    assert got.usage.drafted_tokens > 0 and got.speculative.rounds >= 1
    assert got.speculative.mean_accepted_length == pytest.approx(
        (got.usage.accepted_tokens + got.speculative.rounds) / got.speculative.rounds)
    parts = list(stub.GenerateStream(request(prompt=prompt, max_new_tokens=24, ignore_eos=True)))
    assert len(parts) > 1 and all(p.finish_reason == pb2.FINISH_REASON_UNSPECIFIED for p in parts[:-1])
    assert [t for p in parts for t in p.token_ids] == want.token_ids[0]
    assert "".join(p.text for p in parts) == want.texts[0]
    assert parts[-1].usage.completion_tokens == 24


def test_continuous_batching_more_requests_than_slots(stub, server):
    """Four requests with different settings on 2 slots: each equals its own run alone."""
    cases = [dict(prompt="Tell me a story.", max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True),
             dict(prompt="Count to ten.", max_new_tokens=12, ignore_eos=True),
             dict(prompt="Why is the sky blue?", max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7,
                  ignore_eos=True),
             dict(prompt="Hello", max_new_tokens=9, temperature=1.0, top_k=20, seed=1, ignore_eos=True)]
    alone = [list(stub.Generate(request(**c)).token_ids) for c in cases]
    results = [None] * len(cases)

    def run(i):
        results[i] = list(stub.Generate(request(**cases[i])).token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
    assert [len(r) for r in results] == [20, 12, 16, 9]
    assert wait_until(lambda: server.orchestrator.in_flight() == 0)


def test_stop_strings_cut_the_text_and_end_the_request(stub):
    from serve.server import pb2

    base = dict(prompt="Write something random.", max_new_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    full = stub.Generate(request(**base)).text
    assert len(full) > 12
    stop = full[8:11]
    cut = full.index(stop)
    got = stub.Generate(request(stop=[stop, "never-produced-zzz"], **base))
    assert got.finish_reason == pb2.STOP and got.text == full[:cut]
    streamed = list(stub.GenerateStream(request(stop=[stop], **base)))
    assert "".join(p.text for p in streamed) == full[:cut] and streamed[-1].finish_reason == pb2.STOP
    assert got.usage.completion_tokens < 40


def test_text_stream_never_splits_a_character(target):
    """Deltas of a byte-level tokenizer over emoji, CJK and accents: no U+FFFD, and they add up
    to the full decode; a stop string spanning tokens is held back, never half-sent."""
    from serve.textstream import TextStream

    tok = target.tokenizer
    text = "Voilà 😀 naïve 東京タワー — done 🎉🎉 end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters span several tokens
    stream = TextStream(tok)
    deltas = []
    for t in ids:
        stream.push(t)
        deltas.append(stream.take())
    deltas.append(stream.take(final=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    stream = TextStream(tok, stops=["タワー"])
    sent = []
    for t in ids:
        if stream.push(t):
            break
        sent.append(stream.take())
    sent.append(stream.take(final=True))
    assert "".join(sent) == text[:text.index("タワー")] and stream.stopped == "タワー"
    assert all("タ" not in s for s in sent)


@pytest.mark.parametrize("fields, field", [
    (dict(prompt=""), "prompt"),
    (dict(), "input"),
    (dict(prompt="hi", max_new_tokens=-1), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=100000), "max_new_tokens"),
    (dict(prompt="hi", temperature=3.0), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt="hi", stop=["x"] * 17), "stop"),
    (dict(prompt="hi", stop=[""]), "stop[0]"),
    (dict(prompt="word " * 400), "prompt"),
    (dict(messages={"messages": [{"role": "wizard", "content": "hi"}]}), "messages[0].role"),
    (dict(messages={"messages": []}), "messages"),
    (dict(token_ids={"ids": [5, 10**6]}), "token_ids"),
])
def test_bad_requests_name_the_field(stub, fields, field):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")


def test_messages_and_token_ids_inputs(stub, target):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                               tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    a = stub.Generate(request(messages={"messages": [{"role": "user", "content": "Hi!"}]}, max_new_tokens=6))
    b = stub.Generate(request(token_ids={"ids": ids}, max_new_tokens=6))
    assert list(a.token_ids) == list(b.token_ids) and a.usage.prompt_tokens == len(ids)


def test_abort_cancel_and_deadline_free_the_slot(stub, server, monkeypatch):
    from serve.server import pb2

    real_step = server.engine.step

    def slow_step(*args, **kwargs):  # at most ~10 steps a second: the request outlives the abort
        time.sleep(0.1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(server.engine, "step", slow_step)
    long = dict(prompt="Go on forever.", max_new_tokens=200, ignore_eos=True)
    stream = stub.GenerateStream(request(request_id="job-1", **long))
    first = next(stream)
    assert first.request_id == "job-1" and len(first.token_ids) >= 1
    with pytest.raises(grpc.RpcError) as dup:  # the id is in flight
        stub.Generate(request(request_id="job-1", **long))
    assert dup.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Abort(pb2.AbortRequest(request_id="job-1")).found
    rest = list(stream)
    assert rest[-1].finish_reason == pb2.ABORT
    assert sum(len(p.token_ids) for p in [first] + rest) < 200
    assert not stub.Abort(pb2.AbortRequest(request_id="no-such-job")).found
    assert wait_until(lambda: server.orchestrator.in_flight() == 0)

    stream = stub.GenerateStream(request(**long))  # a client that goes away mid-stream
    next(stream)
    stream.cancel()
    assert wait_until(lambda: server.orchestrator.in_flight() == 0)

    with pytest.raises(grpc.RpcError) as late:
        stub.Generate(request(**long), timeout=0.5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: server.orchestrator.in_flight() == 0)
    assert wait_until(lambda: server.metrics.running._value.get() == 0)


def test_admission_queue_is_bounded(stub, server, monkeypatch):
    """2 slots + 2 waiting places, the engine held inside a step: of 8 requests exactly 4 are
    accepted and 4 get RESOURCE_EXHAUSTED at once (no unbounded wait); the accepted ones finish."""
    engine, gate = server.engine, threading.Event()
    real_step = engine.step

    def held_step(*args, **kwargs):
        gate.wait(60)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", held_step)
    codes, lock = [], threading.Lock()

    def run(i):
        try:
            stub.Generate(request(prompt=f"Request {i}", max_new_tokens=20, ignore_eos=True), timeout=120)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert wait_until(lambda: codes.count("RESOURCE_EXHAUSTED") == 4)
    assert codes == ["RESOURCE_EXHAUSTED"] * 4 and server.orchestrator.in_flight() == 4
    gate.set()
    for t in threads:
        t.join()
    assert sorted(codes) == ["OK"] * 4 + ["RESOURCE_EXHAUSTED"] * 4


def test_client_streams_to_the_terminal(server, capsys):
    from serve import client

    assert client.main(["Say hi", "--address", f"localhost:{server.port}", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert "5 new tokens" in err and "LENGTH" in err


def test_load_benchmark_against_a_running_server(server, tmp_path):
    """serve.bench in --address mode: closed-loop and Poisson levels, counters diffed from the
    server's metrics endpoint, the report files written."""
    import json

    from serve import bench

    url = f"http://localhost:{server.metrics_server.server_port}/metrics"
    argv = ["--address", f"localhost:{server.port}", "--metrics-url", url, "--concurrency", "1", "3", "--rates", "50",
            "--requests", "3", "--warmup", "1", "--max-new-tokens", "6", "--datasets", "mtbench",
            "--max-prompt-chars", "300", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["load"], r["value"]) for r in rows] == [("concurrency", 1), ("concurrency", 3), ("rate", 50.0)]
    for row in rows:
        assert row["completed"] + row["rejected"] + row["errors"] == 3 and row["errors"] == 0
        assert row["server"]["spec_decode_num_draft_tokens"] > 0
        assert row["tpot_s"]["p50"] > 0 and row["ttft_s"]["p50"] > 0
    assert rows[0]["completed"] == 3 and rows[0]["server"]["generation_tokens"] == 18
    assert (tmp_path / "throughput.png").stat().st_size > 0 and "| fixed |" in (tmp_path / "results.md").read_text()


def test_benchmark_ratios_pair_each_repeat_with_none_at_the_same_load():
    from serve.bench import paired_ratios

    def row(policy, repeat, value, out, user):
        return {"policy": policy, "repeat": repeat, "load": "concurrency", "value": value,
                "output_tokens_per_s": out, "per_user_tokens_per_s": user}

    rows = [row("none", 0, 1, 10.0, 10.0), row("dspark", 0, 1, 13.0, 15.0), row("none", 0, 16, 100.0, 5.0),
            row("dspark", 0, 16, 90.0, 4.0), row("dspark", 1, 1, 12.0, 12.0), row("none", 1, 1, 8.0, 8.0),
            row("dspark", 2, 1, 20.0, 20.0)]  # repeat 2 has no none run: not paired
    got = {(r["value"], r["metric"]): r for r in paired_ratios(rows)}
    assert set(got) == {(1, "output_tokens_per_s"), (1, "per_user_tokens_per_s"), (16, "output_tokens_per_s"),
                        (16, "per_user_tokens_per_s")}
    assert got[(1, "output_tokens_per_s")]["ratios"] == [1.3, 1.5] and got[(1, "output_tokens_per_s")]["median"] == 1.4
    assert got[(1, "per_user_tokens_per_s")]["ratios"] == [1.5, 1.5]
    assert got[(16, "output_tokens_per_s")]["ratios"] == [0.9] and got[(16, "per_user_tokens_per_s")]["max"] == 0.8
    assert paired_ratios([r for r in rows if r["policy"] != "none"]) == []


def test_soak_with_cancellations_deadlines_and_malformed_requests(server, tmp_path):
    """A short serve.soak run: no lost or duplicated response, malformed requests refused, and
    every slot and queue place free afterwards (the 5-minute run is the README's)."""
    import json

    from serve import soak

    url = f"http://localhost:{server.metrics_server.server_port}/metrics"
    argv = ["--address", f"localhost:{server.port}", "--metrics-url", url, "--seconds", "6", "--clients", "4",
            "--max-new-tokens", "12", "--malformed", "0.2", "--out", str(tmp_path / "soak.json")]
    assert soak.main(argv) == 0
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["problems"] == [] and report["sent"] >= 8 and report["invalid_ok"] >= 1
    assert report["completed"] >= 1 and all(v == 0 for v in report["gauges_after"].values())
    assert server.orchestrator.in_flight() == 0


def test_engine_fault_is_internal_and_turns_health_off(target):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dspark_jax import Engine
    from serve.server import Server, pb2_grpc

    engine = Engine(target, None, slots=1, max_len=128)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.step = broken
    srv = Server(engine, target.tokenizer, port=0, host="localhost", queue_size=1)
    srv.start(warmup=False)
    try:
        with grpc.insecure_channel(f"localhost:{srv.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            stub = pb2_grpc.DSparkStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(request(prompt="hi", max_new_tokens=4))
            assert err.value.code() == grpc.StatusCode.INTERNAL and "device lost" in err.value.details()
            assert health.Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as after:
                stub.Generate(request(prompt="hi", max_new_tokens=4))
            assert after.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(0)


def test_warming_up_is_not_serving_and_refuses_requests(target):
    """While the engine compiles, health is NOT_SERVING and Generate is UNAVAILABLE; once the
    warmup returns, both turn. The warmup is held on an event so the window cannot be missed."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dspark_jax import Engine
    from serve.server import Server, pb2_grpc

    engine = Engine(target, None, slots=1, max_len=128)
    compiling, release = threading.Event(), threading.Event()

    def held_warmup(**kwargs):
        compiling.set()
        assert release.wait(60)
        return 0.0

    engine.warmup = held_warmup
    srv = Server(engine, target.tokenizer, port=0, host="localhost", queue_size=1)
    starting = threading.Thread(target=srv.start)
    starting.start()
    try:
        assert compiling.wait(30)
        with grpc.insecure_channel(f"localhost:{srv.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb2_grpc.DSparkStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as early:
                stub.Generate(request(prompt="too early", max_new_tokens=2))
            assert early.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in early.value.details()
            release.set()
            starting.join(30)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            assert len(stub.Generate(request(prompt="now", max_new_tokens=2, ignore_eos=True)).token_ids) == 2
    finally:
        release.set()
        starting.join(30)
        srv.stop(0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_reconnect_channel(port: int):
    """A channel to a server that is not up yet: gRPC's default reconnect backoff grows to seconds
    after each refused connection, long enough to sleep through a short warmup, so it is capped."""
    return grpc.insecure_channel(f"localhost:{port}", options=[
        ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 100)])


@pytest.mark.slow
def test_binary_sharded_health_reflection_metrics_and_sigterm_drain(tiny_model_dir, target):
    """`python -m serve` on 4 forced host devices with a tensor-parallel mesh: greedy outputs equal
    the single-device library's; health, reflection and metrics answer; SIGTERM lets the running
    request finish, refuses new ones, and exits 0."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from dspark_jax import generate
    from serve.server import pb2, pb2_grpc

    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "serve", "--model", tiny_model_dir, "--drafter", "none", "--slots", "2",
           "--max-len", "128", "--port", str(port), "--host", "localhost", "--metrics-port", str(metrics_port),
           "--mesh", "data=1,tensor=4"]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with fast_reconnect_channel(port) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            stub = pb2_grpc.DSparkStub(channel)
            early = []  # (health, Generate's status) seen while the server compiles

            def serving():
                assert process.poll() is None, process.stdout.read()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    return False  # the port is not open yet
                if status != health_pb2.HealthCheckResponse.SERVING and not early:
                    try:
                        stub.Generate(request(prompt="too early", max_new_tokens=2), timeout=5)
                        early.append((status, "OK"))
                    except grpc.RpcError as err:
                        early.append((status, err.code()))
                return status == health_pb2.HealthCheckResponse.SERVING

            assert wait_until(serving, timeout=300)
            # If the poll caught the warmup (it usually does; a fast machine can compile between two
            # polls), health was NOT_SERVING and a request was refused as UNAVAILABLE. The window is
            # held open and checked for certain in test_warming_up_is_not_serving_and_refuses_requests.
            assert early in ([], [(health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE)])
            info = stub.GetModelInfo(pb2.ModelInfoRequest())
            assert (info.slots, info.max_context, info.policy, list(info.mesh)) == \
                (2, 128, "none", ["data=1", "fsdp=1", "tensor=4"])
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in answer.list_services_response.service}
            assert {"dspark.v1.DSpark", "grpc.health.v1.Health"} <= names

            prompts = ["What is two plus two?", "Write one word."]
            want = generate(target, prompts, max_new_tokens=10, ignore_eos=True)
            for prompt, ids in zip(prompts, want.token_ids):
                assert list(stub.Generate(request(prompt=prompt, max_new_tokens=10, ignore_eos=True)).token_ids) == ids

            metrics = urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=10).read().decode()
            assert 'dspark:request_success_total{finished_reason="length"} 2.0' in metrics
            assert "dspark:time_to_first_token_seconds_count 2.0" in metrics

            stream = stub.GenerateStream(request(prompt="Keep going.", max_new_tokens=80, ignore_eos=True))
            first = next(stream)
            process.send_signal(signal.SIGTERM)
            assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest()).status ==
                              health_pb2.HealthCheckResponse.NOT_SERVING, timeout=30)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(request(prompt="too late", max_new_tokens=4))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
            assert rest[-1].finish_reason == pb2.LENGTH
            assert len(first.token_ids) + sum(len(p.token_ids) for p in rest) == 80
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_binary_stops_at_once_on_sigterm_during_startup(tiny_model_dir):
    """SIGTERM while the server compiles (health NOT_SERVING, nothing accepted) ends it there with
    exit 0, rather than after the warmup: a pod's SIGKILL deadline is seconds, a warmup minutes."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "serve", "--model", tiny_model_dir, "--drafter", "none", "--slots", "4",
           "--max-len", "256", "--port", str(port), "--host", "localhost"]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with fast_reconnect_channel(port) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def compiling():
                assert process.poll() is None, process.stdout.read()
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    return None  # the port is not open yet

            assert wait_until(lambda: compiling() is not None, timeout=300)
            assert compiling() == health_pb2.HealthCheckResponse.NOT_SERVING
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=120) == 0
        log = process.stdout.read()
        assert "stopped during start-up" in log and "SERVING:" not in log, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
