"""The client against the mock SGLang scheduler (``open_mock_engine_pair(runtime="sglang")``):
the handshake and its layout check, generate, finish reasons and the named stop (token
or string, matched by the scheduler),
logprobs with ranked candidates, n > 1, aborts on the wire (and by rid prefix), the
engine's refusals, data parallel ranks, and the control calls SGLang answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from zmqdispatch import ClientConfig, connect
from zmqdispatch.errors import (
    EngineAbortedRequest,
    EngineHandshakeError,
    RequestRejected,
    RuntimeMismatchError,
    UnsupportedByRuntimeError,
    UtilityCallError,
)
from zmqdispatch.mock.core import mock_text, mock_token
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.testing import open_mock_engine_pair
from zmqdispatch.testing.dial import dial, ready_response
from zmqdispatch.translate import sglang as tr
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import vllm as wire

from ..helpers import GUARD, make_ts_request

pb = tr.pb


def sgl(rid: str = "r1", prompt: tuple[int, ...] = (1, 2, 3), *, stream: bool = True, return_logprob: bool = False,
        top_logprobs_num: int = 0, **sp: Any) -> sg.TokenizedGenerateReqInput:
    sp.setdefault("max_new_tokens", 16)
    return sg.TokenizedGenerateReqInput(rid=rid, input_ids=prompt, sampling_params=sg.SGLangSamplingParams(**sp),
                                        stream=stream, return_logprob=return_logprob,
                                        top_logprobs_num=top_logprobs_num)


def pair(**kw: Any) -> Any:
    return open_mock_engine_pair(runtime="sglang", handshake_timeout=GUARD, **kw)


async def collect(stream: Any) -> list[Any]:
    async with stream as s:
        return [d async for d in s]


async def until(cond: Any) -> None:
    with trio.fail_after(5):
        while not cond():
            await trio.sleep(0.01)


async def test_generate_streams_to_length_and_the_runtime_is_told_by_its_version() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            assert client.runtime is Runtime.SGLANG
            assert client.engine().engine_version.engine_name.startswith("SGLang 0.5.21")
            deltas = await collect(client.generate(sgl("r1")))
            h = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
            assert [t for d in deltas for t in d.token_ids] == [mock_token(h, k, 0, 32_000) for k in range(16)]
            assert deltas[-1].finish_reason is wire.FinishReason.LENGTH and deltas[-1].stop_reason is None
            assert deltas[0].num_prompt_tokens == 3
            assert engine.core.requests_received == 1 and client.protocol.inflight == 0


async def test_a_stop_token_finishes_with_stop_and_is_named() -> None:
    h = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
    eos = mock_token(h, 3, 0, 32_000)
    with trio.fail_after(GUARD):
        async with pair(engine_kw={"eos_token_ids": (eos,)}) as (_engine, client):
            deltas = await collect(client.generate(sgl("r1")))
            assert deltas[-1].finish_reason is wire.FinishReason.STOP and deltas[-1].stop_reason == eos
            assert [t for d in deltas for t in d.token_ids][-1] == eos
            stop_id = mock_token(h, 1, 0, 32_000)
            deltas = await collect(client.generate(sgl("r2", stop_token_ids=(stop_id,), ignore_eos=False)))
            assert deltas[-1].stop_reason == stop_id and sum(len(d.token_ids) for d in deltas) == 2
            deltas = await collect(client.generate(sgl("r3", ignore_eos=True)))
            assert deltas[-1].finish_reason is wire.FinishReason.LENGTH


async def test_logprobs_carry_the_sampled_token_then_its_ranked_candidates() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (_engine, client):
            deltas = await collect(client.generate(sgl("lp", return_logprob=True, top_logprobs_num=3,
                                                       max_new_tokens=4)))
            rows_ids = [row for d in deltas for row in d.logprobs.token_ids]
            rows_lp = [row for d in deltas for row in d.logprobs.logprobs]
            tokens = [t for d in deltas for t in d.token_ids]
            assert len(rows_ids) == 4 and all(len(r) == 4 for r in rows_ids)
            assert [r[0] for r in rows_ids] == tokens and [r[1] for r in rows_ids] == tokens
            assert all(r[1] > r[2] > r[3] for r in rows_lp)


async def test_n_samples_fan_out_and_the_responses_are_the_sglang_package() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            req = pb.GenerateRequest(request_id="p", tokenized=pb.TokenizedInput(input_ids=[5, 6]), stream=True)
            req.sampling_params.n = 3
            req.sampling_params.temperature = 0.8
            req.sampling_params.max_new_tokens = 4
            samples = tr.translate_parallel(req, tr.TranslationConfig(max_model_len=client.max_model_len))
            builders = [t.response_builder() for t in samples]
            responses: list[Any] = []
            async with client.generate_samples([t.request for t in samples]) as merged:
                async for index, delta in merged:
                    responses += builders[index].feed(delta)
            completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
            assert sorted(completes) == [0, 1, 2] and all(r.request_id == "p" for r in responses)
            assert all(c.finish_reason == "length" and len(c.output_ids) == 4 for c in completes.values())
            assert engine.core.requests_received == 3 and client.protocol.inflight == 0


async def test_leaving_a_stream_early_sends_an_abort_on_the_wire() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            async with client.generate(sgl("r1", max_new_tokens=100_000)) as stream:
                assert (await stream.receive()).token_ids
            assert client.protocol.inflight == 0
            await until(lambda: not engine.core.running)
            assert list(engine.core.aborts_received) == ["r1"]
            with trio.move_on_after(0.05):
                await collect(client.generate(sgl("r2", max_new_tokens=100_000)))
            await until(lambda: not engine.core.running)
            assert "r2" in engine.core.aborts_received


async def test_an_abort_stops_only_its_request_though_the_scheduler_aborts_by_prefix() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            async with client.generate(sgl("r-1", max_new_tokens=100_000)) as stream:
                await stream.receive()
                async with client.generate(sgl("r-10", max_new_tokens=40)) as other:
                    assert client.protocol.wire_id("r-10") == "~1~r-10"
                    await other.receive()
                    await stream.aclose()  # the ABORT of "r-1" goes out; the mock stops every rid it prefixes
                    await until(lambda: "r-1" not in engine.core.running)
                    rest = [d async for d in other]
            assert rest[-1].finish_reason is not None and rest[-1].finish_reason.wire_name == "length"
            assert list(engine.core.aborts_received) == ["r-1"]


async def test_the_schedulers_refusal_fails_the_stream_with_its_reason() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            # the client's own check refuses it first, nothing sent
            with pytest.raises(RequestRejected) as info:
                client.generate(sgl("bad", top_p=0.0))
            assert info.value.field == "sampling_params.top_p" and engine.core.requests_received == 0
            # one the client cannot check (the mock's vocabulary is smaller than the client knows)
            core = engine.core
            core.vocab_size = 10
            with pytest.raises(EngineAbortedRequest, match=r"refused the request: sampling_params.logit_bias.*400"):
                await collect(client.generate(sgl("lb", logit_bias={"50": 1.0})))
            assert client.protocol.inflight == 0


async def test_requests_of_another_runtime_are_refused_by_name() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (_engine, client):
            with pytest.raises(RuntimeMismatchError, match="built for the TokenSpeed scheduler"):
                client.generate(make_ts_request("t1"))


async def test_control_calls_flush_cache_and_profile() -> None:
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            assert await client.flush_cache() == ""
            assert await client.start_profile(output_dir="/tmp/prof", num_steps=5) == ""
            with pytest.raises(UtilityCallError, match="already in progress"):
                await client.start_profile()
            assert await client.stop_profile() == ""
            methods = [(m, a) for _c, m, a in engine.core.control_calls]
            assert methods[0] == ("flush_cache", [0.0])
            assert methods[1] == ("start_profile", [{"output_dir": "/tmp/prof", "num_steps": 5}])
            async with client.generate(sgl("busy", max_new_tokens=100_000)) as stream:
                await stream.receive()
                with pytest.raises(UtilityCallError, match="requests are running"):
                    await client.flush_cache()
            with pytest.raises(UnsupportedByRuntimeError, match="its control calls: flush_cache"):
                await client.sleep()
            with pytest.raises(UtilityCallError, match="unknown control method"):
                await client.call_utility("no_such_method")


async def test_a_scheduler_with_another_layout_is_refused_naming_the_field(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/hs.sock"
    layouts = sg_engine.ready_layouts(sampling=(*sg.SAMPLING_LAYOUT[:26], "watermark", *sg.SAMPLING_LAYOUT[26:]))
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            socks: list[Any] = []

            async def engine() -> None:
                socks.append(await dial(addr, ready_response(runtime="sglang", positional_layouts=layouts),
                                        sglang=True))

            nursery.start_soon(engine)
            with pytest.raises(EngineHandshakeError, match=r"SamplingParams field 26 differs.*'watermark'"):
                async with connect(addr, runtime="sglang",
                                   config=ClientConfig(handshake_timeout=5, allow_unknown_engine_version=True)):
                    pass  # pragma: no cover
        for s in socks:
            s.close()


async def test_asking_for_sglang_gets_a_clear_error_from_a_vllm_engine(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            socks: list[Any] = []

            async def engine() -> None:
                socks.append(await dial(addr, ready_response()))

            nursery.start_soon(engine)
            with pytest.raises(EngineHandshakeError, match=r"expected a SGLang scheduler.*vLLM EngineCore"):
                async with connect(addr, runtime="sglang", config=ClientConfig(handshake_timeout=5)):
                    pass  # pragma: no cover
        for s in socks:
            s.close()


async def test_two_scheduler_ranks_are_two_engines_and_a_pin_places_on_its_rank(tmp_path: Path) -> None:
    from zmqdispatch.mock.server import MockEngineConfig, serve_mock_ranks

    addr = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=addr, runtime="sglang", data_parallel_size_local=2,
                           data_parallel_size=2, step_interval=0.001)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_mock_ranks(cfg, in_process=True))
            async with connect(addr, runtime="sglang", config=ClientConfig(handshake_timeout=GUARD)) as client:
                await client.wait_for_engines(2)
                assert sorted(client.engines) == [0, 1]
                assert client.engine(1).ready.data_parallel_rank == 1 and client.engine(1).engine_index == 1
                req = pb.GenerateRequest(request_id="pinned", tokenized=pb.TokenizedInput(input_ids=[4, 5]),
                                         data_parallel_rank=1)
                req.sampling_params.max_new_tokens = 3
                t = tr.translate_request(req, tr.TranslationConfig(max_model_len=client.max_model_len))
                assert t.request.data_parallel_rank == 1 and t.request.routed_dp_rank is None
                deltas = await collect(client.generate(t.request))
                assert sum(len(d.token_ids) for d in deltas) == 3
                assert client.engine(1).stats().requests == 1 and client.engine(0).stats().requests == 0
                load = client.engine(1).load
                assert load is not None and load.engine_index == 1 and load.kv_total_tokens > 0
            nursery.cancel_scope.cancel()


# ----------------------------------------------------------------- stop strings (matched by the scheduler)

H123 = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
TOKENS = [mock_token(H123, k, 0, 32_000) for k in range(16)]  # what the mock generates for prompt (1, 2, 3)
TEXT = mock_text(TOKENS)  # the mock's detokenizer: one letter per token


def first_stop(stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(tokens kept, stop) as SGLang's check reports it: after each token, the first stop
    in request order found in the text of the last longest-stop + 1 tokens."""
    window = max(len(s) for s in stops) + 1
    for end in range(1, len(TEXT) + 1):
        tail = TEXT[max(0, end - window):end]
        for s in stops:
            if s in tail:
                return end, s
    return None


async def test_a_stop_string_across_tokens_finishes_with_stop_and_names_the_string() -> None:
    stop = TEXT[4:7]  # completed by the 7th token at the latest
    kept, matched = first_stop((stop,)) or (0, "")
    assert matched == stop and kept <= 7
    with trio.fail_after(GUARD):
        async with pair() as (engine, client):
            for stream in (True, False):
                rid = f"s-{stream}"
                deltas = await collect(client.generate(sgl(rid, stream=stream, stop=(stop,))))
                assert [t for d in deltas for t in d.token_ids] == TOKENS[:kept]  # the completing token kept
                assert deltas[-1].finish_reason is wire.FinishReason.STOP and deltas[-1].stop_reason == stop
            assert not engine.core.running and client.protocol.inflight == 0


async def test_the_first_stop_in_request_order_wins_not_the_earliest_ending() -> None:
    a, b = TEXT[5:8], TEXT[6:8]  # both complete with the same token (or b earlier)
    with trio.fail_after(GUARD):
        async with pair() as (_engine, client):
            for stops in ((a, b), (b, a)):
                kept, matched = first_stop(stops) or (0, "")
                deltas = await collect(client.generate(sgl("o", stop=stops)))
                assert deltas[-1].stop_reason == matched and sum(len(d.token_ids) for d in deltas) == kept
            # a lone string is one stop (SGLang's stop_strs), and an absent one runs to length
            deltas = await collect(client.generate(sgl("one", stop=TEXT[2:4])))
            assert deltas[-1].stop_reason == TEXT[2:4]
            missing = "z" * 17  # longer than the whole output: never in it
            deltas = await collect(client.generate(sgl("none", stop=(missing,))))
            assert deltas[-1].finish_reason is wire.FinishReason.LENGTH and deltas[-1].stop_reason is None


async def test_stop_strings_ignore_ignore_eos_and_min_new_tokens_and_a_token_stop_wins_on_its_token() -> None:
    stop = TEXT[1:3]
    kept, _ = first_stop((stop,)) or (0, "")
    with trio.fail_after(GUARD):
        async with pair(engine_kw={"eos_token_ids": (TOKENS[kept - 1],)}) as (_engine, client):
            # ignore_eos: the EOS on that token does not count, the string does
            deltas = await collect(client.generate(sgl("ie", stop=(stop,), ignore_eos=True, min_new_tokens=10)))
            assert deltas[-1].stop_reason == stop and sum(len(d.token_ids) for d in deltas) == kept
            # EOS on the token that completes the string: SGLang's token check runs first
            deltas = await collect(client.generate(sgl("eos", stop=(stop,))))
            assert deltas[-1].stop_reason == TOKENS[kept - 1] and sum(len(d.token_ids) for d in deltas) == kept
