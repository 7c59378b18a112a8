"""Gateway multimodal inputs -> vLLM ``EngineCoreRequest.mm_features``, sans-IO.

:func:`translate_mm_inputs` maps ``GenerateRequest.mm_inputs`` and ``extra_mm_inputs``
(``vllm_engine.proto``'s ``MultimodalInputs``: preprocessed pixel values or precomputed
embeddings, model-specific tensors, one placeholder and one hash per item) to one
:class:`~zmqdispatch.wire.vllm_multimodal.MultiModalFeatureSpec` per item, sorted by
offset. The split follows the proto's own keys: a key in ``batched_keys`` gives each
item its row (dim 0 removed); a key in ``flat_keys`` gives each item its rows as counted
by the named sizes tensor; any other key is shared by every item.

Copies: one, protobuf's: reading a ``bytes`` field returns a new ``bytes`` (read once
per tensor). Each item's tensor is a ``memoryview`` slice of it, sent as an aux frame as
it is; the next copy is libzmq's into the socket. With ``mm_dtype`` (the engine's model
dtype) set, a float32 tensor is cast to it (round to nearest even, as vLLM's own
front-end does before its engine sees it: the EngineCore casts nothing), a new buffer;
another floating dtype that is not the model's is refused.

Checked before anything is built (:class:`~zmqdispatch.errors.RequestRejected` naming
the field and the limit): payload kind (inline only), dtype (known; with ``mm_dtype``,
floating tensors of the model's dtype or float32),
byte count against shape, no zero-size dimension in pixel values or embeddings (the
primary tensor, ``pixel_values*`` and ``*_embeds`` keys, and each item's flat share of
them), total bytes against ``max_mm_bytes``, item count against
``max_mm_items``, placeholders (inside the prompt, non-empty, not overlapping, one hash
each), batched / flat leading dimensions, and for embeddings (``*_embeds`` keys) that
each item's rows equal its placeholder's embedded positions.

:class:`ReceiverCacheMirror` (opt-in) tracks what the engine's LRU receiver cache holds,
so an item it holds is sent with ``data`` nil (``docs/multimodal.md``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from ..errors import LocalProtocolError, RequestRejected
from ..wire import vllm as wire
from ..wire.tensors import Tensor, cast_float32, dtype_info
from ..wire.vllm_multimodal import (
    BatchedField,
    FieldElem,
    FlatField,
    MultiModalFeatureSpec,
    PlaceholderRange,
    SharedField,
    cache_item_size,
)

__all__ = ["MM_DTYPES", "ReceiverCacheMirror", "cache_item_size", "is_content_key", "translate_mm_inputs"]

#: Tensor dtypes carried (torch names); vLLM's decoder reads any torch dtype, these
#: are the ones a preprocessor produces.
MM_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint32", "uint8", "bool")

# model dtypes a float32 tensor is cast to (vLLM's front-end casts every floating
# multimodal tensor to the model dtype; the EngineCore does not)
_CASTS = ("float32", "float16", "bfloat16")

# smg.grpc.common.Modality -> vLLM modality name
_MODALITY = {0: "image", 1: "image", 2: "audio", 3: "video"}


def _reject(rid: str, field: str, why: str) -> RequestRejected:
    return RequestRejected(f"{field}: {why}", request_id=rid, field=field)


def is_content_key(key: str, primary: str = "pixel_values") -> bool:
    """Whether a tensor named *key* holds an item's content (the primary tensor, any
    ``pixel_values*`` or ``*_embeds``): such a tensor must not be empty."""
    return key == primary or key.startswith("pixel_values") or key.endswith("_embeds")


def _tensor(rid: str, field: str, td: Any, mm_dtype: str | None, budget: list[int], where: str, *,
            content: bool = False) -> Tensor:
    which = td.WhichOneof("payload")
    if which != "inline":
        raise _reject(rid, field, f"only inline tensor payloads travel over ZMQ, got {which or 'none'}")
    info = dtype_info(td.dtype)
    if info is None or info.name not in MM_DTYPES or td.dtype != info.name:
        raise _reject(rid, field, f"dtype {td.dtype!r} cannot be carried (one of {', '.join(MM_DTYPES)})")
    cast = info.kind == "f" and mm_dtype in _CASTS and info.name != mm_dtype
    if cast and info.name != "float32":
        raise _reject(rid, field, f"dtype {info.name} differs from the engine's model dtype {mm_dtype} "
                      "(only float32 is cast; the engine casts nothing)")
    shape = tuple(td.shape)
    if not shape:
        raise _reject(rid, field, "shape must have at least one dimension")
    if content and 0 in shape:
        raise _reject(rid, field, f"shape {list(shape)} has a zero-size dimension (dim {shape.index(0)}): "
                      "pixel values and embeddings must hold at least one element")
    numel = 1
    for d in shape:
        numel *= d
    # the limit is checked on the shape, before protobuf copies the bytes out
    budget[0] += numel * info.itemsize
    if budget[0] > budget[1]:
        raise _reject(rid, where, f"{budget[0]} bytes of multimodal tensors exceed max_mm_bytes={budget[1]}")
    data = td.inline
    if len(data) != numel * info.itemsize:
        raise _reject(rid, field, f"{len(data)} bytes for shape {list(shape)} of {info.name} "
                      f"(expected {numel * info.itemsize})")
    if cast:
        assert mm_dtype is not None
        try:
            return Tensor(mm_dtype, shape, memoryview(cast_float32(data, mm_dtype)))
        except LocalProtocolError as exc:
            raise _reject(rid, field, f"cast to {mm_dtype}: {exc}") from None
    return Tensor(info.name, shape, memoryview(data))


def _rows(t: Tensor, start: int, stop: int, *, squeeze: bool) -> Tensor:
    row = t.nbytes // t.shape[0] if t.shape[0] else 0
    shape = t.shape[1:] if squeeze else (stop - start, *t.shape[1:])
    mv = t.data if isinstance(t.data, memoryview) else memoryview(t.data)
    return Tensor(t.dtype, shape, mv[start * row:stop * row])


def _batch(rid: str, where: str, mm: Any, prompt: Sequence[int], mm_dtype: str | None,
           budget: list[int]) -> list[MultiModalFeatureSpec]:
    n = len(mm.mm_placeholders)
    modality = _MODALITY.get(mm.modality)
    if modality is None:
        raise _reject(rid, f"{where}.modality", f"modality {mm.modality} cannot be carried (image, audio, video)")
    primary = mm.encoder_input_key if mm.HasField("encoder_input_key") else "pixel_values"
    tensors: dict[str, Tensor] = {}
    if mm.HasField("pixel_values"):
        tensors[primary] = _tensor(rid, f"{where}.pixel_values", mm.pixel_values, mm_dtype, budget, where,
                                   content=True)
    for key in sorted(mm.model_specific_tensors):
        if key in tensors:
            raise _reject(rid, f"{where}.model_specific_tensors", f"{key!r} repeats the primary tensor's key")
        tensors[key] = _tensor(rid, f"{where}.model_specific_tensors[{key}]", mm.model_specific_tensors[key],
                               mm_dtype, budget, where, content=is_content_key(key, primary))
    if n == 0:
        raise _reject(rid, f"{where}.mm_placeholders", "no placeholder: every multimodal batch needs one "
                      "placeholder per item")
    if len(mm.mm_hashes) != n:
        raise _reject(rid, f"{where}.mm_hashes", f"{len(mm.mm_hashes)} hashes for {n} placeholders (one each)")
    if not tensors:
        raise _reject(rid, f"{where}.pixel_values", f"{n} placeholders but no tensor")
    batched, flat = set(mm.batched_keys), dict(mm.flat_keys)
    keep = set(mm.keep_on_cpu_keys)
    for name, keys in (("batched_keys", batched), ("flat_keys", flat), ("keep_on_cpu_keys", keep)):
        for key in keys:
            if key not in tensors:
                raise _reject(rid, f"{where}.{name}", f"key {key!r} names no tensor (tensors: {sorted(tensors)})")
    both = batched & set(flat)
    if both:
        raise _reject(rid, f"{where}.flat_keys", f"keys {sorted(both)} are also in batched_keys")
    positions = []
    for i, ph in enumerate(mm.mm_placeholders):
        f = f"{where}.mm_placeholders[{i}]"
        if ph.length < 1:
            raise _reject(rid, f, "length must be >= 1")
        if ph.offset + ph.length > len(prompt):
            raise _reject(rid, f, f"[{ph.offset}, {ph.offset + ph.length}) falls outside the prompt "
                          f"of {len(prompt)} tokens")
        is_embed = None
        n_embed = ph.length
        if mm.HasField("im_token_id"):
            mask = [t == mm.im_token_id for t in prompt[ph.offset:ph.offset + ph.length]]
            n_embed = sum(mask)
            if n_embed == 0:
                raise _reject(rid, f, f"holds no im_token_id {mm.im_token_id}")
            if n_embed != ph.length:
                is_embed = Tensor("bool", (ph.length,), bytes(mask))
        positions.append((PlaceholderRange(ph.offset, ph.length, is_embed), n_embed))
    items: list[dict[str, FieldElem]] = [{} for _ in range(n)]
    for key, t in tensors.items():
        wire_key = "pixel_values_videos" if modality == "video" and key == "pixel_values" else key
        kf = f"{where}.{key}"
        k_cpu = key in keep
        if key in batched:
            if t.shape[0] != n:
                raise _reject(rid, kf, f"batched: leading dim {t.shape[0]} must equal the {n} items")
            for i in range(n):
                items[i][wire_key] = FieldElem(_rows(t, i, i + 1, squeeze=True), BatchedField(k_cpu))
        elif key in flat:
            sizes_t = tensors.get(flat[key])
            if sizes_t is None or sizes_t.dtype not in ("int64", "int32", "uint32") or sizes_t.numel != n:
                raise _reject(rid, kf, f"flat: sizes tensor {flat[key]!r} must be {n} ints")
            sizes = sizes_t.tolist()
            if any(s < 0 for s in sizes) or sum(sizes) != t.shape[0]:
                raise _reject(rid, kf, f"flat: sizes {sizes} must sum to the leading dim {t.shape[0]}")
            if 0 in sizes and is_content_key(key, primary):
                raise _reject(rid, kf, f"flat: sizes {sizes} give item {sizes.index(0)} zero rows "
                              "(pixel values and embeddings must hold at least one element per item)")
            bounds = [0]
            for s in sizes:
                bounds.append(bounds[-1] + s)
            # flat_from_sizes' form: one (slice,) tuple per item, the whole list in every item
            slices = tuple(((bounds[i], bounds[i + 1], None),) for i in range(n))
            field = FlatField(slices, 0, k_cpu, nested=True)
            for i in range(n):
                items[i][wire_key] = FieldElem(_rows(t, bounds[i], bounds[i + 1], squeeze=False), field)
        else:
            for i in range(n):
                items[i][wire_key] = FieldElem(t, SharedField(n, k_cpu))
        if key.endswith("_embeds") and key in batched | set(flat):
            for i, (_pos, n_embed) in enumerate(positions):
                rows = items[i][wire_key].data.shape[0] if items[i][wire_key].data.shape else 0
                if rows != n_embed:
                    raise _reject(rid, f"{where}.mm_placeholders[{i}]", f"{n_embed} embedded positions but "
                                  f"{key} holds {rows} rows for this item")
    return [MultiModalFeatureSpec(items[i], modality, mm.mm_hashes[i], positions[i][0], mm.mm_hashes[i])
            for i in range(n)]


def translate_mm_inputs(req: pb.GenerateRequest, prompt: Sequence[int], *, mm_dtype: str | None = None,
                        max_mm_bytes: int, max_mm_items: int) -> list[MultiModalFeatureSpec] | None:
    """The request's ``mm_features`` (sorted by offset), or None without multimodal input.

    Args:
        req: the gateway request (``mm_inputs``, ``extra_mm_inputs``).
        prompt: the prompt token ids as sent (placeholders are checked against it).
        mm_dtype: the engine's model dtype (``float32`` / ``float16`` / ``bfloat16``):
            float32 tensors are cast to it, other floating tensors must have it
            (None: tensors are sent as they are).
        max_mm_bytes: the limit on all tensor bytes of the request.
        max_mm_items: the limit on items (placeholders) of the request.

    Raises:
        RequestRejected: ``media_refs`` (needs a processor on the engine side), or
            anything the module docstring lists, naming the field and the limit.
    """
    rid = req.request_id
    if req.HasField("media_refs"):
        raise _reject(rid, "media_refs", "media URLs need a processor the EngineCore does not run: "
                      "send preprocessed mm_inputs")
    batches = ([("mm_inputs", req.mm_inputs)] if req.HasField("mm_inputs") else []) + [
        (f"extra_mm_inputs[{i}]", m) for i, m in enumerate(req.extra_mm_inputs)]
    if not batches:
        return None
    n = sum(len(m.mm_placeholders) for _, m in batches)
    if n > max_mm_items:
        raise _reject(rid, "mm_inputs.mm_placeholders", f"{n} items exceed max_mm_items={max_mm_items}")
    budget = [0, max_mm_bytes]  # [bytes so far, limit]
    features: list[MultiModalFeatureSpec] = []
    for where, mm in batches:
        features.extend(_batch(rid, where, mm, prompt, mm_dtype, budget))
    features.sort(key=lambda f: f.mm_position.offset)
    end = -1
    for f in features:
        if f.mm_position.offset < end:
            raise _reject(rid, "mm_inputs.mm_placeholders", f"placeholder at {f.mm_position.offset} overlaps "
                          f"the one ending at {end}")
        end = f.mm_position.offset + f.mm_position.length
    return features or None


def _wire_item_size(data: dict[str, Any]) -> int:
    return cache_item_size(MultiModalFeatureSpec({k: FieldElem(e["data"], BatchedField()) for k, e in data.items()},
                                                 "image", "", PlaceholderRange(0, 1)))


class ReceiverCacheMirror:
    """What one engine incarnation's LRU receiver cache holds, kept on the client (opt-in).

    The rule it replays (vLLM 0.32 ``LruKeyReplicatedReceiverCache``, run by the engine
    on every ADD before the request is scheduled; present when the model takes
    multimodal input, ``mm_processor_cache_gb`` > 0, ``mm_processor_cache_type`` is
    ``"lru"`` and one API process drives the engine): the key of an item is its
    ``mm_hash``, else its ``identifier``; first every key of the request that the cache
    holds is touched (made most recent); then, item by item in request order, an item
    with data replaces the key's entry (dropped first, then stored if its
    :func:`cache_item_size` fits the capacity, evicting least recently used entries until
    it fits), and an item with data nil is looked up (made most recent) or reported missing.

    :meth:`apply` makes the same updates in the same order, so it sends data nil exactly
    for the items the engine will find, provided (1) the requests reach the engine in the
    order :meth:`apply` saw them, all of them (call it when the ADD is sent, on the one
    connection to that engine: ZMQ keeps the order), (2) no other client feeds that
    engine, (3) the capacity is the engine's ``mm_processor_cache_gb * 2**30`` (smaller is
    safe: it only sends data more often), and (4) :meth:`clear` is called when the engine
    restarts or its cache is reset (the ``reset_mm_cache`` call). An ADD that never
    reached the engine breaks (1): the engine answers the next request naming a missing
    item with ``FinishReason.ERROR`` and ``mm_cache_miss_hashes``; the stream raises
    :class:`~zmqdispatch.errors.MultiModalCacheMissError`: call :meth:`invalidate` with
    its ``mm_hashes`` and send the request again (its items then go with data).

    An engine without that cache (``mm_processor_cache_gb`` 0, several API processes,
    internal data-parallel load balancing, the ``shm`` cache type) must get no mirror:
    every item sent with data nil would be reported missing.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def held(self) -> dict[str, int]:
        """Key -> charged size (:func:`cache_item_size`) of what the engine holds, least
        recently used first."""
        return dict(self._items)

    def apply(self, features: Sequence[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        """The features to send (data nil for every item the engine will find),
        updating the mirror as the engine will on receipt. No tensor is copied."""
        nil = self._update([(f.mm_hash or f.identifier, f.data is not None, lambda f=f: cache_item_size(f))
                            for f in features])
        return [attrs.evolve(f, data=None) if drop and f.data is not None else f for f, drop in zip(features, nil)]

    def apply_request(self, request: wire.EngineCoreRequest) -> wire.EngineCoreRequest:
        """:meth:`apply` on a request's ``mm_features`` as :func:`translate_mm_inputs`
        and ``translate_request`` leave them (wire maps): the request to send."""
        raw = request.mm_features
        if not raw:
            return request
        nil = self._update([(m.get("mm_hash") or m["identifier"], m.get("data") is not None,
                             lambda m=m: _wire_item_size(m["data"])) for m in raw])
        return attrs.evolve(request, mm_features=[{**m, "data": None} if drop else m for m, drop in zip(raw, nil)])

    def _update(self, items: list[tuple[str, bool, Any]]) -> list[bool]:
        """Replay the engine's update for (key, has_data, size()) items: which to send nil."""
        cache = self._items
        for k, _, _ in items:
            if k in cache:
                cache.move_to_end(k)
        out = []
        for k, has_data, size_of in items:
            if k in cache:
                cache.move_to_end(k)
                out.append(True)
                continue
            out.append(False)
            if not has_data:
                continue  # the engine reports it missing
            size = size_of()
            if size > self.capacity_bytes:
                continue  # served uncached
            while self.used_bytes + size > self.capacity_bytes:
                _, old = cache.popitem(last=False)
                self.used_bytes -= old
            cache[k] = size
            self.used_bytes += size
        return out

    def invalidate(self, mm_hashes: Iterable[str]) -> None:
        """Forget keys the engine reported missing (``MultiModalCacheMissError.mm_hashes``)."""
        for k in mm_hashes:
            size = self._items.pop(k, None)
            if size is not None:
                self.used_bytes -= size

    def clear(self) -> None:
        """Forget everything (a new engine incarnation starts with an empty cache)."""
        self._items.clear()
        self.used_bytes = 0
