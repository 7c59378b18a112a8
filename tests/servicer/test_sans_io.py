"""The servicer's sans-IO parts: status mapping, metadata builders, the
tokenizer bundle, one Generate call's responses (no grpc server, no engine)."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqdispatch.errors import (
    ContextLengthError,
    DeadlineExceeded,
    DuplicateRequestIdError,
    EngineAbortedRequest,
    EngineDeadError,
    EngineRequestError,
    NoEngineAvailableError,
    RequestRejected,
    UnsupportedByRuntimeError,
)
from zmqdispatch.protocol.engines import EngineState
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.protocol.placement import EngineLoad
from zmqdispatch.servicer import facts
from zmqdispatch.servicer.generate import GenerateCall, TranslateOptions, translate
from zmqdispatch.servicer.status import status_of
from zmqdispatch.servicer.tokenizer_zip import build_bundle
from zmqdispatch.translate import tokenspeed as ts_translate
from zmqdispatch.translate import vllm as vllm_translate
from zmqdispatch.wire.vllm import FinishReason

vpb = vllm_translate.pb
tpb = ts_translate.pb


# --------------------------------------------------------------------------- status


@pytest.mark.parametrize(("exc", "code"), [
    (RequestRejected("sampling_params.top_p: must be in (0, 1]", field="sampling_params.top_p"), "INVALID_ARGUMENT"),
    (ContextLengthError("too long", prompt_len=10, max_tokens=5, max_model_len=8), "INVALID_ARGUMENT"),
    (DuplicateRequestIdError("r1 is live", field="request_id"), "ALREADY_EXISTS"),
    (EngineDeadError("gone", engine_index=0, reason="process_exit"), "UNAVAILABLE"),
    (NoEngineAvailableError("none up", states={0: "dead: sentinel"}), "UNAVAILABLE"),
    (DeadlineExceeded("late", limit="total", seconds=1.0, elapsed=1.2), "DEADLINE_EXCEEDED"),
    (EngineRequestError("engine error"), "INTERNAL"),
    (EngineAbortedRequest("refused", tokens_before_abort=0, status=400), "INVALID_ARGUMENT"),
    (EngineAbortedRequest("busy", tokens_before_abort=0, status=503), "UNAVAILABLE"),
    (EngineAbortedRequest("aborted", tokens_before_abort=3), "INTERNAL"),
    (UnsupportedByRuntimeError("no utility calls", runtime="tokenspeed"), "UNIMPLEMENTED"),
    (RuntimeError("bug"), "INTERNAL"),
])
def test_each_error_has_its_status(exc, code):
    got, message = status_of(exc)
    assert got == code
    assert message


@pytest.mark.parametrize(("exc", "said"), [
    # the engine requests' prompt fields become the GenerateRequest's
    (RequestRejected("prompt_token_ids: token id 99999 is not below vocab_size=32000", field="prompt_token_ids"),
     "tokenized.input_ids: token id 99999 is not below vocab_size=32000"),
    (RequestRejected("input_ids: token id 99999 is not below vocab_size=32000", field="input_ids"),
     "tokenized.input_ids: token id 99999 is not below vocab_size=32000"),
    (ContextLengthError("prompt_token_ids: prompt of 64 tokens does not fit max_model_len=64", prompt_len=64,
                        max_tokens=None, max_model_len=64), "tokenized.input_ids: prompt of 64 tokens does not fit"),
    # a message without its field gets it first; one that starts with it is kept
    (RequestRejected("no such engine", field="data_parallel_rank"), "data_parallel_rank: no such engine"),
    (RequestRejected("sampling_params.top_p: must be in (0, 1]", field="sampling_params.top_p"),
     "sampling_params.top_p: must be in (0, 1]"),
])
def test_a_refusal_names_the_generate_request_field_first(exc, said):
    code, message = status_of(exc)
    assert code == "INVALID_ARGUMENT" and message.startswith(said), message


def test_a_dead_engine_s_status_names_the_engine_and_why():
    code, message = status_of(EngineDeadError("engine process 7 exited with code 1", engine_index=0,
                                              reason="process_exit"))
    assert (code, message) == ("UNAVAILABLE", "EngineDeadError: engine 0 is dead (process_exit): engine process 7 "
                                              "exited with code 1")
    said = "engine 1 is dead (silence); request 'r' not sent"
    assert status_of(EngineDeadError(said, engine_index=1, reason="silence")) == ("UNAVAILABLE",
                                                                                  f"EngineDeadError: {said}")


def test_a_refused_request_names_its_field_even_when_the_message_does_not():
    code, message = status_of(RequestRejected("too large", field="sampling_params.max_tokens"))
    assert code == "INVALID_ARGUMENT"
    assert message.startswith("sampling_params.max_tokens: ")


# --------------------------------------------------------------------------- facts


def test_model_folder_facts_are_read_and_generation_config_eos_wins(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 1024, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": True,
        "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    got = facts.read_model_dir(str(tmp_path))
    assert got == {"vocab_size": 1024, "eos_token_ids": (2, 7), "bos_token_id": 1,
                   "architectures": ("LlamaForCausalLM",), "model_type": "llama"}  # a bool pad id is no id


def test_a_folder_without_config_gives_nothing_and_a_bad_one_is_named(tmp_path):
    assert facts.read_model_dir(str(tmp_path)) == {}
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        facts.read_model_dir(str(tmp_path))


def test_model_info_of_both_packages():
    f = facts.ModelFacts(served_model_name="tiny", model_path="/m", tokenizer_path="/m", vocab_size=1024,
                         eos_token_ids=(2,), bos_token_id=1, architectures=("LlamaForCausalLM",), model_type="llama")
    v = facts.vllm_model_info(f, 2**40)
    assert (v.served_model_name, v.model_path, v.tokenizer_path, v.vocab_size) == ("tiny", "/m", "/m", 1024)
    assert v.max_context_length == 2**32 - 1 and v.max_req_input_len == 2**31 - 1  # saturated, not wrapped
    assert list(v.eos_token_ids) == [2] and v.bos_token_id == 1 and v.is_generation
    t = facts.tokenspeed_model_info(f, 4096)
    assert (t.max_context_length, t.max_req_input_len, t.vocab_size) == (4096, 4094, 1024)


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed", "sglang"])
def test_max_req_input_len_is_the_longest_prompt_the_translation_takes(runtime):
    from smg_grpc_proto.generated import sglang_scheduler_pb2, tokenspeed_scheduler_pb2, vllm_engine_pb2

    from zmqdispatch.errors import ContextLengthError
    from zmqdispatch.protocol import checks
    from zmqdispatch.servicer.generate import TranslateOptions, translate

    pb = {"vllm": vllm_engine_pb2, "tokenspeed": tokenspeed_scheduler_pb2, "sglang": sglang_scheduler_pb2}[runtime]
    info = {"vllm": facts.vllm_model_info, "tokenspeed": facts.tokenspeed_model_info,
            "sglang": facts.sglang_model_info}[runtime]
    longest = info(facts.ModelFacts(served_model_name="m"), 64).max_req_input_len

    def request(n):
        return pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1] * n),
                                  sampling_params=pb.SamplingParams())

    def admitted(n):  # the servicer's translation, then the client's check before sending
        (t,) = translate(request(n), TranslateOptions(runtime=runtime), max_model_len=64, engine_index=None)
        if runtime == "vllm":
            checks.check_request(t.request, max_model_len=64)
        elif runtime == "tokenspeed":
            checks.check_tokenspeed_request(t.request, max_model_len=64)

    admitted(longest)
    with pytest.raises(ContextLengthError):
        admitted(longest + 1)


def _load(i, running=None, waiting=None, kv=None):
    return EngineLoad(engine_index=i, state=EngineState.UP, in_flight=0, other=0, kv_penalty=0.0,
                      reported_running=running, reported_waiting=waiting, kv_cache_usage=kv)


def test_loads_are_the_engines_reports_and_our_own_count_without_one():
    rows = facts.load_rows([_load(1, 3, 2, 0.25), _load(0)], {0: 4, 1: 9})
    assert [(r.dp_rank, r.num_running_reqs, r.num_waiting_reqs, r.token_usage, r.reported) for r in rows] == [
        (0, 4, 0, 0.0, False), (1, 3, 2, 0.25, True)]
    v = facts.vllm_loads(rows, version="x", now=0.0)
    assert v.dp_rank_count == 2 and v.timestamp == "1970-01-01T00:00:00.000000Z"
    assert [(x.dp_rank, x.num_total_reqs) for x in v.loads] == [(0, 4), (1, 5)]
    assert [x.dp_rank for x in facts.vllm_loads(rows, version="x", dp_rank=1).loads] == [1]
    t = facts.tokenspeed_loads(rows, version="x")
    assert (t.aggregate.total_running_reqs, t.aggregate.total_waiting_reqs, t.aggregate.total_reqs) == (7, 2, 9)


def test_server_info_of_both_packages():
    v = facts.vllm_server_info(active_requests=3, uptime_seconds=1.5, data_parallel_size=2, last_receive_timestamp=9.0)
    assert (v.active_requests, v.server_type, v.data_parallel_size) == (3, "vllm-grpc", 2)
    t = facts.tokenspeed_server_info(active_requests=1, uptime_seconds=2.0, data_parallel_size=1, start_time=10.0,
                                     facts=facts.ModelFacts(served_model_name="m"), max_model_len=64)
    assert t.server_args["served_model_name"] == "m" and t.server_args["context_length"] == 64
    assert t.start_time.seconds == 10


# --------------------------------------------------------------------------- tokenizer bundle


def test_the_bundle_zips_the_tokenizer_files_only_and_is_deterministic(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    a, b = build_bundle(str(tmp_path)), build_bundle(str(tmp_path))
    assert a.data == b.data and a.sha256 == hashlib.sha256(a.data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(a.data)) as zf:
        assert zf.namelist() == ["tokenizer.json", "tokenizer_config.json"]
        assert zf.read("tokenizer.json") == b'{"version": "1.0"}'


@given(size=st.integers(1, 5000), chunk=st.integers(1, 700))
def test_chunks_concatenate_to_the_zip_with_the_digest_on_the_last_only(size, chunk):
    from zmqdispatch.servicer.tokenizer_zip import TokenizerBundle
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    bundle = TokenizerBundle(data=data, sha256=hashlib.sha256(data).hexdigest(), names=())
    chunks = bundle.chunks(chunk)
    assert b"".join(c for c, _ in chunks) == data
    assert [s for _, s in chunks[:-1]] == [""] * (len(chunks) - 1) and chunks[-1][1] == bundle.sha256


def test_a_single_tokenizer_file_is_served_as_tokenizer_json_and_bad_paths_are_named(tmp_path):
    f = tmp_path / "tok.json"
    f.write_text("{}")
    with zipfile.ZipFile(io.BytesIO(build_bundle(str(f)).data)) as zf:
        assert zf.namelist() == ["tokenizer.json"]
    with pytest.raises(ValueError, match="no such file or folder"):
        build_bundle(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no tokenizer file in it"):
        build_bundle(str(empty))


# --------------------------------------------------------------------------- one Generate


def _vllm_request(n=1, stream=True, **sp):
    return vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                               sampling_params=vpb.SamplingParams(n=n, max_tokens=4, **sp), stream=stream)


def test_a_refused_field_is_raised_by_the_translation_with_its_name():
    req = _vllm_request(logprobs=50)
    with pytest.raises(RequestRejected) as info:
        translate(req, TranslateOptions(), max_model_len=64, engine_index=0)
    assert info.value.field == "sampling_params.logprobs"


def test_n_samples_fan_out_and_an_abort_completes_each_open_one():
    ts = translate(_vllm_request(n=3, temperature=1.0, seed=5), TranslateOptions(eos_token_ids=(2,)),
                   max_model_len=64, engine_index=None)
    call = GenerateCall("r", ts)
    assert [r.request_id for r in call.requests] == ["r-0", "r-1", "r-2"]
    assert [r.sampling_params.seed for r in call.requests] == [5, 6, 7]
    out = call.feed(1, OutputDelta("r-1", [7, 8], finish_reason=FinishReason.LENGTH))
    assert [x.WhichOneof("response") for x in out] == ["chunk", "complete"] and out[1].complete.index == 1
    call.feed(0, OutputDelta("r-0", [9]))
    ends = call.abort_responses()
    assert [(x.complete.index, x.complete.finish_reason, list(x.complete.output_ids)) for x in ends] == [
        (0, "abort", [9]), (2, "abort", [])]
    assert call.done and call.abort_responses() == []


def test_tokenspeed_requests_translate_with_their_own_package():
    req = tpb.GenerateRequest(request_id="t", tokenized=tpb.TokenizedInput(input_ids=[1, 2]),
                              sampling_params=tpb.SamplingParams(max_new_tokens=3), stream=False)
    (t,) = translate(req, TranslateOptions(runtime="tokenspeed"), max_model_len=64, engine_index=0)
    call = GenerateCall("t", [t])
    assert call.feed(0, OutputDelta("t", [5])) == []  # not streamed: only the complete
    (done,) = call.feed(0, OutputDelta("t", [6], finish_reason=FinishReason.LENGTH))
    assert done.request_id == "t" and list(done.complete.output_ids) == [5, 6]


def test_options_are_frozen():
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        TranslateOptions().runtime = "x"  # type: ignore[misc]
