"""Opaque field values: one rule for both dialects (``wire.schema._prep``).

vLLM's ``EngineCoreRequest`` carries fields we never interpret (``mm_features``,
``kv_hints``...), TokenSpeed's ADD carries ``multimodal_inputs``; both are sent as
plain msgpack values with every :class:`Tensor` inside routed through the tensor codec
(aux frames), wire structs (anything with ``_to_wire``) in their wire form and enums as
ints. The client checks such values before sending (``vllm.check_opaque_value``), so
whatever that check accepts must encode: a value that passed it and then failed in
``encode_request`` would fail inside the input pump instead of at ``generate()``.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire.tensors import EXT_RAW_VIEW, Tensor

KV_HINTS = 21  # EngineCoreRequest position
MULTIMODAL_INPUTS = 22  # TokenizedGenerateReqInput position, tag included


def _vllm(value: Any) -> list[bytes]:
    return wire.encode_request(wire.EngineCoreRequest(
        request_id="r", prompt_token_ids=(1,), sampling_params=wire.SamplingParams(), arrival_time=0.0,
        kv_hints=value))


def _tokenspeed(value: Any) -> list[bytes]:
    return ts.encode_add(ts.TokenizedGenerateReqInput(
        rid="r", input_ids=(1,), sampling_params=ts.TokenSpeedSamplingParams(), multimodal_inputs=[value]))


def _opaque(frames: list[bytes], runtime: str) -> Any:
    body = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    return body[KV_HINTS] if runtime == "vllm" else body[MULTIMODAL_INPUTS][0]


ENCODE = {"vllm": _vllm, "tokenspeed": _tokenspeed}

REP = wire.RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=2, min_count=3)
CASES = [
    pytest.param(b"\x00\xff", b"\x00\xff", id="bytes"),
    pytest.param(bytearray(b"ab"), b"ab", id="bytearray"),
    pytest.param(wire.FinishReason.LENGTH, 1, id="enum"),
    pytest.param([wire.FinishReason.STOP, "x", 1.5], [0, "x", 1.5], id="enum-in-list"),
    pytest.param({"k": REP}, {"k": {"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3}}, id="wire-struct"),
    pytest.param((1, (2, None)), [1, [2, None]], id="tuples"),
]


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
@pytest.mark.parametrize(("value", "expected"), CASES)
def test_an_opaque_value_has_one_wire_form_in_both_dialects(runtime: str, value: Any, expected: Any) -> None:
    assert _opaque(ENCODE[runtime](value), runtime) == expected


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
def test_tensors_inside_an_opaque_value_go_to_aux_frames_in_both_dialects(runtime: str) -> None:
    small = Tensor.from_values("int32", (2,), [1, 2])
    big = Tensor.from_values("float32", (64,), [0.5] * 64)  # 256 bytes: an aux frame
    frames = ENCODE[runtime]({"a": [small, big], "b": big})
    got = _opaque(frames, runtime)
    assert got["a"][0][:2] == ["int32", [2]] and got["a"][0][2] == msgpack.ExtType(EXT_RAW_VIEW, bytes(small.data))
    assert got["a"][1] == ["float32", [64], 1] and got["b"] == ["float32", [64], 2]
    assert frames[1:] == [bytes(big.data), bytes(big.data)]


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
@pytest.mark.parametrize("value", [object(), {1, 2}, complex(1, 2)], ids=["object", "set", "complex"])
def test_a_value_msgpack_cannot_carry_is_a_local_protocol_error(runtime: str, value: Any) -> None:
    with pytest.raises(LocalProtocolError, match="cannot be encoded as msgpack"):
        ENCODE[runtime](value)


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False), st.text(max_size=4),
    st.binary(max_size=4), st.sampled_from(list(wire.FinishReason)),
    st.builds(wire.RepetitionDetectionParams, max_pattern_size=st.integers(0, 9),
              min_pattern_size=st.integers(0, 9), min_count=st.integers(0, 9)),
    st.builds(lambda n: Tensor.from_values("int64", (n,), list(range(n))), st.integers(0, 40)),
    st.sampled_from([object(), {1}, complex(0, 1)]),
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3) | st.integers(0, 9), inner,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_whatever_check_opaque_value_accepts_encodes(value: Any) -> None:
    try:
        wire.check_opaque_value(value, "kv_hints")
    except LocalProtocolError:
        return
    vllm_frames = _vllm(value)
    ts_frames = _tokenspeed(value)
    assert _opaque(vllm_frames, "vllm") == _opaque(ts_frames, "tokenspeed")
    assert vllm_frames[1:] == ts_frames[1:]
