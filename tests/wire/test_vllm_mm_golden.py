"""``EngineCoreRequest.mm_features`` against vLLM 0.32.0's own encoder.

``vectors/vllm_0.32.0_mm.json`` holds ADDs built with vLLM's classes and encoded with
its ``MsgpackEncoder`` (``scripts/real_vllm/mm_vectors.py``): pixel values as an aux
frame, small inline tensors, a flat field with the whole slice list, a shared field,
``is_embed``, precomputed embeddings in bfloat16, nested lists and bare floats as
kwarg data, a cached item sent with data nil, video and audio. For each: our encoder
gives the same bytes, our decoder reads the golden frames back to what re-encodes to
the same bytes. vLLM's decoder reading our frames is ``tests/real_engine/test_mm_golden.py``.
"""

from __future__ import annotations

import pytest

from zmqdispatch.wire import vllm as w
from zmqdispatch.wire import vllm_engine as w_engine
from zmqdispatch.wire.vllm_multimodal import decode_mm_features, features_to_wire

from .mm_cases import BY_NAME, CASES, golden_frames, request

NAMES = [c["name"] for c in CASES]


def test_the_vectors_cover_each_wire_shape():
    assert NAMES == ["mm_batched_inline", "mm_aux_shared_is_embed_cached", "mm_flat_two_images",
                     "mm_embeds_dtypes_nested", "mm_video_audio"]
    assert all(c["vllm_version"] == "0.32.0" for c in CASES)
    # aux frames at >= 256 bytes, as vLLM's encoder does
    assert [len(c["frames_hex"]) for c in CASES] == [1, 2, 3, 3, 2]


@pytest.mark.parametrize("name", NAMES)
def test_our_encoding_is_byte_equal(name):
    case = BY_NAME[name]
    assert [bytes(f).hex() for f in w.encode_request(request(case["request"]))] == case["frames_hex"]


@pytest.mark.parametrize("name", NAMES)
def test_we_decode_the_golden_frames_to_what_encodes_back_to_them(name):
    case = BY_NAME[name]
    frames = golden_frames(case)
    req = w_engine.decode_request(frames)
    feats = decode_mm_features(req.mm_features, frames)
    assert feats is not None and len(feats) == len(case["request"]["mm_features"])
    again = w.encode_request(w.EngineCoreRequest(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, mm_features=features_to_wire(feats),
        sampling_params=req.sampling_params, arrival_time=req.arrival_time))
    assert [bytes(f).hex() for f in again] == case["frames_hex"]


def test_decoded_aux_tensors_are_the_frames_themselves():
    frames = golden_frames(BY_NAME["mm_flat_two_images"])
    feats = decode_mm_features(w_engine.decode_request(frames).mm_features, frames)
    assert feats is not None
    assert [f.data["pixel_values"].data.data is frames[i + 1] for i, f in enumerate(feats)] == [True, True]
    assert feats[1].data["pixel_values"].data.shape == (2, 48)
    cached = decode_mm_features(*(lambda fr: (w_engine.decode_request(fr).mm_features, fr))(
        golden_frames(BY_NAME["mm_aux_shared_is_embed_cached"])))
    assert cached is not None and cached[1].data is None and cached[1].mm_hash is None
    assert cached[0].mm_position.is_embed is not None
    assert cached[0].mm_position.is_embed.tolist() == [False, True, True, False, True]
