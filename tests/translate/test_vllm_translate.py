"""GenerateRequest -> EngineCoreRequest, field by field, and deltas -> GenerateResponse.

Every field of GenerateRequest / SamplingParams is either mapped (a test here
shows where it lands) or refused by name (a test here shows the error)."""

from __future__ import annotations

import math

import attrs

import pytest

from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.checks import check_request
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.translate.vllm import (
    ResponseBuilder,
    TranslationConfig,
    pb,
    responses,
    shape_top_logprobs,
    to_engine_core_request,
    translate_request,
)
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine


def req(**sp) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id="g1", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), stream=True)
    if sp:
        r.sampling_params.CopyFrom(pb.SamplingParams(**sp))
    return r


def tr(r, **kw):
    kw.setdefault("max_model_len", 100)
    return translate_request(r, TranslationConfig(**kw), arrival_time=1.0)


def params(r, **kw) -> wire.SamplingParams:
    return tr(r, **kw).request.sampling_params


def test_maps_core_sampling_fields():
    e = tr(req(temperature=0.5, top_p=0.9, top_k=7, max_tokens=8, seed=42, stop_token_ids=[9, 4, 9])).request
    sp = e.sampling_params
    assert e.request_id == "g1" and e.prompt_token_ids == (1, 2, 3) and e.arrival_time == 1.0
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.seed) == (0.5, 7, 8, 42)
    assert sp.top_p == pytest.approx(0.9)
    assert sp.stop_token_ids == (9, 4) and set(sp.all_stop_token_ids) == {4, 9}
    assert sp.eos_token_id is None and sp.output_kind == wire.RequestOutputKind.DELTA and sp.detokenize is False
    check_request(e, max_model_len=100)


@pytest.mark.parametrize(
    "kwargs, attr, value",
    [
        ({"min_p": 0.25}, "min_p", 0.25),
        ({"frequency_penalty": 0.5}, "frequency_penalty", 0.5),
        ({"presence_penalty": -0.5}, "presence_penalty", -0.5),
        ({"repetition_penalty": 1.25}, "repetition_penalty", 1.25),
        ({"min_tokens": 2}, "min_tokens", 2),
        ({"logprobs": 3}, "logprobs", 3),
        ({"logprobs": 0}, "logprobs", 0),
        ({"prompt_logprobs": 2}, "prompt_logprobs", 2),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output", True),
        ({"skip_special_tokens": True}, "skip_special_tokens", True),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", False),
        ({"ignore_eos": True}, "ignore_eos", True),
        ({"logit_bias": {5: 2.5, 17: -100.0}}, "logit_bias", {5: 2.5, 17: -100.0}),
    ],
)
def test_each_sampling_field_lands_on_the_wire(kwargs, attr, value):
    sp = params(req(max_tokens=4, **kwargs))
    assert getattr(sp, attr) == value
    # and it survives the wire: encode, then decode as vLLM would
    decoded = wire_engine.decode_request(wire.encode_request(tr(req(max_tokens=4, **kwargs)).request))
    assert getattr(decoded.sampling_params, attr) == value


def test_defaults_without_sampling_params_are_vllms_and_fill_the_context():
    sp = params(req(), max_model_len=100)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.repetition_penalty) == (1.0, 1.0, 0, None, 1.0)
    assert sp.max_tokens == 97  # max_model_len - prompt_len
    assert sp is not None


def test_greedy_resets_top_p_top_k_min_p_and_seed_minus_one_means_none_as_in_vllm():
    sp = params(req(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2, seed=-1, max_tokens=2))
    assert (sp.top_p, sp.top_k, sp.min_p, sp.seed) == (1.0, 0, 0.0, None)
    sp = params(req(temperature=0.7, top_p=0.5, top_k=5, min_p=0.25, seed=-1, max_tokens=2))
    assert (sp.top_k, sp.min_p, sp.seed) == (5, 0.25, None) and sp.top_p == pytest.approx(0.5)


def test_temperature_above_two_is_refused_like_vllm():
    with pytest.raises(RequestRejected) as ei:
        check_request(tr(req(temperature=2.5, max_tokens=2)).request, max_model_len=100)
    assert ei.value.field == "sampling_params.temperature" and "[0, 2]" in str(ei.value)


def test_proto3_zero_values_of_non_optional_fields_mean_unset():
    sp = params(req(top_p=0.0, repetition_penalty=0.0, max_tokens=1))
    assert sp.top_p == 1.0 and sp.repetition_penalty == 1.0


def test_truncate_prompt_tokens_keeps_the_last_k():
    r = pb.GenerateRequest(request_id="t", tokenized=pb.TokenizedInput(input_ids=list(range(1, 11))),
                           sampling_params=pb.SamplingParams(truncate_prompt_tokens=4, max_tokens=2))
    t = tr(r)
    assert t.request.prompt_token_ids == (7, 8, 9, 10) == t.prompt_token_ids
    r.sampling_params.truncate_prompt_tokens = -1
    assert tr(r, max_model_len=6).request.prompt_token_ids == (5, 6, 7, 8, 9, 10)
    r.sampling_params.truncate_prompt_tokens = 0
    with pytest.raises(RequestRejected) as ei:
        tr(r)
    assert ei.value.field == "sampling_params.truncate_prompt_tokens"


def test_eos_as_vllms_front_end_sets_it():
    # docs/reference-gateway-lessons.md §1.4: eos = (5, [7]); user stop ids [7, 9]
    sp = params(req(max_tokens=4, stop_token_ids=[7, 9]), eos_token_ids=(5, 7))
    assert sp.eos_token_id == 5 and set(sp.stop_token_ids) == {7, 9} and set(sp.all_stop_token_ids) == {5, 7, 9}
    sp = params(req(max_tokens=4, stop_token_ids=[9], ignore_eos=True), eos_token_ids=(5, 7))
    assert sp.eos_token_id is None and list(sp.stop_token_ids) == [9] and set(sp.all_stop_token_ids) == {5, 7, 9}
    # the golden vector's shape: primary eos only
    sp = params(req(max_tokens=8, temperature=0.0), eos_token_ids=(2,))
    assert sp.eos_token_id == 2 and sp.stop_token_ids == () and sp.all_stop_token_ids == (2,)


@pytest.mark.parametrize(
    "constraint, expected",
    [
        ({"json_schema": '{"type": "object"}'}, {"json": {"type": "object"}}),
        ({"regex": "a+"}, {"regex": "a+"}),
        ({"grammar": "root ::= 'a'"}, {"grammar": "root ::= 'a'"}),
        ({"choice": pb.ChoiceConstraint(choices=["yes", "no"])}, {"grammar": 'root ::= "yes" | "no"', "choice": None}),
        ({"json_object": True}, {"json_object": True}),
        ({"structural_tag": '{"type": "tag"}'}, {"structural_tag": '{"type": "tag"}'}),
    ],
)
def test_structured_outputs(constraint, expected):
    so = params(req(max_tokens=4, **constraint)).structured_outputs
    for k, v in expected.items():
        assert getattr(so, k) == v
    assert so.backend == "xgrammar" and so.backend_was_auto
    decoded = wire_engine.decode_request(wire.encode_request(tr(req(max_tokens=4, **constraint)).request))
    assert decoded.sampling_params.structured_outputs == so


def test_choice_is_sent_as_vllms_ebnf_grammar_on_xgrammar_and_as_is_on_guidance():
    from zmqdispatch.translate.vllm import choice_as_grammar

    # expected value computed with vLLM 0.32.0's own choice_as_grammar
    assert choice_as_grammar(["yes", "no", 'a"b\\c\nd\x01']) == 'root ::= "yes" | "no" | "a\\"b\\\\c\\nd\\u0001"'
    so = params(req(max_tokens=4, choice=pb.ChoiceConstraint(choices=["x", "y"])),
                structured_outputs_backend="guidance").structured_outputs
    assert so.choice == ("x", "y") and so.grammar is None and so.backend == "guidance"


@pytest.mark.parametrize("vector, constraint", [
    ("request_structured_json_schema",
     {"json_schema": '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
                     '"required": ["name", "age"]}'}),
    ("request_structured_regex", {"regex": "[0-9]{3}-[0-9]{4}"}),
])
def test_structured_outputs_equal_what_vllms_front_end_sends(vector, constraint):
    """The golden vectors whose StructuredOutputsParams vLLM's own front end filled
    (auto backend): ours is identical, and so are its bytes."""
    import json
    import pathlib

    import msgpack

    cases = json.loads((pathlib.Path(__file__).parents[1] / "wire" / "vectors" / "vllm_0.32.0.json").read_text())
    (case,) = [c for c in cases if c["name"] == vector]
    decoded = wire_engine.decode_request([bytes.fromhex(h) for h in case["frames_hex"]])
    theirs = decoded.sampling_params.structured_outputs
    ours = params(req(max_tokens=4, **constraint)).structured_outputs
    assert ours == theirs
    assert msgpack.packb(ours._to_wire()) == msgpack.packb(theirs._to_wire())


def test_structured_output_backend_is_configurable_but_structural_tag_needs_xgrammar():
    so = params(req(max_tokens=4, regex="a"), structured_outputs_backend="guidance").structured_outputs
    assert so.backend == "guidance"
    so = params(req(max_tokens=4, structural_tag="{}"), structured_outputs_backend="guidance").structured_outputs
    assert so.backend == "xgrammar"


def test_json_object_false_means_no_constraint_and_grammar_from_first_token():
    assert params(req(max_tokens=4, json_object=False)).structured_outputs is None
    e = tr(req(max_tokens=4, regex="a+", grammar_from_first_token=True)).request
    assert e.reasoning_ended is True
    with pytest.raises(RequestRejected) as ei:
        tr(req(max_tokens=4, grammar_from_first_token=True))
    assert ei.value.field == "sampling_params.grammar_from_first_token"


@pytest.mark.parametrize(
    "field, kwargs, cfg",
    [
        ("sampling_params.max_tokens", {"max_tokens": 0}, {}),
        ("sampling_params.stop", {"stop": ["\n"]}, {}),
        ("sampling_params.n", {"n": 2}, {}),
        ("sampling_params.logprobs", {"logprobs": -1}, {}),
        ("sampling_params.logprobs", {"logprobs": 21}, {}),
        ("sampling_params.prompt_logprobs", {"prompt_logprobs": 5}, {"max_logprobs": 4}),
        ("sampling_params.logit_bias", {"logit_bias": {-1: 1.0}}, {}),
        ("sampling_params.logit_bias", {"logit_bias": {1000: 1.0}}, {"vocab_size": 1000}),
        ("sampling_params.logit_bias", {"logit_bias": {5: 101.0}}, {}),
        ("sampling_params.temperature", {"temperature": math.inf}, {}),
        ("sampling_params.json_schema", {"json_schema": "{not json"}, {}),
        ("sampling_params.regex", {"regex": ""}, {}),
        ("sampling_params.choice", {"choice": pb.ChoiceConstraint()}, {}),
    ],
)
def test_values_the_engine_cannot_take_are_rejected_by_name(field, kwargs, cfg):
    with pytest.raises(RequestRejected) as ei:
        tr(req(**{"max_tokens": 4, **kwargs}), **cfg)
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
    for setter, field in [
        (lambda r: setattr(r.kv_transfer_params, "remote_host", "h"), "kv_transfer_params"),
        (lambda r: setattr(r, "kv_transfer_params_json", "{}"), "kv_transfer_params"),
        (lambda r: setattr(r.mm_inputs, "im_token_id", 5), "mm_inputs.mm_placeholders"),
        (lambda r: r.extra_mm_inputs.add(), "extra_mm_inputs[0].mm_placeholders"),
        (lambda r: r.media_refs.items.add(url="x"), "media_refs"),
    ]:
        r = req()
        setter(r)
        with pytest.raises(RequestRejected) as ei:
            tr(r)
        assert ei.value.field == field
    r = req()
    r.data_parallel_rank = 1
    with pytest.raises(RequestRejected, match="engine 0"):
        tr(r, engine_index=0)
    r.data_parallel_rank = 0
    assert tr(r, engine_index=0).request.data_parallel_rank == 0


def test_shorthand_still_works():
    e = to_engine_core_request(req(max_tokens=3), max_model_len=50, eos_token_id=2)
    assert e.sampling_params.eos_token_id == 2 and e.sampling_params.max_tokens == 3


# ------------------------------------------------------------------ responses


def d(tokens, finish=None, stop=None, **kw):
    return OutputDelta("g1", list(tokens), finish_reason=finish, stop_reason=stop, **kw)


def lp(rows_ids, rows_vals, ranks=None):
    return wire.LogprobsLists(token_ids=[list(r) for r in rows_ids], logprobs=[list(r) for r in rows_vals],
                              ranks=list(ranks or [1] * len(rows_ids)))


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


def test_top_logprobs_are_shaped_with_the_sampled_token_deduplicated():
    # docs/reference-gateway-lessons.md §1.5 examples
    assert shape_top_logprobs([10, 10, 20], [-0.1, -0.1, -0.3], 2) == ([10, 20], [-0.1, -0.3])
    assert shape_top_logprobs([10, 10, 20], [-0.1, -0.1, -0.3], 1) == ([10], [-0.1])
    assert shape_top_logprobs([10, 20, 30], [-0.5, -0.1, -0.3], 2) == ([10, 20], [-0.5, -0.1])


def test_output_logprobs_per_chunk_and_cumulative_in_the_complete():
    b = ResponseBuilder(3, logprobs=2)
    r1 = b.feed(d([10], logprobs=lp([[10, 10, 20]], [[-0.1, -0.1, -0.3]])))
    r2 = b.feed(d([20, 30], wire.FinishReason.LENGTH,
                  logprobs=lp([[20, 5, 20], [30, 30, 7]], [[-0.2, -0.05, -0.2], [-0.4, -0.4, -0.9]])))
    c1 = r1[0].chunk.output_logprobs
    assert list(c1.token_ids) == [10] and [round(x, 3) for x in c1.token_logprobs] == [-0.1]
    assert [list(t.token_ids) for t in c1.top_logprobs] == [[10, 20]]
    c2 = r2[0].chunk.output_logprobs
    assert [list(t.token_ids) for t in c2.top_logprobs] == [[20, 5], [30, 7]]
    comp = r2[1].complete.output_logprobs
    assert list(comp.token_ids) == [10, 20, 30] == list(r2[1].complete.output_ids)
    assert len(comp.token_logprobs) == 3 and len(comp.top_logprobs) == 3


def test_logprobs_zero_gives_sampled_logprob_without_top_lists():
    (chunk, complete) = responses([d([4], wire.FinishReason.LENGTH, logprobs=lp([[4]], [[-1.5]]))], 1, logprobs=0)
    assert list(chunk.chunk.output_logprobs.token_logprobs) == [-1.5]
    assert len(chunk.chunk.output_logprobs.top_logprobs) == 0


def test_prompt_logprobs_ride_the_first_token_chunk_and_every_complete():
    # docs/reference-gateway-lessons.md §1.6 vector: prompt [1, 2], prompt_logprobs=1,
    # position for token 2 = [(2, -0.5, rank 3), (20, -0.1, rank 1)]
    b = ResponseBuilder(2, prompt_logprobs=1, prompt_token_ids=[1, 2])
    r0 = b.feed(d([], prompt_logprobs=lp([[2, 20]], [[-0.5, -0.1]], [3])))
    r1 = b.feed(d([7]))
    r2 = b.feed(d([8], wire.FinishReason.LENGTH))
    assert r0 == []
    inp = r1[0].chunk.input_logprobs
    assert list(inp.token_ids) == [1, 2]
    assert [v.HasField("value") for v in inp.token_logprobs] == [False, True]
    assert inp.token_logprobs[1].value == pytest.approx(-0.5)
    assert [list(t.token_ids) for t in inp.top_logprobs] == [[], [2]]
    assert not r2[0].chunk.HasField("input_logprobs")  # only once on chunks
    assert list(r2[1].complete.input_logprobs.token_ids) == [1, 2]


@pytest.mark.parametrize("schema", ["null", "123", "true", "[1]", '"x"'])
def test_a_json_schema_that_is_not_an_object_is_refused_by_name(schema):
    # "null" would put a constraint-less StructuredOutputsParams on the wire,
    # which vLLM's own checks reject in the engine's input thread (killing it).
    with pytest.raises(RequestRejected) as ei:
        tr(req(max_tokens=4, json_schema=schema))
    assert ei.value.field == "sampling_params.json_schema"


def test_check_request_demands_exactly_one_structured_constraint():
    from zmqdispatch.protocol.checks import check_request as check

    base = tr(req(max_tokens=4, regex="a+")).request
    for so in (wire.StructuredOutputsParams(backend="xgrammar"),
               wire.StructuredOutputsParams(regex="a", grammar="root ::= 'a'", backend="xgrammar")):
        bad = attrs.evolve(base, sampling_params=attrs.evolve(base.sampling_params, structured_outputs=so))
        with pytest.raises(RequestRejected) as ei:
            check(bad, max_model_len=100)
        assert ei.value.field == "sampling_params.structured_outputs"
