"""Gateway ``mm_inputs`` / ``extra_mm_inputs`` -> ``EngineCoreRequest.mm_features``.

What lands where (batched rows, flat slices, shared tensors, is_embed, video keys,
ordering, zero-copy views of the proto bytes), every refusal by field and limit, and
the split invariants under hypothesis. Byte equality with vLLM's own encoder is in
``tests/wire/test_vllm_mm_golden.py``."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch import limits
from zmqdispatch.errors import RequestRejected
from zmqdispatch.translate.multimodal import translate_mm_inputs
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine
from zmqdispatch.wire.tensors import Tensor, cast_float32
from zmqdispatch.wire.vllm_multimodal import BatchedField, FlatField, SharedField, decode_mm_features

IM = 9  # image placeholder token


def f32(n: int, start: int = 0) -> bytes:
    return struct.pack(f"<{n}f", *range(start, start + n))


def i64(*v: int) -> bytes:
    return struct.pack(f"<{len(v)}q", *v)


def td(dtype: str, shape, data: bytes | None = None, **kw) -> pb.TensorData:
    t = pb.TensorData(shape=list(shape), dtype=dtype, **kw)
    if data is not None:
        t.inline = data
    return t


def image_req(prompt=(1, IM, IM, IM, IM, 2), *, n_items=1, placeholders=((1, 4),), pixel=None,
              batched=("pixel_values",), hashes=None, rid="m1", **mm) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=list(prompt)))
    m = r.mm_inputs
    m.pixel_values.CopyFrom(pixel if pixel is not None else td("float32", [n_items, 3, 2, 2], f32(12 * n_items)))
    for off, ln in placeholders:
        m.mm_placeholders.add(offset=off, length=ln)
    m.mm_hashes.extend(hashes if hashes is not None else [f"h{i}" for i in range(len(placeholders))])
    m.batched_keys.extend(batched)
    for k, v in mm.items():
        if k == "tensors":
            for name, t in v.items():
                m.model_specific_tensors[name].CopyFrom(t)
        elif k == "flat":
            m.flat_keys.update(v)
        elif k == "keep":
            m.keep_on_cpu_keys.extend(v)
        else:
            setattr(m, k, v)
    return r


def tr(r: pb.GenerateRequest, **kw):
    kw.setdefault("max_model_len", 100)
    return translate_request(r, TranslationConfig(**kw), arrival_time=0.0).request


def rejected(r: pb.GenerateRequest, **kw) -> RequestRejected:
    with pytest.raises(RequestRejected) as ei:
        tr(r, **kw)
    assert ei.value.request_id == r.request_id
    return ei.value


def roundtrip(e: wire.EngineCoreRequest):
    frames = wire.encode_request(e)
    got = wire_engine.decode_request(frames)
    return decode_mm_features(got.mm_features, frames), frames


# ------------------------------------------------------------------ what lands where


def test_batched_pixels_one_row_per_item_as_views_of_the_proto_bytes():
    r = image_req(prompt=(1, IM, IM, 2, IM, IM, 3), n_items=2, placeholders=((4, 2), (1, 2)))
    e = tr(r)
    feats = e.mm_features
    # sorted by offset; identifier = mm_hash = the gateway's hash
    assert [(f["mm_position"]["offset"], f["identifier"], f["mm_hash"]) for f in feats] == [(1, "h1", "h1"),
                                                                                         (4, "h0", "h0")]
    assert list(feats[0]) == ["data", "modality", "identifier", "mm_position", "mm_hash"]
    px = [f["data"]["pixel_values"]["data"] for f in feats]
    assert [p.shape for p in px] == [(3, 2, 2), (3, 2, 2)]
    assert bytes(px[1].data) == f32(12)[:48] and bytes(px[0].data) == f32(24)[48:]
    # one read of the proto field (upb copies it out once), then views of that one buffer
    assert all(type(p.data) is memoryview for p in px) and px[0].data.obj is px[1].data.obj
    assert feats[0]["data"]["pixel_values"]["field"] == ["batched", {"keep_on_cpu": False}]
    decoded, frames = roundtrip(e)
    assert [d.modality for d in decoded] == ["image", "image"]
    assert len(frames) == 1  # 48 B tensors go inline


def test_flat_pixels_use_the_sizes_tensor_and_every_item_carries_the_whole_slice_list():
    r = image_req(prompt=(1, IM, IM, IM, 2, IM, IM, 3), placeholders=((1, 3), (5, 2)), batched=("image_grid_thw",),
                  pixel=td("float32", [5, 4], f32(20)),
                  tensors={"image_grid_thw": td("int64", [2, 3], i64(1, 1, 3, 1, 1, 2)),
                           "sizes": td("int64", [2], i64(3, 2))},
                  flat={"pixel_values": "sizes"}, keep=["image_grid_thw"])
    feats, _ = roundtrip(tr(r))
    assert [f.data["pixel_values"].data.shape for f in feats] == [(3, 4), (2, 4)]
    assert [f.data["pixel_values"].data.tolist()[0][0] for f in feats] == [0.0, 12.0]
    field = feats[0].data["pixel_values"].field
    assert field == FlatField((((0, 3, None),), ((3, 5, None),)), 0, False, nested=True)
    assert feats[1].data["pixel_values"].field == field
    assert feats[1].data["image_grid_thw"].data.tolist() == [1, 1, 2]
    assert feats[1].data["image_grid_thw"].field == BatchedField(True)
    # a key in neither list is shared: the whole tensor in every item
    assert feats[0].data["sizes"].data.tolist() == [3, 2] and feats[0].data["sizes"].field == SharedField(2)


def test_im_token_id_gives_is_embed_only_when_some_positions_are_not_embedded():
    r = image_req(prompt=(1, IM, 7, IM, IM, 2), im_token_id=IM)
    (f,) = tr(r).mm_features
    assert f["mm_position"]["is_embed"].tolist() == [True, False, True, True]
    r = image_req(im_token_id=IM)
    assert tr(r).mm_features[0]["mm_position"]["is_embed"] is None


def test_embeddings_rows_must_equal_the_embedded_positions():
    emb = td("float16", [1, 3, 8], bytes(48))
    ok = image_req(prompt=(1, IM, 7, IM, IM, 2), pixel=emb, batched=("image_embeds",),
                   encoder_input_key="image_embeds", im_token_id=IM)
    (f,) = tr(ok).mm_features
    assert f["data"]["image_embeds"]["data"].shape == (3, 8)
    bad = image_req(pixel=emb, batched=("image_embeds",), encoder_input_key="image_embeds")
    e = rejected(bad)
    assert e.field == "mm_inputs.mm_placeholders[0]" and "4 embedded positions" in str(e) and "3 rows" in str(e)


def test_video_renames_pixel_values_and_extra_batches_merge_sorted_by_offset():
    r = image_req(prompt=(1, IM, IM, 2, 5, 5, 5, 3), placeholders=((4, 3),), modality=3)
    extra = r.extra_mm_inputs.add()
    extra.pixel_values.CopyFrom(td("float32", [1, 8], f32(8)))
    extra.mm_placeholders.add(offset=1, length=2)
    extra.mm_hashes.append("img")
    extra.batched_keys.append("pixel_values")
    feats = tr(r).mm_features
    assert [(f["modality"], list(f["data"])) for f in feats] == [("image", ["pixel_values"]),
                                                                 ("video", ["pixel_values_videos"])]


def test_audio_modality_and_encoder_input_key():
    r = image_req(modality=2, encoder_input_key="input_features", batched=("input_features",))
    (f,) = tr(r).mm_features
    assert f["modality"] == "audio" and list(f["data"]) == ["input_features"]


def test_text_requests_carry_no_mm_features():
    r = pb.GenerateRequest(request_id="t", tokenized=pb.TokenizedInput(input_ids=[1, 2]))
    assert tr(r).mm_features is None
    assert translate_mm_inputs(r, (1, 2), max_mm_bytes=10, max_mm_items=1) is None


def test_big_pixels_go_as_aux_frames_that_are_the_proto_bytes():
    r = image_req(pixel=td("float32", [1, 3, 16, 16], f32(768)))
    e = tr(r)
    frames = wire.encode_request(e)
    assert len(frames) == 2 and frames[1].obj is e.mm_features[0]["data"]["pixel_values"]["data"].data.obj
    assert bytes(frames[1]) == f32(768)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("placeholders, field, words", [
    (((1, 4), (3, 2)), "mm_inputs.mm_placeholders", "overlaps"),
    (((3, 4),), "mm_inputs.mm_placeholders[0]", "outside the prompt of 6 tokens"),
    (((1, 0),), "mm_inputs.mm_placeholders[0]", "length must be >= 1"),
])
def test_bad_placeholders(placeholders, field, words):
    r = image_req(n_items=len(placeholders), placeholders=placeholders)
    e = rejected(r)
    assert e.field == field and words in str(e)


def test_placeholders_of_two_batches_that_overlap():
    r = image_req()
    extra = r.extra_mm_inputs.add()
    extra.pixel_values.CopyFrom(td("float32", [1, 2], f32(2)))
    extra.mm_placeholders.add(offset=2, length=1)
    extra.mm_hashes.append("x")
    e = rejected(r)
    assert "overlaps the one ending at 5" in str(e)


@pytest.mark.parametrize("mutate, field, words", [
    (lambda r: r.mm_inputs.ClearField("mm_hashes"), "mm_inputs.mm_hashes", "0 hashes for 1 placeholders"),
    (lambda r: r.mm_inputs.ClearField("mm_placeholders"), "mm_inputs.mm_placeholders", "no placeholder"),
    (lambda r: r.mm_inputs.ClearField("pixel_values"), "mm_inputs.pixel_values", "no tensor"),
    (lambda r: setattr(r.mm_inputs, "modality", 9), "mm_inputs.modality", "modality 9"),
    (lambda r: r.mm_inputs.pixel_values.CopyFrom(td("float64", [1, 1], bytes(8))), "mm_inputs.pixel_values",
     "dtype 'float64'"),
    (lambda r: r.mm_inputs.pixel_values.CopyFrom(td("<f4", [1, 1], bytes(4))), "mm_inputs.pixel_values",
     "dtype '<f4'"),
    (lambda r: r.mm_inputs.pixel_values.CopyFrom(td("float32", [1, 3, 2, 2], bytes(47))), "mm_inputs.pixel_values",
     "47 bytes for shape [1, 3, 2, 2] of float32 (expected 48)"),
    (lambda r: r.mm_inputs.pixel_values.CopyFrom(td("float32", [1, 3, 2, 2], bytes(96))), "mm_inputs.pixel_values",
     "96 bytes"),
    (lambda r: r.mm_inputs.pixel_values.CopyFrom(td("float32", [], b"")), "mm_inputs.pixel_values",
     "at least one dimension"),
    (lambda r: r.mm_inputs.pixel_values.shm.CopyFrom(pb.TensorData().shm.__class__(name="x")),
     "mm_inputs.pixel_values", "only inline tensor payloads travel over ZMQ, got shm"),
    (lambda r: r.mm_inputs.pixel_values.remote.CopyFrom(pb.TensorData().remote.__class__(transport="nixl")),
     "mm_inputs.pixel_values", "got remote"),
    (lambda r: r.mm_inputs.pixel_values.ClearField("inline"), "mm_inputs.pixel_values", "got none"),
    (lambda r: r.mm_inputs.batched_keys.append("nope"), "mm_inputs.batched_keys", "'nope' names no tensor"),
    (lambda r: r.mm_inputs.keep_on_cpu_keys.append("nope"), "mm_inputs.keep_on_cpu_keys", "'nope'"),
    (lambda r: r.mm_inputs.pixel_values.CopyFrom(td("float32", [2, 3, 2, 2], f32(24))), "mm_inputs.pixel_values",
     "batched: leading dim 2 must equal the 1 items"),
    (lambda r: r.mm_inputs.model_specific_tensors["pixel_values"].CopyFrom(td("int64", [1], i64(1))),
     "mm_inputs.model_specific_tensors", "repeats"),
    (lambda r: r.media_refs.items.add(url="http://x/y.png"), "media_refs", "processor"),
])
def test_refusals_name_the_field(mutate, field, words):
    r = image_req()
    mutate(r)
    e = rejected(r)
    assert e.field == field and words in str(e), (e.field, str(e))


def test_flat_sizes_must_fit():
    base = dict(pixel=td("float32", [5, 4], f32(20)), batched=(), placeholders=((1, 2), (3, 2)),
                flat={"pixel_values": "sizes"})
    e = rejected(image_req(tensors={"sizes": td("int64", [2], i64(3, 3))}, **base))
    assert e.field == "mm_inputs.pixel_values" and "sizes [3, 3] must sum to the leading dim 5" in str(e)
    e = rejected(image_req(tensors={"sizes": td("float32", [2], f32(2))}, **base))
    assert "sizes tensor 'sizes' must be 2 ints" in str(e)
    e = rejected(image_req(tensors={"sizes": td("int64", [2], i64(3, 2))},
                           **{**base, "batched": ("pixel_values",)}))
    assert e.field == "mm_inputs.flat_keys" and "also in batched_keys" in str(e)


def test_float32_is_cast_to_the_model_dtype_and_other_floats_must_match_it():
    r = image_req(pixel=td("float32", [1, 3, 2, 2], struct.pack("<12f", *[0.1 * i for i in range(12)])),
                  tensors={"grid": td("int64", [1], i64(3))})
    (f,) = tr(r, mm_dtype="bfloat16").mm_features
    px = f["data"]["pixel_values"]["data"]
    assert px.dtype == "bfloat16" and px.shape == (3, 2, 2) and px.nbytes == 24
    assert bytes(px.data) == cast_float32(r.mm_inputs.pixel_values.inline, "bfloat16")
    assert f["data"]["grid"]["data"].dtype == "int64"  # integers are never cast
    assert tr(r, mm_dtype="float16").mm_features[0]["data"]["pixel_values"]["data"].dtype == "float16"
    assert tr(r, mm_dtype="float32").mm_features[0]["data"]["pixel_values"]["data"].dtype == "float32"
    assert tr(r).mm_features[0]["data"]["pixel_values"]["data"].dtype == "float32"  # no model dtype: as sent
    r = image_req(pixel=td("bfloat16", [1, 3, 2, 2], bytes(24)))
    assert tr(r, mm_dtype="bfloat16").mm_features
    e = rejected(r, mm_dtype="float16")
    assert e.field == "mm_inputs.pixel_values"
    assert "dtype bfloat16 differs from the engine's model dtype float16" in str(e)
    big = image_req(pixel=td("float32", [1, 1, 1, 1], struct.pack("<f", 1e6)))
    e = rejected(big, mm_dtype="float16")
    assert e.field == "mm_inputs.pixel_values" and "beyond float16's range" in str(e)


def test_limits_are_checked_before_anything_is_built():
    r = image_req(pixel=td("float32", [1, 3, 16, 16], f32(768)))
    e = rejected(r, max_mm_bytes=3071)
    assert e.field == "mm_inputs" and "3072 bytes of multimodal tensors exceed max_mm_bytes=3071" in str(e)
    assert tr(r, max_mm_bytes=3072).mm_features
    # checked on the shape, before protobuf copies the bytes out (these 4 bytes are never read)
    huge = image_req(pixel=td("float32", [1, 3, 4096, 4096], bytes(4)))
    e = rejected(huge)
    assert f"201326592 bytes of multimodal tensors exceed max_mm_bytes={limits.DEFAULT_MAX_MM_BYTES}" in str(e)
    r = image_req(prompt=(1, IM, IM, 2), n_items=3, placeholders=((1, 1), (2, 1), (3, 1)))
    e = rejected(r, max_mm_items=2)
    assert e.field == "mm_inputs.mm_placeholders" and "3 items exceed max_mm_items=2" in str(e)
    # the byte limit counts every batch of the request
    r = image_req()
    extra = r.extra_mm_inputs.add()
    extra.pixel_values.CopyFrom(td("float32", [1, 2], f32(2)))
    extra.mm_placeholders.add(offset=5, length=1)
    extra.mm_hashes.append("x")
    extra.batched_keys.append("pixel_values")
    e = rejected(r, max_mm_bytes=50)
    assert e.field == "extra_mm_inputs[0]" and "56 bytes" in str(e)
    assert TranslationConfig(max_model_len=1).max_mm_bytes == limits.DEFAULT_MAX_MM_BYTES
    assert TranslationConfig(max_model_len=1).max_mm_items == limits.DEFAULT_MAX_MM_ITEMS


def test_a_prompt_with_placeholders_cannot_be_truncated():
    r = image_req()
    r.sampling_params.truncate_prompt_tokens = 3
    assert rejected(r).field == "sampling_params.truncate_prompt_tokens"


# ------------------------------------------------------------------ invariants


@st.composite
def flat_batches(draw):
    n = draw(st.integers(1, 5))
    # every item gets >= 1 row: a zero share of pixel values is refused (tested above)
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    rows = sum(sizes)
    width = draw(st.integers(1, 3))
    gaps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    prompt, spans = [1], []
    for g, ln in zip(gaps, lengths):
        prompt += [5] * g
        spans.append((len(prompt), ln))
        prompt += [IM] * ln
    # the gateway may list the placeholders in any order: hashes follow the placeholders
    return n, sizes, rows, width, prompt, [spans[i] for i in order], order


@settings(max_examples=60, deadline=None)
@given(flat_batches())
def test_split_rows_concatenate_back_to_the_gateway_tensor(case):
    n, sizes, rows, width, prompt, spans, order = case
    pixels = f32(rows * width)
    grid = i64(*range(3 * n))
    r = image_req(prompt=prompt, placeholders=spans, pixel=td("float32", [rows, width], pixels),
                  batched=("grid",), flat={"pixel_values": "sizes"},
                  tensors={"sizes": td("int64", [n], i64(*sizes)), "grid": td("int64", [n, 3], grid)})
    feats, _ = roundtrip(tr(r, max_model_len=1000))
    assert [f.mm_position.offset for f in feats] == sorted(s[0] for s in spans)
    # item i of the gateway batch (placeholder i, hash i) holds rows of size sizes[i]
    by_hash = {f.mm_hash: f for f in feats}
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    for i in range(n):
        f = by_hash[f"h{i}"]
        assert (f.mm_position.offset, f.mm_position.length) == spans[i]
        px = f.data["pixel_values"]
        assert bytes(px.data.data) == pixels[bounds[i] * width * 4:bounds[i + 1] * width * 4]
        assert px.data.shape == (sizes[i], width)
        assert px.field.slices == tuple(((bounds[k], bounds[k + 1], None),) for k in range(n))
        assert f.data["grid"].data.tolist() == [3 * i, 3 * i + 1, 3 * i + 2]
    assert b"".join(bytes(by_hash[f"h{i}"].data["pixel_values"].data.data) for i in range(n)) == pixels
    assert sorted(order) == list(range(n))


def test_tensor_view_type_is_what_the_wire_codec_takes():
    r = image_req()
    (f,) = tr(r).mm_features
    assert isinstance(f["data"]["pixel_values"]["data"], Tensor)


def test_samples_of_an_image_request_share_its_tensors():
    from zmqdispatch.translate.vllm import translate_parallel

    r = image_req(pixel=td("float32", [1, 3, 16, 16], f32(768)))
    r.sampling_params.n = 3
    children = translate_parallel(r, TranslationConfig(max_model_len=100))
    assert len(children) == 3
    frames = [wire.encode_request(c.request) for c in children]
    # one buffer behind every sample's aux frame: no copy per sample on the client
    assert len({id(f[1].obj) for f in frames}) == 1


# ----------------------------------------------------------------- zero-size content

ZERO_SHAPES = [[0, 3, 224, 224], [3, 0, 224], [1, 3, 0, 2], [0], [2, 0]]


def _zero_shape_words(shape) -> str:
    return f"shape {list(shape)} has a zero-size dimension (dim {list(shape).index(0)})"


@pytest.mark.parametrize("batched", [(), ("pixel_values",)])
@pytest.mark.parametrize("shape", ZERO_SHAPES)
def test_pixel_values_with_a_zero_size_dimension_are_refused(shape, batched):
    e = rejected(image_req(pixel=td("float32", shape, b""), batched=batched))
    assert e.field == "mm_inputs.pixel_values" and _zero_shape_words(shape) in str(e), str(e)


@pytest.mark.parametrize("key", ["image_embeds", "pixel_values_videos"])
@pytest.mark.parametrize("shape", ZERO_SHAPES)
def test_an_embeddings_or_pixel_side_tensor_with_a_zero_size_dimension_is_refused(shape, key):
    e = rejected(image_req(tensors={key: td("float16", shape, b"")}))
    assert e.field == f"mm_inputs.model_specific_tensors[{key}]" and _zero_shape_words(shape) in str(e), str(e)
    # the primary tensor under an embeddings key, and in an extra batch
    r = image_req(pixel=td("float16", shape, b""), batched=(), encoder_input_key="image_embeds")
    assert rejected(r).field == "mm_inputs.pixel_values"
    r = image_req()
    extra = r.extra_mm_inputs.add()
    extra.pixel_values.CopyFrom(td("float32", shape, b""))
    extra.mm_placeholders.add(offset=1, length=1)
    extra.mm_hashes.append("x")
    assert rejected(r).field == "extra_mm_inputs[0].pixel_values"


def test_other_side_tensors_may_be_empty_and_a_flat_share_of_zero_rows_is_refused():
    (f,) = tr(image_req(tensors={"image_sizes": td("int64", [1, 0], b"")})).mm_features
    assert f["data"]["image_sizes"]["data"].shape == (1, 0)  # not content: carried as given
    r = image_req(prompt=(1, IM, IM, 2, IM, 3), placeholders=((1, 2), (4, 1)), batched=(),
                  pixel=td("float32", [3, 4], f32(12)), tensors={"sizes": td("int64", [2], i64(3, 0))},
                  flat={"pixel_values": "sizes"})
    e = rejected(r)
    assert e.field == "mm_inputs.pixel_values" and "sizes [3, 0] give item 1 zero rows" in str(e), str(e)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(lambda s: 0 in s),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "uint8"]),
       where=st.sampled_from(["pixel_values", "image_embeds"]))
def test_any_shape_with_a_zero_dimension_is_refused_before_anything_is_built(shape, dtype, where):
    empty = td(dtype, shape, b"")
    r = image_req(pixel=empty, batched=()) if where == "pixel_values" else image_req(tensors={where: empty})
    e = rejected(r)
    assert _zero_shape_words(shape) in str(e), str(e)
    assert e.field == ("mm_inputs.pixel_values" if where == "pixel_values"
                       else f"mm_inputs.model_specific_tensors[{where}]")
