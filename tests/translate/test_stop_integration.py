"""Stop strings end to end: translation (never on the wire), ResponseBuilder
(trim, finish "stop", matched_stop_str), and the engine request aborted once
a stop matched before the engine finished."""

from __future__ import annotations

import pytest
import trio

from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine

from .test_stops import IDS, TOK

A, B, C, AB, NL, NLNL, STOP = IDS[b"a"], IDS[b"b"], IDS[b"c"], IDS[b"ab"], IDS[b"\n"], IDS[b"\n\n"], IDS[b"STOP"]
ST, OP = IDS[b"ST"], IDS[b"OP"]


def greq(**sp) -> pb.GenerateRequest:
    sp.setdefault("max_tokens", 20)
    sp.setdefault("skip_special_tokens", True)
    sp.setdefault("spaces_between_special_tokens", True)
    return pb.GenerateRequest(request_id="s1", tokenized=pb.TokenizedInput(input_ids=[A, B]),
                              sampling_params=pb.SamplingParams(**sp), stream=True)


def translate(**sp):
    return translate_request(greq(**sp), TranslationConfig(max_model_len=100, tokenizer=TOK))


def test_stop_strings_never_reach_the_wire_and_single_token_stops_become_stop_ids():
    t = translate(stop=["STOP", "\n\n"])
    sp = t.request.sampling_params
    assert sp.stop == ()  # vLLM's __post_init__ would reject stop strings with detokenize=False
    decoded = wire_engine.decode_request(wire.encode_request(t.request)).sampling_params
    assert decoded.stop == () and decoded.detokenize is False
    assert set(sp.stop_token_ids) >= {STOP, NLNL}  # both are exactly one token
    assert t.stop_plan.token_stops == {STOP: "STOP", NLNL: "\n\n"}


def test_without_a_tokenizer_stop_strings_are_refused_by_name():
    with pytest.raises(RequestRejected) as ei:
        translate_request(greq(stop=["x"]), TranslationConfig(max_model_len=100))
    assert ei.value.field == "sampling_params.stop" and "tokenizer" in str(ei.value)
    with pytest.raises(RequestRejected) as ei:
        translate(stop=[""])
    assert ei.value.field == "sampling_params.stop"


def delta(tokens, finish=None, stop=None):
    return OutputDelta("s1", list(tokens), finish_reason=finish, stop_reason=stop)


def run(builder, deltas):
    out = []
    for d in deltas:
        out += builder.feed(d)
    return out


def test_a_multi_token_stop_trims_the_output_and_reports_the_string():
    b = translate(stop=["STOP"]).response_builder()
    rs = run(b, [delta([A, ST]), delta([OP, C, C]), delta([C])])
    chunks = [r.chunk for r in rs if r.WhichOneof("response") == "chunk"]
    (complete,) = [r.complete for r in rs if r.WhichOneof("response") == "complete"]
    assert [list(c.token_ids) for c in chunks] == [[A, ST], [OP]]  # tokens after the match are dropped
    assert list(complete.output_ids) == [A, ST, OP]
    assert complete.finish_reason == "stop" and complete.matched_stop_str == "STOP"
    assert b.done and b.stopped_early  # the engine had not finished: abort it


def test_a_converted_single_token_stop_reports_the_string_not_the_id():
    b = translate(stop=["STOP"]).response_builder()
    rs = run(b, [delta([A]), delta([STOP], wire.FinishReason.STOP, STOP)])
    complete = rs[-1].complete
    assert complete.matched_stop_str == "STOP" and complete.WhichOneof("matched_stop") == "matched_stop_str"
    assert not b.stopped_early  # the engine finished by itself


def test_a_user_stop_token_id_still_reports_the_id():
    b = translate(stop=["STOP"], stop_token_ids=[C]).response_builder()
    rs = run(b, [delta([A, C], wire.FinishReason.STOP, C)])
    assert rs[-1].complete.matched_token_id == C


def test_repetition_finish_reports_stop_without_a_matched_stop():
    b = translate().response_builder()
    rs = run(b, [delta([A], wire.FinishReason.REPETITION, "repetition_detected")])
    assert rs[-1].complete.finish_reason == "stop" and rs[-1].complete.WhichOneof("matched_stop") is None


async def test_a_client_side_stop_aborts_the_engine_request():
    t = translate(stop=["STOP"])
    async with fake_pair() as (engine, client):
        with trio.fail_after(10):
            builder = t.response_builder()
            responses = []
            async with client.generate(t.request) as stream:
                await engine.receive_add()
                await engine.send_tokens("s1", [A, ST])
                await engine.send_tokens("s1", [OP, C])
                async for d in stream:
                    responses += builder.feed(d)
                    if builder.done:
                        break
            assert responses[-1].complete.matched_stop_str == "STOP"
            assert await engine.receive_abort() == ("s1",)
            assert client.protocol.inflight == 0
