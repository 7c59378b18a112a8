"""Client side of the vLLM v1 EngineCore wire (vLLM 0.32.0; 0.33.0 tolerated), sans-IO.

What a front-end sends and reads, in one import: :func:`encode_request` (ADD),
:func:`encode_abort`, :func:`encode_utility_call`, :func:`encode_start_dp_wave` (here),
and :func:`decode_outputs` (the hot path, once per engine step), defined with the
output structs in :mod:`zmqdispatch.wire.vllm_outputs` and re-exported. The engine's side of the
same wire (decoding requests, encoding outputs: the mock engine, the benchmark engine,
tests) is :mod:`zmqdispatch.wire.vllm_engine`; the handshake is
:mod:`zmqdispatch.wire.vllm_handshake`; the field machinery both dialects share is
:mod:`zmqdispatch.wire.schema`. Nothing here touches a socket. Sources of the format
(facts, not code): ``docs/vllm-wire.md`` §5, and the golden vectors of vLLM's own
encoder (``tests/wire/vectors/vllm_0.32.0.json``), which :func:`encode_request` and the
engine-side encoders reproduce byte for byte.

Wire rules in one place:

- msgspec *array_like* structs (``EngineCoreRequest``, ``EngineCoreOutputs``,
  ``EngineCoreOutput``, ``UtilityOutput``, the logprobs NamedTuples) are positional
  msgpack arrays with every field written. Decoders accept missing trailing fields
  (defaults) and ignore extra trailing ones (newer engines append fields).
- ``SamplingParams`` is a map of its non-default fields (``omit_defaults``);
  dataclasses (``StructuredOutputsParams``, ``RepetitionDetectionParams``,
  ``PrefillStats``, the handshake messages, ``EngineCoreReadyResponse``) are full maps.
  Decoders ignore unknown keys and default missing ones.
- floats are always float64, ints take their smallest msgpack form (``call_id`` may
  be a uint64), strings are ``str`` (never ``bin``), sets travel as arrays in CPython
  set-iteration order.
- Request frames are ``[type_byte, payload, *aux]``; output frames are
  ``[payload, *aux]`` or the single raw frame :data:`ENGINE_CORE_DEAD`.

Errors: every decoder raises only :class:`~zmqdispatch.errors.RemoteProtocolError` for
bytes that do not decode (the connection counts them); every encoder raises
:class:`~zmqdispatch.errors.LocalProtocolError` for a value the wire cannot carry.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.wire.schema import (
    ENGINE_CORE_DEAD,
    _Bad,
    _conv_float,
    _conv_nested_tuple,
    _conv_tuple,
    _field,
    _int_seq,
    _k_bool,
    _k_enum,
    _k_float,
    _k_int,
    _k_map,
    _k_opt,
    _k_seq,
    _k_str,
    _opt_int,
    _pack,
    _pack_omit_defaults_map,
    _prep,
    _spec,
    _struct_from_map,
    _struct_to_map,
    _tname,
    _to_wire,
    _wrap_map_struct,
    is_dead_sentinel,
    msgpack_array_header,
)
from zmqdispatch.wire.tensors import Tensor, check_tensor
# The output side (decode_outputs and what it returns) lives in wire.vllm_outputs;
# re-exported so that this module stays the client side of the wire in one import.
from zmqdispatch.wire.vllm_outputs import (  # re-exports (`x as x`), private ones included
    ROW_FIELDS as ROW_FIELDS,
    _ENVELOPE_DEFAULTS as _ENVELOPE_DEFAULTS,
    _ENVELOPE_LEN as _ENVELOPE_LEN,
    _ROW_DEFAULTS as _ROW_DEFAULTS,
    _OPAQUE_POSITIONS as _OPAQUE_POSITIONS,
    _ROW_N as _ROW_N,
    _as_any as _as_any,
    _decode_outputs_msgpack as _decode_outputs_msgpack,
    _row_struct as _row_struct,
    _typed as _typed,
    EngineCoreOutputRow as EngineCoreOutputRow,
    EngineCoreOutputs as EngineCoreOutputs,
    LogprobsLists as LogprobsLists,
    UtilityOutput as UtilityOutput,
    UtilityResult as UtilityResult,
    _bad_output as _bad_output,
    _decode_logprobs as _decode_logprobs,
    _decode_utility_output as _decode_utility_output,
    _prefill_stats_ok as _prefill_stats_ok,
    _row_problem as _row_problem,
    decode_logprobs_lists as decode_logprobs_lists,
    decode_logprobs_tensors as decode_logprobs_tensors,
    decode_outputs as decode_outputs,
)

__all__ = [
    "ENGINE_CORE_DEAD",
    "OPAQUE_REQUEST_FIELDS",
    "REQUEST_MIN_FIELDS",
    # outputs
    "ROW_FIELDS",
    "EngineCoreOutputRow",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EventType",
    "FinishReason",
    "LogprobsLists",
    "RepetitionDetectionParams",
    "RequestOutputKind",
    # constants and enums
    "RequestType",
    "SamplingParams",
    # requests
    "StructuredOutputsParams",
    "UtilityOutput",
    "UtilityResult",
    "check_opaque_value",
    "decode_logprobs_lists",
    "decode_logprobs_tensors",
    "decode_outputs",
    "encode_abort",
    "encode_request",
    "encode_start_dp_wave",
    "encode_utility_call",
    "is_dead_sentinel",
    "msgpack_array_header",
    "set_order",
]

# =========================================================================== enums


class RequestType(enum.IntEnum):
    """Request-type byte, the first frame the engine reads (vLLM ``EngineCoreRequestType``).

    Any other byte kills the engine's input thread silently (``docs/vllm-wire.md`` §5.2), so
    only these four are ever sent. ``.frame`` is the one-byte frame.
    """

    ADD = 0
    ABORT = 1
    START_DP_WAVE = 2
    UTILITY = 3

    @property
    def frame(self) -> bytes:
        """The one-byte frame for this type (``b"\\x00"`` for ADD)."""
        return _TYPE_FRAMES[self]


_TYPE_FRAMES = {t: bytes((t,)) for t in RequestType}


class FinishReason(enum.IntEnum):
    """``EngineCoreOutput.finish_reason`` (vLLM ``FinishReason``); a request is finished
    when its output carries one. ``.wire_name`` is vLLM's string form."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    @property
    def wire_name(self) -> str:
        """``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``"repetition"``."""
        return self.name.lower()


class EventType(enum.IntEnum):
    """``EngineCoreEvent.type`` (only sent with log_stats); timestamps are engine-monotonic."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class RequestOutputKind(enum.IntEnum):
    """``SamplingParams.output_kind``; only vLLM's front-end looks at it."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# =========================================================================== vLLM-only kinds


def _k_str_or_strs(v: Any) -> tuple[str, ...]:
    # vLLM's stop / bad_words accept nil, a str or a list of str; __post_init__ lists them.
    if v is None:
        return ()
    return (v,) if type(v) is str else _k_seq(_k_str)(v)


def _k_ids_or_nil(v: Any) -> tuple[int, ...]:
    # stop_token_ids: nil becomes [] in vLLM's __post_init__.
    return () if v is None else _int_seq(v)


def _conv_tuple_or_empty(v: Any) -> Any:
    # vLLM's __post_init__ turns None into [] and a lone str into [str].
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return _conv_tuple(v)


def _conv_logit_bias(v: Any) -> Any:
    return {k: _conv_float(x) for k, x in v.items()} if isinstance(v, dict) else v


# =========================================================================== SamplingParams


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """``SamplingParams.structured_outputs`` (vLLM 0.32.0 ``StructuredOutputsParams``).

    A dataclass in vLLM, so it always travels as a full map of all 11 fields, including
    the private ``_backend`` / ``_backend_was_auto`` (attrs names ``backend`` /
    ``backend_was_auto``) that vLLM's front-end fills. Exactly one constraint
    (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``)
    should be set; the engine checks that, not the codec.
    """

    json: str | dict[str, Any] | None = _field(None, _k_opt(lambda v: v if type(v) in (str, dict) else _k_str(v)))
    regex: str | None = _field(None, _k_opt(_k_str))
    choice: tuple[str, ...] | None = _field(None, _k_opt(_k_seq(_k_str)), converter=_conv_tuple)
    grammar: str | None = _field(None, _k_opt(_k_str))
    json_object: bool | None = _field(None, _k_opt(_k_bool))
    disable_any_whitespace: bool = _field(False, _k_bool)
    disable_additional_properties: bool = _field(False, _k_bool)
    whitespace_pattern: str | None = _field(None, _k_opt(_k_str))
    structural_tag: str | None = _field(None, _k_opt(_k_str))
    backend: str | None = _field(None, _k_opt(_k_str), wire="_backend")
    backend_was_auto: bool = _field(False, _k_bool, wire="_backend_was_auto")

    def _to_wire(self) -> dict[str, Any]:
        return _struct_to_map(self, omit_defaults=False)


@attrs.frozen(kw_only=True)
class RepetitionDetectionParams:
    """``SamplingParams.repetition_detection``: a full map of three ints.

    The request finishes with ``FinishReason.REPETITION`` and stop_reason
    ``"repetition_detected"`` when a pattern of ``min_pattern_size..max_pattern_size``
    tokens repeats ``min_count`` times. All three keys are required on decode (we do
    not know vLLM's dataclass defaults, if any).
    """

    max_pattern_size: int = _field(kind=_k_int)
    min_pattern_size: int = _field(kind=_k_int)
    min_count: int = _field(kind=_k_int)

    def _to_wire(self) -> dict[str, Any]:
        return _struct_to_map(self, omit_defaults=False)


def _k_logit_bias(v: Any) -> dict[int, float]:
    if type(v) is not dict:
        raise _Bad(f"expected a map, got {_tname(v)}")
    out = {}
    for k, x in v.items():
        if type(k) is not int:
            raise _Bad(f"keys must be int token ids, got {_tname(k)}")
        out[k] = _k_float(x)
    return out




@attrs.frozen(kw_only=True)
class SamplingParams:
    """vLLM 0.32.0 ``SamplingParams``: every field, in declaration order, vLLM defaults.

    Wire form: a msgpack map of the fields that differ from their default
    (``omit_defaults``), in this order. vLLM's ``__post_init__`` always leaves ``stop``,
    ``stop_token_ids`` and ``bad_words`` as lists and ``skip_reading_prefix_cache`` as a
    bool, so those four are always written (as vLLM's bytes show); so is
    ``temperature``, which vLLM's bytes carry even at 1.0 (vector ``request_ignore_eos``).

    Private vLLM fields are exposed without the underscore: ``eos_token_id``
    (``_eos_token_id``: vLLM's front-end copies the model's EOS here unless
    ``ignore_eos``; the engine knows no other EOS), ``all_stop_token_ids``
    (``_all_stop_token_ids``, a set in vLLM sent in set-iteration order: pass it in wire
    order, e.g. from :func:`set_order`), ``watermarking_skipped``, ``bad_words_token_ids``.

    Sequences are tuples; an int given for a float field is stored as a float, so it is
    written as float64 like vLLM writes it. Values are checked when encoded
    (:class:`LocalProtocolError`), not at construction. ``skip_reading_prefix_cache``
    left ``None`` resolves like vLLM's ``__post_init__``: True iff ``prompt_logprobs`` is set.
    """

    n: int = _field(1, _k_int)
    presence_penalty: float = _field(0.0, _k_float, converter=_conv_float)
    frequency_penalty: float = _field(0.0, _k_float, converter=_conv_float)
    repetition_penalty: float = _field(1.0, _k_float, converter=_conv_float)
    temperature: float = _field(1.0, _k_float, always=True, converter=_conv_float)
    watermarking: Any = _field(None)
    top_p: float = _field(1.0, _k_float, converter=_conv_float)
    top_k: int = _field(0, _k_int)
    min_p: float = _field(0.0, _k_float, converter=_conv_float)
    seed: int | None = _field(None, _opt_int)
    stop: tuple[str, ...] = _field((), _k_str_or_strs, always=True, converter=_conv_tuple_or_empty)
    stop_token_ids: tuple[int, ...] = _field((), _k_ids_or_nil, always=True, converter=_conv_tuple_or_empty)
    ignore_eos: bool = _field(False, _k_bool)
    max_tokens: int | None = _field(16, _opt_int)
    min_tokens: int = _field(0, _k_int)
    logprobs: int | None = _field(None, _opt_int)
    prompt_logprobs: int | None = _field(None, _opt_int)
    prompt_logprob_token_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    prompt_logprob_start: int | None = _field(None, _opt_int)
    logprob_token_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    flat_logprobs: bool = _field(False, _k_bool)
    detokenize: bool = _field(True, _k_bool)
    skip_special_tokens: bool = _field(True, _k_bool)
    spaces_between_special_tokens: bool = _field(True, _k_bool)
    include_stop_str_in_output: bool = _field(False, _k_bool)
    output_kind: RequestOutputKind = _field(RequestOutputKind.CUMULATIVE, _k_enum(RequestOutputKind))
    stream_interval: int | None = _field(None, _opt_int)
    skip_clone: bool = _field(False, _k_bool)
    output_text_buffer_length: int = _field(0, _k_int)
    eos_token_id: int | None = _field(None, _opt_int, wire="_eos_token_id")
    all_stop_token_ids: tuple[int, ...] = _field(
        (), _int_seq, wire="_all_stop_token_ids", converter=_conv_tuple_or_empty
    )
    watermarking_skipped: bool = _field(False, _k_bool, wire="_watermarking_skipped")
    structured_outputs: StructuredOutputsParams | None = _field(
        None, _k_opt(_wrap_map_struct(StructuredOutputsParams, "structured_outputs"))
    )
    logit_bias: dict[int, float] | None = _field(None, _k_opt(_k_logit_bias), converter=_conv_logit_bias)
    allowed_token_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    extra_args: dict[str, Any] | None = _field(None, _k_opt(_k_map))
    bad_words: tuple[str, ...] = _field((), _k_str_or_strs, always=True, converter=_conv_tuple_or_empty)
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = _field(
        None, _k_opt(_k_seq(_int_seq)), wire="_bad_words_token_ids", converter=_conv_nested_tuple
    )
    skip_reading_prefix_cache: bool | None = _field(None, _k_opt(_k_bool), always=True)
    thinking_token_budget: int | None = _field(None, _opt_int)
    repetition_detection: RepetitionDetectionParams | None = _field(
        None, _k_opt(_wrap_map_struct(RepetitionDetectionParams, "repetition_detection"))
    )
    routed_experts_prompt_start: int = _field(0, _k_int)
    trace_decode_token_ids: Any = _field(None)

    def __attrs_post_init__(self) -> None:
        if self.skip_reading_prefix_cache is None:
            object.__setattr__(self, "skip_reading_prefix_cache", self.prompt_logprobs is not None)

    def _to_wire(self) -> dict[str, Any]:
        return _struct_to_map(self, omit_defaults=True)


def set_order(ids: Iterable[int]) -> tuple[int, ...]:
    """The order in which CPython iterates a set built by adding ``ids`` in this order.

    vLLM sends ``_all_stop_token_ids`` (a ``set``) in set-iteration order; pass the
    result as ``SamplingParams.all_stop_token_ids`` to reproduce vLLM's bytes, e.g.
    ``set_order([2, 7, 9]) == (9, 2, 7)``. The engine itself only tests membership, so
    any order works on the wire.
    """
    s: set[int] = set()
    for i in ids:
        s.add(i)
    return tuple(s)


# =========================================================================== EngineCoreRequest


def _k_sampling_params(v: Any) -> Any:
    if isinstance(v, SamplingParams):
        return v
    return _struct_from_map(SamplingParams, v)


def _k_tensor_obj(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v
    raise _Bad(f"expected a Tensor, got {_tname(v)}")


@attrs.frozen(kw_only=True)
class EngineCoreRequest:
    """vLLM 0.32.0 ``EngineCoreRequest`` (``vllm/v1/engine/__init__.py``, array_like).

    Positional array of 22 fields; the first 9 (``request_id`` .. ``data_parallel_rank``)
    are required on decode (here ``request_id``, ``prompt_token_ids``,
    ``sampling_params`` and ``arrival_time`` are required arguments; the other five of
    those nine default to None for convenience). ``request_id`` must be unique among the engine's live
    requests (a duplicate kills the engine). ``client_index`` selects which
    ``outputs[i]`` socket receives this request's outputs. ``arrival_time`` is
    wall-clock seconds. ``prompt_embeds`` is a torch float tensor ``[P, hidden]``.
    Fields we never interpret (``mm_features``, ``pooling_params``, ``lora_request``,
    ``prompt_is_token_ids``, ``kv_hints``...) are kept as decoded msgpack values.
    """

    request_id: str = _field(kind=_k_str)
    prompt_token_ids: tuple[int, ...] | None = _field(kind=_k_opt(_int_seq), converter=_conv_tuple)
    mm_features: Any = _field(None)
    sampling_params: SamplingParams | None = _field(kind=_k_opt(_k_sampling_params))
    pooling_params: Any = _field(None)
    arrival_time: float = _field(kind=_k_float, converter=_conv_float)
    lora_request: Any = _field(None)
    cache_salt: str | None = _field(None, _k_opt(_k_str))
    data_parallel_rank: int | None = _field(None, _opt_int)
    prompt_embeds: Tensor | None = _field(None, _k_opt(_k_tensor_obj))
    prompt_is_token_ids: Any = _field(None)
    client_index: int = _field(0, _k_int)
    current_wave: int = _field(0, _k_int)
    priority: int = _field(0, _k_int)
    trace_headers: dict[str, str] | None = _field(None, _k_opt(_k_map))
    resumable: bool = _field(False, _k_bool)
    external_req_id: str | None = _field(None, _k_opt(_k_str))
    reasoning_ended: bool | None = _field(None, _k_opt(_k_bool))
    reasoning_parser_kwargs: dict[str, Any] | None = _field(None, _k_opt(_k_map))
    abort_immediately: bool = _field(False, _k_bool)
    session_id: str | None = _field(None, _k_opt(_k_str))
    kv_hints: Any = _field(None)


#: Fields of EngineCoreRequest a decoder requires (msgspec: those without a default).
REQUEST_MIN_FIELDS = 9
_REQUEST_FIELDS = [f.name for f in attrs.fields(EngineCoreRequest)]

#: EngineCoreRequest fields we carry without interpreting them (decoded msgpack
#: values; a :class:`Tensor` anywhere inside goes through the tensor codec).
OPAQUE_REQUEST_FIELDS = (
    "mm_features", "pooling_params", "lora_request", "prompt_is_token_ids", "trace_headers",
    "reasoning_parser_kwargs", "kv_hints",
)


def check_opaque_value(v: Any, path: str = "") -> None:
    """Check, without encoding or copying, that an opaque field's value can be
    sent: plain msgpack values (None, bool, int, float, str, bytes, lists, maps
    with str / int keys), :class:`Tensor` s in any buffer layout
    (:func:`~zmqdispatch.wire.tensors.check_tensor`), and raw contiguous buffers.

    Raises:
        LocalProtocolError: the first value that cannot be sent, with its path.
    """
    if v is None or type(v) in (bool, int, float, str, bytes):
        if type(v) is int and not -(2**63) <= v < 2**64:
            raise LocalProtocolError(f"{path or 'value'}: int {v} does not fit 64 bits")
        return
    if isinstance(v, Tensor):
        try:
            check_tensor(v)
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"{path or 'value'}: {exc}") from None
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            check_opaque_value(x, f"{path}[{i}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if type(k) not in (str, int):
                raise LocalProtocolError(f"{path or 'value'}: map key {k!r} is not a str or int")
            check_opaque_value(x, f"{path}.{k}" if path else str(k))
        return
    if isinstance(v, (bytearray, memoryview)):
        try:
            ok = memoryview(v).c_contiguous
        except ValueError as exc:
            raise LocalProtocolError(f"{path or 'value'}: {exc}") from None
        if not ok:
            raise LocalProtocolError(f"{path or 'value'}: a non-contiguous buffer travels only as a Tensor "
                                     "(Tensor.from_array), which is sent in C order")
        return
    _pack(_to_wire(v))  # attrs wire types, enums: raises LocalProtocolError if it cannot be packed


def encode_request(req: EngineCoreRequest) -> list[bytes]:
    """Encode an ADD payload: ``[payload, *aux]`` (send after ``RequestType.ADD.frame``).

    The payload is the 22-element positional array vLLM 0.32.0's ``MsgpackEncoder``
    writes (``dc0016``), ``sampling_params`` a map of its non-default fields; a
    ``prompt_embeds`` tensor of 256 bytes or more goes to aux frame 1.

    Raises:
        LocalProtocolError: a field holds a value of the wrong type (message names it)
            or something msgpack cannot carry (an int beyond 64 bits...).
    """
    aux: list[Any] = []
    # Packed element by element (in field order, so aux indexes follow vLLM's
    # depth-first order) because sampling_params needs msgspec's map16 header.
    parts: list[bytes] = [msgpack_array_header(len(_REQUEST_FIELDS))]
    for name, _wire, _default, kind, _always in _spec(EngineCoreRequest):
        v = getattr(req, name)
        try:
            v = kind(v)
        except _Bad as exc:
            raise LocalProtocolError(f"{name}: {exc}") from None
        if name == "sampling_params" and v is not None:
            try:
                parts.append(_pack_omit_defaults_map(v._to_wire()))  # noqa: SLF001  (a wire struct's encoding hook, wire.schema's)
            except _Bad as exc:
                raise LocalProtocolError(f"sampling_params: {exc}") from None
        else:
            parts.append(_pack(_prep(v, aux)))
    return [b"".join(parts), *aux]


def encode_abort(request_ids: Sequence[str]) -> bytes:
    """ABORT payload: a msgpack array of request-id strings (send after ``RequestType.ABORT.frame``).

    The engine sends no final output for an id it aborts on request; unknown ids are
    ignored. Raises LocalProtocolError for a bare str (the engine would iterate its
    characters) or a non-str id.
    """
    if isinstance(request_ids, (str, bytes)):
        raise LocalProtocolError("request_ids must be a sequence of str, not a single str")
    ids = list(request_ids)
    for rid in ids:
        if type(rid) is not str:
            raise LocalProtocolError(f"request id must be a str, got {_tname(rid)}")
    return _pack(ids)


def encode_start_dp_wave(wave: int, exclude_engine_index: int | None = None) -> bytes:
    """START_DP_WAVE payload ``[wave, exclude_engine_index|nil]`` (MoE data parallel only)."""
    try:
        body = [_k_int(wave), _opt_int(exclude_engine_index)]
    except _Bad as exc:
        raise LocalProtocolError(f"START_DP_WAVE: {exc}") from None
    return _pack(body)


def encode_utility_call(client_index: int, call_id: int, method: str, args: Sequence[Any] = ()) -> bytes:
    """UTILITY payload ``[client_index, call_id, method, [args...]]``.

    ``call_id`` is any int msgpack can carry; vLLM's own client uses
    ``uuid1().int >> 64``, often >= 2**63, which travels as uint64 (``cf``).
    Raises LocalProtocolError for wrong types or an out-of-range int.
    """
    try:
        body = [_k_int(client_index), _k_int(call_id), _k_str(method), _to_wire(list(args))]
    except _Bad as exc:
        raise LocalProtocolError(f"UTILITY: {exc}") from None
    return _pack(body)
