"""The client against the TokenSpeed mock engine, over real ipc sockets: runtime
dispatch, streams, fan-out, aborts and the engine's quirks end to end."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from zmqdispatch import connect
from zmqdispatch.errors import (
    EngineAbortedRequest,
    EngineDeadError,
    EngineHandshakeError,
    RequestRejected,
    RuntimeMismatchError,
    UnsupportedByRuntimeError,
)
from zmqdispatch.config import ClientConfig
from zmqdispatch.mock.core import mock_token
from zmqdispatch.mock.server import MockEngineConfig, serve_mock_ranks
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.translate.tokenspeed import TranslationConfig, pb, translate_parallel, translate_request
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, make_ts_request, tokenspeed_pair


async def collect(stream) -> list:
    out = []
    async with stream:
        async for delta in stream:
            out.append(delta)
    return out


async def test_runtime_and_ready_response_come_from_the_engine():
    async with tokenspeed_pair(max_model_len=512) as (engine, client):
        assert client.runtime is Runtime.TOKENSPEED
        assert client.ready.vllm_version.startswith("tokenspeed-")
        assert client.ready.block_size == 16  # TokenSpeed's prefix_granularity
        assert client.max_model_len == 512
        assert client.load is None  # nothing piggybacked yet
    async with fake_pair() as (_, client):
        assert client.runtime is Runtime.VLLM and client.load is None


async def test_generate_streams_tokens_and_keeps_the_load_snapshot():
    async with tokenspeed_pair() as (engine, client):
        deltas = await collect(client.generate(make_ts_request("t1", max_new_tokens=5)))
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == 5 and deltas[-1].finish_reason is wire.FinishReason.LENGTH
        assert deltas[0].num_prompt_tokens == 3
        # greedy: TokenSpeed pins seed 0, so the mock's tokens are fixed
        h = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
        assert tokens == [mock_token(h, i, 0, 32_000) for i in range(5)]
        assert client.load is not None and client.load.kv_total_pages > 0
        assert client.protocol.inflight == 0 and not engine.core.running


async def test_a_vllm_request_is_refused_by_a_tokenspeed_client_and_vice_versa():
    async with tokenspeed_pair() as (engine, client):
        with pytest.raises(RuntimeMismatchError):
            client.generate(make_request("v1"))
        with pytest.raises(RuntimeMismatchError):
            async with client.generate_samples([make_request("v1")]):
                pass
        assert engine.core.requests_received == 0
    async with fake_pair() as (_, client):
        with pytest.raises(RuntimeMismatchError):
            client.generate(make_ts_request("t1"))


async def test_requiring_the_other_runtime_fails_the_handshake(tmp_path):
    from zmqdispatch.mock.server import MockEngineConfig, start_mock_engine

    addr = f"ipc://{tmp_path}/hs.sock"
    client_done = trio.Event()
    async with trio.open_nursery() as nursery:

        async def engine_side() -> None:
            engine = await start_mock_engine(MockEngineConfig(handshake_address=addr, runtime="tokenspeed"),
                                             in_process=True)
            # keep the sockets until the client decided: closing them at once
            # (linger 0) could drop the ready response before it is delivered
            await client_done.wait()
            engine.socks.close()

        nursery.start_soon(engine_side)
        try:
            with trio.fail_after(30), pytest.raises(EngineHandshakeError, match="expected a vLLM EngineCore"):
                async with connect(addr, runtime="vllm"):
                    pass
        finally:
            client_done.set()


async def test_utility_calls_are_unsupported():
    async with tokenspeed_pair() as (_, client):
        with pytest.raises(UnsupportedByRuntimeError):
            await client.call_utility("is_sleeping")


async def test_refused_request_is_a_typed_error_not_a_completion():
    # An engine started without --enable-output-logprobs aborts logprob requests at
    # admission; the client cannot know the flag, so the engine's silent "abort" arrives.
    async with tokenspeed_pair(engine_kw={"enable_output_logprobs": False}) as (engine, client):
        with pytest.raises(EngineAbortedRequest, match="refused the request at admission") as ei:
            await collect(client.generate(make_ts_request("t1", return_logprob=True)))
        assert ei.value.tokens_before_abort == 0
        assert "--enable-output-logprobs" in engine.core.refused["t1"]
        assert client.protocol.inflight == 0
        # the link is fine
        deltas = await collect(client.generate(make_ts_request("t2", max_new_tokens=2)))
        assert deltas[-1].finish_reason is wire.FinishReason.LENGTH


async def test_invalid_values_never_reach_the_engine():
    async with tokenspeed_pair() as (engine, client):
        with pytest.raises(RequestRejected) as ei:
            client.generate(make_ts_request("t1", temperature=1.0, top_k=200))
        assert ei.value.field == "sampling_params.top_k"
        assert engine.core.requests_received == 0


async def test_leaving_a_stream_early_aborts_it_and_no_terminal_frame_is_awaited():
    async with tokenspeed_pair() as (engine, client):
        async with client.generate(make_ts_request("t1", max_new_tokens=10_000)) as stream:
            first = await stream.receive()
            assert first.token_ids
        # TokenSpeed sends nothing after a client ABORT: the stream is retired locally
        assert client.protocol.inflight == 0
        with trio.fail_after(5):
            while engine.core.running:
                await trio.sleep(0.01)
        assert "t1" in engine.core.aborts_received


async def test_cancelling_a_reader_aborts_on_the_engine():
    async with tokenspeed_pair() as (engine, client):
        with trio.move_on_after(0.05):
            await collect(client.generate(make_ts_request("t1", max_new_tokens=100_000)))
        assert client.protocol.inflight == 0
        with trio.fail_after(5):
            while engine.core.running:
                await trio.sleep(0.01)


async def test_fan_out_runs_end_to_end_and_responses_are_the_tokenspeed_package():
    async with tokenspeed_pair() as (engine, client):
        req = pb.GenerateRequest(request_id="p", tokenized=pb.TokenizedInput(input_ids=[5, 6]), stream=True)
        req.sampling_params.n = 3
        req.sampling_params.temperature = 0.8
        req.sampling_params.max_new_tokens = 4
        req.sampling_params.sampling_seed = 11
        samples = translate_parallel(req, TranslationConfig(max_model_len=client.max_model_len))
        builders = [t.response_builder() for t in samples]
        responses: list[pb.GenerateResponse] = []
        async with client.generate_samples([t.request for t in samples]) as merged:
            async for index, delta in merged:
                responses += builders[index].feed(delta)
        completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
        assert sorted(completes) == [0, 1, 2]
        assert all(r.request_id == "p" for r in responses)
        h = ((5 * 31) + 6) & 0xFFFFFFFF
        for i, c in completes.items():  # child i was seeded 11 + i
            assert list(c.output_ids) == [mock_token(h, k, 11 + i, 32_000) for k in range(4)]
            assert c.finish_reason == "length"
        assert client.protocol.inflight == 0 and not engine.core.running


async def test_leaving_a_fan_out_early_aborts_every_sample_in_one_abort():
    async with tokenspeed_pair() as (engine, client):
        reqs = [make_ts_request(f"p-{i}", max_new_tokens=100_000, temperature=0.9, seed=i) for i in range(4)]
        async with client.generate_samples(reqs) as merged:
            async for _index, _delta in merged:
                break
        assert client.protocol.inflight == 0
        with trio.fail_after(5):
            while engine.core.running:
                await trio.sleep(0.01)
        assert sorted(engine.core.aborts_received) == ["p-0", "p-1", "p-2", "p-3"]


async def test_stop_token_is_in_the_output_and_the_builder_reports_it():
    async with tokenspeed_pair() as (engine, client):
        h = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
        third = mock_token(h, 2, 0, 32_000)
        req = pb.GenerateRequest(request_id="s", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), stream=True)
        req.sampling_params.temperature = 0.0
        req.sampling_params.stop_token_ids.append(third)
        (t,) = translate_parallel(req, TranslationConfig(max_model_len=client.max_model_len))
        builder = t.response_builder()
        out = []
        deltas = await collect(client.generate(t.request))
        assert deltas[-1].token_ids[-1] == third  # the engine includes it
        for delta in deltas:
            out += builder.feed(delta)
        c = out[-1].complete
        assert c.finish_reason == "stop" and c.matched_token_id == third
        assert list(c.output_ids) == [mock_token(h, k, 0, 32_000) for k in range(2)]
        assert c.completion_tokens == 3


async def test_non_streaming_requests_still_get_every_token(mock_clock):
    async with tokenspeed_pair() as (engine, client):
        deltas = await collect(client.generate(make_ts_request("t1", stream=False, max_new_tokens=120)))
        assert sum(len(d.token_ids) for d in deltas) == 120
        assert deltas[-1].finish_reason is wire.FinishReason.LENGTH


async def test_engine_sentinel_fails_every_stream():
    async with tokenspeed_pair(engine_kw={"faults": (("sentinel", 3),)}) as (engine, client):
        with pytest.raises(EngineDeadError) as ei:
            await collect(client.generate(make_ts_request("t1", max_new_tokens=10_000)))
        assert ei.value.reason == "sentinel"


async def test_the_mock_drops_malformed_input_and_keeps_serving():
    # TokenSpeed logs and drops what does not decode (no reply): a client must never
    # send such a frame, and the mock must not die on one either.
    from zmqdispatch.protocol.engine import Outgoing

    async with tokenspeed_pair() as (engine, client):
        p = client.protocol
        for frames in ([b"\x00", b"\xc1junk"], [b"\x07", b"\x90"], [b"\x00"]):
            p._outbox.append(Outgoing([p.identity, *frames]))
        p._wake_sender()
        deltas = await collect(client.generate(make_ts_request("ok", max_new_tokens=2)))
        assert deltas[-1].finish_reason is wire.FinishReason.LENGTH
        assert engine.dropped == 3 and engine.core.requests_received == 1


async def test_two_ranks_are_two_engines_and_a_pin_places_on_its_rank(tmp_path):
    addr = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=addr, runtime="tokenspeed", data_parallel_size_local=2,
                           data_parallel_size=2, step_interval=0.001)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_mock_ranks(cfg, in_process=True))
            async with connect(addr, runtime="tokenspeed", config=ClientConfig(handshake_timeout=30)) as client:
                await client.wait_for_engines(2)
                for k in range(4):
                    req = pb.GenerateRequest(request_id=f"pinned-{k}", tokenized=pb.TokenizedInput(input_ids=[4, 5]),
                                             data_parallel_rank=1)
                    req.sampling_params.max_new_tokens = 3
                    t = translate_request(req, TranslationConfig(max_model_len=client.max_model_len))
                    assert t.request.data_parallel_rank == 1
                    async with client.generate(t.request) as stream:
                        got = [tok async for d in stream for tok in d.token_ids]
                    assert len(got) == 3
                assert client.engine(1).stats().requests == 4 and client.engine(0).stats().requests == 0
                req = pb.GenerateRequest(request_id="nowhere", tokenized=pb.TokenizedInput(input_ids=[4, 5]),
                                         data_parallel_rank=7)
                t = translate_request(req, TranslationConfig(max_model_len=client.max_model_len))
                with pytest.raises(RequestRejected, match="data_parallel_rank: 7 is not an engine") as ei:
                    async with client.generate(t.request):
                        pass  # pragma: no cover
                assert ei.value.field == "data_parallel_rank"
            nursery.cancel_scope.cancel()
