"""Engine side of the vLLM v1 EngineCore wire (vLLM 0.32.0; 0.33.0's ``error``), sans-IO.

What an EngineCore reads and writes: :func:`decode_request` / :func:`decode_abort` /
:func:`decode_utility_call` / :func:`decode_start_dp_wave` for the input socket, and
:func:`encode_outputs` / :func:`encode_utility_output` (with the typed
:class:`EngineCoreOutput`) for the output socket. Used by the mock engine
(:mod:`zmqdispatch.mock`), the benchmark engine, the scripted fake engine of
:mod:`zmqdispatch.testing` and the tests; a client never needs it. The client side,
the enums and the structs both sides share are :mod:`zmqdispatch.wire.vllm`.

The encoders reproduce vLLM's ``MsgpackEncoder`` bytes (the golden vectors
``tests/wire/vectors/vllm_0.32.0.json``); the decoders refuse what vLLM's typed decoder
refuses (``docs/vllm-wire.md`` §5), so a mock engine fails where the real one would.
Decoders raise only :class:`~zmqdispatch.errors.RemoteProtocolError`; encoders
:class:`~zmqdispatch.errors.LocalProtocolError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from zmqdispatch import limits as _limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire.schema import (
    _Bad,
    _conv_float,
    _conv_tuple,
    _field,
    _int_seq,
    _k_any,
    _k_bool,
    _k_enum,
    _k_float,
    _k_int,
    _k_opt,
    _k_seq,
    _k_str,
    _opt_int,
    _pack,
    _prep,
    _spec,
    _struct_from_map,
    _struct_to_map,
    _tname,
    _to_wire,
    _unpack,
)
from zmqdispatch.wire.tensors import Tensor, decode_tensor, encode_tensor
from zmqdispatch.wire.vllm import (
    REQUEST_MIN_FIELDS,
    EngineCoreOutputRow,
    EngineCoreRequest,
    EventType,
    FinishReason,
    LogprobsLists,
    RequestType,
    UtilityOutput,
    decode_logprobs_lists,
    decode_logprobs_tensors,
)

__all__ = [
    "EngineCoreEvent",
    "EngineCoreOutput",
    "OutputError",
    "PrefillStats",
    "UtilityCall",
    "decode_abort",
    "decode_request",
    "decode_start_dp_wave",
    "decode_utility_call",
    "encode_outputs",
    "encode_utility_output",
    "parse_request_type",
]

# =========================================================================== input socket


def parse_request_type(frame: bytes) -> RequestType:
    """Read the request-type frame of an input message (used by the mock engine).

    Raises:
        RemoteProtocolError: the frame is not exactly one byte in 0..3.
    """
    if len(frame) != 1 or frame[0] > 3:
        raise RemoteProtocolError(f"invalid request type frame {bytes(frame)[:8]!r}")
    return RequestType(frame[0])


def decode_request(frames: Sequence[bytes]) -> EngineCoreRequest:
    """Decode an ADD message ``[payload, *aux]`` the way vLLM's typed decoder does.

    Accepts 9..22 elements (missing trailing fields take their defaults) and ignores
    elements past the 22nd; ``sampling_params`` keys that are unknown are ignored and
    missing ones defaulted. Used by the mock engine, which must refuse what the real
    engine refuses.

    Raises:
        RemoteProtocolError: not msgpack, not an array of >= 9, a field of the wrong type
            (the message names it: ``EngineCoreRequest.sampling_params: top_k: expected an
            int, got float``), a bad ``prompt_embeds`` tensor, a pickle ext type.
    """
    if not frames:
        raise RemoteProtocolError("EngineCoreRequest: no payload frame")
    for f in frames[1:]:
        if len(f) > _limits.MAX_FRAME_BYTES:
            raise RemoteProtocolError("EngineCoreRequest: aux frame exceeds MAX_FRAME_BYTES")
    obj = _unpack(frames[0], "EngineCoreRequest")
    if type(obj) is not list or len(obj) < REQUEST_MIN_FIELDS:
        raise RemoteProtocolError(
            f"EngineCoreRequest: expected an array of >= {REQUEST_MIN_FIELDS} elements"
        )
    kwargs: dict[str, Any] = {}
    for (name, _wire, _default, kind, _always), v in zip(_spec(EngineCoreRequest), obj):
        if name == "prompt_embeds" and v is not None:
            v = decode_tensor(v, frames, field="prompt_embeds")
        try:
            kwargs[name] = kind(v)
        except _Bad as exc:
            raise RemoteProtocolError(f"EngineCoreRequest.{name}: {exc}") from None
    return EngineCoreRequest(**kwargs)


def decode_abort(payload: bytes) -> tuple[str, ...]:
    """Decode an ABORT payload into request ids. Raises RemoteProtocolError."""
    obj = _unpack(payload, "ABORT")
    if type(obj) is not list or not all(type(r) is str for r in obj):
        raise RemoteProtocolError("ABORT: expected an array of str request ids")
    return tuple(obj)


def decode_start_dp_wave(payload: bytes) -> tuple[int, int | None]:
    """Decode ``[wave, exclude_engine_index|nil]``. Raises RemoteProtocolError."""
    obj = _unpack(payload, "START_DP_WAVE")
    if type(obj) is not list or len(obj) != 2 or type(obj[0]) is not int or (
        obj[1] is not None and type(obj[1]) is not int
    ):
        raise RemoteProtocolError("START_DP_WAVE: expected [int, int|nil]")
    return obj[0], obj[1]


@attrs.frozen(kw_only=True)
class UtilityCall:
    """A decoded UTILITY request ``[client_index, call_id, method, args]``.

    The engine calls ``getattr(engine_core, method)(*args)`` and answers on the output
    socket of ``client_index`` with a :class:`UtilityOutput` carrying ``call_id``.
    """

    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...]


def decode_utility_call(payload: bytes) -> UtilityCall:
    """Decode a UTILITY payload. Raises RemoteProtocolError."""
    obj = _unpack(payload, "UTILITY")
    if (
        type(obj) is not list
        or len(obj) != 4
        or type(obj[0]) is not int
        or type(obj[1]) is not int
        or type(obj[2]) is not str
        or type(obj[3]) is not list
    ):
        raise RemoteProtocolError("UTILITY: expected [client_index, call_id, method, args]")
    return UtilityCall(client_index=obj[0], call_id=obj[1], method=obj[2], args=tuple(obj[3]))


# =========================================================================== output socket


def _encode_logprobs(lp: LogprobsLists, aux: list[Any], *, tensors: bool) -> list[Any]:
    rows = len(lp.token_ids)
    cols = len(lp.token_ids[0]) if rows else 0
    if len(lp.logprobs) != rows or len(lp.ranks) != rows or any(
        len(r) != cols for r in lp.token_ids
    ) or any(len(r) != cols for r in lp.logprobs):
        raise LocalProtocolError("LogprobsLists: token_ids, logprobs and ranks must be [n, k+1], [n, k+1], [n]")
    ids = Tensor.from_values("int32", (rows, cols), [t for r in lp.token_ids for t in r])
    lps = Tensor.from_values("float32", (rows, cols), [x for r in lp.logprobs for x in r])
    # vLLM's sampler gives int64 ranks for sample logprobs, int32 for prompt logprobs.
    ranks = Tensor.from_values("int32" if tensors else "int64", (rows,), lp.ranks)
    body: list[Any] = [
        encode_tensor(t.dtype, t.shape, t.data, aux, torch=tensors) for t in (ids, lps, ranks)
    ]
    cu = None if lp.cu_num_generated_tokens is None else list(lp.cu_num_generated_tokens)
    body.append(cu)
    if tensors:
        body.append(None)  # cu_num_generated_tokens_tensor
    return body


# --------------------------------------------------------------------------- output structs


@attrs.frozen(kw_only=True)
class PrefillStats:
    """``EngineCoreOutput.prefill_stats`` (a full map), sent on a request's first output.

    All counts are prompt tokens; ``num_cached_tokens`` is the prefix-cache hit (0.32.0
    has no top-level ``num_cached_tokens``).
    """

    num_prompt_tokens: int = _field(0, _k_int)
    num_computed_tokens: int = _field(0, _k_int)
    num_cached_tokens: int = _field(0, _k_int)
    num_local_cached_tokens: int = _field(0, _k_int)
    num_external_cached_tokens: int = _field(0, _k_int)
    num_cache_creation_tokens: int = _field(0, _k_int)

    def _to_wire(self) -> dict[str, Any]:
        return _struct_to_map(self, omit_defaults=False)


@attrs.frozen(kw_only=True)
class EngineCoreEvent:
    """``EngineCoreOutput.events`` entry ``{"type": 1|2|3, "timestamp": monotonic float}``."""

    type: EventType = _field(kind=_k_enum(EventType))
    timestamp: float = _field(kind=_k_float, converter=_conv_float)

    def _to_wire(self) -> dict[str, Any]:
        return _struct_to_map(self, omit_defaults=False)


@attrs.frozen(kw_only=True)
class OutputError:
    """vLLM 0.33.0 ``EngineCoreOutput.error`` (``RequestError`` dataclass, full map).

    Comes with ``FinishReason.ERROR``; codes seen: ``"validation_error"`` (not
    retryable), ``"engine_paused"`` (retryable).
    """

    code: str = _field(kind=_k_str)
    message: str = _field(kind=_k_str)
    retryable: bool = _field(kind=_k_bool)

    def _to_wire(self) -> dict[str, Any]:
        return _struct_to_map(self, omit_defaults=False)


@attrs.define(kw_only=True, slots=True)
class EngineCoreOutput:
    """One request's output of one step (vLLM 0.32.0 ``EngineCoreOutput``, 18 fields).

    Used to *encode* outputs (mock engine, tests) and by :meth:`from_row` for a typed
    view of a decoded row; the router reads the rows as they are decoded. ``new_token_ids`` holds
    only this step's tokens. ``pooling_output``, ``routed_experts`` and
    ``prompt_token_id_logprobs`` take :class:`Tensor` values. ``error`` is vLLM 0.33.0's
    19th element; it is only written when :func:`encode_outputs` is told
    ``vllm_version="0.33.0"``.
    """

    request_id: str
    new_token_ids: Sequence[int] = attrs.field(default=(), converter=_conv_tuple)
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsLists | None = None
    pooling_output: Any = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: Sequence[EngineCoreEvent] | None = attrs.field(default=None, converter=_conv_tuple)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: Any = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: Sequence[str] | None = attrs.field(default=None, converter=_conv_tuple)
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None
    error: OutputError | None = None

    @classmethod
    def from_row(cls, row: EngineCoreOutputRow, frames: Sequence[bytes]) -> EngineCoreOutput:
        """Typed view of a decoded row from :func:`decode_outputs` (not for the hot path).

        Logprobs become :class:`LogprobsLists`, tensors :class:`Tensor`, maps their attrs
        types. Raises RemoteProtocolError for a malformed field.
        """

        def typed(name: str, conv: Callable[[Any], Any], v: Any) -> Any:
            if v is None:
                return None
            try:
                return conv(v)
            except _Bad as exc:
                raise RemoteProtocolError(f"EngineCoreOutput.{name}: {exc}") from None

        def tensor(name: str, v: Any) -> Any:
            return None if v is None else decode_tensor(v, frames, field=name)

        events = typed(
            "events", lambda v: [_struct_from_map(EngineCoreEvent, e) for e in _k_seq(_k_any)(v)], row.events
        )
        fr = row.finish_reason
        lp, plp = row.new_logprobs, row.new_prompt_logprobs_tensors
        return cls(
            request_id=row.request_id,
            new_token_ids=row.new_token_ids,
            new_logprobs=None if lp is None else decode_logprobs_lists(lp, frames),
            new_prompt_logprobs_tensors=None if plp is None else decode_logprobs_tensors(plp, frames),
            pooling_output=tensor("pooling_output", row.pooling_output),
            finish_reason=None if fr is None else FinishReason(fr),
            stop_reason=row.stop_reason,
            events=events,
            kv_transfer_params=row.kv_transfer_params,
            ec_transfer_params=row.ec_transfer_params,
            trace_headers=row.trace_headers,
            prefill_stats=typed("prefill_stats", lambda v: _struct_from_map(PrefillStats, v), row.prefill_stats),
            routed_experts=tensor("routed_experts", row.routed_experts),
            num_nans_in_logits=typed("num_nans_in_logits", _k_int, row.num_nans_in_logits),
            mm_cache_miss_hashes=row.mm_cache_miss_hashes,
            new_sampling_mask=row.new_sampling_mask,
            spec_decode_metrics=row.spec_decode_metrics,
            prompt_token_id_logprobs=tensor("prompt_token_id_logprobs", row.prompt_token_id_logprobs),
            error=typed("error", lambda v: _struct_from_map(OutputError, v), row.error),
        )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _encode_output(o: EngineCoreOutput, aux: list[Any], with_error: bool) -> list[Any]:
    if type(o.request_id) is not str:
        raise LocalProtocolError(f"EngineCoreOutput.request_id: expected a str, got {_tname(o.request_id)}")
    try:
        toks = list(_int_seq(o.new_token_ids))
        fr = None if o.finish_reason is None else int(_k_enum(FinishReason)(o.finish_reason))
        if o.stop_reason is not None and type(o.stop_reason) is not str:
            _k_int(o.stop_reason)
        nans = _k_int(o.num_nans_in_logits)
    except _Bad as exc:
        raise LocalProtocolError(f"EngineCoreOutput({o.request_id!r}): {exc}") from None
    if o.error is not None and not with_error:
        raise LocalProtocolError("EngineCoreOutput.error exists only on the vLLM >= 0.33 wire")
    row = [
        o.request_id,
        toks,
        None if o.new_logprobs is None else _encode_logprobs(o.new_logprobs, aux, tensors=False),
        None
        if o.new_prompt_logprobs_tensors is None
        else _encode_logprobs(o.new_prompt_logprobs_tensors, aux, tensors=True),
        _prep(o.pooling_output, aux),
        fr,
        _to_wire(o.stop_reason),
        _to_wire(o.events),
        _prep(o.kv_transfer_params, aux),
        _prep(o.ec_transfer_params, aux),
        _prep(o.trace_headers, aux),
        _to_wire(o.prefill_stats),
        _prep(o.routed_experts, aux),
        nans,
        _to_wire(o.mm_cache_miss_hashes),
        _prep(o.new_sampling_mask, aux),
        _prep(o.spec_decode_metrics, aux),
        _prep(o.prompt_token_id_logprobs, aux),
    ]
    if with_error:
        row.append(_to_wire(o.error))
    return row


def encode_outputs(
    engine_index: int,
    outputs: Sequence[EngineCoreOutput],
    *,
    timestamp: float,
    scheduler_stats: dict[str, Any] | None = None,
    utility_output: UtilityOutput | None = None,
    finished_requests: Iterable[str] | None = None,
    wave_complete: int | None = None,
    start_wave: int | None = None,
    weight_version: str | None = None,
    vllm_version: str = "0.32.0",
) -> list[bytes]:
    """Encode one output message ``[payload, *aux]`` as vLLM's ``MsgpackEncoder`` does.

    For the mock engine and tests. The payload is the 9-element ``EngineCoreOutputs``
    array; each output an 18-element array (19 with the trailing ``error`` when
    ``vllm_version`` is 0.33 or newer). Sample logprobs are written as numpy arrays
    (``"<i4"``, ``"<f4"``, ``"<i8"``), prompt logprobs as torch tensors (``"int32"``,
    ``"float32"``, ``"int32"``); any array of 256 bytes or more goes to an aux frame,
    indexes counted across the whole message. ``timestamp`` is engine-monotonic
    seconds; vLLM sets ``weight_version="default"`` on step outputs only.
    ``finished_requests`` is written in the order given (vLLM: set order).

    Raises:
        LocalProtocolError: a value of the wrong type, or ``error`` set on a 0.32 wire.
    """
    with_error = _version_tuple(vllm_version) >= (0, 33)
    aux: list[Any] = []
    rows = [_encode_output(o, aux, with_error) for o in outputs]
    try:
        body = [
            _k_int(engine_index),
            rows,
            _prep(scheduler_stats, aux),
            _k_float(timestamp),
            None if utility_output is None else utility_output._to_wire(),  # noqa: SLF001  (a wire struct's encoding hook, wire.schema's)
            None if finished_requests is None else list(_k_seq(_k_str)(list(finished_requests))),
            _opt_int(wave_complete),
            _opt_int(start_wave),
            _k_opt(_k_str)(weight_version),
        ]
    except _Bad as exc:
        raise LocalProtocolError(f"EngineCoreOutputs: {exc}") from None
    return [_pack(body), *aux]


def encode_utility_output(engine_index: int, output: UtilityOutput, *, timestamp: float) -> list[bytes]:
    """Encode the reply to a UTILITY call: an EngineCoreOutputs with only ``utility_output``.

    ``output.result`` is ``UtilityResult(value)`` for a successful call (``None`` values
    included: ``[nil, nil]``), ``None`` when ``failure_message`` is set.
    """
    return encode_outputs(engine_index, (), timestamp=timestamp, utility_output=output)


