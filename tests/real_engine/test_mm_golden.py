"""Our ``mm_features`` read by vLLM 0.32.0 itself (the vllm venv; no engine is started).

- vLLM's ``MsgpackDecoder(EngineCoreRequest)`` decodes our encoding of every golden
  case to objects equal to its decoding of its own frames;
- a gateway request translated by us (``translate_request``) is byte-equal to the
  request vLLM's own processor path builds from the same tensors
  (``MultiModalFieldConfig.batched`` / ``flat_from_sizes`` / ``shared``,
  ``build_elems``), and decodes to equal objects;
- :class:`ReceiverCacheMirror` replayed against vLLM's own
  ``LruKeyReplicatedReceiverCache`` over a random request sequence: every item it
  sends with data nil is found, the two hold the same keys in the same LRU order,
  and :func:`cache_item_size` is the size vLLM charges.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
from pathlib import Path
from typing import Any

import attrs
import pytest

from zmqdispatch.translate.multimodal import ReceiverCacheMirror, cache_item_size
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as w
from zmqdispatch.wire import vllm_engine as w_engine
from zmqdispatch.wire.vllm_multimodal import decode_mm_features, features_to_wire

from ..wire.mm_cases import CASES, request, values

pytestmark = pytest.mark.real_engine

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "real_vllm" / "mm_vectors.py"


def run_vllm(py: str, mode: str, doc: Any) -> Any:
    p = subprocess.run([py, str(SCRIPT), mode], input=json.dumps(doc), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def hexes(frames) -> list[str]:
    return [bytes(f).hex() for f in frames]


def test_vllm_decodes_our_frames_to_its_own_objects(vllm_py):
    ours = [hexes(w.encode_request(request(c["request"]))) for c in CASES]
    diffs = run_vllm(vllm_py, "--decode", {"ours": ours, "golden": [c["frames_hex"] for c in CASES]})
    assert diffs == [None] * len(CASES)


# ------------------------------------------------------------------ translation vs vLLM's processor path

_PACK = {"float32": "f", "int64": "q", "float16": "e", "int32": "i"}


def tspec(dtype: str, shape: list[int], seed: int) -> dict[str, Any]:
    return {"tensor": {"dtype": dtype, "shape": shape, "seed": seed}}


def tensor_pb(spec: dict[str, Any]) -> pb.TensorData:
    s = spec["tensor"]
    n = 1
    for d in s["shape"]:
        n *= d
    vals = s["values"] if "values" in s else values(n, s["seed"], s["dtype"])
    return pb.TensorData(shape=s["shape"], dtype=s["dtype"], inline=struct.pack(f"<{n}{_PACK[s['dtype']]}", *vals))


IM, VID = 900, 901
TRANSLATE_CASES = [
    {"request_id": "t-qwen", "prompt": [1, IM, IM, IM, IM, 2, IM, IM, 3, VID, VID, VID, 4],
     "batches": [
         # Qwen2-VL-like images: flat pixels by patch counts, batched grids, a shared scalar-ish tensor
         {"modality": "image", "placeholders": [[6, 2], [1, 4]], "hashes": ["img-b", "img-a"],
          "tensors": {"pixel_values": tspec("float32", [6, 40], 1), "image_grid_thw": tspec("int64", [2, 3], 2),
                      "patches": {"tensor": {"dtype": "int64", "shape": [2], "values": [2, 4]}},
                      "scale": tspec("float32", [2], 4)},
          "batched": ["image_grid_thw"], "flat": {"pixel_values": "patches"}, "keep": ["image_grid_thw"],
          "im_token_id": None},
         # a video batch (gateway key pixel_values -> the model's pixel_values_videos)
         {"modality": "video", "placeholders": [[9, 3]], "hashes": ["vid-0"],
          "tensors": {"pixel_values_videos": tspec("float32", [1, 2, 3, 4, 4], 5)},
          "batched": ["pixel_values_videos"], "flat": {}, "keep": [], "im_token_id": None}]},
    {"request_id": "t-embeds", "prompt": [1, IM, 7, IM, IM, 2],
     "batches": [
         {"modality": "image", "placeholders": [[1, 4]], "hashes": ["e0"],
          "tensors": {"image_embeds": tspec("float16", [1, 3, 96], 6)},
          "batched": ["image_embeds"], "flat": {}, "keep": [], "im_token_id": IM}]},
]
_MODALITY = {"image": 1, "video": 3, "audio": 2}


def gateway_request(case: dict[str, Any]) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=case["request_id"], tokenized=pb.TokenizedInput(input_ids=case["prompt"]))
    for i, b in enumerate(case["batches"]):
        m = r.mm_inputs if i == 0 else r.extra_mm_inputs.add()
        m.modality = _MODALITY[b["modality"]]
        for name, spec in b["tensors"].items():
            gw = "pixel_values" if name == "pixel_values_videos" else name
            if gw == "pixel_values":
                m.pixel_values.CopyFrom(tensor_pb(spec))
            else:
                m.model_specific_tensors[gw].CopyFrom(tensor_pb(spec))
        for off, ln in b["placeholders"]:
            m.mm_placeholders.add(offset=off, length=ln)
        m.mm_hashes.extend(b["hashes"])
        m.batched_keys.extend("pixel_values" if k == "pixel_values_videos" else k for k in b["batched"])
        m.flat_keys.update(b["flat"])
        m.keep_on_cpu_keys.extend(b["keep"])
        if b["im_token_id"] is not None:
            m.im_token_id = b["im_token_id"]
    return r


def vllm_doc(case: dict[str, Any]) -> dict[str, Any]:
    # vLLM's side gets the tensors in our kwarg order (pixel_values first, then sorted),
    # the order our items carry; its own frontend's order comes from a set.
    doc = json.loads(json.dumps(case))
    for b in doc["batches"]:
        keys = sorted(b["tensors"], key=lambda k: (not k.startswith("pixel_values"), k))
        b["tensors"] = {k: b["tensors"][k] for k in keys}
    return doc


def test_translated_requests_are_byte_equal_to_vllms_processor_path(vllm_py):
    for case in TRANSLATE_CASES:
        r = gateway_request(case)
        e = translate_request(r, TranslationConfig(max_model_len=100), arrival_time=0.0).request
        # the sampling side is the gateway translation's (tested elsewhere): vLLM's defaults here
        e = attrs.evolve(e, sampling_params=w.SamplingParams(max_tokens=4, temperature=0.0))
        ours = hexes(w.encode_request(e))
        doc = vllm_doc(case)
        theirs = run_vllm(vllm_py, "--translate", doc)
        assert ours == theirs, case["request_id"]
        assert run_vllm(vllm_py, "--decode", {"ours": [ours], "golden": [theirs]}) == [None]


# ------------------------------------------------------------------ the receiver cache rule


def test_the_mirror_replays_vllms_receiver_cache(vllm_py):
    rng = random.Random(5)
    keys = [f"k{i}" for i in range(8)]
    sizes = {k: rng.choice([64, 200, 400, 700]) for k in keys}  # float32 elements: 256 B .. 2.8 KB
    mirror = ReceiverCacheMirror(4 * 1024)
    sent: list[list[str]] = []
    expected = []
    for n in range(40):
        picked = [rng.choice(keys) for _ in range(rng.randint(1, 3))]
        prompt = list(range(1, 2 + 2 * len(picked)))
        r = pb.GenerateRequest(request_id=f"c{n}", tokenized=pb.TokenizedInput(input_ids=prompt))
        m = r.mm_inputs
        m.pixel_values.CopyFrom(pb.TensorData(shape=[len(picked), max(sizes[k] for k in picked)], dtype="float32",
                                              inline=bytes(4 * len(picked) * max(sizes[k] for k in picked))))
        m.batched_keys.append("pixel_values")
        m.model_specific_tensors["level"].CopyFrom(pb.TensorData(shape=[1], dtype="int64", inline=bytes(8)))
        for i, k in enumerate(picked):
            m.mm_placeholders.add(offset=1 + 2 * i, length=1)
            m.mm_hashes.append(k)
        e = translate_request(r, TranslationConfig(max_model_len=100), arrival_time=0.0).request
        frames = w.encode_request(e)
        feats = decode_mm_features(w_engine.decode_request(frames).mm_features, frames)
        assert feats is not None
        to_send = mirror.apply(feats)
        sent.append(hexes(w.encode_request(w.EngineCoreRequest(
            request_id=e.request_id, prompt_token_ids=e.prompt_token_ids, mm_features=features_to_wire(to_send),
            sampling_params=e.sampling_params, arrival_time=0.0))))
        expected.append(mirror.held())
        for f in to_send:
            if f.data is not None and f.mm_hash in mirror:
                assert mirror.held()[f.mm_hash] == cache_item_size(f)
    got = run_vllm(vllm_py, "--cache", {"capacity_kib": 4, "requests": sent})
    for step, (held, engine) in enumerate(zip(expected, got)):
        assert engine["missing"] is None, step
        assert engine["keys"] == list(held), step  # same keys, same LRU order
        assert engine["sizes"] == held, step  # the size vLLM charges is cache_item_size
    nil_sent = sum(h.count("a464617461c0") for req in sent for h in req[:1])  # "data": nil
    assert nil_sent > 5  # the sequence exercised hits, not only stores


_TORCH_CAST = """
import sys, torch
raw = sys.stdin.buffer.read()
t = torch.frombuffer(bytearray(raw), dtype=torch.float32)
for dt in (torch.bfloat16, torch.float16):
    print(t.to(dt).view(torch.uint8).numpy().tobytes().hex())
"""


def test_the_float32_cast_equals_torchs(vllm_py):
    from zmqdispatch.wire.tensors import cast_float32

    rng = random.Random(3)
    vals = [rng.uniform(-4, 4) for _ in range(5000)] + [rng.uniform(-60000, 60000) for _ in range(500)]
    bits = [rng.getrandbits(32) & 0x7F7FFFFF | (rng.getrandbits(1) << 31) for _ in range(5000)]  # finite, any
    raw = struct.pack(f"<{len(vals)}f", *vals) + struct.pack(f"<{len(bits)}I", *bits)
    raw += struct.pack("<5I", 0x3F808000, 0x3F818000, 0, 0x80000000, 0x7F800000)
    p = subprocess.run([vllm_py, "-c", _TORCH_CAST], input=raw, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    bf16, f16 = p.stdout.decode().split()
    # (NaN is left out: it stays NaN, but torch's vectorized CPU cast writes another payload)
    assert cast_float32(raw, "bfloat16").hex() == bf16
    # float16: torch turns values beyond 65504 into infinities, we refuse them; compare the rest
    small = struct.pack(f"<{len(vals)}f", *vals)
    assert cast_float32(small, "float16").hex() == f16[:len(small)]
