"""tokenspeed.grpc.scheduler.GenerateRequest -> TokenSpeed wire, and wire deltas ->
that package's GenerateResponse: every field mapped or refused by name."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from zmqdispatch import limits
from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.checks import check_tokenspeed_request
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.translate.tokenspeed import (
    ResponseBuilder,
    TranslationConfig,
    pb,
    translate_parallel,
    translate_request,
)
from zmqdispatch.translate.vllm import pb as vllm_pb
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm as wire

from .test_stops import IDS, TOK

CONFIG = TranslationConfig(max_model_len=64, vocab_size=1000, engine_index=0)

#: Every field of the request messages and how the translation treats it
#: (the module docstring has the rules); a new proto field fails this test.
HANDLED = {
    "GenerateRequest": {
        "request_id", "tokenized", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
        "token_ids_logprob", "stream", "mm_inputs", "encode_bootstrap_info", "kv_bootstrap_info",
        "data_parallel_rank",
    },
    "SamplingParams": {
        "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "n", "logit_bias", "regex", "json_schema", "ebnf_grammar",
        "structural_tag", "no_stop_trim", "custom_params", "sampling_seed",
    },
    "TokenizedInput": {"input_ids", "original_text"},
}


def greq(rid: str = "r1", prompt=(1, 2, 3), **kw) -> pb.GenerateRequest:
    sp = kw.pop("sp", None)
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=list(prompt)), **kw)
    if sp is not None:
        req.sampling_params.CopyFrom(pb.SamplingParams(**sp))
    return req


def rejected(req: pb.GenerateRequest, field: str, match: str | None = None, config=CONFIG) -> RequestRejected:
    with pytest.raises(RequestRejected, match=match) as ei:
        translate_parallel(req, config)
    assert ei.value.field == field, ei.value
    return ei.value


def test_the_proto_has_no_field_the_translation_does_not_know():
    for name, known in HANDLED.items():
        fields = {f.name for f in getattr(pb, name).DESCRIPTOR.fields}
        assert fields == known, (name, fields ^ known)


def test_field_numbers_differ_from_the_vllm_proto():
    # the reason nothing is shared with translate.vllm: same names, other numbers
    t = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    v = vllm_pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert t["sampling_params"].number == 3 and v["sampling_params"].number == 4
    assert pb.TokenizedInput.DESCRIPTOR.fields_by_name["input_ids"].number == 1
    assert vllm_pb.TokenizedInput.DESCRIPTOR.fields_by_name["input_ids"].number == 2


def test_defaults_without_sampling_params_are_tokenspeeds():
    t = translate_request(greq(), CONFIG)
    sp = t.request.sampling_params
    assert sp == ts.TokenSpeedSamplingParams()  # every default, un-normalized: the engine derives
    assert t.request.rid == "r1" and t.request.input_ids == (1, 2, 3)
    assert not t.request.return_logprob and not t.request.stream
    check_tokenspeed_request(t.request, max_model_len=64, vocab_size=1000)


def test_set_fields_travel():
    req = greq(
        return_logprob=True, stream=True, logprob_start_len=-1, data_parallel_rank=0,
        sp=dict(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, frequency_penalty=0.5, presence_penalty=-0.5,
                repetition_penalty=1.1, max_new_tokens=8, min_new_tokens=2, stop_token_ids=[7, 7, 9],
                ignore_eos=True, skip_special_tokens=True, spaces_between_special_tokens=True, no_stop_trim=True,
                logit_bias={"5": 2.0, "6": -100.0}, regex="[ab]+", sampling_seed=2**64 - 1),
    )
    t = translate_request(req, CONFIG)
    sp = t.request.sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.min_new_tokens) == (0.5, pytest.approx(0.9),
                                                                                             40, 8, 2)
    assert sp.stop_token_ids == (7, 9) and sp.ignore_eos and sp.no_stop_trim
    assert sp.logit_bias == {"5": 2.0, "6": -100.0} and sp.regex == "[ab]+" and sp.seed == 2**64 - 1
    assert sp.min_p == pytest.approx(0.05) and sp.repetition_penalty == pytest.approx(1.1)
    assert t.request.return_logprob and t.request.stream and t.request.data_parallel_rank == 0  # the pin
    assert t.no_stop_trim and t.return_logprob and not t.top_logprobs
    payload = ts.encode_add(t.request)[0]
    assert ts_engine.decode_add([payload]).sampling_params.derive() == sp.derive()
    check_tokenspeed_request(t.request, max_model_len=64, vocab_size=1000)


@pytest.mark.parametrize(
    ("which", "wire_name"),
    [("regex", "regex"), ("json_schema", "json_schema"), ("ebnf_grammar", "ebnf"),
     ("structural_tag", "structural_tag")],
)
def test_each_constraint_maps_to_its_wire_field(which, wire_name):
    value = '{"type": "object"}' if which in ("json_schema", "structural_tag") else "root ::= 'a'"
    sp = translate_request(greq(sp={which: value}), CONFIG).request.sampling_params
    assert getattr(sp, wire_name) == value


@pytest.mark.parametrize(
    ("kw", "field", "match"),
    [
        (dict(mm_inputs=pb.MultimodalInputs()), "mm_inputs.items", "must not be empty"),
        (dict(kv_bootstrap_info=pb.KvBootstrapInfo(bootstrap_host="h")), "kv_bootstrap_info", "PD"),
        (dict(encode_bootstrap_info=pb.EncodeBootstrapInfo()), "encode_bootstrap_info", "EPD"),
        (dict(data_parallel_rank=1), "data_parallel_rank", "names no connected engine"),
        (dict(token_ids_logprob=[3]), "token_ids_logprob", "not carried"),
        (dict(logprob_start_len=0), "logprob_start_len", "prompt logprobs"),
        (dict(top_logprobs_num=2, return_logprob=True), "top_logprobs_num", "only the sampled token"),
        (dict(top_logprobs_num=1, return_logprob=True, sp=dict(temperature=0.7)), "top_logprobs_num", "greedy"),
        (dict(top_logprobs_num=1, sp=dict(temperature=0.0)), "top_logprobs_num", "return_logprob"),
        (dict(sp=dict(top_k=0)), "sampling_params.top_k", "-1 .disabled."),
        (dict(sp=dict(top_k=128)), "sampling_params.top_k", "fused top-k kernel limit of 128"),
        (dict(sp=dict(top_k=-5)), "sampling_params.top_k", None),
        (dict(sp=dict(temperature=-0.5)), "sampling_params.temperature", ">= 0"),
        (dict(sp=dict(temperature=float("nan"))), "sampling_params.temperature", "finite"),
        (dict(sp=dict(top_p=float("inf"))), "sampling_params.top_p", "finite"),
        (dict(sp=dict(min_new_tokens=5, max_new_tokens=4)), "sampling_params.min_new_tokens", "exceeds"),
        (dict(sp=dict(logit_bias={"x": 1.0})), "sampling_params.logit_bias", "not a token id"),
        (dict(sp=dict(logit_bias={"1000": 1.0})), "sampling_params.logit_bias", r"\[0, 1000\)"),
        (dict(sp=dict(logit_bias={"-1": 1.0})), "sampling_params.logit_bias", None),
        (dict(sp=dict(logit_bias={"5": 101.0})), "sampling_params.logit_bias", r"\[-100, 100\]"),
        (dict(sp=dict(json_schema="{")), "sampling_params.json_schema", "not valid JSON"),
        (dict(sp=dict(regex="")), "sampling_params.regex", "empty"),
        (dict(sp=dict(stop=["x"])), "sampling_params.stop", "tokenizer"),
        (dict(sp=dict(n=limits.MAX_PARALLEL_SAMPLES + 1)), "sampling_params.n", "exceeds the limit"),
    ],
)
def test_rejections_name_the_field(kw, field, match):
    rejected(greq(**kw), field, match)


def test_request_level_rejections():
    rejected(greq(rid=""), "request_id")
    rejected(pb.GenerateRequest(request_id="r"), "tokenized", "token ids")
    rejected(greq(prompt=()), "tokenized.input_ids", "empty")
    req = greq()
    req.sampling_params.custom_params.CopyFrom(struct_pb2.Struct(fields={"k": struct_pb2.Value(number_value=1)}))
    rejected(req, "sampling_params.custom_params", "custom logit processor")
    req.sampling_params.ClearField("custom_params")
    req.sampling_params.custom_params.CopyFrom(struct_pb2.Struct())
    translate_request(req, CONFIG)  # an empty Struct says nothing


def test_logprob_start_len_at_the_last_prompt_token_means_no_prompt_logprobs():
    t = translate_request(greq(prompt=(1, 2, 3), logprob_start_len=2, return_logprob=True), CONFIG)
    assert t.request.logprob_start_len == -1


def test_greedy_top_logprobs_1_is_the_sampled_token():
    t = translate_request(greq(return_logprob=True, top_logprobs_num=1, sp=dict(top_k=1, temperature=0.8)), CONFIG)
    assert t.top_logprobs and t.request.top_logprobs_num == 0  # never on the wire


def test_fan_out_ids_seeds_and_index():
    req = greq("p", sp=dict(n=3, sampling_seed=2**64 - 2, temperature=0.7))
    children = translate_parallel(req, CONFIG)
    assert [c.request.rid for c in children] == ["p-0", "p-1", "p-2"]
    assert [c.request.sampling_params.seed for c in children] == [2**64 - 2, 2**64 - 1, 0]  # uint64 wraps
    assert [c.index for c in children] == [0, 1, 2]
    assert {c.response_request_id for c in children} == {"p"}
    assert all(c.request.sampling_params.n == 1 for c in children)
    unseeded = translate_parallel(greq("p", sp=dict(n=2)), CONFIG)
    assert [c.request.sampling_params.seed for c in unseeded] == [None, None]  # engine: crc32 of each id
    # greedy n > 1 is TokenSpeed's own choice to allow
    assert len(translate_parallel(greq("g", sp=dict(n=2, temperature=0.0)), CONFIG)) == 2
    assert [c.request.rid for c in translate_parallel(greq("one", sp=dict(n=0)), CONFIG)] == ["one"]


# ------------------------------------------------------------------ responses


def d(tokens, finish=None, lp=None, prompt=None) -> OutputDelta:
    logprobs = None
    if lp is not None:
        logprobs = wire.LogprobsLists(token_ids=[[t] for t in tokens], logprobs=[[v] for v in lp], ranks=[])
    return OutputDelta("r1", list(tokens), finish_reason=finish, logprobs=logprobs, num_prompt_tokens=prompt)


def feed_all(builder: ResponseBuilder, deltas) -> list[pb.GenerateResponse]:
    out = []
    for x in deltas:
        out += builder.feed(x)
    return out


def test_stream_is_chunks_then_complete_with_the_parent_request_id():
    b = ResponseBuilder("parent", 3, index=2)
    out = feed_all(b, [d([5], prompt=3), d([6, 7]), d([8], wire.FinishReason.LENGTH)])
    assert [r.WhichOneof("response") for r in out] == ["chunk", "chunk", "chunk", "complete"]
    assert {r.request_id for r in out} == {"parent"} and {r.chunk.index for r in out[:3]} == {2}
    assert [list(r.chunk.token_ids) for r in out[:3]] == [[5], [6, 7], [8]]
    assert [r.chunk.completion_tokens for r in out[:3]] == [1, 3, 4]
    c = out[-1].complete
    assert list(c.output_ids) == [5, 6, 7, 8] and c.finish_reason == "length" and c.index == 2
    assert c.prompt_tokens == 3 and c.completion_tokens == 4 and c.WhichOneof("matched_stop") is None
    assert b.done and b.feed(d([9])) == []


def test_stop_token_is_reported_as_matched_and_trimmed():
    b = ResponseBuilder("r1", 3, return_logprob=True)
    out = feed_all(b, [d([5], lp=[-0.1]), d([6, 2], wire.FinishReason.STOP, lp=[-0.2, -0.3])])
    assert [list(r.chunk.token_ids) for r in out[:2]] == [[5], [6]]
    assert list(out[1].chunk.output_logprobs.token_logprobs) == pytest.approx([-0.2])
    c = out[-1].complete
    assert list(c.output_ids) == [5, 6] and c.matched_token_id == 2 and c.finish_reason == "stop"
    assert c.completion_tokens == 3  # the engine's count includes the stop token
    assert list(c.output_logprobs.token_ids) == [5, 6] and len(c.output_logprobs.top_logprobs) == 0


def test_no_stop_trim_keeps_the_stop_token():
    out = feed_all(ResponseBuilder("r1", 3, no_stop_trim=True), [d([6, 2], wire.FinishReason.STOP)])
    assert list(out[0].chunk.token_ids) == [6, 2]
    assert list(out[1].complete.output_ids) == [6, 2] and out[1].complete.matched_token_id == 2


def test_a_stop_frame_holding_only_the_stop_token_yields_no_empty_chunk():
    out = feed_all(ResponseBuilder("r1", 3), [d([4]), d([2], wire.FinishReason.STOP)])
    assert [r.WhichOneof("response") for r in out] == ["chunk", "complete"]
    assert list(out[1].complete.output_ids) == [4] and out[1].complete.matched_token_id == 2


def test_non_streaming_emits_only_the_complete():
    out = feed_all(ResponseBuilder("r1", 3, stream=False), [d([4]), d([5], wire.FinishReason.LENGTH)])
    assert [r.WhichOneof("response") for r in out] == ["complete"]
    assert list(out[0].complete.output_ids) == [4, 5]


def test_greedy_top1_logprobs():
    out = feed_all(ResponseBuilder("r1", 3, return_logprob=True, top_logprobs=True),
                   [d([4, 5], wire.FinishReason.LENGTH, lp=[-0.5, -0.25])])
    tops = out[0].chunk.output_logprobs.top_logprobs
    assert [list(t.token_ids) for t in tops] == [[4], [5]]
    assert [list(t.values) for t in tops] == [pytest.approx([-0.5]), pytest.approx([-0.25])]
    assert len(out[1].complete.output_logprobs.top_logprobs) == 2


A, B, STOP, NLNL = IDS[b"a"], IDS[b"b"], IDS[b"STOP"], IDS[b"\n\n"]


def test_stop_strings_are_matched_on_the_client():
    config = TranslationConfig(max_model_len=64, tokenizer=TOK)
    t = translate_request(greq(prompt=(A,), stream=True, sp=dict(stop=["STOP", "ba"], skip_special_tokens=True)),
                          config)
    assert t.request.sampling_params.stop is None  # never on the wire
    assert STOP in t.request.sampling_params.stop_token_ids  # one token: also an engine stop id
    # "b" then "a" completes "ba" on the client before the engine finishes
    b = t.response_builder()
    out = feed_all(b, [d([A]), d([B, A, B])])
    assert b.stopped_early and out[-1].complete.matched_stop_str == "ba"
    assert list(out[-1].complete.output_ids) == [A, B, A]
    # the converted single-token stop: the engine stops on it, reported as the string, token kept
    b = t.response_builder()
    out = feed_all(b, [d([A, STOP], wire.FinishReason.STOP)])
    c = out[-1].complete
    assert c.matched_stop_str == "STOP" and list(c.output_ids) == [A, STOP] and not b.stopped_early
