"""Properties of the TokenSpeed translation and response building (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.checks import check_tokenspeed_request
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.translate.tokenspeed import ResponseBuilder, TranslationConfig, pb, translate_parallel
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.protocol import checks_tokenspeed
from zmqdispatch.wire import vllm as wire

SETTINGS = settings(deadline=None, max_examples=300, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CONFIG = TranslationConfig(max_model_len=256, vocab_size=5000, engine_index=0)

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": floats, "top_p": floats, "top_k": st.integers(-(2**31), 2**31 - 1), "min_p": floats,
        "frequency_penalty": floats, "presence_penalty": floats, "repetition_penalty": floats,
        "max_new_tokens": st.integers(0, 2**32 - 1), "min_new_tokens": st.integers(0, 2**32 - 1),
        "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=4), "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(), "n": st.integers(0, 200),
        "logit_bias": st.dictionaries(st.text(max_size=6), floats, max_size=3),
        "regex": st.text(max_size=8), "json_schema": st.text(max_size=12), "ebnf_grammar": st.text(max_size=8),
        "sampling_seed": st.integers(0, 2**64 - 1),
    },
)
requests = st.builds(
    lambda rid, ids, sp, lp, top, start, stream, dp: _req(rid, ids, sp, lp, top, start, stream, dp),
    st.text(max_size=8), st.lists(st.integers(0, 2**32 - 1), max_size=6), st.none() | sampling, st.booleans(),
    st.integers(0, 3), st.none() | st.integers(-3, 8), st.booleans(), st.none() | st.integers(0, 2),
)


def _req(rid, ids, sp, lp, top, start, stream, dp) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), return_logprob=lp,
                             top_logprobs_num=top, stream=stream)
    if sp is not None:
        one_constraint = {k: v for k, v in sp.items() if k not in ("regex", "json_schema", "ebnf_grammar")}
        for k in ("regex", "json_schema", "ebnf_grammar"):
            if k in sp:
                one_constraint[k] = sp[k]
                break
        req.sampling_params.CopyFrom(pb.SamplingParams(**one_constraint))
    if start is not None:
        req.logprob_start_len = start
    if dp is not None:
        req.data_parallel_rank = dp
    return req


@SETTINGS
@given(requests)
def test_any_request_is_refused_by_name_or_travels_intact(req: pb.GenerateRequest) -> None:
    try:
        samples = translate_parallel(req, CONFIG)
        for t in samples:
            check_tokenspeed_request(t.request, max_model_len=CONFIG.max_model_len, vocab_size=CONFIG.vocab_size)
    except RequestRejected as exc:
        assert exc.field, exc  # always names what is wrong
        return
    n = max(1, req.sampling_params.n)
    assert len(samples) == n
    for i, t in enumerate(samples):
        frames = ts.encode_add(t.request)
        back = ts_engine.decode_add(frames)
        assert back.rid == (req.request_id if n == 1 else f"{req.request_id}-{i}")
        assert back.input_ids == tuple(req.tokenized.input_ids)
        assert back.sampling_params == t.request.sampling_params.derive()
        assert back.return_logprob == req.return_logprob and back.stream == req.stream
        # nothing the engine would refuse without a reason
        assert checks_tokenspeed.admission_error(ts.finalize_add(back), vocab_size=CONFIG.vocab_size,
                                  enable_output_logprobs=True) is None


ticks = st.lists(st.lists(st.integers(3, 999), max_size=4), min_size=1, max_size=8)


@SETTINGS
@given(ticks, st.sampled_from([wire.FinishReason.STOP, wire.FinishReason.LENGTH]), st.booleans(), st.booleans(),
       st.booleans())
def test_chunks_add_up_to_the_complete(token_ticks, finish, stream, keep_stop, logprobs) -> None:
    if finish is wire.FinishReason.STOP and not token_ticks[-1]:
        token_ticks[-1] = [2]  # a "stop" always ends on its token
    b = ResponseBuilder("r", 4, stream=stream, no_stop_trim=keep_stop, return_logprob=logprobs)
    out = []
    for i, toks in enumerate(token_ticks):
        last = i == len(token_ticks) - 1
        lp = wire.LogprobsLists(token_ids=[[t] for t in toks], logprobs=[[-t / 1000] for t in toks], ranks=[])
        out += b.feed(OutputDelta("r", list(toks), finish_reason=finish if last else None,
                                  logprobs=lp if logprobs else None))
    assert b.done and out[-1].HasField("complete") and sum(r.HasField("complete") for r in out) == 1
    c = out[-1].complete
    engine_ids = [t for toks in token_ticks for t in toks]
    expected = engine_ids[:-1] if finish is wire.FinishReason.STOP and not keep_stop else engine_ids
    assert list(c.output_ids) == expected
    assert c.completion_tokens == len(engine_ids)
    assert (c.WhichOneof("matched_stop") == "matched_token_id") == (finish is wire.FinishReason.STOP)
    if stream:
        assert [t for r in out[:-1] for t in r.chunk.token_ids] == expected
        assert all(len(r.chunk.token_ids) > 0 for r in out[:-1])
    else:
        assert len(out) == 1
    if logprobs:
        assert list(c.output_logprobs.token_ids) == expected
        assert len(c.output_logprobs.token_logprobs) == len(expected)
