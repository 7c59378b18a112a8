"""Golden vectors of vLLM 0.32.0's own encoder, replayed against our codec.

For every case of ``vllm_0.32.0.json``: build the message from the case's decoded
view with our encoder and require byte equality of every frame; decode the golden
frames with our decoder and require the same decoded view; re-encode what we decoded
and require the golden bytes again.

The vectors file is found via ``$ZMQD_VECTORS``, else the copy next to this test
(``tests/wire/vectors/``), else ``<repo>/../shared/vectors/``.
"""

from __future__ import annotations

import enum
import json
import os
import pathlib
from typing import Any

import attrs
import pytest

from zmqdispatch import limits
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire import vllm as w
from zmqdispatch.wire import vllm_engine as w_engine
from zmqdispatch.wire import vllm_handshake as handshake
from zmqdispatch.wire.tensors import Tensor, decode_tensor

HERE = pathlib.Path(__file__).resolve().parent
_LOCAL = HERE / "vectors" / "vllm_0.32.0.json"
_SHARED = HERE.parents[2] / "shared" / "vectors" / "vllm_0.32.0.json"


def _vectors_path() -> pathlib.Path:
    env = os.environ.get("ZMQD_VECTORS")
    if env:
        return pathlib.Path(env)
    return _LOCAL if _LOCAL.exists() else _SHARED


CASES: list[dict[str, Any]] = json.loads(_vectors_path().read_text())
BY_NAME = {c["name"]: c for c in CASES}


def golden_frames(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["frames_hex"]]


# ----------------------------------------------------------------- views (vLLM's conventions)


def plain(v: Any) -> Any:
    """JSON-like view: tuples -> lists, enums -> ints, int dict keys -> str."""
    if isinstance(v, enum.IntEnum):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {(str(k) if isinstance(k, int) else k): plain(x) for k, x in v.items()}
    return v


def struct_view(obj: Any, private: frozenset[str] = frozenset()) -> dict[str, Any]:
    out = {}
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        if attrs.has(type(v)):
            v = struct_view(v, frozenset({"backend", "backend_was_auto"}))
        out[("_" + f.name) if f.name in private else f.name] = plain(v)
    return out


SP_PRIVATE = frozenset({"eos_token_id", "all_stop_token_ids", "watermarking_skipped", "bad_words_token_ids"})


def tensor_view(t: Tensor) -> dict[str, Any]:
    key = "__tensor__" if t.is_torch else "__ndarray__"
    return {key: {"dtype": t.dtype, "shape": list(t.shape), "data": t.tolist()}}


def request_view(req: w.EngineCoreRequest) -> dict[str, Any]:
    out = {}
    for f in attrs.fields(w.EngineCoreRequest):
        v = getattr(req, f.name)
        if f.name == "sampling_params" and v is not None:
            v = struct_view(v, SP_PRIVATE)
            v["_all_stop_token_ids"] = sorted(v["_all_stop_token_ids"])  # a set: sorted view
        elif f.name == "prompt_embeds" and v is not None:
            v = tensor_view(v)
        out[f.name] = plain(v)
    return out


ROW_NAMES = [
    "request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors", "pooling_output",
    "finish_reason", "stop_reason", "events", "kv_transfer_params", "ec_transfer_params", "trace_headers",
    "prefill_stats", "routed_experts", "num_nans_in_logits", "mm_cache_miss_hashes", "new_sampling_mask",
    "spec_decode_metrics", "prompt_token_id_logprobs",
]
LISTS_NAMES = ["logprob_token_ids", "logprobs", "sampled_token_ranks", "cu_num_generated_tokens"]
TENSORS_NAMES = [
    "logprob_token_ids", "logprobs", "selected_token_ranks", "cu_num_generated_tokens",
    "cu_num_generated_tokens_tensor",
]


def logprobs_view(raw: Any, frames: list[bytes], names: list[str]) -> dict[str, Any]:
    out = {}
    for i, name in enumerate(names):
        v = raw[i] if i < len(raw) else None
        out[name] = tensor_view(decode_tensor(v, frames)) if i < 3 else plain(v)
    return out


def row_view(row: w.EngineCoreOutputRow, frames: list[bytes]) -> dict[str, Any]:
    assert type(row).__struct_fields__ == w.ROW_FIELDS
    out = {}
    for name in ROW_NAMES:
        v = getattr(row, name)
        if v is not None and name == "new_logprobs":
            v = logprobs_view(v, frames, LISTS_NAMES)
        elif v is not None and name == "new_prompt_logprobs_tensors":
            v = logprobs_view(v, frames, TENSORS_NAMES)
        elif v is not None and name in ("pooling_output", "routed_experts", "prompt_token_id_logprobs"):
            v = tensor_view(decode_tensor(v, frames))
        out[name] = plain(v)
    if row.error is not None:
        out["error"] = plain(row.error)
    return out


def outputs_view(o: w.EngineCoreOutputs) -> dict[str, Any]:
    u = o.utility_output
    return {
        "engine_index": o.engine_index,
        "outputs": [row_view(r, list(o.frames)) for r in o.outputs],
        "scheduler_stats": plain(o.scheduler_stats),
        "timestamp": o.timestamp,
        "utility_output": None
        if u is None
        else {
            "call_id": u.call_id,
            "failure_message": u.failure_message,
            "result": None if u.result is None else {"result": plain(u.result.value)},
        },
        "finished_requests": None if o.finished_requests is None else sorted(o.finished_requests),
        "wave_complete": o.wave_complete,
        "start_wave": o.start_wave,
        "weight_version": o.weight_version,
    }


# ----------------------------------------------------------------- inputs from the views


def tensor_from_view(v: dict[str, Any]) -> Tensor:
    (inner,) = v.values()

    def flat(x: Any) -> list[Any]:
        return [y for e in x for y in flat(e)] if isinstance(x, list) else [x]

    dtype = inner["dtype"]
    t = Tensor.from_values(dtype, inner["shape"], flat(inner["data"]))
    return t


def struct_from_view(cls: type, v: dict[str, Any]) -> Any:
    return cls(**{k.lstrip("_"): x for k, x in v.items()})


def sampling_params_from_view(v: dict[str, Any]) -> w.SamplingParams:
    kw = {k.lstrip("_"): x for k, x in v.items()}
    # A set in vLLM: the view is sorted, the wire has CPython's set order.
    kw["all_stop_token_ids"] = w.set_order(kw["all_stop_token_ids"])
    if kw["logit_bias"] is not None:
        kw["logit_bias"] = {int(k): x for k, x in kw["logit_bias"].items()}
    if kw["structured_outputs"] is not None:
        kw["structured_outputs"] = struct_from_view(w.StructuredOutputsParams, kw["structured_outputs"])
    if kw["repetition_detection"] is not None:
        kw["repetition_detection"] = struct_from_view(w.RepetitionDetectionParams, kw["repetition_detection"])
    return w.SamplingParams(**kw)


def request_from_view(v: dict[str, Any]) -> w.EngineCoreRequest:
    kw = dict(v)
    kw["sampling_params"] = sampling_params_from_view(v["sampling_params"])
    if v["prompt_embeds"] is not None:
        kw["prompt_embeds"] = tensor_from_view(v["prompt_embeds"])
    return w.EngineCoreRequest(**kw)


def logprobs_from_view(v: dict[str, Any], ranks_key: str) -> w.LogprobsLists:
    (ids,) = v["logprob_token_ids"].values()
    (lps,) = v["logprobs"].values()
    (ranks,) = v[ranks_key].values()
    return w.LogprobsLists(ids["data"], lps["data"], ranks["data"], v["cu_num_generated_tokens"])


def output_from_view(v: dict[str, Any]) -> w_engine.EngineCoreOutput:
    kw = dict(v)
    if v["new_logprobs"] is not None:
        kw["new_logprobs"] = logprobs_from_view(v["new_logprobs"], "sampled_token_ranks")
    if v["new_prompt_logprobs_tensors"] is not None:
        kw["new_prompt_logprobs_tensors"] = logprobs_from_view(v["new_prompt_logprobs_tensors"], "selected_token_ranks")
    for name in ("pooling_output", "routed_experts", "prompt_token_id_logprobs"):
        if v[name] is not None:
            kw[name] = tensor_from_view(v[name])
    if v["events"] is not None:
        kw["events"] = [w_engine.EngineCoreEvent(**e) for e in v["events"]]
    if v["prefill_stats"] is not None:
        kw["prefill_stats"] = w_engine.PrefillStats(**v["prefill_stats"])
    return w_engine.EngineCoreOutput(**kw)


def outputs_from_view(v: dict[str, Any]) -> list[bytes]:
    u = v["utility_output"]
    utility = None
    if u is not None:
        result = None if u["result"] is None else w.UtilityResult(u["result"]["result"])
        utility = w.UtilityOutput(call_id=u["call_id"], failure_message=u["failure_message"], result=result)
    return w_engine.encode_outputs(
        v["engine_index"],
        [output_from_view(o) for o in v["outputs"]],
        timestamp=v["timestamp"],
        scheduler_stats=v["scheduler_stats"],
        utility_output=utility,
        finished_requests=v["finished_requests"],
        wave_complete=v["wave_complete"],
        start_wave=v["start_wave"],
        weight_version=v["weight_version"],
    )


def encode_case(case: dict[str, Any]) -> list[bytes]:
    """Our encoding of the case, from its decoded view."""
    name, v, tb = case["name"], case["decoded"], case["type_byte"]
    if tb == "00":
        return w.encode_request(request_from_view(v))
    if tb == "01":
        return [w.encode_abort(v)]
    if tb == "02":
        return [w.encode_start_dp_wave(*v)]
    if tb == "03":
        return [w.encode_utility_call(*v)]
    if name == "outputs_engine_core_dead":
        return [w.ENGINE_CORE_DEAD]
    if case["kind"] in ("outputs", "utility"):
        return outputs_from_view(v)
    if name.startswith(("handshake_hello", "handshake_ready_headless")):
        enc = handshake.encode_hello if v["status"] == "HELLO" else handshake.encode_ready
        return [enc(v["local"], v["headless"])]
    if name == "handshake_init_reply":
        return [handshake.encode_init(**v["addresses"], parallel_config=v["parallel_config"])]
    if name == "handshake_ready_response":
        return [handshake.encode_ready_response(handshake.EngineCoreReadyResponse(**v))]
    raise AssertionError(f"unhandled case {name}")


def decode_case(case: dict[str, Any], frames: list[bytes]) -> Any:
    """Our decoder's view of the golden frames, in the vectors' conventions."""
    name, tb = case["name"], case["type_byte"]
    if tb == "00":
        return request_view(w_engine.decode_request(frames))
    if tb == "01":
        return list(w_engine.decode_abort(frames[0]))
    if tb == "02":
        return list(w_engine.decode_start_dp_wave(frames[0]))
    if tb == "03":
        c = w_engine.decode_utility_call(frames[0])
        return [c.client_index, c.call_id, c.method, plain(c.args)]
    if name == "outputs_engine_core_dead":
        assert w.is_dead_sentinel(frames)
        return {"sentinel": frames[0].decode()}
    if case["kind"] in ("outputs", "utility"):
        assert not w.is_dead_sentinel(frames)
        return outputs_view(w.decode_outputs(frames))
    if name.startswith(("handshake_hello", "handshake_ready_headless")):
        s = handshake.decode_handshake_status(frames[0])
        assert s.parallel_config_hash is None
        return {"status": s.status, "local": s.local, "headless": s.headless}
    if name == "handshake_init_reply":
        i = handshake.decode_init(frames[0])
        addresses = {k: plain(getattr(i, k)) for k in ("inputs", "outputs", "coordinator_input",
                                                     "coordinator_output", "frontend_stats_publish_address")}
        return {"addresses": addresses, "parallel_config": i.parallel_config}
    if name == "handshake_ready_response":
        view = attrs.asdict(handshake.decode_ready_response(frames[0]))
        assert view.pop("positional_layouts") is None  # SGLang's key; vLLM sends none
        assert view.pop("multimodal_encoder_dtype") is None  # TokenSpeed's key; vLLM sends none
        return view
    raise AssertionError(f"unhandled case {name}")


def reencode_case(case: dict[str, Any], frames: list[bytes]) -> list[bytes] | None:
    """Decode the golden frames into our typed objects and encode them again."""
    tb = case["type_byte"]
    if tb == "00":
        return w.encode_request(w_engine.decode_request(frames))
    if tb == "01":
        return [w.encode_abort(w_engine.decode_abort(frames[0]))]
    if tb == "02":
        return [w.encode_start_dp_wave(*w_engine.decode_start_dp_wave(frames[0]))]
    if tb == "03":
        c = w_engine.decode_utility_call(frames[0])
        return [w.encode_utility_call(c.client_index, c.call_id, c.method, c.args)]
    if case["direction"] == "from_engine" and case["kind"] in ("outputs", "utility") and not w.is_dead_sentinel(frames):
        o = w.decode_outputs(frames)
        return w_engine.encode_outputs(
            o.engine_index,
            [w_engine.EngineCoreOutput.from_row(r, frames) for r in o.outputs],
            timestamp=o.timestamp,
            scheduler_stats=o.scheduler_stats,
            utility_output=o.utility_output,
            finished_requests=o.finished_requests,
            wave_complete=o.wave_complete,
            start_wave=o.start_wave,
            weight_version=o.weight_version,
        )
    name = case["name"]
    if name == "handshake_ready_response":
        return [handshake.encode_ready_response(handshake.decode_ready_response(frames[0]))]
    if name.startswith(("handshake_hello", "handshake_ready_headless")):
        st = handshake.decode_handshake_status(frames[0])
        enc = handshake.encode_hello if st.status == "HELLO" else handshake.encode_ready
        return [enc(st.local, st.headless)]
    if name == "handshake_init_reply":
        i = handshake.decode_init(frames[0])
        return [handshake.encode_init(i.inputs, i.outputs, i.coordinator_input, i.coordinator_output,
                              i.frontend_stats_publish_address, i.parallel_config)]
    return None


# ----------------------------------------------------------------- tests

NAMES = [c["name"] for c in CASES]


def test_vectors_file_is_complete() -> None:
    assert len(CASES) == 50
    assert len(set(NAMES)) == 50


@pytest.mark.skipif(not (_LOCAL.exists() and _SHARED.exists()), reason="shared/ not present")
def test_local_copy_matches_shared() -> None:
    assert _LOCAL.read_bytes() == _SHARED.read_bytes()


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_golden_bytes(name: str) -> None:
    case = BY_NAME[name]
    ours = [bytes(f).hex() for f in encode_case(case)]
    assert ours == case["frames_hex"]


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_golden_view(name: str) -> None:
    case = BY_NAME[name]
    view = decode_case(case, golden_frames(case))
    assert view == case["decoded"]
    if case["type_byte"] == "00":
        # Field order is part of the contract: same keys in the same order.
        assert list(view) == list(case["decoded"])
        assert list(view["sampling_params"]) == list(case["decoded"]["sampling_params"])


OUTPUT_NAMES = [n for n in NAMES if BY_NAME[n]["direction"] == "from_engine"
                and BY_NAME[n]["kind"] in ("outputs", "utility") and n != "outputs_engine_core_dead"]


@pytest.mark.parametrize("name", OUTPUT_NAMES)
def test_typed_decode_takes_the_golden_messages_as_the_reference_does(name: str) -> None:
    # Every output vector is taken by the msgspec typed decode itself (no fallback)
    # and decodes to what the msgpack reference decoder makes of it.
    frames = golden_frames(BY_NAME[name])
    row_cls, typed = w._typed(limits.MAX_OUTPUTS_PER_MESSAGE, limits.MAX_TOKENS_PER_TICK, limits.MAX_TOKEN_ID)
    assert all(type(r) is row_cls for r in typed.decode(frames[0]).outputs)
    assert w.decode_outputs(frames) == w._decode_outputs_msgpack(frames)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "outputs_engine_core_dead"])
def test_reencode_is_identical(name: str) -> None:
    case = BY_NAME[name]
    frames = golden_frames(case)
    again = reencode_case(case, frames)
    assert again is not None
    assert [bytes(f).hex() for f in again] == case["frames_hex"]


def test_set_order_reproduces_vllm_set_iteration() -> None:
    assert w.set_order([2, 7, 9]) == (9, 2, 7)
    sp = BY_NAME["request_full_sampling"]["decoded"]["sampling_params"]
    assert sorted(sp["_all_stop_token_ids"]) == [2, 7, 9]


def test_dead_sentinel_is_not_decoded() -> None:
    frames = golden_frames(BY_NAME["outputs_engine_core_dead"])
    assert w.is_dead_sentinel(frames)
    assert not w.is_dead_sentinel(frames + [b""])
    assert not w.is_dead_sentinel([b"ENGINE_CORE_DEAF"])
    with pytest.raises(RemoteProtocolError):
        w.decode_outputs(frames)


def test_logprobs_helpers_agree_with_views() -> None:
    for name in ("outputs_logprobs_k3", "outputs_logprobs_k63_aux", "outputs_logprobs_batch_aux"):
        case = BY_NAME[name]
        o = w.decode_outputs(golden_frames(case))
        for row, expected in zip(o.outputs, case["decoded"]["outputs"]):
            lp = w.decode_logprobs_lists(row.new_logprobs, o.frames)
            exp = expected["new_logprobs"]
            assert lp.token_ids == exp["logprob_token_ids"]["__ndarray__"]["data"]
            assert lp.logprobs == exp["logprobs"]["__ndarray__"]["data"]
            assert lp.ranks == exp["sampled_token_ranks"]["__ndarray__"]["data"]
    for name in ("outputs_prompt_logprobs_small", "outputs_prompt_logprobs_aux"):
        case = BY_NAME[name]
        o = w.decode_outputs(golden_frames(case))
        (row,) = o.outputs
        lp = w.decode_logprobs_tensors(row.new_prompt_logprobs_tensors, o.frames)
        exp = case["decoded"]["outputs"][0]["new_prompt_logprobs_tensors"]
        assert lp.token_ids == exp["logprob_token_ids"]["__tensor__"]["data"]
        assert lp.ranks == exp["selected_token_ranks"]["__tensor__"]["data"]


def test_hot_path_row_shape() -> None:
    o = w.decode_outputs(golden_frames(BY_NAME["outputs_batch_midstream"]))
    assert [r.request_id for r in o.outputs] == ["req-a", "req-b", "req-c"]
    assert [r.new_token_ids for r in o.outputs] == [(332,), (17, 18), (5,)]
    # one typed struct per row, straight from msgspec; 0.32.0 rows carry no error
    assert all(isinstance(r, w.EngineCoreOutputRow) and r.error is None for r in o.outputs)
    assert all(type(r.new_token_ids) is tuple for r in o.outputs)
    o = w.decode_outputs(golden_frames(BY_NAME["outputs_num_cached_tokens_events"]))
    assert o.outputs[0].prefill_stats["num_cached_tokens"] == 32
    assert w.FinishReason(4).wire_name == "repetition"
