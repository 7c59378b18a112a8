"""``zmqdispatch serve-grpc`` as a process over the embedded mock engine: it
serves, drains on SIGTERM (in-flight streams finish within the grace, then
are aborted on the engine, whose ABORT the mock logs), stops its engine, and
refuses bad flags in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

from .procs import alive, descendants, serve_grpc

MOCK = ("--log-level", "debug", "--mock-step-interval-ms", "5")


def _req(rid, max_tokens, n=1, **sp):
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens, n=n, **sp), stream=True)


def test_serves_n_samples_through_the_mock():
    with serve_grpc(*MOCK) as served, grpc.insecure_channel(served.address) as ch:
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
