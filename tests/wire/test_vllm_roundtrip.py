"""Property tests of the vLLM wire codec: round trips, decoder tolerance, hostile input.

- encode -> decode round trips for EngineCoreRequest (with valid SamplingParams) and
  for output messages (logprobs inline and in aux frames, 0.32 and 0.33 rows);
- tolerance like msgspec's array_like decoding: missing trailing elements take the
  defaults, extra trailing elements are ignored, unknown map keys are ignored;
- hostile bytes and msgpack values into every decoder raise only RemoteProtocolError,
  and lying tensor headers are refused before anything is allocated.
"""

from __future__ import annotations

import math
import struct

import attrs
import re

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch import limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire import vllm as w
from zmqdispatch.wire import vllm_engine as w_engine
from zmqdispatch.wire import vllm_handshake as handshake
from zmqdispatch.wire.tensors import Tensor, decode_tensor, encode_tensor, ext_hook

SETTINGS = settings(
    deadline=None, max_examples=100, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# ----------------------------------------------------------------- strategies

int64 = st.integers(-(2**63), 2**63 - 1)
int32 = st.integers(-(2**31), 2**31 - 1)
token = st.integers(0, 2**31 - 1)
small = st.integers(0, 1000)
floats = st.floats(allow_nan=False)
f32 = st.floats(allow_nan=False, width=32)
text = st.text(max_size=8)

# JSON-like opaque values; lists only (the request decoder gives lists back).
json_values = st.recursive(
    st.none() | st.booleans() | int64 | floats | text,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3),
    max_leaves=8,
)
json_maps = st.dictionaries(text, json_values, max_size=3)
scalar_maps = st.dictionaries(text, st.none() | st.booleans() | int64 | text, max_size=3)


def opt(s: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | s


structured = st.builds(
    w.StructuredOutputsParams,
    json=opt(text | json_maps),
    regex=opt(text),
    choice=opt(st.lists(text, max_size=3)),
    grammar=opt(text),
    json_object=opt(st.booleans()),
    disable_any_whitespace=st.booleans(),
    disable_additional_properties=st.booleans(),
    whitespace_pattern=opt(text),
    structural_tag=opt(text),
    backend=opt(st.sampled_from(["xgrammar", "guidance", "outlines"])),
    backend_was_auto=st.booleans(),
)
repetition = st.builds(w.RepetitionDetectionParams, max_pattern_size=small, min_pattern_size=small, min_count=small)

SP_FIELDS = {
    "n": st.integers(1, 8),
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "temperature": floats | st.integers(0, 3),  # ints must still travel as floats
    "watermarking": opt(st.booleans()),
    "top_p": floats,
    "top_k": int32,
    "min_p": floats,
    "seed": opt(int64),
    "stop": st.lists(text, max_size=3),
    "stop_token_ids": st.lists(token, max_size=3),
    "ignore_eos": st.booleans(),
    "max_tokens": opt(st.integers(1, 1 << 20)),
    "min_tokens": small,
    "logprobs": opt(st.integers(-1, 20)),
    "prompt_logprobs": opt(st.integers(-1, 20)),
    "prompt_logprob_token_ids": opt(st.lists(token, max_size=3)),
    "prompt_logprob_start": opt(small),
    "logprob_token_ids": opt(st.lists(token, max_size=3)),
    "flat_logprobs": st.booleans(),
    "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "output_kind": st.sampled_from(list(w.RequestOutputKind)),
    "stream_interval": opt(small),
    "skip_clone": st.booleans(),
    "output_text_buffer_length": small,
    "eos_token_id": opt(token),
    "all_stop_token_ids": st.lists(token, max_size=4).map(w.set_order),
    "watermarking_skipped": st.booleans(),
    "structured_outputs": opt(structured),
    "logit_bias": opt(st.dictionaries(token, floats, max_size=3)),
    "allowed_token_ids": opt(st.lists(token, max_size=3)),
    "extra_args": opt(json_maps),
    "bad_words": st.lists(text, max_size=2),
    "bad_words_token_ids": opt(st.lists(st.lists(token, max_size=2), max_size=2)),
    "skip_reading_prefix_cache": opt(st.booleans()),
    "thinking_token_budget": opt(small),
    "repetition_detection": opt(repetition),
    "routed_experts_prompt_start": small,
    "trace_decode_token_ids": opt(st.booleans()),
}
sampling_params = st.fixed_dictionaries({}, optional=SP_FIELDS).map(lambda kw: w.SamplingParams(**kw))


@st.composite
def tensors(draw: st.DrawFn, dtype: str = "float32") -> Tensor:
    rows = draw(st.integers(0, 3))
    cols = draw(st.integers(0, 80))  # 80 4-byte columns cross the 256 B aux threshold
    data = draw(st.binary(min_size=rows * cols * 4, max_size=rows * cols * 4))
    return Tensor(dtype, (rows, cols), data)


def int_tensors() -> st.SearchStrategy:
    return tensors("int32")


requests = st.builds(
    w.EngineCoreRequest,
    request_id=text,
    prompt_token_ids=opt(st.lists(token, max_size=6)),
    mm_features=opt(st.lists(json_values, max_size=2)),
    sampling_params=opt(sampling_params),
    pooling_params=opt(json_maps),
    arrival_time=floats,
    lora_request=opt(st.lists(json_values, max_size=3)),
    cache_salt=opt(text),
    data_parallel_rank=opt(small),
    prompt_embeds=opt(tensors()),
    prompt_is_token_ids=opt(st.lists(st.booleans(), max_size=3)),
    client_index=small,
    current_wave=small,
    priority=int32,
    trace_headers=opt(st.dictionaries(text, text, max_size=2)),
    resumable=st.booleans(),
    external_req_id=opt(text),
    reasoning_ended=opt(st.booleans()),
    reasoning_parser_kwargs=opt(json_maps),
    abort_immediately=st.booleans(),
    session_id=opt(text),
    kv_hints=opt(json_maps),
)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@st.composite
def logprobs_lists(draw: st.DrawFn) -> w.LogprobsLists:
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 70))  # 4 x 70 x 4 B = 1120 B: aux; 1 x 1: inline
    # Values from a seeded PRNG: drawing thousands of numbers one by one is slow.
    rnd = draw(st.randoms(use_true_random=False))
    ids = [[rnd.randrange(2**31) for _ in range(cols)] for _ in range(rows)]
    lps = [[_f32(rnd.uniform(-50.0, 0.0)) for _ in range(cols)] for _ in range(rows)]
    ranks = [rnd.randrange(1, 2**31) for _ in range(rows)]
    return w.LogprobsLists(ids, lps, ranks)


events = st.builds(w_engine.EngineCoreEvent, type=st.sampled_from(list(w.EventType)), timestamp=floats)
prefill = st.builds(w_engine.PrefillStats, **{f.name: small for f in attrs.fields(w_engine.PrefillStats)})


def outputs(with_error: bool) -> st.SearchStrategy:
    return st.builds(
        w_engine.EngineCoreOutput,
        request_id=text,
        new_token_ids=st.lists(token, max_size=5),
        new_logprobs=opt(logprobs_lists()),
        new_prompt_logprobs_tensors=opt(logprobs_lists()),
        pooling_output=opt(tensors()),
        finish_reason=opt(st.sampled_from(list(w.FinishReason))),
        stop_reason=opt(token | text),
        events=opt(st.lists(events, max_size=2)),
        kv_transfer_params=opt(scalar_maps),
        ec_transfer_params=opt(scalar_maps),
        trace_headers=opt(st.dictionaries(text, text, max_size=2)),
        prefill_stats=opt(prefill),
        routed_experts=opt(int_tensors()),
        num_nans_in_logits=small,
        mm_cache_miss_hashes=opt(st.lists(text, max_size=2)),
        prompt_token_id_logprobs=opt(tensors()),
        error=opt(st.builds(w_engine.OutputError, code=text, message=text, retryable=st.booleans()))
        if with_error
        else st.none(),
    )


@st.composite
def output_messages(draw: st.DrawFn, with_error: bool = False) -> tuple[dict, list[w_engine.EngineCoreOutput]]:
    outs = draw(st.lists(outputs(with_error), max_size=4))
    env = dict(
        engine_index=draw(small),
        timestamp=draw(floats),
        scheduler_stats=draw(opt(scalar_maps)),
        utility_output=draw(
            opt(
                st.builds(
                    w.UtilityOutput,
                    call_id=st.integers(0, 2**64 - 1),
                    failure_message=opt(text),
                    result=opt(st.builds(w.UtilityResult, st.none() | st.booleans() | int64 | text)),
                )
            )
        ),
        finished_requests=draw(opt(st.lists(text, max_size=3).map(tuple))),
        wave_complete=draw(opt(small)),
        start_wave=draw(opt(small)),
        weight_version=draw(opt(text)),
    )
    return env, outs


def encode_message(env: dict, outs: list[w_engine.EngineCoreOutput], version: str = "0.32.0") -> list[bytes]:
    return w_engine.encode_outputs(env["engine_index"], outs, vllm_version=version, **{
        k: v for k, v in env.items() if k != "engine_index"
    })


def check_message(decoded: w.EngineCoreOutputs, env: dict, outs: list[w_engine.EngineCoreOutput]) -> None:
    assert decoded.engine_index == env["engine_index"]
    for key in ("timestamp", "scheduler_stats", "utility_output", "finished_requests",
                "wave_complete", "start_wave", "weight_version"):
        assert getattr(decoded, key) == env[key], key
    assert len(decoded.outputs) == len(outs)
    for row, out in zip(decoded.outputs, outs):
        assert isinstance(row, w.EngineCoreOutputRow)
        assert row.request_id == out.request_id
        assert row.new_token_ids == tuple(out.new_token_ids)
        assert w_engine.EngineCoreOutput.from_row(row, decoded.frames) == out


# ----------------------------------------------------------------- round trips


@SETTINGS
@given(requests)
def test_request_roundtrip(req: w.EngineCoreRequest) -> None:
    frames = w.encode_request(req)
    assert frames[0][:3] == b"\xdc\x00\x16"  # all 22 fields, always
    assert w_engine.decode_request(frames) == req
    # Encoding is a function of the value: the decoded request re-encodes identically.
    assert w.encode_request(w_engine.decode_request(frames)) == frames


@SETTINGS
@given(sampling_params)
def test_sampling_params_floats_are_float64(sp: w.SamplingParams) -> None:
    req = w.EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=sp, arrival_time=1)
    payload = w.encode_request(req)[0]
    sp_map = msgpack.unpackb(payload, strict_map_key=False)[3]
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
        if key in sp_map:
            assert type(sp_map[key]) is float
    assert "temperature" in sp_map and "stop" in sp_map and "skip_reading_prefix_cache" in sp_map


@SETTINGS
@given(output_messages())
def test_outputs_roundtrip(message: tuple[dict, list[w_engine.EngineCoreOutput]]) -> None:
    env, outs = message
    frames = encode_message(env, outs)
    decoded = w.decode_outputs(frames)
    check_message(decoded, env, outs)
    for row in decoded.outputs:
        assert row.error is None


@SETTINGS
@given(output_messages(with_error=True))
def test_outputs_roundtrip_vllm_033_rows(message: tuple[dict, list[w_engine.EngineCoreOutput]]) -> None:
    env, outs = message
    frames = encode_message(env, outs, "0.33.0")
    decoded = w.decode_outputs(frames)
    check_message(decoded, env, outs)
    for row, out in zip(decoded.outputs, outs):
        if out.error is not None:
            assert row.error == {"code": out.error.code, "message": out.error.message,
                                      "retryable": out.error.retryable}


def test_logprobs_inline_and_aux_frames() -> None:
    small_lp = w.LogprobsLists([[5]], [[-0.5]], [1])
    big_lp = w.LogprobsLists([list(range(64))], [[-1.0] * 64], [3])  # 256 B each: aux
    frames = w_engine.encode_outputs(
        0,
        [w_engine.EngineCoreOutput(request_id="a", new_token_ids=[5], new_logprobs=small_lp),
         w_engine.EngineCoreOutput(request_id="b", new_token_ids=[0], new_logprobs=big_lp,
                            new_prompt_logprobs_tensors=big_lp)],
        timestamp=1.0,
    )
    assert len(frames) == 5 and all(len(f) == 256 for f in frames[1:])
    d = w.decode_outputs(frames)
    raw_b = d.outputs[1].new_logprobs
    assert raw_b[0][2] == 1 and raw_b[1][2] == 2  # indexes are global to the message
    # [dtype, shape, data] as msgspec decodes an Any: arrays as lists (the reference too)
    assert d.outputs[1].new_prompt_logprobs_tensors[0][:2] == ["int32", [1, 64]]
    assert w.decode_logprobs_lists(d.outputs[0].new_logprobs, d.frames) == small_lp
    assert w.decode_logprobs_lists(raw_b, d.frames) == big_lp
    assert w.decode_logprobs_tensors(d.outputs[1].new_prompt_logprobs_tensors, d.frames) == big_lp
    assert w._decode_outputs_msgpack(frames) == d


def test_logprobs_shape_disagreement_is_refused() -> None:
    aux: list[bytes] = []
    ids = encode_tensor("int32", (2, 3), bytes(24), aux, torch=False)
    lps = encode_tensor("float32", (2, 2), bytes(16), aux, torch=False)
    ranks = encode_tensor("int64", (2,), bytes(16), aux, torch=False)
    raw = msgpack.unpackb(msgpack.packb([ids, lps, ranks, None]), ext_hook=ext_hook)
    with pytest.raises(RemoteProtocolError, match="shapes disagree"):
        w.decode_logprobs_lists(raw, [b""])
    ranks3 = encode_tensor("int64", (3,), bytes(24), aux, torch=False)
    lps2 = encode_tensor("float32", (2, 3), bytes(24), aux, torch=False)
    raw = msgpack.unpackb(msgpack.packb([ids, lps2, ranks3, None]), ext_hook=ext_hook)
    with pytest.raises(RemoteProtocolError, match="shapes disagree"):
        w.decode_logprobs_lists(raw, [b""])


def test_tensor_dtypes_tolist() -> None:
    cases = [
        ("bool", [True, False, True]), ("|b1", [False, True, True]), ("uint8", [0, 255, 7]),
        ("int8", [-128, 0, 127]), ("<i2", [-2, 3, 4]), ("uint16", [1, 2, 65535]),
        ("<i4", [-1, 2, 3]), ("uint32", [0, 2**32 - 1, 5]), ("<i8", [-(2**63), 0, 2**63 - 1]),
        ("<u8", [0, 1, 2**64 - 1]), ("float16", [0.5, -2.0, 65504.0]), ("bfloat16", [1.0, -0.5, 256.0]),
        ("<f4", [0.25, -1.5, 3.0]), ("float64", [0.1, -1e300, 2.5]),
    ]
    for dtype, values in cases:
        t = Tensor.from_values(dtype, (3,), values)
        back = decode_tensor([dtype, [3], t.data], [b""])
        assert back.tolist() == values, dtype
        assert Tensor.from_values(dtype, (1, 3), values).tolist() == [values]
    # big-endian numpy strings are byte-swapped when read
    assert Tensor(">i4", (2,), b"\x00\x00\x00\x01\xff\xff\xff\xfe").tolist() == [1, -2]
    assert Tensor(">f2", (1,), b"\x3c\x00").tolist() == [1.0]
    # zeros in the shape and 0-d
    assert Tensor("int32", (2, 0, 3), b"").tolist() == [[], []]
    assert Tensor("int32", (0, 3), b"").tolist() == []
    assert Tensor("<i8", (), (7).to_bytes(8, "little")).tolist() == 7
    # 0-d is always inline, whatever the threshold
    aux: list[bytes] = []
    assert type(encode_tensor("int64", (), bytes(8), aux, torch=True, threshold=0)[2]) is msgpack.ExtType


# ----------------------------------------------------------------- tolerance


@SETTINGS
@given(output_messages(), st.integers(2, 18), st.integers(2, 9))
def test_outputs_missing_trailing_elements_take_defaults(
    message: tuple[dict, list[w_engine.EngineCoreOutput]], row_len: int, env_len: int
) -> None:
    env, outs = message
    frames = encode_message(env, outs)
    obj = msgpack.unpackb(frames[0], strict_map_key=False)
    obj[1] = [row[:row_len] for row in obj[1]]
    full_rows = [msgspec.structs.astuple(r) for r in w.decode_outputs(frames).outputs]
    obj = obj[:env_len]
    d = w.decode_outputs([msgpack.packb(obj, use_bin_type=True), *frames[1:]])
    defaults = (0, (), None, 0.0, None, None, None, None, None)
    for i, key in enumerate(("engine_index", "outputs", "scheduler_stats", "timestamp", "utility_output",
                             "finished_requests", "wave_complete", "start_wave", "weight_version")):
        if i >= env_len:
            assert getattr(d, key) == defaults[i], key
    default_row = (None,) * 13 + (0,) + (None,) * 5  # vLLM's defaults; num_nans_in_logits = 0
    for decoded, full in zip(d.outputs, full_rows):
        row = msgspec.structs.astuple(decoded)
        assert len(row) == len(w.ROW_FIELDS)
        assert row[:row_len] == full[:row_len]
        assert row[row_len:] == default_row[row_len:]


@SETTINGS
@given(output_messages(with_error=True), st.lists(json_values, min_size=1, max_size=3))
def test_outputs_extra_trailing_elements_are_ignored(
    message: tuple[dict, list[w_engine.EngineCoreOutput]], extra: list
) -> None:
    env, outs = message
    frames = encode_message(env, outs, "0.33.0")
    obj = msgpack.unpackb(frames[0], strict_map_key=False)
    obj[1] = [row + extra for row in obj[1]]
    obj = obj + extra
    d = w.decode_outputs([msgpack.packb(obj, use_bin_type=True), *frames[1:]])
    check_message(d, env, outs)


@SETTINGS
@given(requests, st.integers(9, 22), st.lists(json_values, max_size=3))
def test_request_truncation_and_extra_elements(req: w.EngineCoreRequest, keep: int, extra: list) -> None:
    frames = w.encode_request(req)
    arr = msgpack.unpackb(frames[0], strict_map_key=False)
    truncated = w_engine.decode_request([msgpack.packb(arr[:keep], use_bin_type=True), *frames[1:]])
    names = [f.name for f in attrs.fields(w.EngineCoreRequest)]
    defaults = {"client_index": 0, "current_wave": 0, "priority": 0, "resumable": False,
                "abort_immediately": False}
    for i, name in enumerate(names):
        expected = getattr(req, name) if i < keep else defaults.get(name)
        assert getattr(truncated, name) == expected, name
    longer = w_engine.decode_request([msgpack.packb(arr + extra, use_bin_type=True), *frames[1:]])
    assert longer == req


@SETTINGS
@given(sampling_params, st.data())
def test_sampling_params_missing_and_unknown_keys(sp: w.SamplingParams, data: st.DataObject) -> None:
    req = w.EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=sp, arrival_time=0.0)
    arr = msgpack.unpackb(w.encode_request(req)[0], strict_map_key=False)
    keys = list(arr[3])
    dropped = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
    for k in dropped:
        del arr[3][k]
    arr[3]["some_future_field"] = [1, {"x": 2}]
    arr[3][7] = "int key"
    got = w_engine.decode_request([msgpack.packb(arr, use_bin_type=True)]).sampling_params
    default = w.SamplingParams()
    for f in attrs.fields(w.SamplingParams):
        wire = f.metadata["wire"] or f.name
        if wire in dropped and f.name != "skip_reading_prefix_cache":
            assert getattr(got, f.name) == getattr(default, f.name), f.name
        elif wire not in dropped:
            assert getattr(got, f.name) == getattr(sp, f.name), f.name
    assert got.skip_reading_prefix_cache in (True, False)


def test_minimum_request_decodes_with_vllm_defaults() -> None:
    payload = msgpack.packb(["r", [1, 2], None, {"max_tokens": 3}, None, 5, None, None, None])
    req = w_engine.decode_request([payload])
    assert req.arrival_time == 5.0 and type(req.arrival_time) is float
    assert req.sampling_params == w.SamplingParams(max_tokens=3)
    assert req.sampling_params.stop == () and req.sampling_params.skip_reading_prefix_cache is False
    assert req.client_index == 0 and req.kv_hints is None
    sp = w_engine.decode_request([msgpack.packb(["r", [1], None, {"prompt_logprobs": 2, "stop": "x"}, None, 0.0,
                                          None, None, None])]).sampling_params
    assert sp.skip_reading_prefix_cache is True and sp.stop == ("x",)


def test_handshake_tolerance() -> None:
    hs = handshake.decode_handshake_status(msgpack.packb({"status": "READY", "local": True, "headless": True,
                                                  "parallel_config_hash": "abc", "num_redundant_experts": 3}))
    assert hs == handshake.HandshakeStatus(status="READY", local=True, headless=True, parallel_config_hash="abc")
    assert handshake.decode_handshake_status(msgpack.packb({"status": "HELLO"})).local is False
    ready = handshake.encode_ready(False, True, "h1")
    assert handshake.decode_handshake_status(ready).parallel_config_hash == "h1"
    init = handshake.decode_init(msgpack.packb({"addresses": {"inputs": ["a"], "outputs": ["b"]}}))
    assert init.inputs == ("a",) and init.coordinator_input is None and init.parallel_config == {}


def test_ready_response_tolerance() -> None:
    r = handshake.decode_ready_response(msgpack.packb({
        "max_model_len": 4096, "prefix_granularity": 64, "max_num_batched_tokens": -1,
        "vllm_version": "tokenspeed-0.1.1", "coord_store_port": 0, "multimodal_encoder_dtype": None,
        "kv_cache_max_concurrency": 3,
    }))
    assert r.block_size == 64 and r.max_num_batched_tokens == -1 and r.world_size == 1
    assert r.kv_cache_max_concurrency == 3.0 and type(r.kv_cache_max_concurrency) is float
    assert handshake.decode_ready_response(msgpack.packb({"max_model_len": 8, "block_size": 16,
                                                  "prefix_granularity": 64})).block_size == 16
    for bad in ({}, {"max_model_len": 0}, {"max_model_len": "256"}, {"max_model_len": True},
                {"max_model_len": 1.0}, {"max_model_len": 8, "num_gpu_blocks": 1.5},
                {"max_model_len": 8, "dtype": 5}, {"max_model_len": 8, "kv_events_config": 3}, [1]):
        with pytest.raises(RemoteProtocolError):
            handshake.decode_ready_response(msgpack.packb(bad))
    with pytest.raises(RemoteProtocolError, match="max_model_len"):
        handshake.decode_ready_response(msgpack.packb({"block_size": 16}))
    with pytest.raises(RemoteProtocolError, match="num_gpu_blocks"):
        handshake.decode_ready_response(msgpack.packb({"max_model_len": 8, "num_gpu_blocks": "x"}))


# ----------------------------------------------------------------- hostile input

DECODERS = [
    lambda b: w.decode_outputs([b]),
    lambda b: w.decode_outputs([b, b]),
    lambda b: w_engine.decode_request([b]),
    lambda b: w_engine.decode_request([b, b"\x00" * 16]),
    handshake.decode_handshake_status,
    handshake.decode_ready_response,
    handshake.decode_init,
    w_engine.decode_abort,
    w_engine.decode_utility_call,
    w_engine.decode_start_dp_wave,
]


def only_remote_errors(fn, arg) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(arg)
    except RemoteProtocolError:
        pass


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_remote_protocol_error(payload: bytes) -> None:
    for decode in DECODERS:
        only_remote_errors(decode, payload)


ext_types = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=24))
msgpack_scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=8) | ext_types
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda c: st.lists(c, max_size=5)
    | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5) | st.none(), c, max_size=4),
    max_leaves=25,
)


@st.composite
def _mutated(draw: st.DrawFn, base: list) -> list:
    """``base`` with a few positions replaced by junk, then truncated or extended."""
    value = list(base)
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(value) - 1))
        value[i] = draw(msgpack_values)
    cut = draw(st.integers(0, len(value) + 2))
    return value[:cut] + draw(st.lists(msgpack_values, max_size=2)) if cut > len(value) else value[:cut]


@st.composite
def output_like(draw: st.DrawFn) -> list:
    """Valid-looking EngineCoreOutputs with a few fields (envelope, rows, logprobs) broken."""
    aux: list = []
    logprobs = [encode_tensor("int32", (1, 2), bytes(8), aux, torch=False),
                encode_tensor("float32", (1, 2), bytes(8), aux, torch=False),
                encode_tensor("int64", (1,), bytes(8), aux, torch=False), None]
    rows = []
    for _ in range(draw(st.integers(0, 3))):
        row = ["r", [1, 2], draw(_mutated(logprobs)), None, None, draw(st.none() | st.integers(-1, 5)),
               None, None, None, None, None, {"num_prompt_tokens": 5}, None, 0, None, None, None, None]
        rows.append(draw(_mutated(row)))
    env = [0, rows, None, 1.0, None, None, None, None, "default"]
    return draw(_mutated(env)) if draw(st.booleans()) else env


@SETTINGS
@given(msgpack_values | output_like())
def test_arbitrary_msgpack_raises_only_remote_protocol_error(value: object) -> None:
    payload = msgpack.packb(value, use_bin_type=True)
    for decode in DECODERS:
        only_remote_errors(decode, payload)
    try:
        d = w.decode_outputs([payload, b"\x00" * 8])
    except RemoteProtocolError:
        return
    for row in d.outputs:  # lazily decoded parts obey the same contract
        only_remote_errors(lambda r: w.decode_logprobs_lists(r, d.frames), row.new_logprobs)
        only_remote_errors(lambda r: w.decode_logprobs_tensors(r, d.frames), row.new_prompt_logprobs_tensors)
        only_remote_errors(lambda r: w_engine.EngineCoreOutput.from_row(r, d.frames), row)


@SETTINGS
@given(
    st.sampled_from(["<i4", "int32", "float16", "bfloat16", "|b1", ">f8", "uint64", "<c8", "object", ""])
    | st.text(max_size=4) | st.integers(-(2**63), 2**64 - 1),
    st.lists(st.integers(-3, 2**64 - 1), max_size=6) | msgpack_values,
    st.binary(max_size=64) | st.integers(-2, 4) | ext_types | msgpack_values,
)
def test_tensor_decode_raises_only_remote_protocol_error(dtype: object, shape: object, data: object) -> None:
    frames = [b"body", b"\x01" * 8, b"\x02" * 16]
    raw = msgpack.unpackb(msgpack.packb([dtype, shape, data], use_bin_type=True), use_list=False,
                          strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    try:
        t = decode_tensor(raw, frames)
    except RemoteProtocolError:
        return
    assert t.nbytes == t.numel * t.info.itemsize <= 16 + 8
    t.tolist()


def test_lying_tensor_headers_are_refused_without_allocation() -> None:
    for shape in ([2**40], [2**20, 2**20], [limits.MAX_TENSOR_ELEMENTS + 1], [2**64 - 1, 0]):
        with pytest.raises(RemoteProtocolError):
            decode_tensor(["int32", shape, b"\x00" * 4], [b""])
    with pytest.raises(RemoteProtocolError, match="elements"):
        decode_tensor(["int32", [2**40], 1], [b"", b"\x00" * 4])
    with pytest.raises(RemoteProtocolError, match="bytes"):
        decode_tensor(["int32", [3], b"\x00" * 8], [b""])
    with pytest.raises(RemoteProtocolError, match="index"):
        decode_tensor(["int32", [1], 0], [b"\x00" * 4])  # frame 0 is the body, never data
    with pytest.raises(RemoteProtocolError, match="index"):
        decode_tensor(["int32", [1], 2], [b"", b"\x00" * 4])
    with pytest.raises(RemoteProtocolError, match=r"index|ext type"):
        decode_tensor(["int32", [1], True], [b"", b"\x00" * 4])
    with pytest.raises(RemoteProtocolError, match=r"rank|shape"):
        decode_tensor(["int32", [1] * 65, b"\x00" * 4], [b""])
    for code in (1, 2, 9):
        with pytest.raises(RemoteProtocolError, match="ext type"):
            decode_tensor(["int32", [1], msgpack.ExtType(code, b"\x00" * 4)], [b""])


@pytest.mark.parametrize("code", [1, 2, 42, 127])
def test_pickle_and_unknown_ext_types_are_refused_anywhere(code: int) -> None:
    body = msgpack.packb([0, [], {"x": msgpack.ExtType(code, b"\x80\x04N.")}, 1.0])
    with pytest.raises(RemoteProtocolError, match="ext type"):
        w.decode_outputs([body])
    with pytest.raises(RemoteProtocolError, match="ext type"):
        w_engine.decode_request([msgpack.packb(["r", [1], None, None, None, 0.0, None, None, None,
                                         msgpack.ExtType(code, b"x")])])


def _row(**changes: object) -> list:
    row: list = ["r", [1]] + [None] * 11 + [0] + [None] * 4
    for k, v in changes.items():
        row[w.ROW_FIELDS.index(k)] = v
    return row


@pytest.mark.parametrize(
    ("row", "field"),
    [
        (_row(request_id=b"r"), "request_id"),
        (_row(request_id=None), "request_id"),
        (_row(new_token_ids=[-1]), "new_token_ids"),
        (_row(new_token_ids=[True]), "new_token_ids"),
        (_row(new_token_ids=[1.0]), "new_token_ids"),
        (_row(new_token_ids=None), "new_token_ids"),
        (_row(new_token_ids={"a": 1}), "new_token_ids"),
        (_row(finish_reason=5), "finish_reason"),
        (_row(finish_reason=-1), "finish_reason"),
        (_row(finish_reason="stop"), "finish_reason"),
        (_row(stop_reason=1.5), "stop_reason"),
        (_row(stop_reason=[7]), "stop_reason"),
        (_row(prefill_stats=[5]), "prefill_stats"),
        (_row(prefill_stats={"num_prompt_tokens": -1}), "prefill_stats"),
        (_row(prefill_stats={"num_cached_tokens": "3"}), "prefill_stats"),
        (_row(stop_reason=-5), "stop_reason"),
        (_row(new_token_ids=[2**32]), "new_token_ids"),
        (["r"], "row"),
        ("r", "row"),
    ],
)
def test_bad_rows_name_the_field(row: object, field: str) -> None:
    # A bad row is set aside with its request id (when readable); the good rows
    # of the same message are still decoded.
    good = _row()
    msg = w.decode_outputs([msgpack.packb([0, [good, row], None, 1.0])])
    assert len(msg.outputs) == 1 and msg.outputs[0].request_id == "r"
    ((rid, err),) = msg.bad_rows
    assert isinstance(err, RemoteProtocolError)
    assert re.search(f"outputs\\[1\\]\\.{field}", str(err))
    expected_rid = row[0] if isinstance(row, list) and row and isinstance(row[0], str) else None
    assert rid == expected_rid


@pytest.mark.parametrize("bad_at", [0, 1, 3, 5])
def test_rows_keep_their_order_around_short_and_bad_rows(bad_at: int) -> None:
    # Well-formed rows are passed through uncopied; from the first short or bad
    # row on, the decoder builds its own list: order and padding must not change.
    rows: list[object] = [_row(request_id=f"r{i}", new_token_ids=[i]) for i in range(6)]
    rows[bad_at] = _row(request_id=f"r{bad_at}", finish_reason=9)
    rows[4] = ["r4", [4]]  # short: padded with vLLM's defaults
    msg = w.decode_outputs([msgpack.packb([0, rows, None, 1.0])])
    kept = [i for i in range(6) if i != bad_at]
    assert [r.request_id for r in msg.outputs] == [f"r{i}" for i in kept]
    assert [r.new_token_ids for r in msg.outputs] == [(i,) for i in kept]
    assert msg.outputs[kept.index(4)].num_nans_in_logits == 0
    ((rid, err),) = msg.bad_rows
    assert rid == f"r{bad_at}" and "finish_reason" in str(err)


@pytest.mark.parametrize(
    ("envelope", "field"),
    [
        ([0], "expected an array"),
        ({"engine_index": 0}, "expected an array"),
        ([None, []], "engine_index"),
        ([True, []], "engine_index"),
        ([0, {}], "outputs"),
        ([0, [], [1]], "scheduler_stats"),
        ([0, [], None, "now"], "timestamp"),
        ([0, [], None, 1.0, [b"x"]], "utility_output"),
        ([0, [], None, 1.0, [1, 2]], "failure_message"),
        ([0, [], None, 1.0, [1, None, [None]]], "result"),
        ([0, [], None, 1.0, None, "req-1"], "finished_requests"),
        ([0, [], None, 1.0, None, [1]], "finished_requests"),
        ([0, [], None, 1.0, None, None, 1.5], "wave_complete"),
        ([0, [], None, 1.0, None, None, None, "x"], "start_wave"),
        ([0, [], None, 1.0, None, None, None, None, 1], "weight_version"),
    ],
)
def test_bad_envelopes_name_the_field(envelope: object, field: str) -> None:
    with pytest.raises(RemoteProtocolError, match=field):
        w.decode_outputs([msgpack.packb(envelope)])


def test_limits_are_enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = w_engine.encode_outputs(0, [w_engine.EngineCoreOutput(request_id=str(i), new_token_ids=[1, 2, 3])
                                  for i in range(3)], timestamp=0.0)
    w.decode_outputs(frames)
    monkeypatch.setattr(limits, "MAX_OUTPUTS_PER_MESSAGE", 2)
    with pytest.raises(RemoteProtocolError, match="MAX_OUTPUTS_PER_MESSAGE"):
        w.decode_outputs(frames)
    monkeypatch.undo()
    monkeypatch.setattr(limits, "MAX_TOKENS_PER_TICK", 2)
    msg = w.decode_outputs(frames)  # each over-long row is set aside with its request id
    assert msg.outputs == () and [rid for rid, _ in msg.bad_rows] == ["0", "1", "2"]
    assert all("new_token_ids" in str(err) for _, err in msg.bad_rows)
    monkeypatch.undo()
    monkeypatch.setattr(limits, "MAX_FRAME_BYTES", len(frames[0]) - 1)
    with pytest.raises(RemoteProtocolError, match="MAX_FRAME_BYTES"):
        w.decode_outputs(frames)
    with pytest.raises(RemoteProtocolError, match="MAX_FRAME_BYTES"):
        handshake.decode_handshake_status(b"\x80" * len(frames[0]))
    with pytest.raises(RemoteProtocolError):
        w.decode_outputs([])


@pytest.mark.parametrize(
    "payload",
    [
        ["r", [1], None, None, None, 0.0, None, None],  # 8 < 9 elements
        ["r", [1], None, "temperature=0", None, 0.0, None, None, None],
        ["r", [1], None, {"top_k": 1.5}, None, 0.0, None, None, None],
        ["r", [1], None, {"n": True}, None, 0.0, None, None, None],
        ["r", [1], None, {"temperature": "0"}, None, 0.0, None, None, None],
        ["r", [1], None, {"logit_bias": {"5": 1.0}}, None, 0.0, None, None, None],
        ["r", [1], None, {"output_kind": 7}, None, 0.0, None, None, None],
        ["r", [1], None, {"structured_outputs": {"regex": 5}}, None, 0.0, None, None, None],
        ["r", [1], None, {"repetition_detection": {"min_count": 3}}, None, 0.0, None, None, None],
        [1, [1], None, None, None, 0.0, None, None, None],
        ["r", ["1"], None, None, None, 0.0, None, None, None],
        ["r", [1], None, None, None, "now", None, None, None],
        ["r", [1], None, None, None, 0.0, None, None, None, ["float32", [2], b"\x00" * 4]],
        ["r", [1], None, None, None, 0.0, None, None, None, None, None, "0"],
        {"request_id": "r"},
    ],
)
def test_malformed_requests_are_refused(payload: object) -> None:
    with pytest.raises(RemoteProtocolError):
        w_engine.decode_request([msgpack.packb(payload, use_bin_type=True)])


def test_encoders_refuse_what_the_wire_cannot_carry() -> None:
    base = dict(request_id="r", prompt_token_ids=[1], sampling_params=w.SamplingParams(), arrival_time=0.0)
    for change in (
        {"request_id": 5},
        {"prompt_token_ids": [1, 2**64]},
        {"prompt_token_ids": ["1"]},
        {"sampling_params": w.SamplingParams(top_k=1.5)},
        {"sampling_params": w.SamplingParams(logit_bias={"5": 1.0})},
        {"sampling_params": w.SamplingParams(structured_outputs=w.StructuredOutputsParams(regex=5))},
        {"prompt_embeds": Tensor("float32", (2,), b"\x00" * 4)},
        {"arrival_time": "now"},
    ):
        with pytest.raises(LocalProtocolError):
            w.encode_request(w.EngineCoreRequest(**{**base, **change}))
    with pytest.raises(LocalProtocolError):
        w.encode_abort("req-1")
    with pytest.raises(LocalProtocolError):
        w.encode_abort([1])
    with pytest.raises(LocalProtocolError):
        w.encode_utility_call(0, 2**64, "m", [])
    assert w.encode_utility_call(0, 2**64 - 1, "m", [])[2:3] == b"\xcf"
    with pytest.raises(LocalProtocolError):
        w_engine.encode_outputs(0, [w_engine.EngineCoreOutput(request_id="r", error=w_engine.OutputError(
            code="c", message="m", retryable=False))], timestamp=0.0)
    with pytest.raises(LocalProtocolError):
        w_engine.encode_outputs(0, [w_engine.EngineCoreOutput(request_id="r", finish_reason=9)], timestamp=0.0)
    with pytest.raises(LocalProtocolError):
        w_engine.encode_outputs(0, [w_engine.EngineCoreOutput(request_id="r", new_token_ids=[1.5])], timestamp=0.0)
    with pytest.raises(LocalProtocolError):
        encode_tensor("bfloat16", (1,), b"\x00\x00", [], torch=False)  # numpy has no bfloat16
    with pytest.raises(LocalProtocolError):
        encode_tensor("float32", (2,), b"\x00" * 4, [], torch=True)
    with pytest.raises(LocalProtocolError):
        encode_tensor("complex64", (1,), b"\x00" * 8, [], torch=True)


def test_request_type_frames() -> None:
    assert [t.frame for t in w.RequestType] == [b"\x00", b"\x01", b"\x02", b"\x03"]
    assert w_engine.parse_request_type(b"\x03") is w.RequestType.UTILITY
    for bad in (b"", b"\x04", b"\x05", b"\x00\x00"):
        with pytest.raises(RemoteProtocolError):
            w_engine.parse_request_type(bad)
    assert [r.wire_name for r in w.FinishReason] == ["stop", "length", "abort", "error", "repetition"]
    assert math.isclose(w.SamplingParams(temperature=0).temperature, 0.0)
    assert type(w.SamplingParams(temperature=0).temperature) is float
