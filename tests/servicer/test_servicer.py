"""The servicer over the real ``zmqdispatch.aio`` client and a scripted engine
on the wire (``threaded_engine.py``): a client cancel, a deadline, an Abort
each reach the engine as an ABORT; a dead engine is UNAVAILABLE and unhealthy;
n > 1; 1,000 concurrent streams leave nothing open."""

from __future__ import annotations

import asyncio
import os
import queue
import tempfile

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

from zmqdispatch import aio
from zmqdispatch.servicer.facts import ModelFacts
from zmqdispatch.servicer.server import ServeOptions, open_server

from .threaded_engine import ThreadedFakeEngine

GUARD = 60


def _req(rid, max_tokens, n=1, stream=True, **sp):
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens, n=n, **sp), stream=stream)


async def _get(q: queue.Queue, timeout: float = 10.0):
    return await asyncio.get_running_loop().run_in_executor(None, q.get, True, timeout)


def _serve(body, **engine_kw):
    """Run ``body(stub, engine, running, client)`` against a servicer over aio and a threaded FakeEngine."""
    d = tempfile.mkdtemp(prefix="zqg-")
    addr = f"ipc://{d}/hs.sock"

    async def main():
        with ThreadedFakeEngine(addr, **engine_kw) as engine:
            async with aio.connect(addr) as client, \
                    open_server(client, ServeOptions(facts=ModelFacts(served_model_name="m"), drain_grace=1)) as srv, \
                    grpc.aio.insecure_channel(srv.address) as ch:
                await body(pbg.VllmEngineStub(ch), engine, srv, client)
                assert srv.core.open_calls == {}

    try:
        asyncio.run(asyncio.wait_for(main(), GUARD))
    finally:
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


async def _until_closed(srv):
    while srv.core.open_calls:  # the handler's finally runs after the client saw the end
        await asyncio.sleep(0.01)


def test_a_client_cancel_is_an_abort_on_the_wire():
    async def body(stub, engine, srv, client):
        call = stub.Generate(_req("c1", 1000))
        assert (await call.read()).chunk.token_ids == [7]
        call.cancel()
        assert await _get(engine.aborts) == "c1"
        await _until_closed(srv)

    _serve(body)


def test_a_deadline_is_an_abort_on_the_wire():
    async def body(stub, engine, srv, client):
        call = stub.Generate(_req("d1", 1000), timeout=0.5)
        assert (await call.read()).chunk.token_ids == [7]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await _get(engine.aborts) == "d1"
        await _until_closed(srv)

    _serve(body)


def test_abort_by_request_id_is_an_abort_on_the_wire_and_ends_the_stream():
    async def body(stub, engine, srv, client):
        call = stub.Generate(_req("a1", 1000))
        assert (await call.read()).chunk.token_ids == [7]
        await stub.Abort(pb.AbortRequest(request_ids=["a1"]))
        last = await call.read()
        assert (last.complete.finish_reason, list(last.complete.output_ids)) == ("abort", [7])
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        assert await _get(engine.aborts) == "a1"

    _serve(body)


def test_n_samples_stream_interleaved_and_complete_each():
    async def body(stub, engine, srv, client):
        out = [r async for r in stub.Generate(_req("s", 3, n=2, temperature=1.0))]
        completes = sorted((r.complete for r in out if r.HasField("complete")), key=lambda c: c.index)
        assert [(c.index, list(c.output_ids)) for c in completes] == [(0, [7, 7, 7]), (1, [7, 7, 7])]
        assert sorted([engine.adds.get_nowait(), engine.adds.get_nowait()]) == ["s-0", "s-1"]
        out = [r async for r in stub.Generate(_req("ns", 2, stream=False))]
        assert [r.WhichOneof("response") for r in out] == ["complete"]

    _serve(body)


def test_a_dead_engine_is_unavailable_and_unhealthy():
    async def body(stub, engine, srv, client):
        call = stub.Generate(_req("x", 1000))
        await call.read()
        engine.die()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        health = await stub.HealthCheck(pb.HealthCheckRequest())
        assert not health.healthy
        with pytest.raises(grpc.aio.AioRpcError) as again:
            async for _ in stub.Generate(_req("y", 2)):
                pass
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        await _until_closed(srv)

    _serve(body)


def test_a_thousand_concurrent_streams_all_complete_and_leave_nothing_open():
    async def body(stub, engine, srv, client):
        async def one(i):
            out = [r async for r in stub.Generate(_req(f"k{i}", 3))]
            return list(out[-1].complete.output_ids)

        results = await asyncio.gather(*(one(i) for i in range(1000)))
        assert results == [[7, 7, 7]] * 1000
        await _until_closed(srv)
        assert all(s.in_flight == 0 for s in client.stats().values())
        # and a stream that leaves early among many: still served after
        assert [r async for r in stub.Generate(_req("after", 1))][-1].complete.finish_reason == "length"

    _serve(body)


def test_cancelling_n_samples_aborts_every_sample_on_the_wire():
    async def body(stub, engine, srv, client):
        call = stub.Generate(_req("m", 1000, n=2, temperature=1.0))
        await call.read()
        await call.read()  # both samples have their first token
        call.cancel()
        assert sorted([await _get(engine.aborts), await _get(engine.aborts)]) == ["m-0", "m-1"]
        await _until_closed(srv)

    _serve(body)
