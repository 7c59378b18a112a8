"""Hypothesis properties of the translation (issue: translation, property-tested).

1. For generated GenerateRequests: translate, encode, decode as vLLM's typed
   decoder would -> every set field is back where it belongs; a refused request
   raises only RequestRejected.
2. For any split of the same ticks across engine messages and any consumer
   pace: the chunks' token ids concatenate to the complete's output_ids, and
   the logprobs line up with them one to one.
"""

from __future__ import annotations

import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.checks import check_request
from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine

from ..helpers import make_request, out, outputs_frames

MAX_MODEL_LEN = 512
VOCAB = 1000

f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def sampling_params(draw):
    kw = {}
    if draw(st.booleans()):
        kw["temperature"] = draw(st.sampled_from([0.0, 0.5, 1.0, 1.5]) | f32)
    for name, strat in [
        ("top_p", st.sampled_from([0.0, 0.5, 1.0]) | f32),
        ("top_k", st.integers(0, 100)),
        ("min_p", st.sampled_from([0.0, 0.1]) | f32),
        ("frequency_penalty", st.sampled_from([0.0, 0.5, -2.0]) | f32),
        ("presence_penalty", st.sampled_from([0.0, 1.0]) | f32),
        ("repetition_penalty", st.sampled_from([0.0, 1.0, 1.2]) | f32),
        ("min_tokens", st.integers(0, 8)),
        ("ignore_eos", st.booleans()),
        ("include_stop_str_in_output", st.booleans()),
        ("skip_special_tokens", st.booleans()),
        ("spaces_between_special_tokens", st.booleans()),
    ]:
        if draw(st.booleans()):
            kw[name] = draw(strat)
    for name, strat in [
        ("max_tokens", st.integers(0, 600)),
        ("seed", st.integers(-(2**31), 2**31 - 1)),
        ("logprobs", st.integers(-2, 25)),
        ("prompt_logprobs", st.integers(-2, 25)),
        ("truncate_prompt_tokens", st.integers(-2, 40)),
    ]:
        if draw(st.booleans()):
            kw[name] = draw(strat)
    if draw(st.booleans()):
        kw["stop_token_ids"] = draw(st.lists(st.integers(0, VOCAB + 5), max_size=4))
    if draw(st.booleans()):
        kw["logit_bias"] = draw(st.dictionaries(st.integers(-2, VOCAB + 2), st.floats(-150, 150), max_size=3))
    constraint = draw(st.sampled_from([None, "json_schema", "regex", "choice", "grammar", "json_object",
                                       "structural_tag"]))
    if constraint == "json_schema":
        kw["json_schema"] = draw(st.sampled_from(['{"type": "object"}', "{bad", '"x"']))
    elif constraint == "choice":
        kw["choice"] = pb.ChoiceConstraint(choices=draw(st.lists(st.text(max_size=5), max_size=3)))
    elif constraint == "json_object":
        kw["json_object"] = draw(st.booleans())
    elif constraint is not None:
        kw[constraint] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        kw["n"] = draw(st.integers(0, 3))
    return pb.SamplingParams(**kw)


@st.composite
def generate_requests(draw):
    r = pb.GenerateRequest(
        request_id=draw(st.text(min_size=0, max_size=12)),
        tokenized=pb.TokenizedInput(input_ids=draw(st.lists(st.integers(0, VOCAB + 5), min_size=0, max_size=40))),
        stream=draw(st.booleans()),
    )
    if draw(st.booleans()):
        r.sampling_params.CopyFrom(draw(sampling_params()))
    return r


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


@settings(max_examples=400, deadline=None)
@given(generate_requests(), st.sampled_from([(), (2,), (2, 7)]))
def test_translate_encode_decode_keeps_every_set_field(r, eos):
    config = TranslationConfig(max_model_len=MAX_MODEL_LEN, eos_token_ids=eos, vocab_size=VOCAB)
    try:
        t = translate_request(r, config)
        check_request(t.request, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB)
    except RequestRejected as exc:
        assert exc.field or str(exc)
        event(f"rejected: {exc.field}")
        return
    event("accepted")
    back = wire_engine.decode_request(wire.encode_request(t.request))
    assert back.request_id == r.request_id
    assert back.prompt_token_ids == t.prompt_token_ids
    assert t.prompt_token_ids == tuple(r.tokenized.input_ids)[-len(t.prompt_token_ids):]
    sp, src = back.sampling_params, r.sampling_params
    assert back.sampling_params == t.request.sampling_params
    if src.HasField("temperature"):
        assert close(sp.temperature, src.temperature)
    else:
        assert sp.temperature == 1.0
    if sp.temperature < 1e-5:  # greedy: vLLM's own __post_init__ resets these
        assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)
    else:
        assert close(sp.top_p, src.top_p or 1.0) and sp.top_k == src.top_k
        assert close(sp.min_p, src.min_p)
    assert close(sp.frequency_penalty, src.frequency_penalty) and close(sp.presence_penalty, src.presence_penalty)
    assert close(sp.repetition_penalty, src.repetition_penalty or 1.0)
    assert sp.min_tokens == src.min_tokens and sp.ignore_eos == src.ignore_eos
    assert sp.include_stop_str_in_output == src.include_stop_str_in_output
    assert sp.max_tokens == (src.max_tokens if src.HasField("max_tokens") else MAX_MODEL_LEN - len(t.prompt_token_ids))
    assert sp.seed == (src.seed if src.HasField("seed") and src.seed != -1 else None)
    assert sp.logprobs == (src.logprobs if src.HasField("logprobs") else None)
    assert sp.prompt_logprobs == (src.prompt_logprobs if src.HasField("prompt_logprobs") else None)
    assert set(src.stop_token_ids) <= set(sp.stop_token_ids) <= set(src.stop_token_ids) | set(eos[1:])
    assert set(sp.all_stop_token_ids) == set(src.stop_token_ids) | set(eos)
    assert sp.eos_token_id == (eos[0] if eos and not src.ignore_eos else None)
    assert (sp.logit_bias or {}) == {k: v for k, v in src.logit_bias.items()} or all(
        close(sp.logit_bias[k], v) for k, v in src.logit_bias.items())
    which = src.WhichOneof("constraint")
    if which is None or (which == "json_object" and not src.json_object):
        assert sp.structured_outputs is None
    else:
        so = sp.structured_outputs
        got = {"json_schema": so.json, "regex": so.regex, "grammar": so.grammar, "structural_tag": so.structural_tag,
               "json_object": so.json_object, "choice": so.choice or so.grammar}[which]
        assert got is not None


@st.composite
def tick_streams(draw):
    n = draw(st.integers(1, 30))
    k = draw(st.integers(0, 3))
    ticks = []
    for _ in range(n):
        width = draw(st.integers(0, 2))  # tokens in this tick (0: stats-only)
        toks = draw(st.lists(st.integers(0, 999), min_size=width, max_size=width))
        rows = [[t] + draw(st.lists(st.integers(0, 999), min_size=k, max_size=k)) for t in toks]
        vals = [[-float(i + 1) for i in range(k + 1)] for _ in toks]
        ticks.append((toks, rows, vals))
    return k, ticks


@settings(max_examples=200, deadline=None)
@given(tick_streams(), st.data())
def test_chunks_concatenate_to_the_complete_and_logprobs_line_up(stream, data):
    k, ticks = stream
    p = EngineProtocol()
    mb, _ = p.submit(make_request("r", max_tokens=1000, logprobs=k))
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    from zmqdispatch.translate.vllm import ResponseBuilder

    builder = ResponseBuilder(3, logprobs=k)
    responses = []
    batch = []
    for i, (toks, rows, vals) in enumerate(ticks):
        last = i == len(ticks) - 1
        lists = wire.LogprobsLists(token_ids=rows, logprobs=vals, ranks=[1] * len(rows)) if toks else None
        batch.append(out("r", toks, wire.FinishReason.LENGTH if last else None, new_logprobs=lists))
        if last or data.draw(st.booleans()):
            p.frames_received(outputs_frames(batch))
            batch = []
        if last or data.draw(st.booleans()):
            while (delta := mb.take()) is not None:
                responses += builder.feed(delta)
                if delta.finish_reason is not None:
                    break
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    (complete,) = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    all_tokens = [t for toks, _, _ in ticks for t in toks]
    assert [t for c in chunks for t in c.token_ids] == list(complete.output_ids) == all_tokens
    assert list(complete.output_logprobs.token_ids) == all_tokens
    assert len(complete.output_logprobs.token_logprobs) == len(all_tokens)
    assert [t for c in chunks for t in c.output_logprobs.token_ids] == all_tokens
    if k > 0:
        assert len(complete.output_logprobs.top_logprobs) == len(all_tokens)
        for top in complete.output_logprobs.top_logprobs:
            assert len(set(top.token_ids)) == len(top.token_ids) <= k
