"""tokenspeed.grpc.scheduler ``mm_inputs`` -> TokenSpeed ``multimodal_inputs``: the mapping,
the padding, and every refusal (field and limit named, nothing built)."""

from __future__ import annotations

import hashlib
import struct

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2

from zmqdispatch.errors import RequestRejected
from zmqdispatch.protocol.checks import check_tokenspeed_request
from zmqdispatch.translate.tokenspeed import TranslationConfig, pb, translate_parallel, translate_request
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import tokenspeed_multimodal as tsmm

CONFIG = TranslationConfig(max_model_len=64, vocab_size=1000)
PIXELS = struct.pack("<96f", *range(96))  # [4, 24] float32, 384 bytes
IMAGE, AUDIO, VIDEO = common_pb2.IMAGE, common_pb2.AUDIO, common_pb2.VIDEO


def tensor(shape=(4, 24), dtype="float32", data=PIXELS, **kw) -> pb.TensorData:
    if kw:
        return pb.TensorData(shape=list(shape), dtype=dtype, **kw)
    return pb.TensorData(shape=list(shape), dtype=dtype, inline=data)


def item(*, modality=IMAGE, placeholders=((1, 3),), token=9, h=b"\x05" + b"\x00" * 31, enc="default", side=None):
    it = pb.MultimodalItem(modality=modality, content_hash=h,
                           placeholders=[pb.PlaceholderRange(offset=o, length=n) for o, n in placeholders])
    if enc == "default":
        it.encoder_input.CopyFrom(tensor())
    elif enc is not None:
        it.encoder_input.CopyFrom(enc)
    if token is not None:
        it.placeholder_token_id = token
    for k, v in (side or {}).items():
        it.model_specific_tensors[k].CopyFrom(v)
    return it


def greq(*items, prompt=(1, 9, 9, 9, 2)) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r1", tokenized=pb.TokenizedInput(input_ids=list(prompt)),
                              mm_inputs=pb.MultimodalInputs(items=list(items)))


def rejected(req, field, match=None, config=CONFIG) -> RequestRejected:
    with pytest.raises(RequestRejected, match=match) as ei:
        translate_parallel(req, config)
    assert ei.value.field == field, ei.value
    assert ei.value.request_id == "r1"
    return ei.value


# ----------------------------------------------------------------- mapping


def test_image_item_maps_to_a_padded_prompt_and_a_data_item():
    t = translate_request(greq(item()), CONFIG)
    r = t.request
    pad = ts.pad_value(ts.Modality.IMAGE, 5)
    assert pad == 1_000_005
    assert r.input_ids == (1, pad, pad, pad, 2)
    assert r.input_ids_unpadded == (1, 9, 9, 9, 2)
    assert t.prompt_token_ids == (1, 9, 9, 9, 2)  # stop strings and prompt counts use the original ids
    mm = r.multimodal_inputs
    assert mm.im_token_id == 9 and mm.video_token_id is None
    (it,) = mm.mm_items
    assert (it.modality, it.hash, it.pad_value, it.offsets) == (ts.Modality.IMAGE, 5, pad, ((1, 3),))
    assert (it.feature.dtype, it.feature.shape, bytes(it.feature.data)) == ("float32", (4, 24), PIXELS)
    check_tokenspeed_request(r, max_model_len=64, vocab_size=1000)  # pad ids pass the vocabulary check


def test_the_feature_is_not_copied():
    """From the proto's bytes (which protobuf hands out when the field is read) to the
    aux frame the socket sends: the same buffer, no copy."""
    r = translate_request(greq(item()), CONFIG).request
    feature = r.multimodal_inputs.mm_items[0].feature
    assert isinstance(feature.data, memoryview) and type(feature.data.obj) is bytes
    assert ts.encode_add(r)[1] is feature.data


def test_hash_is_the_first_8_bytes_little_endian_and_offsets_are_inclusive():
    h = bytes(range(1, 33))
    t = translate_request(greq(item(h=h, placeholders=((1, 2), (3, 1))), prompt=(1, 9, 9, 9, 2)), CONFIG)
    (it,) = t.request.multimodal_inputs.mm_items
    assert it.hash == int.from_bytes(h[:8], "little")
    assert it.offsets == ((1, 2), (3, 3))
    assert it.num_tokens == 3


def test_an_empty_content_hash_is_tokenspeeds_own_feature_hash():
    (it,) = translate_request(greq(item(h=b"")), CONFIG).request.multimodal_inputs.mm_items
    assert it.hash == int.from_bytes(hashlib.blake2b(PIXELS, digest_size=8).digest(), "big")
    assert it.pad_value == ts.pad_value(ts.Modality.IMAGE, it.hash)


def test_audio_maps_to_tokenspeeds_enum_and_its_own_pad_interval():
    audio = item(modality=AUDIO, placeholders=((3, 2),), token=None, h=b"\x01" + b"\x00" * 7)
    t = translate_request(greq(item(placeholders=((0, 2),)), audio, prompt=(9, 9, 7, 7, 7)), CONFIG)
    image, sound = t.request.multimodal_inputs.mm_items
    assert int(sound.modality) == 3 and sound.pad_value == tsmm.MM_PAD_BASE + 2 * tsmm.MM_PAD_HASH_SLOTS + 1
    assert t.request.input_ids == (image.pad_value,) * 2 + (7,) + (sound.pad_value,) * 2
    assert t.request.multimodal_inputs.im_token_id == 9


def test_side_tensors_keep_their_dtype_in_sorted_order():
    side = {"b_mask": tensor((2,), "int64", struct.pack("<2q", 1, 0)), "a_sizes": tensor((1, 2), "int32",
                                                                                        struct.pack("<2i", 4, 6))}
    (it,) = translate_request(greq(item(side=side)), CONFIG).request.multimodal_inputs.mm_items
    assert list(it.model_specific_data) == ["a_sizes", "b_mask"]
    assert it.model_specific_data["b_mask"].dtype == "int64"


def test_the_add_carries_the_feature_as_an_aux_frame_and_decodes_back():
    r = translate_request(greq(item()), CONFIG).request
    frames = ts.encode_add(r)
    assert len(frames) == 2 and bytes(frames[1]) == PIXELS
    decoded = ts_engine.decode_add(frames)
    assert decoded.input_ids == r.input_ids and decoded.input_ids_unpadded == r.input_ids_unpadded
    assert tsmm.decode_multimodal_inputs(decoded.multimodal_inputs, frames) == r.multimodal_inputs


def test_samples_share_the_items():
    req = greq(item())
    req.sampling_params.n = 3
    children = translate_parallel(req, CONFIG)
    assert len({id(c.request.multimodal_inputs) for c in children}) == 1
    assert all(c.request.input_ids == children[0].request.input_ids for c in children)


def test_mm_dtype_admits_the_matching_float_dtype():
    bf16 = tensor((4, 24), "bfloat16", bytes(192))
    cfg = attrs.evolve(CONFIG, mm_dtype="bfloat16")
    (it,) = translate_request(greq(item(enc=bf16)), cfg).request.multimodal_inputs.mm_items
    assert it.feature.dtype == "bfloat16"


# ----------------------------------------------------------------- refusals


_SHM = pb.TensorData(shape=[4], dtype="float32", shm=common_pb2.ShmHandle(name="/x", nbytes=16))
_REMOTE = pb.TensorData(shape=[4], dtype="float32", remote=common_pb2.RemoteTensorHandle(transport="nixl"))


@pytest.mark.parametrize(
    ("items", "prompt", "field", "match"),
    [
        ((), None, "mm_inputs.items", "must not be empty"),
        ((item(modality=common_pb2.MODALITY_UNSPECIFIED),), None, "mm_inputs.items[0].modality",
         "not IMAGE, AUDIO or VIDEO"),
        ((item(modality=VIDEO),), None, "mm_inputs.items[0].modality", "M-RoPE"),
        ((item(side={"image_grid_thw": tensor((1, 3), "int64", bytes(24))}),), None,
         "mm_inputs.items[0].model_specific_tensors[image_grid_thw]", "mrope_positions"),
        ((item(enc=None),), None, "mm_inputs.items[0].encoder_input", "required"),
        ((item(enc=_SHM),), None, "mm_inputs.items[0].encoder_input", "only inline.*got shm"),
        ((item(enc=_REMOTE),), None, "mm_inputs.items[0].encoder_input", "only inline.*got remote"),
        ((item(enc=tensor(dtype="complex64")),), None, "mm_inputs.items[0].encoder_input", "cannot be carried"),
        ((item(enc=tensor(dtype=">f4")),), None, "mm_inputs.items[0].encoder_input", "cannot be carried"),
        ((item(enc=tensor(dtype="<f4")),), None, "mm_inputs.items[0].encoder_input", "cannot be carried"),
        ((item(enc=tensor(data=PIXELS[:-1])),), None, "mm_inputs.items[0].encoder_input", "383 bytes.*expected 384"),
        ((item(enc=tensor(shape=())),), None, "mm_inputs.items[0].encoder_input", "at least one dimension"),
        ((item(enc=tensor(shape=(0, 24), data=b"")),), None, "mm_inputs.items[0].encoder_input",
         r"shape \[0, 24\] has a zero-size dimension \(dim 0\)"),
        ((item(side={"image_sizes": tensor((1, 2), "int64", bytes(8))}),), None,
         "mm_inputs.items[0].model_specific_tensors[image_sizes]", "expected 16"),
        ((item(placeholders=()),), None, "mm_inputs.items[0].placeholders", "at least one"),
        ((item(placeholders=((1, 0),)),), None, "mm_inputs.items[0].placeholders[0]", "length must be >= 1"),
        ((item(placeholders=((3, 3),)),), None, "mm_inputs.items[0].placeholders[0]",
         r"\[3, 6\) falls outside the prompt of 5 tokens"),
        ((item(placeholders=((0, 2),)),), None, "mm_inputs.items[0].placeholders[0]",
         "position 0 holds token 1, not placeholder_token_id 9"),
        ((item(placeholders=((1, 2), (2, 2))),), None, "mm_inputs.items[0].placeholders[1]", "overlaps"),
        ((item(placeholders=((1, 2),)), item(placeholders=((2, 2),))), None, "mm_inputs.items[1].placeholders[0]",
         r"\[2, 3\] overlaps mm_inputs.items\[0\].placeholders\[0\] \[1, 2\]"),
        ((item(placeholders=((1, 1),)), item(placeholders=((3, 1),), token=7)), (1, 9, 2, 7, 3),
         "mm_inputs.items[1].placeholder_token_id", "7 conflicts with 9"),
    ],
)
def test_refusals_name_the_field(items, prompt, field, match):
    rejected(greq(*items, prompt=prompt or (1, 9, 9, 9, 2)), field, match)


def test_item_count_limit_is_named():
    cfg = attrs.evolve(CONFIG, max_mm_items=1)
    rejected(greq(item(placeholders=((1, 1),)), item(placeholders=((2, 1),))), "mm_inputs.items",
             "2 items exceed max_mm_items=1", config=cfg)


def test_byte_limit_is_named_and_counts_side_tensors():
    side = {"image_sizes": tensor((1, 2), "int64", bytes(16))}
    rejected(greq(item(side=side)), "mm_inputs.items[0]", "exceed max_mm_bytes=399",
             config=attrs.evolve(CONFIG, max_mm_bytes=384 + 15))
    translate_request(greq(item(side=side)), attrs.evolve(CONFIG, max_mm_bytes=384 + 16))


def test_a_huge_image_is_refused_on_its_shape_before_its_bytes_are_read():
    huge = tensor(shape=(1 << 16, 1 << 12), data=b"")  # claims 1 GiB of float32
    e = rejected(greq(item(enc=huge)), "mm_inputs.items[0]", "exceed max_mm_bytes=134217728")
    assert "1073741824 bytes" in str(e)


def test_mm_dtype_casts_float32_and_refuses_another_float_dtype():
    """float32 pixels become the engine's dtype (as TokenSpeed's own gRPC servicer casts
    them); another float dtype is refused; integer side tensors keep theirs."""
    cfg = attrs.evolve(CONFIG, mm_dtype="bfloat16")
    side = {"image_sizes": tensor((1, 2), "int64", struct.pack("<2q", 3, 4))}
    (it,) = translate_request(greq(item(side=side)), cfg).request.multimodal_inputs.mm_items
    assert (it.feature.dtype, it.feature.shape, it.feature.nbytes) == ("bfloat16", (4, 24), 192)
    assert it.feature.tolist()[0][:3] == [0.0, 1.0, 2.0]  # small ints are exact in bfloat16
    assert it.model_specific_data["image_sizes"].dtype == "int64"
    rejected(greq(item(enc=tensor((4, 24), "float16", bytes(192)))), "mm_inputs.items[0].encoder_input",
             "float16 differs from the engine's model dtype bfloat16", config=cfg)


def test_an_item_with_grid_thw_among_several_is_refused():
    grid = {"video_grid_thw": tensor((1, 3), "int64", bytes(24))}
    rejected(greq(item(placeholders=((1, 1),)), item(placeholders=((2, 2),), side=grid)),
             "mm_inputs.items[1].model_specific_tensors[video_grid_thw]")


# ----------------------------------------------------------------- the client check on a hand-built request


def _built() -> ts.TokenizedGenerateReqInput:
    return translate_request(greq(item()), CONFIG).request


@pytest.mark.parametrize(
    ("change", "field", "match"),
    [
        (dict(input_ids=(1, 9, 9, 9, 2)), "input_ids", "element 1 is 9, expected 1000005"),
        (dict(input_ids_unpadded=None), "input_ids_unpadded", "non-empty"),
        (dict(input_ids_unpadded=(1, 9, 9, 9)), "input_ids_unpadded", "4 ids for an input_ids of 5"),
        (dict(input_ids_unpadded=(1, 9, 9, 9, 5000)), "input_ids_unpadded", "not below vocab_size=1000"),
    ],
)
def test_client_check_of_a_multimodal_request(change, field, match):
    with pytest.raises(RequestRejected, match=match) as ei:
        check_tokenspeed_request(attrs.evolve(_built(), **change), max_model_len=64, vocab_size=1000)
    assert ei.value.field == field


def test_client_check_refuses_an_item_the_encoder_would_refuse():
    r = _built()
    (it,) = r.multimodal_inputs.mm_items
    mm = attrs.evolve(r.multimodal_inputs, mm_items=[attrs.evolve(it, pad_value=it.pad_value + 1)])
    with pytest.raises(RequestRejected, match="is not pad_value") as ei:
        check_tokenspeed_request(attrs.evolve(r, multimodal_inputs=mm), max_model_len=64, vocab_size=1000)
    assert ei.value.field == "multimodal_inputs.mm_items[0].pad_value"


def test_client_check_refuses_offsets_outside_the_prompt():
    r = _built()
    (it,) = r.multimodal_inputs.mm_items
    mm = attrs.evolve(r.multimodal_inputs, mm_items=[attrs.evolve(it, offsets=[(3, 5)])])
    with pytest.raises(RequestRejected, match="outside the prompt of 5 tokens") as ei:
        check_tokenspeed_request(attrs.evolve(r, multimodal_inputs=mm), max_model_len=64, vocab_size=1000)
    assert ei.value.field == "multimodal_inputs.mm_items[0].offsets"


# ----------------------------------------------------------------- properties


@st.composite
def placements(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt with the placeholder token at each of a few disjoint runs."""
    n = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, 40), min_size=2 * n, max_size=2 * n, unique=True)))
    runs = [(cuts[2 * i], cuts[2 * i + 1] - cuts[2 * i]) for i in range(n)]
    prompt = [draw(st.integers(0, 8)) for _ in range(cuts[-1] + draw(st.integers(0, 3)))]
    for o, length in runs:
        prompt[o:o + length] = [9] * length
    return prompt, [(o, length) for o, length in runs]


@settings(max_examples=60, deadline=None)
@given(placements(), st.lists(st.binary(min_size=0, max_size=12), min_size=4, max_size=4))
def test_padding_rewrites_exactly_the_placeholders(case, hashes):
    prompt, runs = case
    items = [item(placeholders=[run], h=hashes[i]) for i, run in enumerate(runs)]
    r = translate_request(greq(*items, prompt=prompt), CONFIG).request
    assert r.input_ids_unpadded == tuple(prompt)
    covered = {}
    for it in r.multimodal_inputs.mm_items:
        assert tsmm.MM_PAD_BASE <= it.pad_value < tsmm.MM_PAD_BASE + tsmm.MM_PAD_HASH_SLOTS  # IMAGE interval
        for s, e in it.offsets:
            covered.update({p: it.pad_value for p in range(s, e + 1)})
    assert r.input_ids == tuple(covered.get(p, t) for p, t in enumerate(prompt))
    check_tokenspeed_request(r, max_model_len=64, vocab_size=1000)


# ----------------------------------------------------------------- zero-size content

ZERO_SHAPES = [(0, 3, 224, 224), (3, 0, 224), (1, 3, 0, 2), (0,), (4, 0)]


def _zero_words(shape) -> str:
    return f"shape {list(shape)} has a zero-size dimension (dim {list(shape).index(0)})"


@pytest.mark.parametrize("shape", ZERO_SHAPES)
def test_an_encoder_input_with_a_zero_size_dimension_is_refused(shape):
    e = rejected(greq(item(enc=tensor(shape, data=b""))), "mm_inputs.items[0].encoder_input")
    assert _zero_words(shape) in str(e), str(e)
    # before the cast and before any other item is looked at
    e = rejected(greq(item(), item(enc=tensor(shape, data=b""), placeholders=((4, 1),))),
                 "mm_inputs.items[1].encoder_input", config=attrs.evolve(CONFIG, mm_dtype="bfloat16"))
    assert _zero_words(shape) in str(e), str(e)


@pytest.mark.parametrize("key", ["image_embeds", "pixel_values_videos"])
@pytest.mark.parametrize("shape", ZERO_SHAPES)
def test_an_embeddings_or_pixel_side_tensor_with_a_zero_size_dimension_is_refused(shape, key):
    e = rejected(greq(item(side={key: tensor(shape, dtype="float16", data=b"")})),
                 f"mm_inputs.items[0].model_specific_tensors[{key}]")
    assert _zero_words(shape) in str(e), str(e)


def test_an_empty_side_tensor_that_is_not_content_is_carried():
    t = translate_request(greq(item(side={"image_sizes": tensor((1, 0), dtype="int64", data=b"")})), CONFIG)
    assert t.request.multimodal_inputs.mm_items[0].model_specific_data["image_sizes"].shape == (1, 0)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(lambda s: 0 in s),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "uint8"]))
def test_any_encoder_input_shape_with_a_zero_dimension_is_refused(shape, dtype):
    e = rejected(greq(item(enc=tensor(shape, dtype=dtype, data=b""))), "mm_inputs.items[0].encoder_input")
    assert _zero_words(shape) in str(e), str(e)
