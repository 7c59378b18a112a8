"""sglang.grpc.scheduler.GenerateRequest -> SGLang's TokenizedGenerateReqInput, and the responses."""

from __future__ import annotations

import pytest

from zmqdispatch import limits
from zmqdispatch.errors import ContextLengthError, RequestRejected
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.translate import sglang as tr
from zmqdispatch.translate.sglang import pb
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import vllm as vllm_wire

CFG = tr.TranslationConfig(max_model_len=64, vocab_size=1000, engine_index=1)


def request(**kw: object) -> pb.GenerateRequest:
    sp = kw.pop("sampling_params", None)
    req = pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), **kw)  # type: ignore[arg-type]
    if sp is not None:
        req.sampling_params.CopyFrom(sp)  # type: ignore[arg-type]
    return req


def test_sampling_params_are_mapped_and_proto3_zeros_take_sglangs_defaults() -> None:
    sp = pb.SamplingParams(temperature=0.5, top_k=20, max_new_tokens=7, min_new_tokens=1, stop=["\n"],
                           stop_token_ids=[5, 5, 9], ignore_eos=True, no_stop_trim=True, stream_interval=2,
                           logit_bias={"7": -1.5}, json_schema='{"type": "object"}', skip_special_tokens=True)
    t = tr.translate_request(request(sampling_params=sp, stream=True, require_reasoning=True,
                                     data_parallel_rank=1), CFG)
    p = t.request.sampling_params
    assert (p.temperature, p.top_k, p.max_new_tokens, p.min_new_tokens) == (0.5, 20, 7, 1)
    assert (p.top_p, p.min_p, p.repetition_penalty) == (1.0, 0.0, 1.0)  # proto3 zeros
    assert p.stop == ("\n",) and p.stop_token_ids == (5, 9) and p.logit_bias == {"7": -1.5}
    assert p.json_schema == '{"type": "object"}' and p.stream_interval == 2 and p.ignore_eos and p.no_stop_trim
    assert t.request.rid == "r" and t.request.input_ids == (1, 2, 3) and t.request.stream
    assert t.request.require_reasoning and t.request.routed_dp_rank is None
    # and it encodes and decodes on the scheduler side
    assert sg_engine.decode_add(sg.encode_add(t.request)).rid == "r"


def test_defaults_without_sampling_params() -> None:
    p = tr.translate_request(request(), CFG).request.sampling_params
    assert p == sg.SGLangSamplingParams(max_new_tokens=128)
    top_k_unset = tr.translate_request(request(sampling_params=pb.SamplingParams(top_k=0)), CFG)
    assert top_k_unset.request.sampling_params.top_k == -1


@pytest.mark.parametrize(("kw", "field", "text"), [
    ({"sampling_params": pb.SamplingParams(top_p=1.5)}, "sampling_params.top_p", "(0, 1]"),
    ({"sampling_params": pb.SamplingParams(temperature=-1)}, "sampling_params.temperature", ">= 0"),
    ({"sampling_params": pb.SamplingParams(top_k=-2)}, "sampling_params.top_k", ">= 1"),
    ({"sampling_params": pb.SamplingParams(frequency_penalty=3)}, "sampling_params.frequency_penalty", "[-2, 2]"),
    ({"sampling_params": pb.SamplingParams(repetition_penalty=2.5)}, "sampling_params.repetition_penalty", "(0, 2]"),
    ({"sampling_params": pb.SamplingParams(max_new_tokens=1, min_new_tokens=2)}, "sampling_params.min_new_tokens",
     "exceeds"),
    ({"sampling_params": pb.SamplingParams(stop=["x"] * 33)}, "sampling_params.stop", "32"),
    ({"sampling_params": pb.SamplingParams(stop_token_ids=[1000])}, "sampling_params.stop_token_ids", "1000"),
    ({"sampling_params": pb.SamplingParams(logit_bias={"x": 1.0})}, "sampling_params.logit_bias", "not a token id"),
    ({"sampling_params": pb.SamplingParams(regex="")}, "sampling_params.regex", "empty"),
    ({"sampling_params": pb.SamplingParams(n=2)}, "sampling_params.n", "translate_parallel"),
    ({"sampling_params": pb.SamplingParams(stream_interval=0)}, "sampling_params.stream_interval", ">= 1"),
    ({"return_logprob": True, "logprob_start_len": 0}, "logprob_start_len", "prompt logprobs"),
    ({"top_logprobs_num": 21, "return_logprob": True, "logprob_start_len": -1}, "top_logprobs_num", "[0, 20]"),
    ({"top_logprobs_num": 2}, "top_logprobs_num", "return_logprob"),
    ({"token_ids_logprob": [1]}, "token_ids_logprob", "not carried"),
    ({"return_hidden_states": True}, "return_hidden_states", "not carried"),
    ({"lora_id": "a"}, "lora_id", "LoRA"),
    ({"custom_logit_processor": "x"}, "custom_logit_processor", "not carried"),
    ({"input_embeds": [0.5]}, "input_embeds", "not carried"),
    ({"mm_inputs": pb.MultimodalInputs()}, "mm_inputs", "multimodal"),
    ({"disaggregated_params": pb.DisaggregatedParams()}, "disaggregated_params", "PD"),
    ({"data_parallel_rank": 0}, "data_parallel_rank", "rank 1"),
])
def test_refusals_name_field_and_limit(kw: dict[str, object], field: str, text: str) -> None:
    with pytest.raises(RequestRejected) as info:
        tr.translate_request(request(**kw), CFG)
    assert info.value.field == field and text in str(info.value)


def test_prompt_checks() -> None:
    with pytest.raises(RequestRejected, match="tokenized"):
        tr.translate_request(pb.GenerateRequest(request_id="r"), CFG)
    with pytest.raises(RequestRejected, match="must not be empty"):
        tr.translate_request(pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput()), CFG)
    with pytest.raises(RequestRejected, match="max_model_len=64"):
        tr.translate_request(pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1] * 64)), CFG)


def test_max_new_tokens_must_leave_the_sum_below_max_model_len() -> None:
    # prompt 3 + 60 = 63 < 64 is sent; 3 + 61 = 64 is refused, as SGLang's own front end does
    ok = tr.translate_request(request(sampling_params=pb.SamplingParams(max_new_tokens=60)), CFG)
    assert ok.request.sampling_params.max_new_tokens == 60
    with pytest.raises(ContextLengthError, match=r"max_new_tokens=61 does not fit max_model_len=64") as ei:
        tr.translate_request(request(sampling_params=pb.SamplingParams(max_new_tokens=61)), CFG)
    assert ei.value.field == "sampling_params.max_new_tokens" and ei.value.max_tokens == 61
    assert ei.value.prompt_len == 3 and ei.value.max_model_len == 64
    # unset: SGLang's default 128 is sent and its scheduler caps it to the context
    unset = tr.translate_request(request(), CFG)
    assert unset.request.sampling_params.max_new_tokens == 128


def test_n_fans_out_with_suffixed_ids() -> None:
    ts_ = tr.translate_parallel(request(sampling_params=pb.SamplingParams(n=3)), CFG)
    assert [t.request.rid for t in ts_] == ["r-0", "r-1", "r-2"] and [t.index for t in ts_] == [0, 1, 2]
    assert all(t.request.sampling_params.n == 1 and t.response_request_id == "r" for t in ts_)
    with pytest.raises(RequestRejected, match="exceeds the limit"):
        tr.translate_parallel(request(sampling_params=pb.SamplingParams(n=limits.MAX_PARALLEL_SAMPLES + 1)), CFG)


def test_responses_chunks_complete_logprobs_and_matched_stop() -> None:
    lp_req = tr.translate_request(request(return_logprob=True, logprob_start_len=-1, top_logprobs_num=2), CFG)
    assert lp_req.request.top_logprobs_num == 2 and lp_req.return_logprob
    b = tr.ResponseBuilder("r", 3, index=2, return_logprob=True)
    lp = vllm_wire.LogprobsLists(token_ids=[[5, 5, 8]], logprobs=[[-0.1, -0.1, -2.0]], ranks=[])
    first = b.feed(OutputDelta("r", [5], logprobs=lp, num_prompt_tokens=3, num_cached_tokens=1))
    assert len(first) == 1 and list(first[0].chunk.token_ids) == [5] and first[0].chunk.index == 2
    assert list(first[0].chunk.output_logprobs.top_logprobs[0].token_ids) == [5, 8]
    lp2 = vllm_wire.LogprobsLists(token_ids=[[2, 2, 4]], logprobs=[[-0.5, -0.5, -1.0]], ranks=[])
    last = b.feed(OutputDelta("r", [2], vllm_wire.FinishReason.STOP, stop_reason=2, logprobs=lp2))
    assert [r.WhichOneof("response") for r in last] == ["chunk", "complete"]
    c = last[1].complete
    assert list(c.output_ids) == [5, 2] and c.finish_reason == "stop" and c.matched_token_id == 2
    assert c.cached_tokens == 1 and c.completion_tokens == 2 and len(c.output_logprobs.token_logprobs) == 2
    s = tr.ResponseBuilder("q", 1, stream=False)
    assert s.feed(OutputDelta("q", [1])) == []
    done = s.feed(OutputDelta("q", [2], vllm_wire.FinishReason.STOP, stop_reason="END"))
    assert done[0].complete.matched_stop_str == "END" and list(done[0].complete.output_ids) == [1, 2]
    with pytest.raises(RuntimeError):
        s.feed(OutputDelta("q", []))


@pytest.mark.parametrize("shape", [[0, 3, 224, 224], [3, 0, 224], [1, 3, 224, 224]])
def test_multimodal_input_of_any_shape_is_refused_before_anything_is_built(shape: list[int]) -> None:
    # SGLang's ZMQ transport carries no multimodal input: zero-size or not, mm_inputs is
    # refused as a whole, for one sample and for a fan-out alike
    mm = pb.MultimodalInputs(pixel_values=pb.TensorData(shape=shape, dtype="float32"))
    for translate in (tr.translate_request, tr.translate_parallel):
        with pytest.raises(RequestRejected) as info:
            translate(request(mm_inputs=mm), CFG)
        assert info.value.field == "mm_inputs" and "not supported" in str(info.value)
