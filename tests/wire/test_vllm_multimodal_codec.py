"""The ``mm_features`` codec's refusals, both sides, and buffer layouts.

Encode side (:func:`features_to_wire`, then ``encode_request``): what cannot be sent is
a ``LocalProtocolError`` naming the feature and kwarg, before any frame exists.
Decode side (:func:`decode_mm_features`, the mock engine's reader): what vLLM's
decoder fails on is a ``RemoteProtocolError`` naming the path. Layouts: a
non-contiguous array is sent in C order (one copy, as vLLM does), a contiguous one
as the caller's buffer; a big-endian array is refused."""

from __future__ import annotations

import copy

import msgpack
import numpy as np
import pytest

from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire import vllm as w
from zmqdispatch.wire import vllm_engine as w_engine
from zmqdispatch.wire.tensors import Tensor
from zmqdispatch.wire.vllm_multimodal import (
    BatchedField,
    FieldElem,
    MultiModalFeatureSpec,
    PlaceholderRange,
    decode_mm_features,
    features_to_wire,
)

from .mm_cases import BY_NAME, golden_frames


POS = PlaceholderRange(1, 2)


def feat(data, *, modality="image", pos=POS, ident="h"):
    return MultiModalFeatureSpec(data, modality, ident, pos, ident)


def px(t: Tensor):
    return {"pixel_values": FieldElem(t, BatchedField())}


def send(features) -> list:
    return w.encode_request(w.EngineCoreRequest(request_id="r", prompt_token_ids=(1, 2, 3),
                                                mm_features=features_to_wire(features),
                                                sampling_params=w.SamplingParams(max_tokens=1), arrival_time=0.0))


def back(frames):
    return decode_mm_features(w_engine.decode_request(frames).mm_features, frames)


# ------------------------------------------------------------------ encode side


@pytest.mark.parametrize("features, words", [
    ([feat(px(Tensor("float32", (2,), bytes(8))), modality="3d")], "mm_features[0].modality: '3d' is not one of"),
    ([feat(px(Tensor("<f4", (2,), bytes(8))))], "mm_features[0].data.pixel_values: dtype '<f4' is numpy's"),
    ([feat(px(Tensor("float32", (2,), bytes(7))))], "data holds 7 bytes; shape [2] of float32 needs 8"),
    ([feat(px(Tensor("complex64", (2,), bytes(16))))], "dtype 'complex64' cannot be sent"),
    ([feat({"pixel_values": FieldElem("pixels", BatchedField())})], "expected a Tensor, a number or a list"),
    ([feat({"pixel_values": FieldElem([Tensor("float32", (1,), bytes(3))], BatchedField())})],
     "mm_features[0].data.pixel_values[0]: data holds 3 bytes"),
    ([feat({1: FieldElem(0.5, BatchedField())})], "kwarg name 1 is not a str"),
    ([feat(None, pos=PlaceholderRange(0, 2, Tensor("int8", (2,), bytes(2))))],
     "mm_features[0].mm_position.is_embed: must be a bool tensor [2]"),
    ([feat(None, pos=PlaceholderRange(0, 2, Tensor("bool", (3,), bytes(3))))], "must be a bool tensor [2]"),
    ([feat(None, pos=PlaceholderRange(0, 2, Tensor("bool", (2,), bytes(1))))],
     "mm_features[0].mm_position.is_embed: data holds 1 bytes"),
])
def test_what_cannot_be_sent_is_refused_by_path(features, words):
    with pytest.raises(LocalProtocolError) as ei:
        features_to_wire(features)
    assert words in str(ei.value)


def test_big_endian_arrays_are_refused_before_a_tensor_exists():
    with pytest.raises(LocalProtocolError, match="cannot send a tensor of dtype"):
        Tensor.from_array(np.arange(4, dtype=">f4"))
    # byte-swapped to little-endian by the caller, it goes through
    t = Tensor.from_array(np.arange(4, dtype=">f4").astype("<f4"))
    (f,) = back(send([feat(px(t))]))
    assert f.data["pixel_values"].data.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_non_contiguous_array_is_sent_in_c_order_and_a_contiguous_one_as_is():
    base = np.arange(2 * 3 * 64, dtype=np.float32).reshape(2, 3, 64)
    view = base.transpose(1, 0, 2)  # [3, 2, 64], not C-contiguous
    frames = send([feat(px(Tensor.from_array(view)))])
    (f,) = back(frames)
    got = f.data["pixel_values"].data
    assert got.shape == (3, 2, 64) and bytes(got.data) == np.ascontiguousarray(view).tobytes()
    frames = send([feat(px(Tensor.from_array(base)))])
    assert len(frames) == 2 and frames[1].obj is base  # the caller's buffer, no copy
    assert bytes(back(frames)[0].data["pixel_values"].data.data) == base.tobytes()


# ------------------------------------------------------------------ decode side


def golden_raw(name="mm_flat_two_images"):
    frames = golden_frames(BY_NAME[name])
    body = msgpack.unpackb(frames[0], raw=False, strict_map_key=False,
                           ext_hook=lambda c, d: msgpack.ExtType(c, d))
    return body, frames


def mangle(edit, name="mm_flat_two_images", frames_edit=None):
    body, frames = golden_raw(name)
    mm = copy.deepcopy(body[2])
    edit(mm)
    if frames_edit is not None:
        frames = frames_edit(frames)
    return mm, frames


@pytest.mark.parametrize("edit, frames_edit, words", [
    (lambda mm: mm[0]["data"]["pixel_values"]["field"].__setitem__(0, "ragged"), None,
     "unknown field factory 'ragged'"),
    (lambda mm: mm[0]["data"]["pixel_values"]["field"][1].__setitem__("pad", 1), None,
     "unknown flat field kwargs ['pad']"),
    (lambda mm: mm[0]["data"]["pixel_values"]["field"][1].__setitem__("slices", [[[0, "4", None]]]), None,
     "a slice must be [start, stop, step]"),
    (lambda mm: mm[0]["data"]["image_grid_thw"]["field"][1].__setitem__("keep_on_cpu", 1), None,
     "keep_on_cpu must be a bool"),
    (lambda mm: mm[0]["data"]["pixel_values"]["data"].__setitem__(2, 7), None,
     "aux frame index 7 out of range 1..2"),
    (lambda mm: None, lambda fr: [fr[0], fr[1][:-4], fr[2]],
     "mm_features[0].data.pixel_values: 764 bytes for shape [4, 48] of float32 (expected 768)"),
    (lambda mm: None, lambda fr: [fr[0], fr[1], fr[2] + b"\0" * 4], "388 bytes for shape [2, 48]"),
    (lambda mm: mm[1]["data"]["pixel_values"]["data"].__setitem__(0, "float128"), None, "unknown dtype 'float128'"),
    (lambda mm: mm[0].pop("mm_position"), None, "mm_features[0]: expected a map with modality"),
    (lambda mm: mm[0]["mm_position"].__setitem__("offset", "1"), None, "mm_features[0].mm_position"),
    (lambda mm: mm[0].__setitem__("modality", 3), None, "modality and identifier must be str"),
    (lambda mm: mm[0]["data"].__setitem__("x", {"data": None}), None, "mm_features[0].data.x: expected {data, field}"),
    (lambda mm: mm[0]["data"]["pixel_values"].__setitem__("data", "abc"), None, "expected a tensor, a number"),
])
def test_what_vllms_decoder_fails_on_is_refused_by_path(edit, frames_edit, words):
    mm, frames = mangle(edit, frames_edit=frames_edit)
    with pytest.raises(RemoteProtocolError) as ei:
        decode_mm_features(mm, frames)
    assert words in str(ei.value) and "EngineCoreRequest.mm_features" in str(ei.value)


def test_a_tensor_frame_no_field_refers_to_is_not_read_and_nil_is_no_features():
    body, frames = golden_raw("mm_batched_inline")
    feats = decode_mm_features(body[2], [*frames, b"stray"])
    assert feats is not None and len(feats) == 1
    assert decode_mm_features(None, frames) is None
    with pytest.raises(RemoteProtocolError, match="expected an array"):
        decode_mm_features({"data": None}, frames)
