"""TokenSpeed ``multimodal_inputs`` codec without TokenSpeed: slot layout, pad values,
padding, what the encoder refuses and what the engine-side decoder refuses
(``test_tokenspeed_mm_reference.py`` checks the same against TokenSpeed's modules)."""

from __future__ import annotations

from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.mock.tokenspeed_core import typed_multimodal
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import tokenspeed_multimodal as tsmm
from zmqdispatch.wire.tensors import Tensor

from .test_tokenspeed_roundtrip import msgpack_values


def item(nbytes: int = 1024, **kw: Any) -> ts.DataItem:
    fields: dict[str, Any] = dict(modality=ts.Modality.IMAGE, hash=11, pad_value=ts.pad_value(ts.Modality.IMAGE, 11),
                                  offsets=[(1, 2)], feature=Tensor("uint8", (nbytes,), bytes(nbytes)))
    fields.update(kw)
    return ts.DataItem(**fields)


def request(mm: ts.MultimodalInputs, prompt: tuple[int, ...] = (5, 6, 6, 8)) -> ts.TokenizedGenerateReqInput:
    return ts.TokenizedGenerateReqInput(rid="r", input_ids=ts.pad_input_ids(prompt, mm), input_ids_unpadded=prompt,
                                        sampling_params=ts.TokenSpeedSamplingParams(), multimodal_inputs=mm)


def body(frames: list[Any]) -> list[Any]:
    return msgpack.unpackb(frames[0], raw=False, strict_map_key=False)


def test_pad_constants():
    assert tsmm.MM_PAD_HASH_SLOTS == 715_494_549
    assert tsmm.MM_PAD_MAX <= 2**31 - 1 < tsmm.MM_PAD_MAX + 3
    assert [m.pad_tag for m in ts.Modality] == [0, 1, 2]
    assert [int(m) for m in (ts.Modality.IMAGE, ts.Modality.VIDEO, ts.Modality.AUDIO)] == [1, 2, 3]


@given(st.sampled_from(list(ts.Modality)), st.integers(-(2**63), 2**64 - 1))
def test_pad_value_lands_in_the_modality_interval(modality, h):
    v = ts.pad_value(modality, h)
    lo = tsmm.MM_PAD_BASE + modality.pad_tag * tsmm.MM_PAD_HASH_SLOTS
    assert lo <= v < lo + tsmm.MM_PAD_HASH_SLOTS <= tsmm.MM_PAD_MAX + 1
    assert v == ts.pad_value(modality, h + tsmm.MM_PAD_HASH_SLOTS)


def test_slot_layout_and_the_aux_threshold():
    side = {"small": Tensor("int64", (2,), bytes(16)), "edge": Tensor("uint8", (256,), bytes(256))}
    mm = ts.MultimodalInputs(mm_items=[item(255, model_specific_data=side)], im_token_id=6)
    frames = ts.encode_add(request(mm))
    raw = body(frames)
    assert len(raw) == ts.REQUEST_ELEMENTS
    assert raw[21] == [5, 6, 6, 8]  # input_ids_unpadded
    assert raw[4] == [5, mm.mm_items[0].pad_value, mm.mm_items[0].pad_value, 8]
    mmi = raw[22]
    assert len(mmi) == tsmm.INPUTS_SLOTS and mmi[1:] == [6, None, None, None, None, None]
    (it,) = mmi[0]
    assert len(it) == tsmm.DATA_ITEM_SLOTS
    assert it[:4] == [1, 11, mm.mm_items[0].pad_value, [[1, 2]]]
    assert it[4][:2] == ["uint8", [255]] and isinstance(it[4][2], msgpack.ExtType)  # 255 bytes: inline
    assert it[5] is None and it[7:] == [None, None, None]
    assert list(it[6]) == ["small", "edge"] and it[6]["edge"] == ["uint8", [256], 1]  # 256 bytes: frame 1
    assert len(frames) == 2


def test_tensors_take_frames_in_depth_first_order():
    a = item(300)
    b = item(400, offsets=[(3, 3)], model_specific_data={"x": Tensor("uint8", (500,), bytes(500))})
    frames = ts.encode_add(request(ts.MultimodalInputs(mm_items=[a, b]), prompt=(1, 2, 3, 4)))
    assert [len(f) for f in frames[1:]] == [300, 400, 500]


@pytest.mark.parametrize(
    ("mm", "match"),
    [
        (ts.MultimodalInputs(mm_items=[]), "mm_items: must not be empty"),
        (ts.MultimodalInputs(mm_items=[item(hash=None)]), r"mm_items\[0\]: hash and pad_value are required"),
        (ts.MultimodalInputs(mm_items=[item(pad_value=None)]), "hash and pad_value are required"),
        (ts.MultimodalInputs(mm_items=[item(pad_value=5)]), r"pad_value: 5 is not pad_value\(IMAGE, hash\)"),
        (ts.MultimodalInputs(mm_items=[item(hash=2**64)]), r"mm_items\[0\].hash: expected an int"),
        (ts.MultimodalInputs(mm_items=[item(offsets=[])]), "offsets: at least one"),
        (ts.MultimodalInputs(mm_items=[item(offsets=[(3, 2)])]), r"\[3, 2\] is not a range"),
        (ts.MultimodalInputs(mm_items=[item(offsets=[(1, 2, 3)])]), r"\(1, 2, 3\) is not a \(start, end\) pair"),
        (ts.MultimodalInputs(mm_items=[item(offsets=[(1.0, 2)])]), "pair of ints"),
        (ts.MultimodalInputs(mm_items=[item(offsets=[5])]), "pair of ints"),
        (ts.MultimodalInputs(mm_items=[item(feature_shm={"shm_name": "x"})]), "feature_shm: shared memory"),
        (ts.MultimodalInputs(mm_items=[item(encode_handshake={})]), "encode_handshake: EPD"),
        (ts.MultimodalInputs(mm_items=[item(feature=Tensor("<f4", (1,), bytes(4)))]), "numpy's spelling"),
        (ts.MultimodalInputs(mm_items=[item(feature=Tensor(">f4", (1,), bytes(4)))]), "cannot be sent"),
        (ts.MultimodalInputs(mm_items=[item(feature=Tensor("float32", (2,), bytes(7)))]),
         r"feature: data holds 7 bytes; shape \[2\] of float32 needs 8"),
        (ts.MultimodalInputs(mm_items=[item(model_specific_data={1: Tensor("uint8", (1,), b"x")})]), "not a str"),
        (ts.MultimodalInputs(mm_items=[item()], mrope_position_delta_scalar=3), "M-RoPE"),
        (ts.MultimodalInputs(mm_items=[item()], im_token_id="x"), "im_token_id"),
    ],
)
def test_what_the_encoder_refuses(mm, match):
    req = ts.TokenizedGenerateReqInput(rid="r", input_ids=(1, 2, 3), sampling_params=ts.TokenSpeedSamplingParams(),
                                       multimodal_inputs=mm)
    with pytest.raises(LocalProtocolError, match=match):
        ts.encode_add(req)


def test_pad_input_ids_refuses_malformed_offsets_with_a_typed_error():
    for bad in ([(1, 2, 3)], [(1.5, 2)], [7], "ab"):
        with pytest.raises(LocalProtocolError, match="offsets"):
            ts.pad_input_ids((1, 2, 3, 4), ts.MultimodalInputs(mm_items=[item(offsets=bad)]))


def test_pad_input_ids_refuses_ranges_outside_or_overlapping():
    with pytest.raises(LocalProtocolError, match=r"\[3, 4\] falls outside the prompt of 4 tokens"):
        ts.pad_input_ids((1, 2, 3, 4), ts.MultimodalInputs(mm_items=[item(offsets=[(3, 4)])]))
    two = ts.MultimodalInputs(mm_items=[item(offsets=[(0, 1)]), item(offsets=[(1, 2)])])
    with pytest.raises(LocalProtocolError, match=r"mm_items\[1\].offsets: \[1, 2\] overlaps \[0, 1\] of mm_items\[0\]"):
        ts.pad_input_ids((1, 2, 3, 4), two)


@st.composite
def inputs(draw: st.DrawFn) -> tuple[tuple[int, ...], ts.MultimodalInputs]:
    n = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, 30), min_size=2 * n, max_size=2 * n, unique=True)))
    items = []
    for i in range(n):
        m = draw(st.sampled_from(list(ts.Modality)))
        h = draw(st.integers(0, 2**64 - 1))
        size = draw(st.integers(0, 600))
        items.append(ts.DataItem(modality=m, hash=h, pad_value=ts.pad_value(m, h),
                                 offsets=[(cuts[2 * i], cuts[2 * i + 1])],
                                 feature=Tensor("uint8", (size,), draw(st.binary(min_size=size, max_size=size)))))
    prompt = tuple(draw(st.lists(st.integers(0, 999), min_size=cuts[-1] + 1, max_size=cuts[-1] + 4)))
    return prompt, ts.MultimodalInputs(mm_items=items)


@settings(max_examples=80, deadline=None)
@given(inputs())
def test_encode_then_engine_decode_gives_the_same_values(case):
    prompt, mm = case
    frames = ts.encode_add(request(mm, prompt))
    decoded = ts_engine.decode_add(frames)
    assert decoded.input_ids_unpadded == prompt
    assert tsmm.decode_multimodal_inputs(decoded.multimodal_inputs, frames) == mm
    padded = decoded.input_ids
    inside = {p: it.pad_value for it in mm.mm_items for s, e in it.offsets for p in range(s, e + 1)}
    assert padded == tuple(inside.get(p, t) for p, t in enumerate(prompt))


def _frames() -> list[Any]:
    return ts.encode_add(request(ts.MultimodalInputs(mm_items=[item()])))


@pytest.mark.parametrize(
    ("frames_of", "match"),
    [
        (lambda f: [f[0], f[1][:-1]], "1023 bytes for shape"),
        (lambda f: [f[0], bytes(f[1]) + b"\x00"], "1025 bytes for shape"),
        (lambda f: [f[0]], "aux frame index 1 out of range"),
    ],
)
def test_engine_side_refuses_a_wrong_sized_or_missing_frame(frames_of, match):
    frames = frames_of(_frames())
    with pytest.raises(RemoteProtocolError, match=match):
        tsmm.decode_multimodal_inputs(ts_engine.decode_add(frames).multimodal_inputs, frames)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([], "at least 1 elements"),
        ([[[4]]], "modality: 4 is not a Modality value"),
        ([[[1, "h"]]], "hash: expected an int"),
        ([[[1, 1, 1, [[1]]]]], "each range must be an array of two ints"),
        ([[[1, None, None, None, None, {"shm_name": 1}]]], "feature_shm"),
        ([[[1, None, None, None, None, None, {"k": None}]]], "model_specific_data"),
        ([[[1, None, None, None, None, None, None, None, None, [1]]]], "encode_handshake"),
        ([[], "x"], "im_token_id"),
    ],
)
def test_engine_side_refuses_malformed_values(value, match):
    with pytest.raises(RemoteProtocolError, match=match):
        tsmm.decode_multimodal_inputs(value, [b""])


def test_engine_side_reads_a_shm_handle_as_tokenspeed_would():
    raw = [[[1, 3, ts.pad_value(ts.Modality.IMAGE, 3), [[0, 0]], None,
             {"shm_name": "/psm_1", "shape": [2], "dtype": "float32"}]]]
    (it,) = tsmm.decode_multimodal_inputs(raw, [b""]).mm_items
    assert it.feature is None and it.feature_shm == {"shm_name": "/psm_1", "shape": [2], "dtype": "float32"}
    with pytest.raises(LocalProtocolError, match="feature_shm"):
        tsmm.to_wire(ts.MultimodalInputs(mm_items=[attrs.evolve(it, feature_shm=it.feature_shm)]))


@st.composite
def mutated_mm_adds(draw: st.DrawFn) -> list[Any]:
    """A valid multimodal ADD with one element of ``multimodal_inputs`` (at any depth)
    replaced, or an aux frame cut or dropped."""
    prompt, mm = draw(inputs())
    frames = ts.encode_add(request(mm, prompt))
    if len(frames) > 1 and draw(st.booleans()):
        i = draw(st.integers(1, len(frames) - 1))
        cut = draw(st.integers(0, len(frames[i])))
        return [frames[0], *frames[1:i], bytes(frames[i])[:cut], *frames[i + 1:]]
    raw = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    node = raw
    key: Any = 22
    while isinstance(node[key], list) and node[key] and draw(st.booleans()):
        node, key = node[key], draw(st.integers(0, len(node[key]) - 1))
    node[key] = draw(msgpack_values)
    return [msgpack.packb(raw, use_bin_type=True), *frames[1:]]


@settings(max_examples=200, deadline=None)
@given(mutated_mm_adds())
def test_the_engine_side_raises_only_remote_errors(frames):
    """Whatever arrives, the mock engine's decode fails with RemoteProtocolError (dropped,
    as TokenSpeed drops it) or returns values that encode again."""
    try:
        _, req = ts_engine.decode_input([b"\x00", *frames])
        req = typed_multimodal(req, frames)
    except RemoteProtocolError:
        return
    assert req.multimodal_inputs is None or isinstance(req.multimodal_inputs, ts.MultimodalInputs)
