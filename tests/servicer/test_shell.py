"""The grpc.aio shell's own rules, over a pure-asyncio stand-in client
(``fake_client.py``): what each RPC answers, Abort's completes, health, the
tokenizer stream, a malformed request. The same shell over the real
``zmqdispatch.aio`` client and an engine: ``test_servicer.py``."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as tpb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as tgrpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

from zmqdispatch.servicer.facts import ModelFacts
from zmqdispatch.servicer.generate import TranslateOptions
from zmqdispatch.servicer.server import ServeOptions, open_server
from zmqdispatch.servicer.tokenizer_zip import build_bundle

from .fake_client import FakeAioClient


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _req(rid="r", n=1, max_tokens=4, stream=True, **sp):
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                              sampling_params=pb.SamplingParams(n=n, max_tokens=max_tokens, **sp), stream=stream)


def _options(**kw):
    kw.setdefault("facts", ModelFacts(served_model_name="tiny", vocab_size=1024))
    kw.setdefault("drain_grace", 0.5)
    return ServeOptions(**kw)


def test_metadata_rpcs_and_unimplemented_ones():
    async def main():
        client = FakeAioClient()
        async with open_server(client, _options()) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = pbg.VllmEngineStub(ch)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.served_model_name, info.max_context_length, info.vocab_size) == ("tiny", 256, 1024)
            server = await stub.GetServerInfo(pb.GetServerInfoRequest())
            assert server.server_type == "vllm-grpc" and server.data_parallel_size == 1
            flush = await stub.FlushCache(common_pb2.FlushCacheRequest())
            assert flush.success and client.calls[-1][0] == "reset_prefix_cache"
            prof = await stub.StartProfile(common_pb2.StartProfileRequest(num_steps=3))
            assert prof.success and client.calls[-1] == ("profile", (True,), {"max_iterations": 3})
            prof = await stub.StartProfile(common_pb2.StartProfileRequest(output_dir="/tmp/x"))
            assert not prof.success and "output_dir" in prof.message
            for call in (stub.Embed(pb.EmbedRequest()),):
                with pytest.raises(grpc.aio.AioRpcError) as info_:
                    await call
                assert info_.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as kv:
                async for _ in stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()):
                    pass
            assert kv.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as tok:
                async for _ in stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
                    pass
            assert tok.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    _run(main())


def test_the_tokenizer_streams_as_a_zip_with_its_digest(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"x" * (1300 * 1024))  # three chunks
    bundle = build_bundle(str(tmp_path))

    async def main():
        async with open_server(FakeAioClient(), _options(bundle=bundle)) as srv, \
                grpc.aio.insecure_channel(srv.address) as ch:
            chunks = [c async for c in pbg.VllmEngineStub(ch).GetTokenizer(common_pb2.GetTokenizerRequest())]
        data = b"".join(c.data for c in chunks)
        assert len(chunks) >= 1 and [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
        assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            assert zf.read("tokenizer.json") == b"x" * (1300 * 1024)

    _run(main())


def test_a_refused_field_is_invalid_argument_and_the_server_keeps_serving():
    async def main():
        client = FakeAioClient()
        async with open_server(client, _options()) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = pbg.VllmEngineStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(_req(logprobs=50)):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("sampling_params.logprobs")
            # bytes that are no GenerateRequest: grpc refuses them; the next request is served
            raw = ch.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in raw(b"\xff\xff\xff"):
                    pass
            out = [r async for r in stub.Generate(_req())]
            assert out[-1].complete.finish_reason == "length"
            assert srv.core.open_calls == {}

    _run(main())


def test_abort_ends_every_open_sample_with_an_abort_complete():
    async def main():
        gate = asyncio.Event()
        client = FakeAioClient(tokens=100, gate=gate)
        async with open_server(client, _options()) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = pbg.VllmEngineStub(ch)
            call = stub.Generate(_req("a", max_tokens=100))
            while "a" not in srv.core.open_calls:
                await asyncio.sleep(0.01)
            await stub.Abort(pb.AbortRequest(request_ids=["a", "unknown"]))
            out = [r async for r in call]
            assert [r.complete.finish_reason for r in out] == ["abort"]
            assert client.ended == {"a": "left early"}
            assert await call.code() == grpc.StatusCode.OK
            assert srv.core.open_calls == {}

    _run(main())


def test_health_turns_false_once_the_engine_is_dead():
    async def main():
        client = FakeAioClient()
        async with open_server(client, _options()) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = pbg.VllmEngineStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            client.is_alive = False
            client.dead.set()
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            got = await stub.HealthCheck(pb.HealthCheckRequest())
            assert not got.healthy and "engine 0: dead (process_exit)" in got.message

    _run(main())


def test_the_engine_watch_returns_once_every_engine_stayed_dead_for_the_grace():
    from zmqdispatch.errors import EngineDeadError
    from zmqdispatch.servicer.server import engines_lost, watch_engines

    async def main():
        client = FakeAioClient()
        client.the_engine.death = EngineDeadError("engine process 7 exited with code 1", engine_index=0,
                                                  reason="process_exit")
        watch = asyncio.create_task(watch_engines(client, 0.5))

        def die():
            client.is_alive = False
            client.up.clear()
            client.dead.set()

        die()
        await client.waiting_up.wait()  # dead: the grace runs
        assert engines_lost(client) == "engine 0: process_exit: engine process 7 exited with code 1"
        client.waiting_up.clear()
        client.waiting_dead.clear()
        client.dead.clear()
        client.is_alive = True
        client.up.set()  # back within the grace (restarted elsewhere): watched again, not lost
        await asyncio.wait_for(client.waiting_dead.wait(), 30)
        assert engines_lost(client) is None and not watch.done()
        die()  # dead again, for good this time
        assert await asyncio.wait_for(watch, 30) == "engine 0: process_exit: engine process 7 exited with code 1"

    _run(main())


def test_tokenspeed_abort_says_whether_a_stream_was_open():
    async def main():
        gate = asyncio.Event()
        client = FakeAioClient(tokens=100, gate=gate)
        opts = _options(translate=TranslateOptions(runtime="tokenspeed"))
        async with open_server(client, opts) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = tgrpc.TokenSpeedSchedulerStub(ch)
            req = tpb.GenerateRequest(request_id="t", tokenized=tpb.TokenizedInput(input_ids=[1, 2]),
                                      sampling_params=tpb.SamplingParams(max_new_tokens=100), stream=True)
            call = stub.Generate(req)
            while "t" not in srv.core.open_calls:
                await asyncio.sleep(0.01)
            assert not (await stub.Abort(tpb.AbortRequest(request_id="other"))).success
            assert (await stub.Abort(tpb.AbortRequest(request_id="t"))).success
            out = [r async for r in call]
            assert [(r.request_id, r.complete.finish_reason) for r in out] == [("t", "abort")]
            info = await stub.GetModelInfo(tpb.GetModelInfoRequest())
            assert info.served_model_name == "tiny"

    _run(main())


def test_reflection_lists_the_services():
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        async with open_server(FakeAioClient(), _options()) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = stub.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            resp = await call.read()
            await call.done_writing()
            names = {s.name for s in resp.list_services_response.service}
            assert {"vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health"} <= names
            call.cancel()

    _run(main())
