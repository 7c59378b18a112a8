"""``zmqdispatch serve-grpc`` as a process over the embedded mock engine: it
serves (under uvloop, its default, and asyncio's own loop), drains on SIGTERM
(in-flight streams finish within the grace, then are aborted on the engine,
whose ABORT the mock logs), stops its engine, and refuses bad flags in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

from .procs import alive, descendants, serve_grpc

MOCK = ("--log-level", "debug", "--mock-step-interval-ms", "5")


def _req(rid, max_tokens, n=1, **sp):
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens, n=n, **sp), stream=True)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_serves_n_samples_through_the_mock(loop):
    with serve_grpc(*MOCK, "--loop", loop) as served, grpc.insecure_channel(served.address) as ch:
        out = list(pbg.VllmEngineStub(ch).Generate(_req("n2", 6, n=2, temperature=1.0)))
        completes = sorted((r.complete for r in out if r.HasField("complete")), key=lambda c: c.index)
        assert [(c.index, len(c.output_ids), c.finish_reason) for c in completes] == [(0, 6, "length"),
                                                                                    (1, 6, "length")]


def test_sigterm_lets_a_short_stream_finish_and_stops_the_engine():
    with serve_grpc(*MOCK, "--drain-grace", "20") as served:
        engine_pids = descendants(served.proc.pid)
        assert engine_pids
        with grpc.insecure_channel(served.address) as ch:
            stub = pbg.VllmEngineStub(ch)
            assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
            # a stream of ~1 s is in flight when SIGTERM comes: it finishes within the grace
            call = stub.Generate(_req("short", 200))
            first = next(call)
            assert first.HasField("chunk")
            served.proc.send_signal(signal.SIGTERM)
            rest = list(call)
            assert rest[-1].complete.finish_reason == "length" and len(rest[-1].complete.output_ids) == 200
        assert served.proc.wait(30) == 0
    assert [p for p in engine_pids if alive(p)] == []


def test_past_the_grace_sigterm_aborts_the_stream_on_the_engine():
    # a stream of 60,000 tokens at 5 ms: five minutes, far past the 30 s the exit is waited for
    with serve_grpc(*MOCK, "--drain-grace", "0.3", "--mock-max-model-len", "65536") as served, \
            grpc.insecure_channel(served.address) as ch:
        stub = pbg.VllmEngineStub(ch)
        call = stub.Generate(_req("long", 60_000))
        assert next(call).HasField("chunk")
        served.proc.send_signal(signal.SIGTERM)
        try:
            for _ in call:
                pass
            raise AssertionError("the stream ended without an error")
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert "long" in served.wait_line("ABORT")
        assert served.proc.wait(30) == 0


def test_a_client_that_goes_away_mid_stream_aborts_it_and_the_server_keeps_serving():
    with serve_grpc(*MOCK) as served:
        with grpc.insecure_channel(served.address) as ch:
            call = pbg.VllmEngineStub(ch).Generate(_req("gone", 3000))
            assert next(call).HasField("chunk")
        # the channel is closed: the connection drops under the stream
        assert "gone" in served.wait_line("ABORT")
        with grpc.insecure_channel(served.address) as ch:
            out = list(pbg.VllmEngineStub(ch).Generate(_req("after", 4)))
            assert out[-1].complete.finish_reason == "length"


def test_bad_flags_are_one_line_and_exit_2(tmp_path):
    for args, needle in ((["--handshake-address", "tcp://127.0.0.1:99999"], "99999"),
                         (["--tokenizer-path", str(tmp_path / "none")], "no such file or folder")):
        p = subprocess.run([sys.executable, "-m", "zmqdispatch", "serve-grpc", *args], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_sigterm_during_the_handshake_exits_143_without_serving(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "serve-grpc", "--port", "0",
                          "--handshake-address", f"ipc://{tmp_path}/hs.sock"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        waiting = threading.Event()

        def watch():
            for line in p.stderr:
                if b"waiting for" in line:  # the wait line: the handshake socket is bound
                    waiting.set()
        threading.Thread(target=watch, daemon=True).start()
        assert waiting.wait(30)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 143
        assert p.stdout.read() == b""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_engines_each_report_their_load_and_both_take_requests():
    with serve_grpc(*MOCK, "--data-parallel-size", "2") as served, grpc.insecure_channel(served.address) as ch:
        stub = pbg.VllmEngineStub(ch)
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.data_parallel_size == 2
        calls = [stub.Generate(_req(f"dp{i}", 400)) for i in range(4)]
        for c in calls:
            assert next(c).HasField("chunk")
        loads = stub.GetLoads(pb.GetLoadsRequest())
        assert [x.dp_rank for x in loads.loads] == [0, 1] and loads.dp_rank_count == 2
        assert sum(x.num_running_reqs for x in loads.loads) == 4 and all(x.num_running_reqs for x in loads.loads)
        for c in calls:
            c.cancel()
        assert stub.GetLoads(pb.GetLoadsRequest(dp_rank=1)).dp_rank_count == 1
        with pytest.raises(grpc.RpcError) as info:
            stub.GetLoads(pb.GetLoadsRequest(dp_rank=2))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("dp_rank: 2 is not an engine") and "ranks 0, 1" in info.value.details()


def test_the_tokenspeed_scheduler_service_over_the_tokenspeed_mock():
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as tpb
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as tgrpc

    with serve_grpc(*MOCK, "--runtime", "tokenspeed", "--eos-token-id", "2") as served, \
            grpc.insecure_channel(served.address) as ch:
        stub = tgrpc.TokenSpeedSchedulerStub(ch)
        assert stub.HealthCheck(tpb.HealthCheckRequest()).healthy
        req = tpb.GenerateRequest(request_id="ts1", tokenized=tpb.TokenizedInput(input_ids=[1, 2, 3]),
                                  sampling_params=tpb.SamplingParams(max_new_tokens=5, ignore_eos=True), stream=True)
        out = list(stub.Generate(req))
        assert {r.request_id for r in out} == {"ts1"}
        assert out[-1].complete.finish_reason == "length" and len(out[-1].complete.output_ids) == 5
        # TokenSpeed's wire has no utility calls: FlushCache says so instead of failing the RPC
        flush = stub.FlushCache(common_pb2.FlushCacheRequest())
        assert not flush.success and "tokenspeed" in flush.message.lower()


def test_a_port_in_use_is_one_line_and_exit_3_before_any_engine_is_awaited(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # no engine will ever dial this address: the bind is checked first
        p = subprocess.run([sys.executable, "-m", "zmqdispatch", "serve-grpc", "--port", str(port),
                            "--handshake-address", f"ipc://{tmp_path}/hs.sock"], capture_output=True, text=True,
                           timeout=60)
    assert p.returncode == 3, p.stderr
    assert f"127.0.0.1:{port}: cannot bind" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_the_sglang_scheduler_service_over_the_sglang_mock():
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgrpc

    with serve_grpc(*MOCK, "--runtime", "sglang") as served, grpc.insecure_channel(served.address) as ch:
        stub = sgrpc.SglangSchedulerStub(ch)
        assert stub.HealthCheck(spb.HealthCheckRequest()).healthy
        req = spb.GenerateRequest(request_id="sg1", tokenized=spb.TokenizedInput(input_ids=[1, 2, 3]),
                                  sampling_params=spb.SamplingParams(max_new_tokens=5, temperature=0.5, n=2),
                                  stream=True)
        out = list(stub.Generate(req))
        completes = [r.complete for r in out if r.HasField("complete")]
        assert {r.request_id for r in out} == {"sg1"} and sorted(c.index for c in completes) == [0, 1]
        assert all(c.finish_reason == "length" and len(c.output_ids) == 5 for c in completes)
        info = stub.GetServerInfo(spb.GetServerInfoRequest())
        assert info.sglang_version.startswith("0.5.21") and info.server_type == "grpc"
        assert stub.GetModelInfo(spb.GetModelInfoRequest()).is_generation
        loads = stub.GetLoads(spb.GetLoadsRequest())
        assert loads.dp_rank_count == 1 and loads.loads[0].token_usage == 0.0
        # the control calls SGLang answers, as CONTROL on the wire
        flush = stub.FlushCache(common_pb2.FlushCacheRequest())
        assert flush.success and "cache flushed" in flush.message
        started = stub.StartProfile(common_pb2.StartProfileRequest(output_dir="/tmp/p", num_steps=2))
        assert started.success and "profiler started" in started.message
        again = stub.StartProfile(common_pb2.StartProfileRequest())
        assert not again.success and "already in progress" in again.message
        assert stub.StopProfile(common_pb2.StopProfileRequest()).success
        bad = spb.GenerateRequest(request_id="bad", tokenized=spb.TokenizedInput(input_ids=[1]), lora_id="x")
        try:
            list(stub.Generate(bad))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_id" in exc.details()
        else:  # pragma: no cover
            raise AssertionError("a lora_id was accepted")


def test_the_embedded_mock_s_vocabulary_is_checked_so_a_bad_id_cannot_kill_it():
    with serve_grpc(*MOCK) as served, grpc.insecure_channel(served.address) as ch:
        stub = pbg.VllmEngineStub(ch)
        bad = pb.GenerateRequest(request_id="big", tokenized=pb.TokenizedInput(input_ids=[1, 40_000]),
                                 sampling_params=pb.SamplingParams(max_tokens=4), stream=True)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "32000" in info.value.details(), info.value.details()
        assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
        out = list(stub.Generate(_req("after", 3)))
        assert out[-1].complete.finish_reason == "length"


def test_the_help_names_the_service_each_runtime_serves(capsys, monkeypatch):
    from zmqdispatch import cli
    from zmqdispatch.mock.server import RUNTIMES
    from zmqdispatch.servicer.server import _service_names

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    overview = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["serve-grpc", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    description = text.split("options:")[0]
    for runtime in RUNTIMES:
        (name,) = _service_names(runtime)
        assert name in description, (runtime, name)  # what the servicer registers, named in the description
        assert name.rsplit(".", 1)[1] in overview


def _fails_unavailable(call, *needles):
    """The rest of a streaming *call* ends in UNAVAILABLE whose details contain each of *needles*."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    for needle in needles:
        assert needle in info.value.details(), info.value.details()
    return info.value.details()


def _wait_not_serving(ch):
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
    try:
        for update in watch:  # SERVING first, then the change (no polling, no sleep)
            if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return
    finally:
        watch.cancel()
    raise AssertionError("the health watch ended while SERVING")


def _the_one_error_line(served):
    errors = [line for line in served.stderr().splitlines() if line.startswith("zmqdispatch: error:")]
    assert len(errors) == 1, served.stderr()
    return errors[0]


def test_a_killed_launched_engine_fails_the_streams_and_exits_4_after_the_grace():
    with serve_grpc(*MOCK, "--engine-lost-grace", "5", "--mock-max-model-len", "65536") as served, \
            grpc.insecure_channel(served.address) as ch:
        (engine,) = [p for p in descendants(served.proc.pid) if os.getpgid(p) == p]  # the engine leads its group
        stub = pbg.VllmEngineStub(ch)
        call = stub.Generate(_req("inflight", 60_000))
        assert next(call).HasField("chunk")
        os.killpg(engine, signal.SIGKILL)  # the engine and its watchdog
        # the link sees a SIGKILLed engine either way: its process exit or its closed connection
        why = _fails_unavailable(call, "engine 0 is dead (")
        reason = re.match(r"EngineDeadError: engine 0 is dead \((process_exit|disconnected)\): ", why)
        assert reason, why
        # within the grace: NOT_SERVING, and a new request is refused naming the engine and why
        _wait_not_serving(ch)
        health = stub.HealthCheck(pb.HealthCheckRequest())
        assert not health.healthy and f"engine 0: dead ({reason[1]})" in health.message, health.message
        _fails_unavailable(stub.Generate(_req("new", 4)), f"engine 0 is dead ({reason[1]})")
        assert served.proc.wait(60) == 4
    line = _the_one_error_line(served)
    assert f"every engine was dead for 5 s and none came back: engine 0: {reason[1]}" in line, line


def test_an_attached_engine_gone_past_liveness_exits_4(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    engine = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", address,
                               "--step-interval-ms", "5"], stdin=subprocess.DEVNULL)
    try:
        with serve_grpc("--handshake-address", address, "--silence-timeout", "1", "--engine-lost-grace", "0.5") \
                as served, grpc.insecure_channel(served.address) as ch:
            call = pbg.VllmEngineStub(ch).Generate(_req("hung", 3000))
            assert next(call).HasField("chunk")
            # a hung engine (started elsewhere): silent with a request in flight, and it never dials again
            os.kill(engine.pid, signal.SIGSTOP)
            _fails_unavailable(call, "engine 0 is dead (silence)")
            assert served.proc.wait(60) == 4
        assert "none came back: engine 0: silence" in _the_one_error_line(served)
        assert engine.poll() is None  # started elsewhere: not stopped by serve-grpc
    finally:
        engine.kill()
        engine.wait()


def test_an_attached_engine_that_comes_back_within_the_grace_is_served_again(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    argv = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", address,
            "--step-interval-ms", "5"]
    first = subprocess.Popen([*argv, "--fault", "exit:5"], stdin=subprocess.DEVNULL)
    second = None
    try:
        with serve_grpc("--handshake-address", address, "--engine-lost-grace", "120") as served, \
                grpc.insecure_channel(served.address) as ch:
            stub = pbg.VllmEngineStub(ch)
            _fails_unavailable(stub.Generate(_req("before", 1000)), "engine 0 is dead")
            assert first.wait(60) == 1
            second = subprocess.Popen(argv, stdin=subprocess.DEVNULL)  # the engine restarted elsewhere
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            for update in watch:
                if update.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            watch.cancel()
            out = list(stub.Generate(_req("after", 4)))
            assert out[-1].complete.finish_reason == "length"
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(60) == 0
        assert "zmqdispatch: error:" not in served.stderr()
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
                p.wait()


def test_the_help_spells_the_exit_status_of_lost_engines(capsys, monkeypatch):
    from zmqdispatch import cli
    from zmqdispatch._cli_common import EXIT_ENGINE_LOST

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main(["serve-grpc", "--help"])
    text = capsys.readouterr().out
    assert f"\n  {EXIT_ENGINE_LOST}    the engines were lost while serving" in text
    assert "--engine-lost-grace S" in text and "(default: 5.0)" in text


@pytest.mark.parametrize(("flags", "warned"), [
    (["--launch", "engine {handshake_address}"], True),
    (["--launch", "engine {handshake_address}", "--vocab-size", "1000"], False),
    ([], False),  # the embedded mock: its vocabulary is known
])
def test_a_vllm_engine_without_a_known_vocabulary_is_warned_about_at_startup(caplog, flags, warned):
    from zmqdispatch import _cli_grpc, cli
    from zmqdispatch.servicer.server import warn_at_startup

    args = cli._build_parser().parse_args(["serve-grpc", *flags])
    with caplog.at_level("WARNING", logger="zmqdispatch.servicer"):
        options, _ = _cli_grpc._options(args)
        warn_at_startup(options)
    said = [r.getMessage() for r in caplog.records if "no vocabulary size" in r.getMessage()]
    assert bool(said) == warned, said
    assert (options.translate.vocab_size is None) == warned
