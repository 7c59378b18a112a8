"""Multimodal ADDs cross-checked against TokenSpeed 0.1.1's own modules, with real torch.

TokenSpeed's tensor codec (``io_struct.MsgpackEncoder`` / ``MsgpackDecoder``) builds and
reads real ``torch.Tensor`` objects, so this helper process runs the wheel's modules with
the CPU torch that ``scripts/install_tokenspeed_reference.sh`` installs in the reference
venv (every other missing third-party module is stubbed, as in
``test_tokenspeed_reference.py``). Checked against TokenSpeed's code, not a copy of it:

- its decoder (``zmq_wire.decode_request_frames``, what the msgpack ingest runs) reads
  our multimodal ADD, inline and aux-frame tensors, into the expected
  ``MultimodalInputs`` / ``MultimodalDataItem`` values;
- its encoder writes the same frames, byte for byte, for the same values;
- its ``MultimodalDataItem.set_pad_value``, ``pad_input_tokens`` and ``hash_feature``
  give our :func:`~zmqdispatch.wire.tokenspeed.pad_value`, ``pad_input_ids`` and the
  translation's fallback hash;
- it refuses what we refuse of a multimodal ADD (a truncated or missing aux frame, a
  modality outside the enum, a wrong type in any slot), so the mock engine drops what
  TokenSpeed drops;
- a gateway request translated end to end decodes in TokenSpeed with the padded
  ``input_ids``, the original ``input_ids_unpadded`` and the item's tensors;
- for random gateway requests, what TokenSpeed decodes from our ADD equals what the
  reference gateway's own TokenSpeed servicer (``smg_grpc_servicer`` 0.14.1, from
  ``ZMQD_TOKENSPEED_SMG_PATH``) and TokenSpeed's input processor make of the same proto.

Skipped, with the reason, without ``ZMQD_TOKENSPEED_PYTHON`` / ``ZMQD_TOKENSPEED_PATH``
(``ZMQD_REQUIRE_TOKENSPEED_REFERENCE=1``, set by ``scripts/test --real-engine`` and CI,
makes that a failure); also skipped when that Python has no torch (a reference venv
made before torch was added: re-run the install script).
"""

from __future__ import annotations

import os
import struct
import subprocess
import textwrap
from collections.abc import Iterator
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from zmqdispatch.errors import RemoteProtocolError, RequestRejected
from zmqdispatch.translate import tokenspeed as translate
from zmqdispatch.translate.tokenspeed_multimodal import content_hash
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import tokenspeed_multimodal as tsmm
from zmqdispatch.wire.tensors import Tensor

from .test_tokenspeed_reference import (
    ENV_PATH,
    ENV_PYTHON,
    IMPORT_STUBS,
    TokenSpeedHelper,
    hexes,
    request_view,
    requires_tokenspeed,
    unhex,
)

pytestmark = requires_tokenspeed

SETTINGS = settings(deadline=None, max_examples=40, database=None, suppress_health_check=[HealthCheck.too_slow])

_HELPER = IMPORT_STUBS + textwrap.dedent(
    r'''
    import torch  # the real CPU build: TokenSpeed's tensor codec builds real tensors
    import msgspec
    from tokenspeed.version import __version__
    from tokenspeed.runtime.engine import zmq_wire
    from tokenspeed.runtime.engine.io_struct import MsgpackEncoder, SessionParams, TokenizedGenerateReqInput
    from tokenspeed.runtime.multimodal.inputs import Modality, MultimodalDataItem, MultimodalInputs
    from tokenspeed.runtime.multimodal.hash import hash_feature
    from tokenspeed.runtime.multimodal.embedder import pad_input_tokens
    from tokenspeed.runtime.sampling.sampling_params import SamplingParams

    ENC = MsgpackEncoder()

    def tensor_view(t):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            return {"not_a_tensor": type(t).__name__}
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "hex": raw.hex()}

    def build_tensor(v):
        if v is None:
            return None
        dtype = getattr(torch, v["dtype"])
        raw = bytes.fromhex(v["hex"])
        if not raw:
            return torch.empty(v["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(v["shape"])

    def item_view(it):
        return {
            "modality": it.modality.value, "hash": it.hash, "pad_value": it.pad_value,
            "offsets": None if it.offsets is None else [list(r) for r in it.offsets],
            "feature": tensor_view(it.feature), "feature_shm": None if it.feature_shm is None else "set",
            "model_specific_data": {k: tensor_view(t) for k, t in it.model_specific_data.items()},
            "encoded": tensor_view(it.encoded), "encoded_deepstack": tensor_view(it.encoded_deepstack),
            "encode_handshake": it.encode_handshake,
        }

    def mm_view(mm):
        if mm is None:
            return None
        return {
            "mm_items": [item_view(it) for it in mm.mm_items], "im_token_id": mm.im_token_id,
            "video_token_id": mm.video_token_id, "mrope_positions": tensor_view(mm.mrope_positions),
            "mrope_position_delta": tensor_view(mm.mrope_position_delta),
            "mrope_position_delta_scalar": mm.mrope_position_delta_scalar,
            "mrope_position_delta_repeated_cache": tensor_view(mm.mrope_position_delta_repeated_cache),
        }

    def build_mm(v):
        items = [MultimodalDataItem(
            modality=Modality(it["modality"]), hash=it["hash"], pad_value=it["pad_value"],
            offsets=[tuple(r) for r in it["offsets"]], feature=build_tensor(it["feature"]),
            model_specific_data={k: build_tensor(t) for k, t in it["model_specific_data"].items()})
            for it in v["mm_items"]]
        return MultimodalInputs(mm_items=items, im_token_id=v["im_token_id"], video_token_id=v["video_token_id"])

    def build_req(view, mm):
        sp = SamplingParams()
        for key, value in view["sampling_params"].items():  # raw values: no __post_init__
            if key == "stop_token_ids" and value is not None:
                value = set(value)
            setattr(sp, key, value)
        kwargs = dict(view, sampling_params=sp, multimodal_inputs=build_mm(mm))
        if view.get("session_params") is not None:
            kwargs["session_params"] = SessionParams(**dict(zip(("id", "rid", "offset", "replace"),
                                                                view["session_params"])))
        return TokenizedGenerateReqInput(**kwargs)

    def handle(job):
        op = job["op"]
        if op == "version":
            return {"version": __version__, "torch": torch.__version__}
        if op == "decode":
            frames = [bytes.fromhex(h) for h in job["frames"]]
            try:
                io = zmq_wire.decode_request_frames([b"\x00", *frames])[0]
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"error": None, "input_ids": io.input_ids, "input_ids_unpadded": io.input_ids_unpadded,
                    "multimodal_inputs": mm_view(io.multimodal_inputs)}
        if op == "decode_raw":  # the whole message as the socket delivers it, type frame included
            try:
                io = zmq_wire.decode_request_frames([bytes.fromhex(h) for h in job["frames"]])[0]
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"error": None, "rid": getattr(io, "rid", None)}
        if op == "encode":
            return {"frames": [bytes(f).hex() for f in ENC.encode(build_req(job["req"], job["mm"]))]}
        if op == "pad_value":
            it = MultimodalDataItem(modality=Modality(job["modality"]), hash=job["hash"])
            it.set_pad_value()
            return {"pad_value": it.pad_value}
        if op == "pad_input_tokens":
            return {"input_ids": pad_input_tokens(job["input_ids"], build_mm(job["mm"]))}
        if op == "cast":  # what TokenSpeed's gRPC servicer does to a float32 feature
            return {"tensor": tensor_view(build_tensor(job["tensor"]).to(getattr(torch, job["dtype"])))}
        if op == "smg_servicer":  # the reference gateway's own TokenSpeed servicer, proto -> engine structs
            from smg_grpc_proto.generated import tokenspeed_scheduler_pb2
            from smg_grpc_servicer.tokenspeed.servicer import TokenSpeedSchedulerServicer as S

            req = tokenspeed_scheduler_pb2.GenerateRequest.FromString(bytes.fromhex(job["request"]))
            cast_to = None if job["model_dtype"] is None else getattr(torch, job["model_dtype"])
            try:
                mm = S._mm_inputs_from_itemized_proto(S.__new__(S), req.mm_inputs, model_dtype=cast_to)
            except Exception as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
            # what TokenSpeed's input processor then does with it (the msgpack ingest does not)
            mm.ensure_pad_values()
            ids = list(req.tokenized.input_ids)
            return {"error": None, "multimodal_inputs": mm_view(mm), "input_ids": pad_input_tokens(ids, mm)}
        if op == "hash_feature":
            return {"hash": hash_feature(build_tensor(job["tensor"]))}
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except Exception as exc:
            reply = {"helper_error": f"{type(exc).__name__}: {exc}"}
        _out.write(json.dumps(reply) + "\n")
        _out.flush()
    '''
)


ENV_SMG_PATH = "ZMQD_TOKENSPEED_SMG_PATH"


def _has_torch(python: str) -> bool:
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def _missing(why: str) -> None:
    if os.environ.get("ZMQD_REQUIRE_TOKENSPEED_REFERENCE") == "1":
        pytest.fail(f"{why}: re-run scripts/install_tokenspeed_reference.sh")
    pytest.skip(f"{why}: re-run scripts/install_tokenspeed_reference.sh")


@pytest.fixture(scope="module")
def tokenspeed() -> Iterator[TokenSpeedHelper]:
    python = os.environ[ENV_PYTHON]
    if not _has_torch(python):
        _missing(f"{python} has no torch")
    path = os.pathsep.join(p for p in (os.environ[ENV_PATH], os.environ.get(ENV_SMG_PATH, "")) if p)
    helper = TokenSpeedHelper(python, path, _HELPER)
    try:
        assert helper.call(op="version")["version"] == ts.TOKENSPEED_VERSION
        yield helper
    finally:
        helper.close()


# ----------------------------------------------------------------- values and views

_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


@st.composite
def tensors(draw: st.DrawFn, *, dtypes: tuple[str, ...] = tuple(_DTYPES)) -> Tensor:
    """A torch-spelled tensor, inline (< 256 bytes) or an aux frame, by chance."""
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 8), min_size=1, max_size=3)))
    n = 1
    for d in shape:
        n *= d
    if dtype == "bool":
        data = bytes(b & 1 for b in draw(st.binary(min_size=n, max_size=n)))
    else:
        data = draw(st.binary(min_size=n * _DTYPES[dtype], max_size=n * _DTYPES[dtype]))
    return Tensor(dtype, shape, data)


@st.composite
def multimodal(draw: st.DrawFn) -> tuple[tuple[int, ...], ts.MultimodalInputs]:
    """An unpadded prompt and items whose ranges lie apart inside it."""
    n_items = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, 60), min_size=2 * n_items, max_size=2 * n_items, unique=True)))
    items = []
    for i in range(n_items):
        lo, hi = cuts[2 * i], cuts[2 * i + 1]
        # one or two sub-ranges inside [lo, hi]
        if hi - lo >= 2 and draw(st.booleans()):
            mid = draw(st.integers(lo, hi - 2))
            offsets = [(lo, mid), (mid + 2, hi)]
        else:
            offsets = [(lo, hi)]
        modality = draw(st.sampled_from(list(ts.Modality)))
        h = draw(st.integers(0, 2**64 - 1))
        side = draw(st.dictionaries(st.sampled_from(["image_sizes", "feature_attention_mask", "aspect_ratio_ids"]),
                                    tensors(dtypes=("int64", "int32", "float32")), max_size=2))
        items.append(ts.DataItem(modality=modality, hash=h, pad_value=ts.pad_value(modality, h), offsets=offsets,
                                 feature=draw(tensors()), model_specific_data=side))
    prompt = tuple(draw(st.lists(st.integers(0, 50_000), min_size=cuts[-1] + 1, max_size=cuts[-1] + 8)))
    mm = ts.MultimodalInputs(mm_items=items, im_token_id=draw(st.none() | st.integers(0, 50_000)),
                             video_token_id=draw(st.none() | st.integers(0, 50_000)))
    return prompt, mm


def tensor_view(t: Tensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"dtype": t.dtype, "shape": list(t.shape), "hex": bytes(t.data).hex()}


def mm_view(mm: ts.MultimodalInputs) -> dict[str, Any]:
    """What TokenSpeed's decoder must produce (its field names, our values)."""
    return {
        "mm_items": [{
            "modality": int(it.modality), "hash": it.hash, "pad_value": it.pad_value,
            "offsets": [list(r) for r in it.offsets or ()], "feature": tensor_view(it.feature), "feature_shm": None,
            "model_specific_data": {k: tensor_view(t) for k, t in it.model_specific_data.items()},
            "encoded": None, "encoded_deepstack": None, "encode_handshake": None,
        } for it in mm.mm_items],
        "im_token_id": mm.im_token_id, "video_token_id": mm.video_token_id, "mrope_positions": None,
        "mrope_position_delta": None, "mrope_position_delta_scalar": None,
        "mrope_position_delta_repeated_cache": None,
    }


def mm_request(prompt: tuple[int, ...], mm: ts.MultimodalInputs, rid: str = "mm-1") -> ts.TokenizedGenerateReqInput:
    return ts.TokenizedGenerateReqInput(rid=rid, input_ids=ts.pad_input_ids(prompt, mm), input_ids_unpadded=prompt,
                                        sampling_params=ts.TokenSpeedSamplingParams(max_new_tokens=4),
                                        multimodal_inputs=mm)


def _aux_count(mm: ts.MultimodalInputs) -> int:
    ts_ = [t for it in mm.mm_items for t in (it.feature, *it.model_specific_data.values()) if t is not None]
    return sum(1 for t in ts_ if t.nbytes >= 256)


# ----------------------------------------------------------------- the ADD both ways


@SETTINGS
@given(multimodal())
def test_tokenspeed_decodes_our_multimodal_add(tokenspeed: TokenSpeedHelper, case: Any) -> None:
    prompt, mm = case
    req = mm_request(prompt, mm)
    frames = ts.encode_add(req)
    assert len(frames) == 1 + _aux_count(mm)  # every tensor of 256 bytes or more rides its own frame
    reply = tokenspeed.call(op="decode", frames=hexes(frames))
    assert reply["error"] is None
    assert reply["input_ids"] == list(req.input_ids)
    assert reply["input_ids_unpadded"] == list(prompt)
    assert reply["multimodal_inputs"] == mm_view(mm)
    # and our engine-side decoder (the mock engine's) reads the same values back
    assert tsmm.decode_multimodal_inputs(ts_engine.decode_add(frames).multimodal_inputs, frames) == mm


@SETTINGS
@given(multimodal())
def test_tokenspeed_encoder_writes_our_bytes(tokenspeed: TokenSpeedHelper, case: Any) -> None:
    prompt, mm = case
    req = mm_request(prompt, mm)
    ours = ts.encode_add(req)
    view = request_view(attrs.evolve(req, multimodal_inputs=None))
    theirs = unhex(tokenspeed.call(op="encode", req=view, mm=mm_view(mm))["frames"])
    assert theirs == [bytes(f) for f in ours]


@SETTINGS
@given(st.sampled_from(list(ts.Modality)), st.integers(-(2**63), 2**64 - 1))
def test_pad_value_is_tokenspeeds(tokenspeed: TokenSpeedHelper, modality: ts.Modality, h: int) -> None:
    assert tokenspeed.call(op="pad_value", modality=int(modality), hash=h)["pad_value"] == ts.pad_value(modality, h)


@SETTINGS
@given(multimodal())
def test_pad_input_ids_is_tokenspeeds(tokenspeed: TokenSpeedHelper, case: Any) -> None:
    prompt, mm = case
    theirs = tokenspeed.call(op="pad_input_tokens", input_ids=list(prompt), mm=mm_view(mm))["input_ids"]
    assert theirs == list(ts.pad_input_ids(prompt, mm))


@SETTINGS
@given(tensors())
def test_fallback_hash_is_tokenspeeds_hash_feature(tokenspeed: TokenSpeedHelper, t: Tensor) -> None:
    assert tokenspeed.call(op="hash_feature", tensor=tensor_view(t))["hash"] == content_hash(b"", t)


# ----------------------------------------------------------------- what both refuse


def _one_item_add(nbytes: int = 1024) -> tuple[list[bytes], ts.MultimodalInputs]:
    t = Tensor("float32", (nbytes // 4,), bytes(range(256)) * (nbytes // 256))
    it = ts.DataItem(modality=ts.Modality.IMAGE, hash=7, pad_value=ts.pad_value(ts.Modality.IMAGE, 7),
                     offsets=[(1, 2)], feature=t)
    mm = ts.MultimodalInputs(mm_items=[it])
    return ts.encode_add(mm_request((5, 6, 6, 8), mm)), mm


def _both_refuse(tokenspeed: TokenSpeedHelper, frames: list[bytes]) -> None:
    reply = tokenspeed.call(op="decode", frames=hexes(frames))
    assert reply["error"] is not None, "TokenSpeed accepted it"
    with pytest.raises(RemoteProtocolError):
        tsmm.decode_multimodal_inputs(ts_engine.decode_add(frames).multimodal_inputs, frames)


def test_truncated_tensor_frame_is_refused_by_both(tokenspeed: TokenSpeedHelper) -> None:
    frames, _ = _one_item_add()
    _both_refuse(tokenspeed, [frames[0], bytes(frames[1])[:-1]])


def test_oversized_tensor_frame_is_refused_by_both(tokenspeed: TokenSpeedHelper) -> None:
    frames, _ = _one_item_add()
    _both_refuse(tokenspeed, [frames[0], bytes(frames[1]) + b"\x00" * 4])


def test_missing_tensor_frame_is_refused_by_both(tokenspeed: TokenSpeedHelper) -> None:
    frames, _ = _one_item_add()
    _both_refuse(tokenspeed, [frames[0]])


def _mutate(frames: list[bytes], path: tuple[int, ...], value: Any) -> list[bytes]:
    raw = msgpack.unpackb(frames[0], use_list=True, raw=False, strict_map_key=False)
    node = raw[22]  # multimodal_inputs
    for i in path[:-1]:
        node = node[i]
    node[path[-1]] = value
    return [msgpack.packb(raw, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ((0, 0, 0), 0),  # modality outside the enum
        ((0, 0, 0), 4),
        ((0, 0, 0), "image"),
        ((0, 0, 1), "h"),  # hash
        ((0, 0, 1), 1.5),
        ((0, 0, 3), [[1, 2, 3]]),  # an offsets range that is not a pair
        ((0, 0, 4), ["float32", [255], 1]),  # 255 floats against an aux frame of 1024 bytes
        ((0, 0, 4), ["complex", [256], 1]),  # unknown dtype
        ((0, 0, 6), {"k": 5}),  # a side value that is not a tensor
        ((0, 0, 9), [1]),  # encode_handshake not a map
        ((1,), "x"),  # im_token_id
        ((0,), 5),  # mm_items not an array
    ],
)
def test_malformed_multimodal_is_refused_by_both(
    tokenspeed: TokenSpeedHelper, path: tuple[int, ...], value: Any
) -> None:
    frames, _ = _one_item_add()
    _both_refuse(tokenspeed, _mutate(frames, path, value))


def test_short_and_long_arrays_decode_in_both(tokenspeed: TokenSpeedHelper) -> None:
    """Prefix tolerance both ways: a 1-slot MultimodalInputs, a 1-slot item, extra slots."""
    frames, mm = _one_item_add()
    raw = msgpack.unpackb(frames[0], use_list=True, raw=False, strict_map_key=False)
    for mutated in ([raw[22][0]], [*raw[22], None, None]):
        body = list(raw)
        body[22] = mutated
        fs = [msgpack.packb(body, use_bin_type=True), *frames[1:]]
        assert tokenspeed.call(op="decode", frames=hexes(fs))["error"] is None
        assert tsmm.decode_multimodal_inputs(ts_engine.decode_add(fs).multimodal_inputs, fs).mm_items == mm.mm_items
    body = list(raw)
    body[22] = [[[1]]]  # an item of its modality alone
    fs = [msgpack.packb(body, use_bin_type=True)]
    reply = tokenspeed.call(op="decode", frames=hexes(fs))
    assert reply["error"] is None and reply["multimodal_inputs"]["mm_items"][0]["offsets"] is None
    assert tsmm.decode_multimodal_inputs(ts_engine.decode_add(fs).multimodal_inputs, fs).mm_items[0].offsets is None


# ----------------------------------------------------------------- the gateway request, end to end


def test_translated_gateway_request_decodes_in_tokenspeed(tokenspeed: TokenSpeedHelper) -> None:
    pixels = struct.pack("<96f", *(i / 8 for i in range(96)))  # 384 bytes: an aux frame
    audio = struct.pack("<20e", *(i / 4 for i in range(20)))  # 40 bytes: inline
    prompt = [1, 9, 9, 9, 2, 9, 9, 3, 7, 7, 4]
    req = pb.GenerateRequest(
        request_id="gw-1",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_new_tokens=3),
        mm_inputs=pb.MultimodalInputs(items=[
            pb.MultimodalItem(modality=common_pb2.IMAGE, content_hash=bytes(range(1, 33)),
                              encoder_input=pb.TensorData(shape=[4, 24], dtype="float32", inline=pixels),
                              model_specific_tensors={"image_sizes": pb.TensorData(
                                  shape=[1, 2], dtype="int64", inline=struct.pack("<2q", 48, 32))},
                              placeholders=[pb.PlaceholderRange(offset=1, length=3),
                                            pb.PlaceholderRange(offset=5, length=2)],
                              placeholder_token_id=9),
            pb.MultimodalItem(modality=common_pb2.AUDIO,
                              encoder_input=pb.TensorData(shape=[2, 10], dtype="float16", inline=audio),
                              placeholders=[pb.PlaceholderRange(offset=8, length=2)]),
        ]),
    )
    t = translate.translate_request(req, translate.TranslationConfig(max_model_len=64, vocab_size=100))
    frames = ts.encode_add(t.request)
    assert len(frames) == 2
    reply = tokenspeed.call(op="decode", frames=hexes(frames))
    assert reply["error"] is None
    image_hash = int.from_bytes(bytes(range(1, 9)), "little")
    audio_hash = tokenspeed.call(op="hash_feature", tensor={"dtype": "float16", "shape": [2, 10],
                                                            "hex": audio.hex()})["hash"]
    image_pad = tokenspeed.call(op="pad_value", modality=1, hash=image_hash)["pad_value"]
    audio_pad = tokenspeed.call(op="pad_value", modality=3, hash=audio_hash)["pad_value"]
    assert reply["input_ids_unpadded"] == prompt
    assert reply["input_ids"] == [1, image_pad, image_pad, image_pad, 2, image_pad, image_pad, 3, audio_pad,
                                  audio_pad, 4]
    image, sound = reply["multimodal_inputs"]["mm_items"]
    assert (image["modality"], image["hash"], image["offsets"]) == (1, image_hash, [[1, 3], [5, 6]])
    assert image["feature"] == {"dtype": "float32", "shape": [4, 24], "hex": pixels.hex()}
    assert image["model_specific_data"] == {"image_sizes": {"dtype": "int64", "shape": [1, 2],
                                                            "hex": struct.pack("<2q", 48, 32).hex()}}
    assert (sound["modality"], sound["hash"], sound["offsets"]) == (3, audio_hash, [[8, 9]])
    assert sound["feature"]["dtype"] == "float16" and sound["feature"]["hex"] == audio.hex()
    assert reply["multimodal_inputs"]["im_token_id"] == 9
    assert reply["multimodal_inputs"]["video_token_id"] is None


def test_non_contiguous_array_arrives_in_c_order(tokenspeed: TokenSpeedHelper) -> None:
    """A transposed numpy view is sent in C order (one copy, at encoding), as torch's own
    ``contiguous()`` would; TokenSpeed reads the logical values."""
    np = pytest.importorskip("numpy")
    base = np.arange(12 * 10, dtype="<f4").reshape(12, 10)
    view = base.T  # (10, 12), Fortran-ordered
    t = Tensor.from_array(view)
    it = ts.DataItem(modality=ts.Modality.IMAGE, hash=3, pad_value=ts.pad_value(ts.Modality.IMAGE, 3),
                     offsets=[(0, 0)], feature=t)
    frames = ts.encode_add(mm_request((9, 1), ts.MultimodalInputs(mm_items=[it])))
    reply = tokenspeed.call(op="decode", frames=hexes(frames))
    assert reply["error"] is None
    feature = reply["multimodal_inputs"]["mm_items"][0]["feature"]
    assert feature == {"dtype": "float32", "shape": [10, 12], "hex": np.ascontiguousarray(view).tobytes().hex()}


def test_stray_tensor_frames(tokenspeed: TokenSpeedHelper) -> None:
    """A lone tensor frame (no type byte, no payload) is dropped by both; an aux frame that
    no tensor names rides along unread in both."""
    frames, _ = _one_item_add()
    lone = [bytes(frames[1])]
    assert tokenspeed.call(op="decode_raw", frames=hexes(lone))["error"] is not None
    with pytest.raises(RemoteProtocolError):
        ts_engine.decode_input(lone)
    text = ts.encode_add(ts.TokenizedGenerateReqInput(rid="t", input_ids=(1, 2),
                                                      sampling_params=ts.TokenSpeedSamplingParams()))
    extra = [b"\x00", *text, bytes(frames[1])]
    assert tokenspeed.call(op="decode_raw", frames=hexes(extra)) == {"error": None, "rid": "t"}
    assert ts_engine.decode_input(extra)[1].rid == "t"


@SETTINGS
@given(st.lists(st.floats(width=32, allow_nan=False, min_value=-60000, max_value=60000), min_size=1, max_size=80),
       st.sampled_from(["bfloat16", "float16"]))
def test_a_float32_feature_is_cast_as_torch_casts_it(tokenspeed: TokenSpeedHelper, values: list[float],
                                                     dtype: str) -> None:
    """With ``mm_dtype`` set, a float32 ``encoder_input`` arrives in that dtype with the bytes
    torch's ``.to()`` gives (what TokenSpeed's own servicer does before its engine sees it)."""
    raw = struct.pack(f"<{len(values)}f", *values)
    req = pb.GenerateRequest(
        request_id="c", tokenized=pb.TokenizedInput(input_ids=[1, 9, 2]),
        mm_inputs=pb.MultimodalInputs(items=[pb.MultimodalItem(
            modality=common_pb2.IMAGE, content_hash=b"\x01" * 8,
            encoder_input=pb.TensorData(shape=[len(values)], dtype="float32", inline=raw),
            placeholders=[pb.PlaceholderRange(offset=1, length=1)])]),
    )
    cfg = translate.TranslationConfig(max_model_len=64, mm_dtype=dtype)
    frames = ts.encode_add(translate.translate_request(req, cfg).request)
    feature = tokenspeed.call(op="decode", frames=hexes(frames))["multimodal_inputs"]["mm_items"][0]["feature"]
    expected = tokenspeed.call(op="cast", tensor={"dtype": "float32", "shape": [len(values)], "hex": raw.hex()},
                               dtype=dtype)["tensor"]
    assert feature == expected



# ----------------------------------------------------------------- against the reference gateway's TokenSpeed servicer


@pytest.fixture(scope="module")
def smg(tokenspeed: TokenSpeedHelper) -> TokenSpeedHelper:
    if not os.environ.get(ENV_SMG_PATH):
        _missing(f"{ENV_SMG_PATH} is not set (the reference gateway's TokenSpeed servicer)")
    return tokenspeed


_FINITE_F32 = st.floats(width=32, allow_nan=False, min_value=-60000, max_value=60000)


@st.composite
def gateway_requests(draw: st.DrawFn, *, castable: bool = False) -> pb.GenerateRequest:
    """IMAGE and AUDIO items (what this transport carries) with their placeholders in the
    prompt, hashes given or empty, float32 / float16 / bfloat16 features, side tensors.
    ``castable``: float32 features hold finite values within float16's range (NaN payloads
    and float16 overflow are where a cast may differ from torch's: refused or documented)."""
    n = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, 40), min_size=2 * n, max_size=2 * n, unique=True)))
    prompt = [draw(st.integers(0, 99)) for _ in range(cuts[-1] + draw(st.integers(1, 4)))]
    req = pb.GenerateRequest(request_id="smg", tokenized=pb.TokenizedInput(input_ids=prompt))
    for i in range(n):
        lo, hi = cuts[2 * i], cuts[2 * i + 1]
        image = draw(st.booleans())
        token = 500 if image else 600
        prompt[lo:hi] = [token] * (hi - lo)
        it = req.mm_inputs.items.add(modality=common_pb2.IMAGE if image else common_pb2.AUDIO,
                                     content_hash=draw(st.sampled_from([b"", bytes(range(i, i + 32)), b"\x09" * 8])))
        dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
        t = draw(tensors(dtypes=(dtype,)).filter(lambda t: t.numel > 0))  # an empty one is refused
        if castable and dtype == "float32":
            values = draw(st.lists(_FINITE_F32, min_size=t.numel, max_size=t.numel))
            t = Tensor("float32", t.shape, struct.pack(f"<{t.numel}f", *values))
        it.encoder_input.CopyFrom(pb.TensorData(shape=list(t.shape), dtype=t.dtype, inline=bytes(t.data)))
        for key in draw(st.sets(st.sampled_from(["image_sizes", "feature_attention_mask"]), max_size=2)):
            side = draw(tensors(dtypes=("int64", "int32")))
            it.model_specific_tensors[key].CopyFrom(pb.TensorData(shape=list(side.shape), dtype=side.dtype,
                                                                  inline=bytes(side.data)))
        it.placeholders.add(offset=lo, length=hi - lo)
        if draw(st.booleans()):
            it.placeholder_token_id = token
    req.tokenized.input_ids[:] = prompt
    return req


def _sorted_sides(view: dict[str, Any]) -> dict[str, Any]:
    for it in view["mm_items"]:
        it["model_specific_data"] = dict(sorted(it["model_specific_data"].items()))
    return view


@SETTINGS
@given(gateway_requests())
def test_translation_equals_the_reference_gateways_tokenspeed_servicer(smg: TokenSpeedHelper,
                                                                       req: pb.GenerateRequest) -> None:
    """The gateway request, translated by us and sent over the msgpack wire, reaches
    TokenSpeed as the same ``MultimodalInputs`` and padded ``input_ids`` that the
    reference gateway's own TokenSpeed gRPC servicer (``smg_grpc_servicer`` 0.14.1) and
    TokenSpeed's input processor make of it (pad values, hashes, inclusive offsets,
    ``im_token_id``, tensors byte for byte)."""
    reference = smg.call(op="smg_servicer", request=req.SerializeToString().hex(), model_dtype=None)
    assert reference["error"] is None
    t = translate.translate_request(req, translate.TranslationConfig(max_model_len=128))
    reply = smg.call(op="decode", frames=hexes(ts.encode_add(t.request)))
    assert reply["error"] is None
    assert reply["input_ids"] == reference["input_ids"]
    assert reply["input_ids_unpadded"] == list(req.tokenized.input_ids)
    assert _sorted_sides(reply["multimodal_inputs"]) == _sorted_sides(reference["multimodal_inputs"])


@SETTINGS
@given(gateway_requests(castable=True), st.sampled_from(["bfloat16", "float16"]))
def test_cast_to_the_model_dtype_equals_the_reference_servicers(smg: TokenSpeedHelper, req: pb.GenerateRequest,
                                                                dtype: str) -> None:
    """With ``mm_dtype`` = the model dtype, float32 features arrive cast as the reference
    servicer casts them; a feature of another float dtype we refuse (the servicer would
    cast it too: on this transport the gateway must send float32 or the model's dtype)."""
    cfg = translate.TranslationConfig(max_model_len=128, mm_dtype=dtype)
    dtypes = {it.encoder_input.dtype for it in req.mm_inputs.items}
    if not dtypes <= {"float32", dtype}:
        with pytest.raises(RequestRejected, match="differs from the engine's model dtype"):
            translate.translate_request(req, cfg)
        return
    reference = smg.call(op="smg_servicer", request=req.SerializeToString().hex(), model_dtype=dtype)
    assert reference["error"] is None
    t = translate.translate_request(req, cfg)
    reply = smg.call(op="decode", frames=hexes(ts.encode_add(t.request)))
    assert reply["input_ids"] == reference["input_ids"]
    assert _sorted_sides(reply["multimodal_inputs"]) == _sorted_sides(reference["multimodal_inputs"])
