"""``TokenizedGenerateReqInput.multimodal_inputs`` of TokenSpeed 0.1.1's wire, both sides, sans-IO.

Wire form (TokenSpeed 0.1.1 ``runtime/multimodal/inputs.py``, msgspec *untagged*
``array_like`` structs nested in the ADD payload; ``docs/multimodal.md`` §TokenSpeed):

- ``MultimodalInputs``: 7 positions ``[mm_items, im_token_id, video_token_id,
  mrope_positions, mrope_position_delta, mrope_position_delta_scalar,
  mrope_position_delta_repeated_cache]``; only ``mm_items`` has no default;
- ``MultimodalDataItem``: 10 positions ``[modality, hash, pad_value, offsets, feature,
  feature_shm, model_specific_data, encoded, encoded_deepstack, encode_handshake]``;
  ``modality`` is TokenSpeed's ``Modality`` enum value (IMAGE 1, VIDEO 2, AUDIO 3),
  ``offsets`` a list of ``[start, end]`` prompt positions, both INCLUSIVE;
- tensors are torch-spelled ``[dtype, shape, data]`` triples (:mod:`zmqdispatch.wire.tensors`):
  inline (ExtType 3) below 256 bytes (``MSGPACK_ZERO_COPY_THRESHOLD``), else the index of
  an aux frame of the ADD (``[b"\\x00", payload, *aux]``, the payload being index 0).

What the msgpack ingest does NOT do for the sender (its ``decode_request_frames`` skips
the input processor's multimodal steps): resolve ``pad_value``, write it over each
placeholder range of ``input_ids``, keep the original ids, compute M-RoPE positions. So
a request built here always carries ``hash`` and ``pad_value`` (:func:`pad_value`), the
padded ids go in ``input_ids`` (:func:`pad_input_ids`) and the original ones in
``input_ids_unpadded``; ``mrope_*`` are nil (models that need M-RoPE positions are
refused by the translation, :mod:`zmqdispatch.translate.tokenspeed_multimodal`).
``feature_shm`` (POSIX shared memory), ``encoded`` / ``encoded_deepstack`` (scheduler
local) and ``encode_handshake`` (EPD) are always nil when sending.

Client side: :class:`MultimodalInputs` goes in ``TokenizedGenerateReqInput.multimodal_inputs``
and :func:`zmqdispatch.wire.tokenspeed.encode_add` sends it (no tensor bytes copied: a
C-contiguous buffer becomes its aux frame). Engine side: :func:`decode_multimodal_inputs`
reads the raw value :func:`zmqdispatch.wire.tokenspeed_engine.decode_add` leaves, with the
ADD's frames, as TokenSpeed's typed decoder does (the mock engine, tests).

Errors: :class:`~zmqdispatch.errors.LocalProtocolError` for what cannot be sent (the
message names the item and field), :class:`~zmqdispatch.errors.RemoteProtocolError` for
bytes TokenSpeed's decoder would refuse.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import attrs

from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire.tensors import Tensor, check_tensor, decode_tensor

__all__ = [
    "DATA_ITEM_SLOTS",
    "INPUTS_SLOTS",
    "MM_PAD_BASE",
    "MM_PAD_HASH_SLOTS",
    "MM_PAD_MAX",
    "DataItem",
    "Modality",
    "MultimodalInputs",
    "check_placeholders",
    "decode_multimodal_inputs",
    "pad_input_ids",
    "pad_value",
    "to_wire",
]

#: Positions of ``MultimodalInputs`` in 0.1.1.
INPUTS_SLOTS = 7
#: Positions of ``MultimodalDataItem`` in 0.1.1.
DATA_ITEM_SLOTS = 10

#: Lowest pad id: pad values sit above any text vocabulary, in the signed int32 range.
MM_PAD_BASE = 1_000_000
#: Width of each modality's pad interval: ``(2**31 - 1 - MM_PAD_BASE + 1) // 3``.
MM_PAD_HASH_SLOTS = (2**31 - MM_PAD_BASE) // 3
#: Highest pad id.
MM_PAD_MAX = MM_PAD_BASE + 3 * MM_PAD_HASH_SLOTS - 1

_U64 = 2**64
_I64_MIN = -(2**63)


class Modality(enum.IntEnum):
    """TokenSpeed's ``Modality`` enum as it travels (``enum.auto()`` values).

    Not the gateway proto's numbering (``smg.grpc.common.Modality``: IMAGE 1, AUDIO 2,
    VIDEO 3). ``pad_tag`` is the modality's pad interval (IMAGE 0, VIDEO 1, AUDIO 2).
    """

    IMAGE = 1
    VIDEO = 2
    AUDIO = 3

    @property
    def pad_tag(self) -> int:
        """Index of this modality's interval of pad ids."""
        return self.value - 1


def pad_value(modality: Modality, hash: int) -> int:
    """The pad id of an item: ``MM_PAD_BASE + pad_tag * MM_PAD_HASH_SLOTS + hash % MM_PAD_HASH_SLOTS``.

    What TokenSpeed's ``MultimodalDataItem.set_pad_value`` computes (Python's ``%``,
    so a negative hash still lands in the interval); in ``[MM_PAD_BASE, MM_PAD_MAX]``,
    outside every text vocabulary. Two items with the same hash and modality share it:
    the engine's prefix cache then matches them.
    """
    return MM_PAD_BASE + Modality(modality).pad_tag * MM_PAD_HASH_SLOTS + hash % MM_PAD_HASH_SLOTS


def _conv_offsets(v: Any) -> Any:
    # (start, end) pairs as tuples; their types are checked when sent (to_wire)
    if v is None or type(v) is str:
        return v
    return tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in v)


def _conv_items(v: Any) -> tuple[Any, ...]:
    return tuple(v)


@attrs.frozen(kw_only=True)
class DataItem:
    """One multimodal item (``MultimodalDataItem``), the fields a sender sets.

    Attributes:
        modality: :class:`Modality`.
        hash: the item's content id (uint64 or int64 range); the engine's encoder
            cache and prefix cache key.
        pad_value: :func:`pad_value` of ``modality`` and ``hash`` (a pad id in
            ``[MM_PAD_BASE, MM_PAD_MAX]``).
        offsets: the item's placeholder ranges in ``input_ids``, ``(start, end)``
            both inclusive, in prompt order (one per sub-grid).
        feature: the encoder input (pixel values, audio features), a torch-spelled
            :class:`~zmqdispatch.wire.tensors.Tensor`; None only for an item whose
            embedding arrives another way (never on this transport).
        model_specific_data: side tensors by name, sent in this order.
        feature_shm, encode_handshake: as decoded (engine side); must be None to send.
    """

    modality: Modality = attrs.field(converter=Modality)
    hash: int | None = None
    pad_value: int | None = None
    offsets: tuple[tuple[int, int], ...] | None = attrs.field(default=None, converter=_conv_offsets)
    feature: Tensor | None = None
    model_specific_data: dict[str, Tensor] = attrs.field(factory=dict)
    feature_shm: dict[str, Any] | None = None
    encode_handshake: dict[Any, Any] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt positions the item's embeddings fill (the sum of its inclusive ranges)."""
        return sum(end - start + 1 for start, end in self.offsets or ())


@attrs.frozen(kw_only=True)
class MultimodalInputs:
    """A request's multimodal payload (``MultimodalInputs``).

    Attributes:
        mm_items: the items, in prompt order.
        im_token_id, video_token_id: the placeholder token ids the gateway expanded
            (informational for the engine once ``input_ids`` are padded).
        mrope_positions, mrope_position_delta, mrope_position_delta_scalar: M-RoPE
            positions, as decoded (engine side); None to send (nothing computes them
            here).
    """

    mm_items: tuple[DataItem, ...] = attrs.field(converter=_conv_items)
    im_token_id: int | None = None
    video_token_id: int | None = None
    mrope_positions: Tensor | None = None
    mrope_position_delta: Tensor | None = None
    mrope_position_delta_scalar: int | None = None

    def _to_wire(self) -> list[Any]:
        """The 7-position array, tensors left as :class:`Tensor` for the ADD encoder."""
        return to_wire(self)


def _send_tensor(t: Any, path: str) -> Tensor:
    try:
        return check_tensor(t, torch=True)
    except LocalProtocolError as exc:
        raise LocalProtocolError(f"{path}: {exc}") from None


def _opt_int(v: Any, path: str, lo: int = _I64_MIN, hi: int = _U64 - 1) -> int | None:
    if v is None:
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise LocalProtocolError(f"{path}: expected an int in [{lo}, {hi}] or None, got {v!r:.40}")
    return v


def to_wire(mm: MultimodalInputs) -> list[Any]:
    """The ``multimodal_inputs`` value of an ADD: 7 positions, each item 10.

    Tensors stay :class:`Tensor` objects (the ADD encoder sends them inline or as
    aux frames, in depth-first order: each item's ``feature`` then its
    ``model_specific_data`` values). No byte is copied.

    Raises:
        LocalProtocolError: no items; an item without ``hash`` / ``pad_value`` (the
            msgpack ingest resolves neither), a ``pad_value`` other than
            :func:`pad_value`, a missing or malformed ``offsets`` (``start <= end``,
            non-negative), a tensor that cannot be sent (dtype, byte count, numpy
            spelling), a non-str side-tensor name, a set ``feature_shm`` /
            ``encode_handshake`` / ``mrope_*``. The message names the item and field.
    """
    if not isinstance(mm, MultimodalInputs):
        raise LocalProtocolError(f"multimodal_inputs: expected MultimodalInputs, got {type(mm).__name__}")
    if not mm.mm_items:
        raise LocalProtocolError("multimodal_inputs.mm_items: must not be empty")
    if mm.mrope_positions is not None or mm.mrope_position_delta is not None \
            or mm.mrope_position_delta_scalar is not None:
        raise LocalProtocolError("multimodal_inputs.mrope_*: M-RoPE positions are not sent on this transport")
    items = []
    for i, it in enumerate(mm.mm_items):
        path = f"multimodal_inputs.mm_items[{i}]"
        if not isinstance(it, DataItem):
            raise LocalProtocolError(f"{path}: expected a DataItem, got {type(it).__name__}")
        h = _opt_int(it.hash, f"{path}.hash")
        pv = _opt_int(it.pad_value, f"{path}.pad_value")
        if h is None or pv is None:
            raise LocalProtocolError(f"{path}: hash and pad_value are required (TokenSpeed's msgpack ingest "
                                     "resolves neither)")
        if pv != pad_value(it.modality, h):
            raise LocalProtocolError(f"{path}.pad_value: {pv} is not pad_value({it.modality.name}, hash) = "
                                     f"{pad_value(it.modality, h)}")
        if not it.offsets:
            raise LocalProtocolError(f"{path}.offsets: at least one [start, end] range is required")
        for start, end in _pairs(it, path):
            if not 0 <= start <= end:
                raise LocalProtocolError(f"{path}.offsets: [{start}, {end}] is not a range 0 <= start <= end "
                                         "(both inclusive)")
        if it.feature_shm is not None:
            raise LocalProtocolError(f"{path}.feature_shm: shared memory tensors are not sent on this transport")
        if it.encode_handshake is not None:
            raise LocalProtocolError(f"{path}.encode_handshake: EPD is not supported on this transport")
        feature = None if it.feature is None else _send_tensor(it.feature, f"{path}.feature")
        side: dict[str, Tensor] = {}
        for key, t in it.model_specific_data.items():
            if type(key) is not str:
                raise LocalProtocolError(f"{path}.model_specific_data: name {key!r} is not a str")
            side[key] = _send_tensor(t, f"{path}.model_specific_data[{key}]")
        items.append([int(it.modality), h, pv, [[s, e] for s, e in it.offsets], feature, None, side,
                      None, None, None])
    return [items, _opt_int(mm.im_token_id, "multimodal_inputs.im_token_id"),
            _opt_int(mm.video_token_id, "multimodal_inputs.video_token_id"), None, None, None, None]


def _pairs(it: DataItem, path: str) -> tuple[tuple[int, int], ...]:
    offsets = it.offsets or ()
    if type(offsets) is not tuple:
        raise LocalProtocolError(f"{path}.offsets: expected (start, end) pairs, got {type(offsets).__name__}")
    for r in offsets:
        if type(r) is not tuple or len(r) != 2 or any(type(x) is not int for x in r):
            raise LocalProtocolError(f"{path}.offsets: {r!r:.40} is not a (start, end) pair of ints")
    return offsets


def check_placeholders(mm: MultimodalInputs, prompt_len: int) -> None:
    """Every range inside the prompt, no two ranges overlapping (across all items).

    Raises:
        LocalProtocolError: naming the item, the range and the prompt length.
    """
    ranges = []
    for i, it in enumerate(mm.mm_items):
        if not isinstance(it, DataItem):
            raise LocalProtocolError(f"multimodal_inputs.mm_items[{i}]: expected a DataItem, got {type(it).__name__}")
        for start, end in _pairs(it, f"multimodal_inputs.mm_items[{i}]"):
            if not 0 <= start <= end < prompt_len:
                raise LocalProtocolError(f"multimodal_inputs.mm_items[{i}].offsets: [{start}, {end}] falls "
                                         f"outside the prompt of {prompt_len} tokens")
            ranges.append((start, end, i))
    ranges.sort()
    for (s0, e0, i0), (s1, e1, i1) in pairwise(ranges):
        if s1 <= e0:
            raise LocalProtocolError(f"multimodal_inputs.mm_items[{i1}].offsets: [{s1}, {e1}] overlaps "
                                     f"[{s0}, {e0}] of mm_items[{i0}]")


def pad_input_ids(input_ids: Sequence[int], mm: MultimodalInputs) -> tuple[int, ...]:
    """``input_ids`` with each item's ranges overwritten by its ``pad_value``.

    What TokenSpeed's input processor does (``pad_input_tokens``) and its msgpack
    ingest does not; the result goes in ``input_ids``, the original in
    ``input_ids_unpadded``. Items without ``pad_value`` or ``offsets`` are left as they
    are (as TokenSpeed does). Cost: one list copy of the prompt.

    Raises:
        LocalProtocolError: a range outside or overlapping (:func:`check_placeholders`).
    """
    check_placeholders(mm, len(input_ids))
    out = list(input_ids)
    for it in mm.mm_items:
        if it.pad_value is None:
            continue
        for start, end in it.offsets or ():
            out[start:end + 1] = [it.pad_value] * (end - start + 1)
    return tuple(out)


# ------------------------------------------------------------------ engine side


def _bad(path: str, why: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"TokenizedGenerateReqInput.{path}: {why}")


def _array(v: Any, path: str, *, min_len: int = 0) -> Sequence[Any]:
    if type(v) not in (list, tuple) or len(v) < min_len:
        raise _bad(path, f"expected an array of at least {min_len} elements")
    out: Sequence[Any] = v
    return out


def _dec_int(v: Any, path: str) -> int | None:
    if v is None:
        return None
    if type(v) is not int or not _I64_MIN <= v < _U64:
        raise _bad(path, f"expected an int or nil, got {type(v).__name__}")
    return v


def _dec_tensor(v: Any, frames: Sequence[Any], path: str) -> Tensor | None:
    if v is None:
        return None
    return decode_tensor(v, frames, field=f"TokenizedGenerateReqInput.{path}")


def _slot(arr: Sequence[Any], i: int) -> Any:
    return arr[i] if i < len(arr) else None


def _dec_item(raw: Any, frames: Sequence[Any], path: str) -> DataItem:
    arr = _array(raw, path, min_len=1)  # modality has no default
    m = arr[0]
    if type(m) is not int or m not in (1, 2, 3):
        raise _bad(f"{path}.modality", f"{m!r:.40} is not a Modality value (1 image, 2 video, 3 audio)")
    offsets = _slot(arr, 3)
    if offsets is not None:
        pairs = []
        for r in _array(offsets, f"{path}.offsets"):
            if type(r) not in (list, tuple) or len(r) != 2 or any(type(x) is not int for x in r):
                raise _bad(f"{path}.offsets", "each range must be an array of two ints")
            pairs.append((r[0], r[1]))
        offsets = tuple(pairs)
    shm = _slot(arr, 5)
    if shm is not None:
        if type(shm) is not dict or type(shm.get("shm_name")) is not str or type(shm.get("dtype")) is not str \
                or type(shm.get("shape")) not in (list, tuple):
            raise _bad(f"{path}.feature_shm", "expected a {shm_name, shape, dtype} map")
    side_raw = _slot(arr, 6)
    side: dict[str, Tensor] = {}
    if side_raw is not None:
        if type(side_raw) is not dict:
            raise _bad(f"{path}.model_specific_data", "expected a map of name -> tensor")
        for key, t in side_raw.items():
            if type(key) is not str or t is None:
                raise _bad(f"{path}.model_specific_data", "names must be str and values tensors")
            tensor = _dec_tensor(t, frames, f"{path}.model_specific_data[{key}]")
            assert tensor is not None
            side[key] = tensor
    for j, name in ((7, "encoded"), (8, "encoded_deepstack")):
        _dec_tensor(_slot(arr, j), frames, f"{path}.{name}")  # typed, ignored: scheduler-local
    handshake = _slot(arr, 9)
    if handshake is not None and type(handshake) is not dict:
        raise _bad(f"{path}.encode_handshake", "expected a map or nil")
    return DataItem(
        modality=Modality(m),
        hash=_dec_int(_slot(arr, 1), f"{path}.hash"),
        pad_value=_dec_int(_slot(arr, 2), f"{path}.pad_value"),
        offsets=offsets,
        feature=_dec_tensor(_slot(arr, 4), frames, f"{path}.feature"),
        model_specific_data=side,
        feature_shm=shm,
        encode_handshake=handshake,
    )


def decode_multimodal_inputs(raw: Any, frames: Sequence[Any]) -> MultimodalInputs | None:
    """Read a decoded ``multimodal_inputs`` value as TokenSpeed's typed decoder does.

    Args:
        raw: the value as :func:`~zmqdispatch.wire.tokenspeed_engine.decode_add` left it
            (arrays as tuples, ExtType 3 as bytes, aux frames as int indexes).
        frames: the ADD's ``[payload, *aux]`` (indexes count from the payload, 0).

    Prefix tolerant like msgspec (missing trailing positions default, extra ones are
    ignored); the item count is not limited here (the engine does not).

    Raises:
        RemoteProtocolError: what TokenSpeed's decoder refuses (the frame would be
            dropped): no ``mm_items``, a modality other than 1..3, a wrong type in any
            position, a tensor whose bytes do not match its shape or whose aux index
            names no frame; the message names the path.
    """
    if raw is None:
        return None
    arr = _array(raw, "multimodal_inputs", min_len=1)
    items = [_dec_item(it, frames, f"multimodal_inputs.mm_items[{i}]")
             for i, it in enumerate(_array(arr[0], "multimodal_inputs.mm_items"))]
    _dec_tensor(_slot(arr, 6), frames, "multimodal_inputs.mrope_position_delta_repeated_cache")
    return MultimodalInputs(
        mm_items=items,
        im_token_id=_dec_int(_slot(arr, 1), "multimodal_inputs.im_token_id"),
        video_token_id=_dec_int(_slot(arr, 2), "multimodal_inputs.video_token_id"),
        mrope_positions=_dec_tensor(_slot(arr, 3), frames, "multimodal_inputs.mrope_positions"),
        mrope_position_delta=_dec_tensor(_slot(arr, 4), frames, "multimodal_inputs.mrope_position_delta"),
        mrope_position_delta_scalar=_dec_int(_slot(arr, 5), "multimodal_inputs.mrope_position_delta_scalar"),
    )
