"""The TokenSpeed mock and our translation, checked against TokenSpeed 0.1.1's own wire
code (the engine needs CUDA; its pure wire modules run here, see
``tests/wire/test_tokenspeed_reference.py``). Skipped, with the reason, without the wheel;
CI (``scripts/test --real-engine``) installs it and requires these to run."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch.mock.tokenspeed_core import MockTokenSpeedScheduler
from zmqdispatch.protocol.checks import check_tokenspeed_request
from zmqdispatch.errors import RequestRejected
from zmqdispatch.translate.tokenspeed import TranslationConfig, pb, translate_parallel
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine

from ..wire.test_tokenspeed_reference import (  # noqa: F401  (the fixture is used by name)
    TokenSpeedHelper,
    batch_view,
    hexes,
    requires_tokenspeed,
    tokenspeed,
)

pytestmark = requires_tokenspeed

SETTINGS = settings(deadline=None, max_examples=40, database=None, suppress_health_check=[HealthCheck.too_slow])


def test_every_mock_batch_decodes_in_tokenspeed_to_the_same_values(tokenspeed: TokenSpeedHelper) -> None:
    core = MockTokenSpeedScheduler(eos_token_ids=(7,), stream_interval=2, tokens_per_step=2)
    reqs = [
        ts.TokenizedGenerateReqInput(rid="plain", input_ids=(1, 2, 3),
                                     sampling_params=ts.TokenSpeedSamplingParams(max_new_tokens=9), stream=True),
        ts.TokenizedGenerateReqInput(rid="lp", input_ids=(4, 5), return_logprob=True,
                                     sampling_params=ts.TokenSpeedSamplingParams(temperature=0.0, max_new_tokens=5)),
        ts.TokenizedGenerateReqInput(rid="bad", input_ids=(1,),
                                     sampling_params=ts.TokenSpeedSamplingParams(top_k=0)),
    ]
    batches = []
    for req in reqs:
        _, finalized = ts_engine.decode_input([b"\x00", *ts.encode_add(req)])
        if (b := core.add(finalized)) is not None:
            batches.append(b)
    while core.running:
        if (b := core.step()) is not None:
            batches.append(b)
    assert any("abort" in b.finished_reasons for b in batches)
    for b in batches:
        reply = tokenspeed.call(op="out_decode", frames=hexes(ts_engine.encode_outputs(b)))
        assert reply["error"] is None and reply["decoded"] == batch_view(b)


def test_mock_admission_matches_tokenspeed_ingress(tokenspeed: TokenSpeedHelper) -> None:
    """What the mock refuses is what TokenSpeed's receiver refuses."""
    cases = [
        ts.TokenSpeedSamplingParams(top_k=200),
        ts.TokenSpeedSamplingParams(top_p=0.0),
        ts.TokenSpeedSamplingParams(n=3),
        ts.TokenSpeedSamplingParams(logprobs=1),
        ts.TokenSpeedSamplingParams(temperature=0.0, top_k=200),
        ts.TokenSpeedSamplingParams(),
    ]
    flags = {"vocab_size": 32_000, "enable_output_logprobs": True, "supports_prompt_logprobs": False}
    for sp in cases:
        req = ts.TokenizedGenerateReqInput(rid="r", input_ids=(1, 2), sampling_params=sp)
        frames = ts.encode_add(req)
        reply = tokenspeed.call(op="add_decode", frames=hexes(frames), admission=flags)
        _, finalized = ts_engine.decode_input([b"\x00", *frames])
        refused = MockTokenSpeedScheduler().add(finalized) is not None
        assert refused == bool(reply["admission"]), (sp, reply["admission"])


@SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
            "top_p": st.sampled_from([0.1, 0.9, 1.0]),
            "top_k": st.sampled_from([-1, 1, 20, 127]),
            "min_p": st.sampled_from([0.0, 0.3]),
            "repetition_penalty": st.sampled_from([0.5, 1.0, 2.0]),
            "max_new_tokens": st.integers(0, 50),
            "min_new_tokens": st.integers(0, 3),
            "stop_token_ids": st.lists(st.integers(0, 999), max_size=3),
            "ignore_eos": st.booleans(),
            "logit_bias": st.dictionaries(st.integers(0, 999).map(str), st.floats(-100, 100), max_size=2),
            "regex": st.just("[ab]+"),
            "sampling_seed": st.integers(0, 2**64 - 1),
        },
    ),
    st.booleans(),
)
def test_what_we_translate_tokenspeed_admits(tokenspeed: TokenSpeedHelper, sp: dict, return_logprob: bool) -> None:
    """A request that passes our translation and checks is admitted by TokenSpeed's own
    ingress (no silent drop, no reasonless abort); our checks refuse only what it refuses."""
    req = pb.GenerateRequest(request_id="x", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                             sampling_params=pb.SamplingParams(**sp), return_logprob=return_logprob)
    flags = {"vocab_size": 1000, "enable_output_logprobs": True, "supports_prompt_logprobs": False}
    try:
        (t,) = translate_parallel(req, TranslationConfig(max_model_len=4096, vocab_size=1000))
        check_tokenspeed_request(t.request, max_model_len=4096, vocab_size=1000)
    except RequestRejected as exc:
        # the one refusal these values can meet; TokenSpeed refuses it too
        assert exc.field == "sampling_params.min_new_tokens", exc
        wire_req = ts.TokenizedGenerateReqInput(
            rid="x", input_ids=(1, 2, 3),
            sampling_params=ts.TokenSpeedSamplingParams(max_new_tokens=sp["max_new_tokens"],
                                                        min_new_tokens=sp["min_new_tokens"]))
        reply = tokenspeed.call(op="add_decode", frames=hexes(ts.encode_add(wire_req)), admission=flags)
        assert reply["admission"]
        return
    reply = tokenspeed.call(op="add_decode", frames=hexes(ts.encode_add(t.request)), admission=flags)
    assert reply["error"] is None and reply["finalize_error"] is None
    assert not reply["admission"], reply["admission"]
