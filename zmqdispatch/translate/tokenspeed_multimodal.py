"""Gateway multimodal inputs -> TokenSpeed 0.1.1 ``multimodal_inputs``, sans-IO.

:func:`translate_mm_inputs` maps ``tokenspeed.grpc.scheduler.GenerateRequest.mm_inputs``
(``tokenspeed_scheduler.proto``: ``MultimodalInputs.items``, each a ``MultimodalItem``
with ``modality``, ``content_hash``, ``encoder_input``, ``model_specific_tensors``,
``placeholders`` and ``placeholder_token_id``) to a
:class:`~zmqdispatch.wire.tokenspeed_multimodal.MultimodalInputs`, and gives the padded
prompt TokenSpeed's msgpack ingest expects (it does not pad for us):

=============================  ===========================================================
proto field                    rule
=============================  ===========================================================
``items``                      one ``MultimodalDataItem`` each, in request order; at least
                               one, at most ``max_mm_items``
``modality``                   IMAGE 1 -> ``Modality.IMAGE`` (1), AUDIO 2 -> ``AUDIO`` (3);
                               VIDEO 3 refused (a video item carries ``video_grid_thw``,
                               TokenSpeed's own servicer refuses one without it, and that
                               marks M-RoPE, below); UNSPECIFIED refused
``content_hash``               ``hash`` = the first 8 bytes read little-endian; empty: the
                               engine's own ``hash_feature`` of ``encoder_input`` (BLAKE2b,
                               8-byte digest, big-endian), which the msgpack ingest would
                               not compute
(derived)                      ``pad_value`` = ``1_000_000 + tag * 715_494_549 + hash %
                               715_494_549`` (tag IMAGE 0, VIDEO 1, AUDIO 2)
``encoder_input``              ``feature``: required, no zero-size dimension (nor in a
                               ``pixel_values*`` / ``*_embeds`` side tensor); inline bytes only (``shm`` / ``remote``
                               refused), dtype and byte count checked; with ``mm_dtype``
                               set, float32 is cast to it (float16 / bfloat16, as
                               TokenSpeed's own gRPC servicer casts to the model dtype:
                               one new buffer) and another float dtype is refused (the
                               ZMQ ingest casts nothing); else sent as it is (no copy: an
                               aux frame at >= 256 bytes)
``model_specific_tensors``     ``model_specific_data``, by name in sorted order, dtypes kept;
                               ``image_grid_thw`` / ``video_grid_thw`` refused: they mark
                               M-RoPE models, whose positions the ingest does not compute
``placeholders``               ``offsets`` ``(offset, offset + length - 1)``, inclusive; at
                               least one, ``length >= 1``, inside the prompt, no two
                               overlapping (across items)
``placeholder_token_id``       when set, every placeholder position must hold it; IMAGE's
                               is ``im_token_id``, VIDEO's ``video_token_id`` (one value per
                               modality)
=============================  ===========================================================

Then ``input_ids`` = the prompt with each range set to its item's ``pad_value`` and
``input_ids_unpadded`` = the prompt as given. All tensor bytes of the request count
against ``max_mm_bytes``, checked on each tensor's shape before its bytes are read. Every refusal is a
:class:`~zmqdispatch.errors.RequestRejected` naming the field and the limit; nothing is
sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import pairwise
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from ..errors import RequestRejected
from ..wire import tokenspeed as ts
from ..wire.tensors import Tensor
from .multimodal import _tensor as _checked_tensor
from .multimodal import is_content_key

__all__ = ["M_ROPE_KEYS", "MODALITIES", "content_hash", "translate_mm_inputs"]

#: ``smg.grpc.common.Modality`` -> TokenSpeed's ``Modality``.
MODALITIES = {
    common_pb2.IMAGE: ts.Modality.IMAGE,
    common_pb2.AUDIO: ts.Modality.AUDIO,
    common_pb2.VIDEO: ts.Modality.VIDEO,
}

#: Side tensors that mark an M-RoPE model (Qwen2/2.5/3-VL...): refused, as the msgpack
#: ingest leaves ``mrope_positions`` unset and such a model then runs 1-D positions.
M_ROPE_KEYS = ("image_grid_thw", "video_grid_thw")


def _reject(rid: str, field: str, why: str) -> RequestRejected:
    return RequestRejected(f"{field}: {why}", request_id=rid, field=field)


def content_hash(raw: bytes, feature: Tensor | None) -> int | None:
    """The item's ``hash``: ``content_hash[:8]`` read little-endian (what the reference
    servicer does); for an empty one, TokenSpeed's ``hash_feature`` of the feature
    (BLAKE2b with an 8-byte digest over its raw bytes, read big-endian); None without
    either. Cost of the fallback: one pass over the feature bytes (~1 GB/s)."""
    if raw:
        return int.from_bytes(raw[:8], "little")
    if feature is None:
        return None
    return int.from_bytes(hashlib.blake2b(feature.data, digest_size=8).digest(), "big")


def translate_mm_inputs(
    req: pb.GenerateRequest,
    prompt: Sequence[int],
    *,
    mm_dtype: str | None,
    max_mm_bytes: int,
    max_mm_items: int,
) -> tuple[ts.MultimodalInputs, tuple[int, ...]] | None:
    """The request's ``multimodal_inputs`` and padded ``input_ids``, or None without
    ``mm_inputs``.

    Args:
        req: the gateway request.
        prompt: its ``tokenized.input_ids`` (the placeholders index it).
        mm_dtype: the dtype the engine's encoder takes (its ready response's
            ``multimodal_encoder_dtype``, else the model ``dtype``): float32 is cast to it, another float dtype refused;
            None sends floating tensors as they are.
        max_mm_bytes: limit on the request's tensor bytes.
        max_mm_items: limit on its items.

    Returns:
        ``(multimodal_inputs, padded_input_ids)``; the original prompt goes in
        ``input_ids_unpadded``.

    Raises:
        RequestRejected: anything the module docstring's table refuses, naming the
            field (``mm_inputs.items[2].placeholders[0]``...) and the limit.
    """
    if not req.HasField("mm_inputs"):
        return None
    rid = req.request_id
    items_pb = req.mm_inputs.items
    if len(items_pb) == 0:
        raise _reject(rid, "mm_inputs.items", "must not be empty (leave mm_inputs unset for a text request)")
    if len(items_pb) > max_mm_items:
        raise _reject(rid, "mm_inputs.items", f"{len(items_pb)} items exceed max_mm_items={max_mm_items}")
    budget = [0, max_mm_bytes]  # bytes so far, the limit: checked on each shape before its bytes are read
    items: list[ts.DataItem] = []
    token_ids: dict[ts.Modality, int] = {}
    ranges: list[tuple[int, int, str]] = []
    for i, it in enumerate(items_pb):
        where = f"mm_inputs.items[{i}]"
        modality = MODALITIES.get(it.modality)
        if modality is None:
            raise _reject(rid, f"{where}.modality", f"{it.modality} is not IMAGE, AUDIO or VIDEO")
        if modality is ts.Modality.VIDEO:
            raise _reject(rid, f"{where}.modality", "VIDEO items need video_grid_thw and M-RoPE positions, which "
                          "TokenSpeed's msgpack ingest does not compute: serve them over gRPC")
        for key in M_ROPE_KEYS:
            if key in it.model_specific_tensors:
                raise _reject(rid, f"{where}.model_specific_tensors[{key}]",
                              "M-RoPE models need mrope_positions, which TokenSpeed's msgpack ingest does not "
                              "compute: serve them over gRPC")
        if not it.HasField("encoder_input"):
            raise _reject(rid, f"{where}.encoder_input", "required (no encode worker sends embeddings here)")
        feature = _checked_tensor(rid, f"{where}.encoder_input", it.encoder_input, mm_dtype, budget, where,
                                  content=True)
        side: dict[str, Tensor] = {}
        for key in sorted(it.model_specific_tensors):
            side[key] = _checked_tensor(rid, f"{where}.model_specific_tensors[{key}]",
                                        it.model_specific_tensors[key], None, budget, where,
                                        content=is_content_key(key))
        if len(it.placeholders) == 0:
            raise _reject(rid, f"{where}.placeholders", "at least one placeholder is required")
        offsets = []
        tok = it.placeholder_token_id if it.HasField("placeholder_token_id") else None
        for j, ph in enumerate(it.placeholders):
            f = f"{where}.placeholders[{j}]"
            if ph.length < 1:
                raise _reject(rid, f, "length must be >= 1")
            end = ph.offset + ph.length - 1
            if end >= len(prompt):
                raise _reject(rid, f, f"[{ph.offset}, {ph.offset + ph.length}) falls outside the prompt "
                              f"of {len(prompt)} tokens")
            if tok is not None:
                for p in range(ph.offset, end + 1):
                    if prompt[p] != tok:
                        raise _reject(rid, f, f"position {p} holds token {prompt[p]}, not placeholder_token_id "
                                      f"{tok}")
            offsets.append((ph.offset, end))
            ranges.append((ph.offset, end, f))
        if tok is not None and modality is not ts.Modality.AUDIO:
            if token_ids.setdefault(modality, tok) != tok:
                raise _reject(rid, f"{where}.placeholder_token_id", f"{tok} conflicts with "
                              f"{token_ids[modality]} of an earlier {modality.name} item")
        h = content_hash(bytes(it.content_hash), feature)
        assert h is not None
        items.append(ts.DataItem(modality=modality, hash=h, pad_value=ts.pad_value(modality, h),
                                 offsets=offsets, feature=feature, model_specific_data=side))
    ranges.sort()
    for (s0, e0, f0), (s1, e1, f1) in pairwise(ranges):
        if s1 <= e0:
            raise _reject(rid, f1, f"[{s1}, {e1}] overlaps {f0} [{s0}, {e0}] (ranges inclusive)")
    mm = ts.MultimodalInputs(mm_items=items, im_token_id=token_ids.get(ts.Modality.IMAGE),
                             video_token_id=token_ids.get(ts.Modality.VIDEO))
    return mm, ts.pad_input_ids(prompt, mm)

