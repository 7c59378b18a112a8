"""Engine side of TokenSpeed's direct msgpack ZMQ wire (TokenSpeed 0.1.1), sans-IO.

What a TokenSpeed scheduler reads and writes: :func:`decode_input` (ADD as
``finalize_add(decode_add(...))``, ABORT), :func:`encode_outputs`
(``BatchTokenIDOutSlim``, 14 elements or a legacy 9 / 10 prefix) and its handshake maps
(:func:`encode_hello`, :func:`encode_ready`, :func:`encode_ready_response`). Used by
the mock engine (:mod:`zmqdispatch.mock.tokenspeed_core`, :mod:`zmqdispatch.mock.server`)
and tests; a client never needs it. The client side and the structs both sides share
are :mod:`zmqdispatch.wire.tokenspeed`; what TokenSpeed's ingress refuses after
decoding is :mod:`zmqdispatch.protocol.checks_tokenspeed`.

The encoders reproduce TokenSpeed's ``MsgpackEncoder`` bytes (the golden vectors
``tests/wire/vectors/tokenspeed_0.1.1.json``); the decoders refuse what TokenSpeed's
typed decoder refuses (``docs/tokenspeed-wire.md`` §1), so the mock engine drops what
the real one would. Decoders raise only :class:`~zmqdispatch.errors.RemoteProtocolError`;
encoders :class:`~zmqdispatch.errors.LocalProtocolError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmqdispatch import limits as _limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire import vllm_engine as _vllm_engine
from zmqdispatch.wire.schema import (
    _Bad,
    _k_float,
    _k_int,
    _k_map,
    _k_opt,
    _k_str,
    _opt_int,
    _opt_str,
    _pack,
    _positional,
)
from zmqdispatch.wire.schema import _unpack as _unpack_any
from zmqdispatch.wire.tokenspeed import (
    _COLUMNS,
    _REQUEST_SPEC,
    _SCALARS,
    BATCH_ELEMENTS,
    BATCH_MIN_ELEMENTS,
    BATCH_TAG,
    REQUEST_MIN_ELEMENTS,
    REQUEST_TAG,
    RequestType,
    TokenizedGenerateReqInput,
    TokenSpeedBatch,
    TokenSpeedSamplingParams,
    _k_array,
    finalize_add,
)
from zmqdispatch.wire.vllm_handshake import EngineCoreReadyResponse

__all__ = [
    "READY_DTYPES",
    "decode_abort",
    "decode_add",
    "decode_input",
    "encode_hello",
    "encode_outputs",
    "encode_ready",
    "encode_ready_response",
    "parse_request_type",
]


def _unpack(payload: Any, what: str) -> Any:
    """One msgpack document, arrays as tuples (TokenSpeed's positional structs)."""
    return _unpack_any(payload, what, use_list=False)


# =========================================================================== input socket


def parse_request_type(frame: bytes) -> RequestType:
    """Read the request-type frame of an input message (used by the mock engine).

    Raises:
        RemoteProtocolError: the frame is not exactly ``b"\\x00"`` or ``b"\\x01"``
            (TokenSpeed drops such a message without a reply).
    """
    if len(frame) != 1 or frame[0] > 1:
        raise RemoteProtocolError(f"invalid TokenSpeed request type frame {bytes(frame)[:8]!r}")
    return RequestType(frame[0])


# =========================================================================== ADD


def _decode_sampling_params(v: Any) -> TokenSpeedSamplingParams:
    sp = _positional(TokenSpeedSamplingParams, v, "sampling_params")
    return sp.derive()  # msgspec runs __post_init__ on decode


def decode_add(frames: Sequence[bytes]) -> TokenizedGenerateReqInput:
    """Decode an ADD message ``[payload, *aux]`` the way TokenSpeed's typed decoder does.

    Mirrors ``MsgpackDecoder(TokenizedGenerateReqInput)``: the tag must match, at least 6
    elements (through ``sampling_params``), missing trailing fields take their defaults,
    extra trailing elements (request and sampling array) are ignored, and the sampling
    params come back :meth:`~TokenSpeedSamplingParams.derive`'d, as TokenSpeed's
    ``__post_init__`` leaves them. It does not finalize (see :func:`finalize_add`).

    One deliberate difference: TokenSpeed's decoder also admits a nil or list ``rid``,
    whose finalization then fails (the frame is dropped); here a non-str ``rid`` is
    refused outright.

    Raises:
        RemoteProtocolError: not msgpack, not a tagged array of >= 6 elements, a wrong
            tag, a field of the wrong type (the message names it), a pickle ext type.
    """
    if not frames:
        raise RemoteProtocolError("TokenizedGenerateReqInput: no payload frame")
    for f in frames[1:]:
        if len(f) > _limits.MAX_FRAME_BYTES:
            raise RemoteProtocolError("TokenizedGenerateReqInput: aux frame exceeds MAX_FRAME_BYTES")
    obj = _unpack(frames[0], "TokenizedGenerateReqInput")
    if type(obj) is not tuple or not obj:
        raise RemoteProtocolError("TokenizedGenerateReqInput: expected a tagged array")
    if obj[0] != REQUEST_TAG or type(obj[0]) is not str:
        raise RemoteProtocolError(f"wrong msgspec tag: expected {REQUEST_TAG!r}, got {obj[0]!r:.60}")
    if len(obj) < REQUEST_MIN_ELEMENTS:
        raise RemoteProtocolError(
            f"TokenizedGenerateReqInput: missing positional field "
            f"{_REQUEST_SPEC[len(obj) - 1][0]!r} (got {len(obj)} elements, need >= {REQUEST_MIN_ELEMENTS})"
        )
    try:
        return _positional(
            TokenizedGenerateReqInput,
            obj[1:],
            "TokenizedGenerateReqInput",
            nested={"sampling_params": _nested_sampling},
        )
    except _Bad as exc:
        raise RemoteProtocolError(str(exc)) from None


def _nested_sampling(v: Any) -> TokenSpeedSamplingParams:
    try:
        return _decode_sampling_params(v)
    except _Bad as exc:
        msg = str(exc)
        if not msg.startswith("sampling_params"):
            msg = f"sampling_params: {msg}"
        raise _Bad(f"TokenizedGenerateReqInput.{msg}") from None


def decode_input(frames: Sequence[bytes]) -> tuple[RequestType, TokenizedGenerateReqInput | tuple[str, ...]]:
    """Decode one input message ``[type, payload, *aux]`` as TokenSpeed's receiver does.

    ADD -> ``(RequestType.ADD, finalize_add(decode_add(...)))``; ABORT ->
    ``(RequestType.ABORT, request_ids)``. For the mock engine, which must drop (log,
    no reply) whatever this refuses.

    Raises:
        RemoteProtocolError: fewer than 2 frames, an unknown type byte, or a payload
            that does not decode.
    """
    if len(frames) < 2:
        raise RemoteProtocolError(f"TokenSpeed input needs >= 2 frames (type, payload), got {len(frames)}")
    rtype = parse_request_type(frames[0])
    if rtype is RequestType.ADD:
        return rtype, finalize_add(decode_add(frames[1:]))
    return rtype, decode_abort(frames[1])


def decode_abort(payload: bytes) -> tuple[str, ...]:
    """Decode an ABORT payload into request ids. Raises RemoteProtocolError."""
    return _vllm_engine.decode_abort(payload)


# =========================================================================== outputs


def encode_outputs(batch: TokenSpeedBatch, *, elements: int = BATCH_ELEMENTS) -> list[bytes]:
    """Encode one output message ``[payload]`` as TokenSpeed's ``MsgpackEncoder`` does.

    For the mock engine and tests. ``elements`` 14 (0.1.1, the default), or 9 / 10 to
    write a legacy prefix; the scalars a prefix leaves out must be 0. Logprob values
    are written as float64. ``wire_elements`` is ignored.

    Raises:
        LocalProtocolError: ragged columns, values of the wrong type (or negative
            counts/ids), a dropped non-zero scalar, or ``elements`` outside 9..14.
    """
    if not BATCH_MIN_ELEMENTS <= elements <= BATCH_ELEMENTS:
        raise LocalProtocolError(f"elements must be in {BATCH_MIN_ELEMENTS}..{BATCH_ELEMENTS}, got {elements}")
    m = len(batch.rids)
    body: list[Any] = [BATCH_TAG]
    try:
        for name in _COLUMNS:
            col = getattr(batch, name)
            if type(col) not in (list, tuple) or len(col) != m:
                raise _Bad(f"{name}: expected {m} entries like rids (ragged columns)")
            if name in ("rids", "finished_reasons"):
                body.append([_k_str(x) for x in col])
            elif name in ("output_ids", "logprob_ids"):
                body.append([[_nonneg(t) for t in _k_array(row)] for row in col])
            elif name == "logprob_vals":
                body.append([[_k_float(x) for x in _k_array(row)] for row in col])
            else:
                body.append([_nonneg(x) for x in col])
        for row_v, row_i in zip(batch.logprob_vals, batch.logprob_ids):
            if len(row_v) != len(row_i):
                raise _Bad("logprob_vals and logprob_ids rows must have equal lengths")
        for i, name in enumerate(_SCALARS, start=BATCH_MIN_ELEMENTS):
            v = _nonneg(getattr(batch, name))
            if i < elements:
                body.append(v)
            elif v != 0:
                raise _Bad(f"{name} is {v} but a {elements}-element batch does not carry it")
    except _Bad as exc:
        raise LocalProtocolError(f"BatchTokenIDOutSlim.{exc}") from None
    return [_pack(body)]


def _nonneg(v: Any) -> int:
    n = _k_int(v)
    if n < 0:
        raise _Bad(f"{n} is negative")
    return n


# =========================================================================== handshake

# The handshake is vLLM's (:mod:`zmqdispatch.wire.vllm_handshake`: INIT, the decoders);
# TokenSpeed writes these maps its own way.


def encode_hello() -> bytes:
    """TokenSpeed's HELLO: ``{status: "HELLO", local: true, headless: true,
    parallel_config_hash: nil}`` (4 keys, the nil hash included, unlike vLLM's 3-key map).
    For the mock engine."""
    return _pack({"status": "HELLO", "local": True, "headless": True, "parallel_config_hash": None})


def encode_ready() -> bytes:
    """TokenSpeed's READY map, shaped like :func:`encode_hello`. For the mock engine."""
    return _pack({"status": "READY", "local": True, "headless": True, "parallel_config_hash": None})


#: The only ``dtype`` values a TokenSpeed ready response carries (it refuses to start on
#: anything else).
READY_DTYPES = frozenset({"bfloat16", "float16", "float32"})


def encode_ready_response(resp: EngineCoreReadyResponse) -> bytes:
    """TokenSpeed 0.1.1's ready-response map (for the mock engine): 19 keys in its order.

    Keys: ``max_model_len, num_gpu_blocks, prefix_granularity`` (= ``resp.block_size``),
    ``dp_stats_address, dtype, multimodal_encoder_dtype, vllm_version, world_size,
    data_parallel_size, tensor_parallel_size, pipeline_parallel_size,
    decode_context_parallel_size, data_parallel_rank, max_num_seqs,
    max_num_batched_tokens, instance_id, kv_cache_size_tokens,
    kv_cache_max_concurrency, kv_events_config``; ``multimodal_encoder_dtype`` is
    ``resp.multimodal_encoder_dtype`` (nil when None). vLLM-only fields of ``resp``
    (``supports_lora``...) are not written.

    Raises:
        LocalProtocolError: ``dtype`` outside :data:`READY_DTYPES`, a negative
            ``max_num_batched_tokens`` (TokenSpeed clamps it to >= 0), or a value of
            the wrong type.
    """
    if resp.dtype not in READY_DTYPES:
        raise LocalProtocolError(f"ready response dtype must be one of {sorted(READY_DTYPES)}, got {resp.dtype!r}")
    if resp.max_num_batched_tokens < 0:
        raise LocalProtocolError("ready response max_num_batched_tokens must be >= 0 (0 = no cap)")
    mcr = resp.kv_cache_max_concurrency
    try:
        body = {
            "max_model_len": _k_int(resp.max_model_len),
            "num_gpu_blocks": _k_int(resp.num_gpu_blocks),
            "prefix_granularity": _k_int(resp.block_size),
            "dp_stats_address": _opt_str(resp.dp_stats_address),
            "dtype": resp.dtype,
            "multimodal_encoder_dtype": _opt_str(resp.multimodal_encoder_dtype),
            "vllm_version": _k_str(resp.vllm_version),
            "world_size": _k_int(resp.world_size),
            "data_parallel_size": _k_int(resp.data_parallel_size),
            "tensor_parallel_size": _k_int(resp.tensor_parallel_size),
            "pipeline_parallel_size": _k_int(resp.pipeline_parallel_size),
            "decode_context_parallel_size": _k_int(resp.decode_context_parallel_size),
            "data_parallel_rank": _k_int(resp.data_parallel_rank),
            "max_num_seqs": _k_int(resp.max_num_seqs),
            "max_num_batched_tokens": _k_int(resp.max_num_batched_tokens),
            "instance_id": _k_str(resp.instance_id),
            "kv_cache_size_tokens": _opt_int(resp.kv_cache_size_tokens),
            "kv_cache_max_concurrency": _k_opt(_k_float)(mcr),
            "kv_events_config": _k_opt(_k_map)(resp.kv_events_config),
        }
    except _Bad as exc:
        raise LocalProtocolError(f"ready response: {exc}") from None
    return _pack(body)

