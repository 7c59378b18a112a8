"""``EngineCoreRequest.mm_features`` of vLLM 0.32's wire, both sides, sans-IO.

Wire form (vLLM 0.32 ``vllm/multimodal/inputs.py`` classes as ``vllm/v1/serial_utils.py``
encodes them; pinned byte for byte by ``tests/wire/vectors/vllm_0.32.0_mm.json``):

- slot 2 of the request array: a list of ``MultiModalFeatureSpec`` maps, one per item,
  every key in this order: ``data`` (a ``MultiModalKwargsItem`` map or nil: nil means
  "the engine's receiver cache holds it"), ``modality``, ``identifier``,
  ``mm_position`` (``{"offset", "length", "is_embed"}``, ``is_embed`` a bool tensor of
  ``length`` or nil), ``mm_hash`` (str or nil);
- a ``MultiModalKwargsItem`` maps a model kwarg name (``pixel_values``,
  ``image_grid_thw``, ``image_embeds``...) to ``{"data": tensor, "field": [factory,
  kwargs]}``; ``factory`` is ``"batched"`` (``{"keep_on_cpu"}``), ``"flat"``
  (``{"keep_on_cpu", "slices", "dim"}``, each slice ``[start, stop, step]``) or
  ``"shared"`` (``{"keep_on_cpu", "batch_size"}``);
- tensors are torch-spelled ``[dtype, shape, data]`` triples
  (:mod:`zmqdispatch.wire.tensors`): inline below 256 bytes, else an aux frame, the
  caller's buffer itself (no copy when it is C-contiguous).

:func:`features_to_wire` gives the value to put in ``EngineCoreRequest.mm_features``;
:func:`decode_mm_features` reads it back on the engine side (the mock engine, tests).

Errors: :class:`~zmqdispatch.errors.LocalProtocolError` for a feature that cannot be
encoded, :class:`~zmqdispatch.errors.RemoteProtocolError` for bytes that do not decode.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import attrs

from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire.tensors import Tensor, check_tensor, decode_tensor

__all__ = [
    "FIELD_FACTORIES",
    "MODALITIES",
    "BatchedField",
    "FieldElem",
    "FlatField",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "SharedField",
    "cache_item_size",
    "check_wire_features",
    "decode_mm_features",
    "feature_nbytes",
    "features_to_wire",
]

#: Modalities vLLM 0.32's multimodal registry names (``MultiModalFeatureSpec.modality``).
MODALITIES = ("image", "video", "audio")

#: Field factory names of ``MultiModalFieldConfig`` (``MMF_CLASS_TO_FACTORY``).
FIELD_FACTORIES = ("batched", "flat", "shared")

Slice = tuple[int | None, int | None, int | None]


@attrs.frozen
class BatchedField:
    """``MultiModalBatchedField``: the item's data is one row of the batch (dim 0 removed)."""

    keep_on_cpu: bool = False

    def _to_wire(self) -> list[Any]:
        return ["batched", {"keep_on_cpu": self.keep_on_cpu}]


@attrs.frozen
class FlatField:
    """``MultiModalFlatField``: the item's data is its slice of rows along ``dim``.

    ``slices``: the slice of EVERY item of the original batch (vLLM sends the whole
    list with each item), each ``(start, stop, step)``; for ``dim > 0`` each entry is a
    tuple of such slices (``nested=True``).
    """

    slices: tuple[Any, ...]
    dim: int = 0
    keep_on_cpu: bool = False
    nested: bool = False

    def _to_wire(self) -> list[Any]:
        if self.nested:
            slices: list[Any] = [[list(s) for s in group] for group in self.slices]
        else:
            slices = [list(s) for s in self.slices]
        return ["flat", {"keep_on_cpu": self.keep_on_cpu, "slices": slices, "dim": self.dim}]


@attrs.frozen
class SharedField:
    """``MultiModalSharedField``: the whole tensor, the same in every item of ``batch_size``."""

    batch_size: int
    keep_on_cpu: bool = False

    def _to_wire(self) -> list[Any]:
        return ["shared", {"keep_on_cpu": self.keep_on_cpu, "batch_size": self.batch_size}]


Field = BatchedField | FlatField | SharedField


@attrs.frozen
class FieldElem:
    """``MultiModalFieldElem``: one kwarg of one item (``data`` a :class:`Tensor`, a
    number, or a nested list of those)."""

    data: Any
    field: Field


@attrs.frozen
class PlaceholderRange:
    """Where an item's embeddings go in the prompt: ``offset``, ``length`` tokens;
    ``is_embed`` a bool :class:`Tensor` ``[length]`` (None: every position)."""

    offset: int
    length: int
    is_embed: Tensor | None = None


@attrs.frozen
class MultiModalFeatureSpec:
    """One multimodal item of a request (``vllm.multimodal.inputs.MultiModalFeatureSpec``).

    Attributes:
        data: kwarg name -> :class:`FieldElem`, or None when the engine's receiver
            cache already holds the item (keyed by ``mm_hash``, else ``identifier``).
        modality: one of :data:`MODALITIES`.
        identifier: the encoder-output cache key.
        mm_position: the item's placeholder.
        mm_hash: the receiver-cache key (None: ``identifier`` is used).
    """

    data: dict[str, FieldElem] | None
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    mm_hash: str | None = None


def _nested_data(v: Any, path: str) -> Any:
    if isinstance(v, Tensor):
        try:
            check_tensor(v, torch=True)
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"{path}: {exc}") from None
        return v
    if type(v) in (int, float):
        return v
    if isinstance(v, (list, tuple)):
        return [_nested_data(x, f"{path}[{i}]") for i, x in enumerate(v)]
    raise LocalProtocolError(f"{path}: expected a Tensor, a number or a list of them, got {type(v).__name__}")


def features_to_wire(features: Sequence[MultiModalFeatureSpec]) -> list[dict[str, Any]]:
    """The ``mm_features`` value of an ``EngineCoreRequest``: plain maps with the
    :class:`Tensor` s left in place (the request encoder sends them inline or as aux
    frames, in this depth-first order). No tensor bytes are copied.

    Raises:
        LocalProtocolError: an unknown modality, a tensor that cannot be sent (dtype,
            byte count, numpy spelling), a non-bool ``is_embed``; the message names the
            feature and kwarg.
    """
    out = []
    for i, f in enumerate(features):
        path = f"mm_features[{i}]"
        if f.modality not in MODALITIES:
            raise LocalProtocolError(f"{path}.modality: {f.modality!r} is not one of {', '.join(MODALITIES)}")
        data: dict[str, Any] | None = None
        if f.data is not None:
            data = {}
            for key, elem in f.data.items():
                if type(key) is not str:
                    raise LocalProtocolError(f"{path}.data: kwarg name {key!r} is not a str")
                data[key] = {"data": None if elem.data is None else _nested_data(elem.data, f"{path}.data.{key}"),
                             "field": elem.field._to_wire()}  # noqa: SLF001
        pos = f.mm_position
        if pos.is_embed is not None:
            try:
                check_tensor(pos.is_embed, torch=True)
            except LocalProtocolError as exc:
                raise LocalProtocolError(f"{path}.mm_position.is_embed: {exc}") from None
            if pos.is_embed.dtype != "bool" or pos.is_embed.shape != (pos.length,):
                raise LocalProtocolError(f"{path}.mm_position.is_embed: must be a bool tensor [{pos.length}]")
        out.append({
            "data": data,
            "modality": f.modality,
            "identifier": f.identifier,
            "mm_position": {"offset": pos.offset, "length": pos.length, "is_embed": pos.is_embed},
            "mm_hash": f.mm_hash,
        })
    return out


def _tensor_nbytes(v: Any) -> int:
    if isinstance(v, Tensor):
        return v.nbytes
    if isinstance(v, (list, tuple)):
        return sum(_tensor_nbytes(x) for x in v)
    return 0


def feature_nbytes(feature: MultiModalFeatureSpec) -> int:
    """Tensor bytes of a feature's data: the size vLLM's receiver cache charges for it."""
    if feature.data is None:
        return 0
    return sum(_tensor_nbytes(e.data) for e in feature.data.values())


def _check_nested(v: Any, path: str, depth: int = 0) -> None:
    if isinstance(v, Tensor):
        try:
            check_tensor(v, torch=True)
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"{path}: {exc}") from None
    elif type(v) in (list, tuple) and depth < 8:
        for i, x in enumerate(v):
            _check_nested(x, f"{path}[{i}]", depth + 1)
    elif type(v) not in (int, float):
        raise LocalProtocolError(f"{path}: expected a Tensor, a number or a list of them, got {type(v).__name__}")


def check_wire_features(raw: Any, prompt_len: int | None = None) -> None:
    """Check an ``EngineCoreRequest.mm_features`` value before it is encoded (the
    form :func:`features_to_wire` returns, or one built by hand), so that vLLM's
    decoder and scheduler take it: maps with ``modality`` / ``identifier`` str,
    ``mm_hash`` str or nil, a known field factory with its own kwargs, torch-spelled
    tensors whose bytes match their shape, a bool ``is_embed`` of the placeholder's
    length; with *prompt_len*, placeholders non-empty, inside the prompt and not
    overlapping. Sans-IO, no copy.

    Raises:
        LocalProtocolError: the first problem, naming ``mm_features[i]...``.
    """
    if type(raw) not in (list, tuple):
        raise LocalProtocolError(f"mm_features: expected a list of MultiModalFeatureSpec maps, got "
                                 f"{type(raw).__name__}")
    spans = []
    for i, m in enumerate(raw):
        path = f"mm_features[{i}]"
        if type(m) is not dict or set(m) - {"data", "modality", "identifier", "mm_position", "mm_hash"} \
                or not {"modality", "identifier", "mm_position"} <= set(m):
            raise LocalProtocolError(f"{path}: expected a map of data, modality, identifier, mm_position, mm_hash")
        if type(m["modality"]) is not str or type(m["identifier"]) is not str \
                or not (m.get("mm_hash") is None or type(m.get("mm_hash")) is str):
            raise LocalProtocolError(f"{path}: modality and identifier must be str, mm_hash str or nil")
        pos = m["mm_position"]
        if type(pos) is not dict or type(pos.get("offset")) is not int or type(pos.get("length")) is not int \
                or set(pos) - {"offset", "length", "is_embed"}:
            raise LocalProtocolError(f"{path}.mm_position: expected {{offset: int, length: int, is_embed}}")
        off, length, is_embed = pos["offset"], pos["length"], pos.get("is_embed")
        if is_embed is not None:
            _check_nested(is_embed, f"{path}.mm_position.is_embed")
            if not isinstance(is_embed, Tensor) or is_embed.dtype != "bool" or is_embed.shape != (length,):
                raise LocalProtocolError(f"{path}.mm_position.is_embed: must be a bool tensor [{length}]")
        spans.append((off, length, path))
        data = m.get("data")
        if data is None:
            continue
        if type(data) is not dict:
            raise LocalProtocolError(f"{path}.data: expected a map of kwarg name -> {{data, field}}")
        for key, elem in data.items():
            ep = f"{path}.data.{key}"
            if type(key) is not str or type(elem) is not dict or set(elem) != {"data", "field"}:
                raise LocalProtocolError(f"{ep}: expected {{data, field}}")
            if elem["data"] is not None:
                _check_nested(elem["data"], ep)
            try:
                _decode_field(elem["field"], f"{ep}.field")
            except RemoteProtocolError as exc:
                raise LocalProtocolError(str(exc).removeprefix("EngineCoreRequest.")) from None
    if prompt_len is None:
        return
    end = 0
    for off, length, path in sorted(spans):
        if length < 1 or off < 0 or off + length > prompt_len:
            raise LocalProtocolError(f"{path}.mm_position: [{off}, {off + length}) must be a non-empty range "
                                     f"inside the prompt of {prompt_len} tokens")
        if off < end:
            raise LocalProtocolError(f"{path}.mm_position: [{off}, {off + length}) overlaps a placeholder "
                                     f"ending at {end}")
        end = off + length


def _leaf_size(v: Any) -> int:
    if isinstance(v, Tensor):
        return v.nbytes
    if isinstance(v, (list, tuple)):
        return sum(_leaf_size(x) for x in v)
    return sys.getsizeof(v)


def cache_item_size(feature: MultiModalFeatureSpec) -> int:
    """What vLLM 0.32's receiver cache charges for an item sent with data
    (``MultiModalCache.get_item_size`` of the decoded ``MultiModalKwargsItem``): the
    bytes of every tensor plus ``sys.getsizeof`` of every bare number and of a nil elem
    data; 0 for an item sent with data nil."""
    if feature.data is None:
        return 0
    return sum(_leaf_size(e.data) for e in feature.data.values())


# ------------------------------------------------------------------ engine side


def _bad(path: str, why: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"EngineCoreRequest.{path}: {why}")


def _decode_slice(v: Any, path: str) -> Slice:
    if type(v) not in (list, tuple) or len(v) != 3 or not all(x is None or type(x) is int for x in v):
        raise _bad(path, "a slice must be [start, stop, step] of ints or nil")
    return (v[0], v[1], v[2])


def _decode_field(v: Any, path: str) -> Field:
    if type(v) not in (list, tuple) or len(v) != 2 or type(v[1]) is not dict:
        raise _bad(path, "expected [factory_name, kwargs]")
    name, kw = v
    allowed = {"batched": {"keep_on_cpu"}, "flat": {"keep_on_cpu", "slices", "dim"},
               "shared": {"keep_on_cpu", "batch_size"}}.get(name) if type(name) is str else None
    if allowed is None:
        raise _bad(path, f"unknown field factory {name!r} (vLLM's decoder raises: known {FIELD_FACTORIES})")
    extra = set(kw) - allowed
    if extra:
        raise _bad(path, f"unknown {name} field kwargs {sorted(extra)}")
    keep = kw.get("keep_on_cpu", False)
    if type(keep) is not bool:
        raise _bad(path, "keep_on_cpu must be a bool")
    if name == "batched":
        return BatchedField(keep)
    if name == "shared":
        bs = kw.get("batch_size")
        if type(bs) is not int or bs < 1:
            raise _bad(path, "shared batch_size must be an int >= 1")
        return SharedField(bs, keep)
    slices, dim = kw.get("slices"), kw.get("dim", 0)
    if type(slices) not in (list, tuple) or type(dim) is not int:
        raise _bad(path, "flat needs a slices list and an int dim")
    nested = bool(slices) and type(slices[0]) in (list, tuple) and bool(slices[0]) \
        and type(slices[0][0]) in (list, tuple)
    if nested:
        groups = tuple(tuple(_decode_slice(s, path) for s in g) for g in slices)
        return FlatField(groups, dim, keep, nested=True)
    return FlatField(tuple(_decode_slice(s, path) for s in slices), dim, keep)


def _decode_nested(v: Any, frames: Sequence[Any], path: str, depth: int = 0) -> Any:
    if type(v) in (int, float):
        return v
    if type(v) is not list or depth > 8:
        raise _bad(path, "expected a tensor, a number or a list of them")
    if v and type(v[0]) is str:
        return decode_tensor(v, frames, field=f"EngineCoreRequest.{path}")
    return [_decode_nested(x, frames, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]


def decode_mm_features(raw: Any, frames: Sequence[Any]) -> list[MultiModalFeatureSpec] | None:
    """Read ``EngineCoreRequest.mm_features`` (decoded msgpack, aux indexes into
    *frames*) as vLLM's ``MsgpackDecoder`` does, with vLLM's decode-time failures
    (unknown factory or kwarg, a tensor whose bytes do not match its shape) raised.

    Raises:
        RemoteProtocolError: anything vLLM's decoder would fail on, naming the path.
    """
    if raw is None:
        return None
    if type(raw) is not list:
        raise _bad("mm_features", "expected an array of MultiModalFeatureSpec maps")
    out = []
    for i, m in enumerate(raw):
        path = f"mm_features[{i}]"
        if type(m) is not dict or not {"modality", "identifier", "mm_position"} <= set(m):
            raise _bad(path, "expected a map with modality, identifier, mm_position")
        modality, ident, mm_hash = m["modality"], m["identifier"], m.get("mm_hash")
        if type(modality) is not str or type(ident) is not str or not (mm_hash is None or type(mm_hash) is str):
            raise _bad(path, "modality and identifier must be str, mm_hash str or nil")
        pos = m["mm_position"]
        if type(pos) is not dict or type(pos.get("offset")) is not int or type(pos.get("length")) is not int:
            raise _bad(f"{path}.mm_position", "expected {offset: int, length: int, is_embed}")
        is_embed = pos.get("is_embed")
        if is_embed is not None:
            is_embed = decode_tensor(is_embed, frames, field=f"EngineCoreRequest.{path}.mm_position.is_embed")
        data = m.get("data")
        item: dict[str, FieldElem] | None = None
        if data is not None:
            if type(data) is not dict:
                raise _bad(f"{path}.data", "expected a map of kwarg name -> field elem")
            item = {}
            for key, elem in data.items():
                ep = f"{path}.data.{key}"
                if type(key) is not str or type(elem) is not dict or "field" not in elem:
                    raise _bad(ep, "expected {data, field}")
                d = elem.get("data")
                item[key] = FieldElem(None if d is None else _decode_nested(d, frames, ep),
                                      _decode_field(elem["field"], f"{ep}.field"))
        out.append(MultiModalFeatureSpec(item, modality, ident, PlaceholderRange(pos["offset"], pos["length"],
                                                                                  is_embed), mm_hash))
    return out
