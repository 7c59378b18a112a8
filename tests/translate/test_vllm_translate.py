"""GenerateRequest -> EngineCoreRequest (the fields this transport maps) and
deltas -> GenerateResponse; every unmapped set field is refused by name."""

from __future__ import annotations

import pytest

from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.checks import check_request
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.translate.vllm import ResponseBuilder, pb, responses, to_engine_core_request
from zmqdispatch.wire import vllm as wire


def req(**sp) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id="g1", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), stream=True)
    if sp:
        r.sampling_params.CopyFrom(pb.SamplingParams(**sp))
    return r


def tr(r, **kw):
    kw.setdefault("max_model_len", 100)
    return to_engine_core_request(r, arrival_time=1.0, **kw)


def test_maps_the_transport_fields():
    e = tr(req(temperature=0.5, top_p=0.9, top_k=7, max_tokens=8, seed=42, stop_token_ids=[9, 4, 9]))
    sp = e.sampling_params
    assert e.request_id == "g1" and e.prompt_token_ids == (1, 2, 3) and e.arrival_time == 1.0
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.seed) == (0.5, 7, 8, 42)
    assert sp.top_p == pytest.approx(0.9)
    assert sp.stop_token_ids == (9, 4) and set(sp.all_stop_token_ids) == {4, 9}
    assert sp.eos_token_id is None
    check_request(e, max_model_len=100)


def test_defaults_without_sampling_params_are_vllms_and_fill_the_context():
    e = tr(req(), max_model_len=100)
    sp = e.sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed) == (1.0, 1.0, 0, None)
    assert sp.max_tokens == 97  # max_model_len - prompt_len
    check_request(e, max_model_len=100)


def test_proto3_zero_top_p_means_unset():
    assert tr(req(top_p=0.0, max_tokens=1)).sampling_params.top_p == 1.0


def test_explicit_zero_max_tokens_is_rejected():
    with pytest.raises(RequestRejected) as ei:
        tr(req(max_tokens=0))
    assert ei.value.field == "sampling_params.max_tokens"


def test_eos_rides_eos_token_id_unless_ignore_eos():
    sp = tr(req(max_tokens=4, stop_token_ids=[7]), eos_token_id=2).sampling_params
    assert sp.eos_token_id == 2 and set(sp.all_stop_token_ids) == {2, 7} and sp.stop_token_ids == (7,)
    sp = tr(req(max_tokens=4, ignore_eos=True), eos_token_id=2).sampling_params
    assert sp.eos_token_id is None and set(sp.all_stop_token_ids) == {2} and sp.ignore_eos


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("sampling_params.min_p", {"min_p": 0.1}),
        ("sampling_params.frequency_penalty", {"frequency_penalty": 0.5}),
        ("sampling_params.presence_penalty", {"presence_penalty": 0.5}),
        ("sampling_params.repetition_penalty", {"repetition_penalty": 1.2}),
        ("sampling_params.min_tokens", {"min_tokens": 2}),
        ("sampling_params.stop", {"stop": ["\n"]}),
        ("sampling_params.logprobs", {"logprobs": 2}),
        ("sampling_params.prompt_logprobs", {"prompt_logprobs": 1}),
        ("sampling_params.include_stop_str_in_output", {"include_stop_str_in_output": True}),
        ("sampling_params.logit_bias", {"logit_bias": {5: 1.0}}),
        ("sampling_params.truncate_prompt_tokens", {"truncate_prompt_tokens": 4}),
        ("sampling_params.grammar_from_first_token", {"grammar_from_first_token": True}),
        ("sampling_params.regex", {"regex": "a+"}),
        ("sampling_params.json_schema", {"json_schema": "{}"}),
        ("sampling_params.json_object", {"json_object": True}),
        ("sampling_params.grammar", {"grammar": "root ::= 'a'"}),
        ("sampling_params.structural_tag", {"structural_tag": "{}"}),
        ("sampling_params.choice", {"choice": pb.ChoiceConstraint(choices=["a"])}),
        ("sampling_params.n", {"n": 2}),
    ],
)
def test_every_unmapped_sampling_field_is_rejected_by_name(field, kwargs):
    with pytest.raises(RequestRejected) as ei:
        tr(req(max_tokens=4, **kwargs))
    assert ei.value.field == field and field.split(".")[1] in str(ei.value)


def test_request_level_rejections():
    r = pb.GenerateRequest(request_id="t", text="hello")
    with pytest.raises(RequestRejected, match="token ids") as ei:
        tr(r)
    assert ei.value.field == "text"
    with pytest.raises(RequestRejected) as ei:
        tr(pb.GenerateRequest(request_id="t"))
    assert ei.value.field == "tokenized"
    with pytest.raises(RequestRejected) as ei:
        tr(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1])))
    assert ei.value.field == "request_id"
    r = req()
    r.kv_transfer_params.remote_host = "h"
    with pytest.raises(RequestRejected) as ei:
        tr(r)
    assert ei.value.field == "kv_transfer_params"
    r = req()
    r.mm_inputs.im_token_id = 5
    with pytest.raises(RequestRejected) as ei:
        tr(r)
    assert ei.value.field == "mm_inputs"
    r = req()
    r.media_refs.items.add(url="x")
    with pytest.raises(RequestRejected) as ei:
        tr(r)
    assert ei.value.field == "media_refs"
    r = req()
    r.data_parallel_rank = 1
    with pytest.raises(RequestRejected, match="engine 0") as ei:
        tr(r, engine_index=0)
    r.data_parallel_rank = 0
    assert tr(r, engine_index=0).data_parallel_rank == 0


def test_accepted_fields_without_effect_on_token_ids():
    e = tr(req(max_tokens=2, skip_special_tokens=True, spaces_between_special_tokens=False))
    assert e.sampling_params.max_tokens == 2


def d(tokens, finish=None, stop=None, **kw):
    return OutputDelta("g1", list(tokens), finish_reason=finish, stop_reason=stop, **kw)


def test_response_stream_is_chunks_then_one_complete():
    rs = responses([d([5], num_prompt_tokens=3, num_cached_tokens=1), d([6, 7]), d([8], wire.FinishReason.STOP, 8)], 3)
    kinds = [r.WhichOneof("response") for r in rs]
    assert kinds == ["chunk", "chunk", "chunk", "complete"]
    assert [list(r.chunk.token_ids) for r in rs[:3]] == [[5], [6, 7], [8]]
    assert [r.chunk.completion_tokens for r in rs[:3]] == [1, 3, 4]
    c = rs[-1].complete
    assert list(c.output_ids) == [5, 6, 7, 8] and c.finish_reason == "stop"
    assert c.matched_token_id == 8 and c.prompt_tokens == 3 and c.cached_tokens == 1 and c.completion_tokens == 4


def test_terminal_without_tokens_is_a_bare_complete_and_prompt_tokens_fall_back():
    rs = responses([d([1]), d([], wire.FinishReason.LENGTH)], prompt_len=7)
    assert [r.WhichOneof("response") for r in rs] == ["chunk", "complete"]
    assert rs[-1].complete.prompt_tokens == 7 and rs[-1].complete.finish_reason == "length"
    assert rs[-1].complete.WhichOneof("matched_stop") is None


@pytest.mark.parametrize("reason, text", [(wire.FinishReason.ABORT, "abort"), (wire.FinishReason.REPETITION, "stop")])
def test_finish_strings(reason, text):
    (c,) = responses([d([], reason)], 1)
    assert c.complete.finish_reason == text


def test_non_streaming_emits_only_the_complete():
    rs = responses([d([1]), d([2], wire.FinishReason.LENGTH)], 1, stream=False)
    assert len(rs) == 1 and list(rs[0].complete.output_ids) == [1, 2]


def test_matched_stop_string():
    (c,) = responses([d([], wire.FinishReason.STOP, "###")], 1)
    assert c.complete.matched_stop_str == "###"
