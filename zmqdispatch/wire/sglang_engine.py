"""Engine side of the SGLang scheduler's msgpack ZMQ wire (SGLang 0.5.21 behind the
SGLang plugin of ``smg-grpc-servicer`` 0.14.1), sans-IO.

What the scheduler (its plugin) reads and writes: :func:`decode_input` (ADD as
SGLang's positional ``TokenizedGenerateReqInput``, ABORT, CONTROL ``[call_id,
method, args]``), :func:`encode_outputs` (``BatchTokenIDSlimOutput``),
:func:`encode_control_reply` (``ControlReplySlim``) and the ready response with its
``positional_layouts`` (:func:`ready_layouts`). Used by the mock scheduler
(:mod:`zmqdispatch.mock.sglang_core`) and tests; a client never needs it. What the
plugin refuses after decoding is :mod:`zmqdispatch.protocol.checks_sglang`.

Decoders raise only :class:`~zmqdispatch.errors.RemoteProtocolError`; encoders
:class:`~zmqdispatch.errors.LocalProtocolError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire.schema import _Bad, _pack, _positional, _tname
from zmqdispatch.wire.schema import _unpack as _unpack_any
from zmqdispatch.wire.sglang import (
    _REQUEST_SPEC,
    BATCH_TAG,
    CONTROL_TAG,
    REQUEST_LAYOUT,
    REQUEST_MIN_ELEMENTS,
    REQUEST_TAG,
    SAMPLING_LAYOUT,
    ControlReply,
    RequestType,
    SGLangBatch,
    SGLangSamplingParams,
    TokenizedGenerateReqInput,
)

__all__ = [
    "ControlCall",
    "decode_abort",
    "decode_add",
    "decode_control",
    "decode_input",
    "encode_control_reply",
    "encode_outputs",
    "ready_layouts",
]

#: A decoded CONTROL payload: ``(call_id, method, args)``.
ControlCall = tuple[int, str, list[Any]]


def _unpack(payload: Any, what: str) -> Any:
    return _unpack_any(payload, what, use_list=True)


def decode_add(frames: Sequence[bytes]) -> TokenizedGenerateReqInput:
    """Decode an ADD ``[payload, *aux]`` as the plugin's typed decode reads it.

    Any prefix of at least 14 elements (tag .. ``stream``); extra trailing elements
    are ignored; the nested ``SamplingParams`` is prefix tolerant. ``input_ids`` may
    be a plain int array (as SMG and this client send it). The values are as sent:
    SGLang's ``__post_init__`` is :meth:`SGLangSamplingParams.derive`.

    Raises:
        RemoteProtocolError: not msgpack, a wrong tag, too few elements, a field of
            the wrong type (the message names it).
    """
    if not frames:
        raise RemoteProtocolError(f"{REQUEST_TAG}: no payload frame")
    arr = _unpack(frames[0], REQUEST_TAG)
    if type(arr) is not list or not arr:
        raise RemoteProtocolError(f"{REQUEST_TAG}: expected a tagged array, got {_tname(arr)}")
    if arr[0] != REQUEST_TAG:
        raise RemoteProtocolError(f"wrong msgspec tag: expected {REQUEST_TAG!r}, got {arr[0]!r:.60}")
    if len(arr) < REQUEST_MIN_ELEMENTS:
        missing = _REQUEST_SPEC[len(arr) - 1].name
        raise RemoteProtocolError(
            f"{REQUEST_TAG}: missing required field {missing!r} (got {len(arr)} elements, "
            f"need >= {REQUEST_MIN_ELEMENTS})"
        )
    try:
        return _positional(TokenizedGenerateReqInput, arr[1:len(REQUEST_LAYOUT) + 1], REQUEST_TAG,
                           nested={"sampling_params": _sampling})
    except _Bad as exc:
        raise RemoteProtocolError(str(exc)) from None


def _sampling(v: Any) -> SGLangSamplingParams:
    try:
        return _positional(SGLangSamplingParams, v, "sampling_params")
    except _Bad as exc:
        raise _Bad(f"{REQUEST_TAG}.{exc}") from None


def decode_abort(payload: bytes) -> tuple[str, ...]:
    """ABORT payload -> the rids (an array of str). Raises RemoteProtocolError."""
    ids = _unpack(payload, "ABORT")
    if type(ids) is not list or not all(type(r) is str for r in ids):
        raise RemoteProtocolError("ABORT: expected an array of str request ids")
    return tuple(ids)


def decode_control(payload: bytes) -> ControlCall:
    """CONTROL payload -> ``(call_id, method, args)`` (the plugin's ``tuple[int, str, list]``).

    Raises:
        RemoteProtocolError: not a 3-element array of those types.
    """
    obj = _unpack(payload, "CONTROL")
    if (type(obj) is not list or len(obj) != 3 or type(obj[0]) is not int or type(obj[1]) is not str
            or type(obj[2]) is not list):
        raise RemoteProtocolError(f"CONTROL: expected [call_id: int, method: str, args: array], got {obj!r:.80}")
    return obj[0], obj[1], obj[2]


def decode_input(
    frames: Sequence[bytes],
) -> tuple[RequestType, TokenizedGenerateReqInput | tuple[str, ...] | ControlCall]:
    """One input message ``[type, payload, *aux]`` (identity already stripped).

    Raises:
        RemoteProtocolError: fewer than 2 frames, an unknown type byte (the plugin
            drops such a message with a log line), or a payload that does not decode.
    """
    if len(frames) < 2:
        raise RemoteProtocolError(f"request needs >= 2 frames (type, payload), got {len(frames)}")
    t = bytes(frames[0])
    if t == RequestType.ADD.frame:
        return RequestType.ADD, decode_add(frames[1:])
    if t == RequestType.ABORT.frame:
        return RequestType.ABORT, decode_abort(frames[1])
    if t == RequestType.CONTROL.frame:
        return RequestType.CONTROL, decode_control(frames[1])
    raise RemoteProtocolError(f"unknown request type byte {t!r}")


def _col(v: Any) -> Any:
    if v is None:
        return None
    return [_col(x) for x in v] if isinstance(v, (list, tuple)) else v


def encode_outputs(batch: SGLangBatch, *, elements: int | None = None) -> list[bytes]:
    """One ``BatchTokenIDSlimOutput`` as the plugin's msgspec encoder writes it.

    ``elements``: how many array elements to write, 11..20 (tag, the 10 columns,
    the 5 load scalars, ``finished_status``, the two top-logprob columns,
    ``reasoning_tokens``). Default: 16 when no optional column is set, else 20.

    Raises:
        LocalProtocolError: ``elements`` out of range, or an optional column set
            beyond it.
    """
    optional = (batch.finished_status, batch.top_logprob_vals, batch.top_logprob_ids, batch.reasoning_tokens)
    if elements is None:
        elements = 20 if any(c is not None for c in optional) else 16
    if not 11 <= elements <= 20:
        raise LocalProtocolError(f"elements must be in 11..20, got {elements}")
    body = [
        BATCH_TAG, _col(batch.rids), _col(batch.output_ids), _col(batch.finished_reasons),
        _col(batch.finished_messages), _col(batch.finished_matched), _col(batch.prompt_tokens),
        _col(batch.completion_tokens), _col(batch.cached_tokens), _col(batch.logprob_vals),
        _col(batch.logprob_ids), batch.engine_index, batch.num_running, batch.num_waiting,
        batch.kv_used_tokens, batch.kv_total_tokens, *(_col(c) for c in optional),
    ]
    if any(c is not None for c in optional[max(0, elements - 16):]):
        raise LocalProtocolError(f"an optional column is set but a {elements}-element batch does not carry it")
    return [_pack(body[:elements])]


def encode_control_reply(reply: ControlReply) -> bytes:
    """``["ControlReplySlim", call_id, success, message, engine_index]`` (all four fields)."""
    return _pack([CONTROL_TAG, reply.call_id, reply.success, reply.message, reply.engine_index])


def ready_layouts(*, sampling: Sequence[str] = SAMPLING_LAYOUT,
                  request: Sequence[str] = REQUEST_LAYOUT) -> dict[str, tuple[str, ...]]:
    """The ready response's ``positional_layouts`` of an SGLang 0.5.21 scheduler, for
    the two structs a generation request decodes into (the plugin also lists the
    embedding request, its dispatch-error notice and the multimodal structs; the
    client reads only these two). Pass another layout to play another release."""
    return {"TokenizedGenerateReqInput": tuple(request), "SamplingParams": tuple(sampling)}
