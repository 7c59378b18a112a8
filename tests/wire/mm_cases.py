"""Builds the cases of ``vectors/vllm_0.32.0_mm.json`` (specs written by
``scripts/real_vllm/mm_vectors.py``) with our classes."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from zmqdispatch.wire import vllm as w
from zmqdispatch.wire.tensors import Tensor
from zmqdispatch.wire.vllm_multimodal import (
    BatchedField,
    FieldElem,
    FlatField,
    MultiModalFeatureSpec,
    PlaceholderRange,
    SharedField,
    features_to_wire,
)

VECTORS = pathlib.Path(__file__).resolve().parent / "vectors" / "vllm_0.32.0_mm.json"
CASES: list[dict[str, Any]] = json.loads(VECTORS.read_text())
BY_NAME = {c["name"]: c for c in CASES}


def values(n: int, seed: int, dtype: str) -> list[Any]:
    out = [(i * 7919 + seed * 31) % 251 for i in range(n)]
    return [v % 2 == 1 for v in out] if dtype == "bool" else out


def tensor(spec: dict[str, Any]) -> Tensor:
    n = 1
    for d in spec["shape"]:
        n *= d
    return Tensor.from_values(spec["dtype"], spec["shape"], values(n, spec["seed"], spec["dtype"]))


def nested(v: Any) -> Any:
    if isinstance(v, dict):
        return tensor(v["tensor"])
    if isinstance(v, list):
        return [nested(x) for x in v]
    return v


def field(spec: list[Any]) -> Any:
    name, kw = spec
    if name == "batched":
        return BatchedField(kw["keep_on_cpu"])
    if name == "shared":
        return SharedField(kw["batch_size"], kw["keep_on_cpu"])
    slices = kw["slices"]
    is_nested = bool(slices) and isinstance(slices[0][0], list)
    if is_nested:
        return FlatField(tuple(tuple(tuple(s) for s in g) for g in slices), kw["dim"], kw["keep_on_cpu"], nested=True)
    return FlatField(tuple(tuple(s) for s in slices), kw["dim"], kw["keep_on_cpu"])


def features(spec: dict[str, Any]) -> list[MultiModalFeatureSpec]:
    out = []
    for f in spec["mm_features"]:
        data = None
        if f["data"] is not None:
            data = {k: FieldElem(nested(e["data"]), field(e["field"])) for k, e in f["data"].items()}
        pos = f["mm_position"]
        is_embed = None
        if pos["is_embed"] is not None:
            is_embed = Tensor.from_values("bool", [len(pos["is_embed"])], pos["is_embed"])
        out.append(MultiModalFeatureSpec(data, f["modality"], f["identifier"],
                                         PlaceholderRange(pos["offset"], pos["length"], is_embed), f["mm_hash"]))
    return out


def request(spec: dict[str, Any]) -> w.EngineCoreRequest:
    return w.EngineCoreRequest(
        request_id=spec["request_id"], prompt_token_ids=spec["prompt_token_ids"],
        mm_features=features_to_wire(features(spec)),
        sampling_params=w.SamplingParams(**spec["sampling_params"]), arrival_time=spec["arrival_time"])


def golden_frames(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["frames_hex"]]
