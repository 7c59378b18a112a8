"""Sans-IO codec of the vLLM v1 EngineCore wire (vLLM 0.32.0; 0.33.0 tolerated).

Everything here turns typed values into frames and frames into typed values; nothing
touches a socket. Sources of the format (facts, not code): ``docs/vllm-wire.md`` §5,
and the golden vectors of vLLM's own encoder
(``tests/wire/vectors/vllm_0.32.0.json``), which :func:`encode_request`,
:func:`encode_outputs` and the handshake encoders reproduce byte for byte.

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
from typing import Any, Callable, Iterable, Sequence

import attrs
import cattrs

from zmqdispatch import limits as _limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.wire.tensors import Tensor, check_tensor, decode_tensor, encode_tensor
from ._fields import (
    ENGINE_CORE_DEAD,
    _unpack_output_message,
    is_dead_sentinel,
    _Bad,
    _tname,
    _pack,
    _unpack,
    _k_any,
    _k_int,
    _k_float,
    _k_bool,
    _k_str,
    _k_map,
    _k_opt,
    _k_seq,
    _conv_float,
    _conv_tuple,
    _conv_nested_tuple,
)


__all__ = [
    # constants and enums
    "RequestType",
    "ENGINE_CORE_DEAD",
    "FinishReason",
    "EventType",
    "RequestOutputKind",
    "parse_request_type",
    # requests
    "StructuredOutputsParams",
    "RepetitionDetectionParams",
    "SamplingParams",
    "set_order",
    "EngineCoreRequest",
    "REQUEST_MIN_FIELDS",
    "encode_request",
    "decode_request",
    "encode_abort",
    "decode_abort",
    "encode_start_dp_wave",
    "decode_start_dp_wave",
    "UtilityCall",
    "encode_utility_call",
    "decode_utility_call",
    # outputs
    "ROW_LEN",
    "O_REQUEST_ID",
    "O_NEW_TOKEN_IDS",
    "O_NEW_LOGPROBS",
    "O_NEW_PROMPT_LOGPROBS",
    "O_POOLING_OUTPUT",
    "O_FINISH_REASON",
    "O_STOP_REASON",
    "O_EVENTS",
    "O_KV_TRANSFER_PARAMS",
    "O_EC_TRANSFER_PARAMS",
    "O_TRACE_HEADERS",
    "O_PREFILL_STATS",
    "O_ROUTED_EXPERTS",
    "O_NUM_NANS",
    "O_MM_CACHE_MISS_HASHES",
    "O_NEW_SAMPLING_MASK",
    "O_SPEC_DECODE_METRICS",
    "O_PROMPT_TOKEN_ID_LOGPROBS",
    "O_ERROR",
    "output_error",
    "UtilityResult",
    "UtilityOutput",
    "EngineCoreOutputs",
    "is_dead_sentinel",
    "decode_outputs",
    "LogprobsLists",
    "decode_logprobs_lists",
    "decode_logprobs_tensors",
    "PrefillStats",
    "msgpack_array_header",
    "EngineCoreEvent",
    "OutputError",
    "EngineCoreOutput",
    "encode_outputs",
    "encode_utility_output",
    # handshake
    "HandshakeStatus",
    "encode_hello",
    "encode_ready",
    "decode_handshake_status",
    "HandshakeInit",
    "encode_init",
    "decode_init",
    "EngineCoreReadyResponse",
    "encode_ready_response",
    "decode_ready_response",
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

#: The fatal-error sentinel: one raw 16-byte frame (not msgpack) on the output socket.


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


def parse_request_type(frame: bytes) -> RequestType:
    """Read the request-type frame of an input message (used by the mock engine).

    Raises:
        RemoteProtocolError: the frame is not exactly one byte in 0..3.
    """
    if len(frame) != 1 or frame[0] > 3:
        raise RemoteProtocolError(f"invalid request type frame {bytes(frame)[:8]!r}")
    return RequestType(frame[0])


# =========================================================================== helpers


def msgpack_array_header(n: int) -> bytes:
    """The msgpack header of an *n*-element array (fixarray, array 16 or array 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _pack_omit_defaults_map(m: dict) -> bytes:
    # msgspec writes an omit_defaults Struct as a map with a map16 header ("de" + count)
    # whatever the count, since it only knows the count after writing the fields (it
    # patches the reserved header). Vectors: "de0006" for a 6-key SamplingParams where
    # plain msgpack would write fixmap "86".
    n = len(m)
    head = b"\xde" + n.to_bytes(2, "big") if n < 0x10000 else b"\xdf" + n.to_bytes(4, "big")
    return head + b"".join(_pack(k) + _pack(v) for k, v in m.items())






# Field "kinds": each checks one decoded value and returns it normalised (or raises
# _Bad). The same kinds validate what callers hand to the encoders, so a value that
# encodes also decodes. bool is never accepted where an int is expected (msgspec
# refuses it too), an int is accepted where a float is expected and widened.


















def _k_enum(cls: type[enum.IntEnum]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        try:
            return cls(_k_int(v))
        except ValueError:
            raise _Bad(f"{v!r} is not a valid {cls.__name__}") from None

    return check


def _k_str_or_strs(v: Any) -> tuple:
    # vLLM's stop / bad_words accept nil, a str or a list of str; __post_init__ lists them.
    if v is None:
        return ()
    return (v,) if type(v) is str else _k_seq(_k_str)(v)


def _k_ids_or_nil(v: Any) -> tuple:
    # stop_token_ids: nil becomes [] in vLLM's __post_init__.
    return () if v is None else _int_seq(v)


_opt_int = _k_opt(_k_int)
_int_seq = _k_seq(_k_int)


def _to_wire(v: Any) -> Any:
    """Plain msgpack-ready value: attrs wire types to maps, enums to ints, tuples to lists."""
    if v is None or type(v) in (int, float, str, bool, bytes):
        return v
    to_map = getattr(v, "_to_wire", None)
    if to_map is not None:
        return to_map()
    if isinstance(v, enum.IntEnum):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    return v


def _field(default: Any = attrs.NOTHING, kind: Callable = _k_any, *, wire: str | None = None,
           always: bool = False, converter: Callable | None = None) -> Any:
    """attrs field carrying its wire key, value kind and "always written" flag."""
    md = {"kind": kind, "wire": wire, "always": always}
    return attrs.field(default=default, metadata=md, converter=converter)


def _spec(cls: type) -> list[tuple[str, str, Any, Callable, bool]]:
    """(attr name, wire key, default, kind, always) per field, in declaration order."""
    cached = cls.__dict__.get("_wire_spec_cache")
    if cached is None:
        cached = [
            (f.name, f.metadata.get("wire") or f.name, f.default, f.metadata["kind"], f.metadata.get("always", False))
            for f in attrs.fields(cls)
        ]
        type.__setattr__(cls, "_wire_spec_cache", cached)
    return cached


def _struct_from_map(cls: type, m: Any) -> Any:
    """A map-encoded struct: known keys checked, unknown keys ignored, missing keys
    defaulted (a missing key without a default is an error). Raises _Bad."""
    if type(m) is not dict:
        raise _Bad(f"expected a map, got {_tname(m)}")
    kwargs = {}
    for name, wire, default, kind, _always in _spec(cls):
        if wire in m:
            try:
                kwargs[name] = kind(m[wire])
            except _Bad as exc:
                raise _Bad(f"{wire}: {exc}") from None
        elif default is attrs.NOTHING:
            raise _Bad(f"{wire}: missing")
    return cls(**kwargs)


def _struct_to_map(obj: Any, *, omit_defaults: bool) -> dict:
    """The map form of a wire struct, in declaration order. Raises _Bad."""
    out = {}
    for name, wire, default, kind, always in _spec(type(obj)):
        v = getattr(obj, name)
        try:
            v = kind(v)
            if omit_defaults and not always and v == default and type(v) is type(default):
                continue
            out[wire] = _to_wire(v)
        except _Bad as exc:
            raise _Bad(f"{wire}: {exc}") from None
    return out






def _conv_tuple_or_empty(v: Any) -> Any:
    # vLLM's __post_init__ turns None into [] and a lone str into [str].
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return _conv_tuple(v)




def _conv_logit_bias(v: Any) -> Any:
    return {k: _conv_float(x) for k, x in v.items()} if isinstance(v, dict) else v


def _wrap_map_struct(cls: type, what: str) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if isinstance(v, cls):
            return v
        return _struct_from_map(cls, v)

    check.__name__ = f"_k_{what}"
    return check


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

    json: str | dict | None = _field(None, _k_opt(lambda v: v if type(v) in (str, dict) else _k_str(v)))
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

    def _to_wire(self) -> dict:
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

    def _to_wire(self) -> dict:
        return _struct_to_map(self, omit_defaults=False)


def _k_logit_bias(v: Any) -> dict:
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
    all_stop_token_ids: tuple[int, ...] = _field((), _int_seq, wire="_all_stop_token_ids", converter=_conv_tuple_or_empty)
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

    def _to_wire(self) -> dict:
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


def _prep(v: Any, aux: list) -> Any:
    """Wire form of an opaque field value, routing any Tensor inside through the codec."""
    if v is None or type(v) in (int, float, str, bool):
        return v
    if isinstance(v, Tensor):
        return encode_tensor(v.dtype, v.shape, v.data, aux, torch=v.is_torch)
    if isinstance(v, (list, tuple)):
        return [_prep(x, aux) for x in v]
    if isinstance(v, dict):
        return {k: _prep(x, aux) for k, x in v.items()}
    return _to_wire(v)


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
                parts.append(_pack_omit_defaults_map(v._to_wire()))
            except _Bad as exc:
                raise LocalProtocolError(f"sampling_params: {exc}") from None
        else:
            parts.append(_pack(_prep(v, aux)))
    return [b"".join(parts), *aux]


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


def decode_abort(payload: bytes) -> tuple[str, ...]:
    """Decode an ABORT payload into request ids. Raises RemoteProtocolError."""
    obj = _unpack(payload, "ABORT")
    if type(obj) is not list or not all(type(r) is str for r in obj):
        raise RemoteProtocolError("ABORT: expected an array of str request ids")
    return tuple(obj)


def encode_start_dp_wave(wave: int, exclude_engine_index: int | None = None) -> bytes:
    """START_DP_WAVE payload ``[wave, exclude_engine_index|nil]`` (MoE data parallel only)."""
    try:
        body = [_k_int(wave), _opt_int(exclude_engine_index)]
    except _Bad as exc:
        raise LocalProtocolError(f"START_DP_WAVE: {exc}") from None
    return _pack(body)


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


# =========================================================================== outputs

# Positions in a raw EngineCoreOutput row (vLLM 0.32.0 order; O_ERROR is 0.33.0's #18).
O_REQUEST_ID = 0
O_NEW_TOKEN_IDS = 1
O_NEW_LOGPROBS = 2
O_NEW_PROMPT_LOGPROBS = 3
O_POOLING_OUTPUT = 4
O_FINISH_REASON = 5
O_STOP_REASON = 6
O_EVENTS = 7
O_KV_TRANSFER_PARAMS = 8
O_EC_TRANSFER_PARAMS = 9
O_TRACE_HEADERS = 10
O_PREFILL_STATS = 11
O_ROUTED_EXPERTS = 12
O_NUM_NANS = 13
O_MM_CACHE_MISS_HASHES = 14
O_NEW_SAMPLING_MASK = 15
O_SPEC_DECODE_METRICS = 16
O_PROMPT_TOKEN_ID_LOGPROBS = 17
O_ERROR = 18

#: Every decoded row has at least this many elements (vLLM 0.32.0's 18), so every
#: ``O_*`` position but ``O_ERROR`` is always readable; ``O_ERROR`` (0.33.0's 19th
#: element) is present only when the engine sent it: read it with :func:`output_error`.
ROW_LEN = 18
# vLLM's defaults for each position (0 and 1 are required, never padded).
_ROW_DEFAULTS: tuple[Any, ...] = (None,) * O_NUM_NANS + (0,) + (None,) * (ROW_LEN - O_NUM_NANS - 1)
# _ROW_PADS[n] is the tail that pads an n-element row to ROW_LEN (precomputed: only rows
# shorter than 0.32.0's are padded, with one tuple concatenation; full rows are kept as
# msgpack built them, no per-row copy).
_ROW_PADS: tuple[tuple[Any, ...], ...] = tuple(_ROW_DEFAULTS[n:] for n in range(ROW_LEN))


def output_error(row: tuple[Any, ...]) -> Any:
    """A decoded row's ``error`` (vLLM 0.33.0 ``EngineCoreOutput.error``, a map) or
    ``None`` when the row has no such element (0.32.0) or it is nil."""
    return row[O_ERROR] if len(row) > O_ERROR else None
# EngineCoreOutputs envelope defaults: engine_index .. weight_version.
_ENVELOPE_DEFAULTS: tuple[Any, ...] = (0, (), None, 0.0, None, None, None, None, None)
_ENVELOPE_LEN = len(_ENVELOPE_DEFAULTS)


@attrs.frozen
class UtilityResult:
    """``UtilityOutput.result``, on the wire ``[type_info|nil, value]``.

    ``type_info`` is nil unless the engine runs with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
    (then it names Python classes to rebuild; we keep it but never act on it).
    """

    value: Any
    type_info: Any = None


@attrs.frozen(kw_only=True)
class UtilityOutput:
    """vLLM ``UtilityOutput`` (array_like): ``[call_id, failure_message|nil, result|nil]``.

    ``failure_message`` is set when the call failed (e.g. ``"Call to <m> method failed:
    ..."``, ``"Server shutting down"``); ``result`` is ``None`` then.
    """

    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None

    def _to_wire(self) -> list:
        result = None if self.result is None else [_to_wire(self.result.type_info), _to_wire(self.result.value)]
        return [_k_int(self.call_id), _k_opt(_k_str)(self.failure_message), result]


def _decode_utility_output(raw: Any) -> UtilityOutput:
    if type(raw) is not tuple or not raw or type(raw[0]) is not int:
        raise RemoteProtocolError("EngineCoreOutputs.utility_output: expected [call_id, failure_message, result]")
    failure = raw[1] if len(raw) > 1 else None
    if failure is not None and type(failure) is not str:
        raise RemoteProtocolError("EngineCoreOutputs.utility_output.failure_message: expected a str or nil")
    result = raw[2] if len(raw) > 2 else None
    if result is not None:
        if type(result) is not tuple or len(result) != 2:
            raise RemoteProtocolError("EngineCoreOutputs.utility_output.result: expected [type_info, value]")
        result = UtilityResult(result[1], result[0])
    return UtilityOutput(call_id=raw[0], failure_message=failure, result=result)


@attrs.define(slots=True)
class EngineCoreOutputs:
    """One decoded output message (vLLM ``EngineCoreOutputs``, array_like, 9 fields).

    Attributes:
        engine_index: the sending engine's index (DP rank).
        outputs: raw ``EngineCoreOutput`` rows, each a tuple of at least :data:`ROW_LEN`
            elements indexed with the ``O_*`` constants (``O_ERROR``: :func:`output_error`). Checked: ``[O_REQUEST_ID]`` str,
            ``[O_NEW_TOKEN_IDS]`` tuple of non-negative ints (the step's *new* tokens),
            ``[O_FINISH_REASON]`` nil or 0..4, ``[O_STOP_REASON]`` nil/int/str,
            ``[O_PREFILL_STATS]`` nil or map. Other positions are raw msgpack values
            (logprobs: see :func:`decode_logprobs_lists`).
        scheduler_stats: the SchedulerStats map (only with log_stats) or None.
        timestamp: the engine's ``time.monotonic()`` in seconds, not wall clock.
        utility_output: the reply to a UTILITY call, or None.
        finished_requests: ids the engine finished itself (set; DP coordinator present, or
            engine-generated abort/error), or None.
        wave_complete / start_wave: MoE-DP wave control, or None.
        weight_version: ``"default"`` on step outputs, None on utility/abort/error messages.
        frames: the message's frames, to resolve aux-frame tensors lazily.
        bad_rows: rows that failed the checks above, as ``(request_id or None,
            RemoteProtocolError)``: one bad row does not sink the others, and
            the caller can fail exactly the request it belonged to (or, with no
            readable id, every request that got no valid row).
    """

    engine_index: int = 0
    outputs: tuple[tuple[Any, ...], ...] = ()
    scheduler_stats: dict | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: tuple[str, ...] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None
    frames: Sequence[bytes] = ()
    bad_rows: tuple[tuple[str | None, RemoteProtocolError], ...] = ()


def _bad_output(i: int, what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"EngineCoreOutputs.outputs[{i}].{what}")


def decode_outputs(frames: Sequence[bytes]) -> EngineCoreOutputs:
    """Decode one output message ``[payload, *aux]`` (the hot path: once per engine step).

    Wire format: vLLM 0.32.0 ``vllm/v1/engine/__init__.py`` ``EngineCoreOutputs`` /
    ``EngineCoreOutput`` (array_like). One ``msgpack.unpackb`` (arrays as tuples) plus
    one loop over the rows; no per-token objects, no per-row copy. Envelopes shorter
    than 9 elements (at least 2) take vLLM's defaults; longer ones are accepted. Rows
    shorter than :data:`ROW_LEN` (0.32.0's 18) are padded with vLLM's defaults; full
    rows (18, or 0.33.0's 19 with ``error``) and longer ones are kept as they are.

    Raises:
        RemoteProtocolError: the ``ENGINE_CORE_DEAD`` sentinel (check
            :func:`is_dead_sentinel` first), no frames, a frame over
            ``limits.MAX_FRAME_BYTES``, undecodable msgpack, a pickle/unknown ext type,
            or a field of the wrong shape (message names it). More than
            ``limits.MAX_OUTPUTS_PER_MESSAGE`` rows or ``limits.MAX_TOKENS_PER_TICK``
            tokens in one row is also refused.
    """
    obj = _unpack_output_message(frames, "EngineCoreOutputs")
    if type(obj) is not tuple or len(obj) < 2:
        raise RemoteProtocolError("EngineCoreOutputs: expected an array of >= 2 elements")
    n = len(obj)
    if n != _ENVELOPE_LEN:
        obj = obj[:_ENVELOPE_LEN] if n > _ENVELOPE_LEN else obj + _ENVELOPE_DEFAULTS[n:]
    engine_index, rows, stats, timestamp, utility, finished, wave_complete, start_wave, weight_version = obj

    if type(engine_index) is not int:
        raise RemoteProtocolError("EngineCoreOutputs.engine_index: expected an int")
    if type(rows) is not tuple:
        raise RemoteProtocolError("EngineCoreOutputs.outputs: expected an array")
    if len(rows) > _limits.MAX_OUTPUTS_PER_MESSAGE:
        raise RemoteProtocolError(f"EngineCoreOutputs.outputs: {len(rows)} rows exceed MAX_OUTPUTS_PER_MESSAGE")
    if stats is not None and type(stats) is not dict:
        raise RemoteProtocolError("EngineCoreOutputs.scheduler_stats: expected a map or nil")
    if type(timestamp) is not float:
        if type(timestamp) is not int:
            raise RemoteProtocolError("EngineCoreOutputs.timestamp: expected a float")
        timestamp = float(timestamp)
    if utility is not None:
        utility = _decode_utility_output(utility)
    if finished is not None:
        if type(finished) is not tuple or not all(type(r) is str for r in finished):
            raise RemoteProtocolError("EngineCoreOutputs.finished_requests: expected an array of str or nil")
    if wave_complete is not None and type(wave_complete) is not int:
        raise RemoteProtocolError("EngineCoreOutputs.wave_complete: expected an int or nil")
    if start_wave is not None and type(start_wave) is not int:
        raise RemoteProtocolError("EngineCoreOutputs.start_wave: expected an int or nil")
    if weight_version is not None and type(weight_version) is not str:
        raise RemoteProtocolError("EngineCoreOutputs.weight_version: expected a str or nil")

    # The per-row loop: type() identity tests only, locals for every global, no
    # per-token objects, and no copy of the rows while they are all well formed
    # (msgpack's tuple is kept; a list is started only at the first padded or bad
    # row). Error messages are built only on failure; a bad row is set aside (with
    # its request id when readable), the others go on.
    max_tokens = _limits.MAX_TOKENS_PER_TICK
    max_id = _limits.MAX_TOKEN_ID
    row_len = ROW_LEN
    _tuple, _int, _str, _dict = tuple, int, str, dict
    out: list[tuple[Any, ...]] | None = None
    bad: list[tuple[str | None, RemoteProtocolError]] | None = None
    for i, row in enumerate(rows):
        # The accepted shape is tested first, in one expression per field; the
        # problem is worked out only for a row that fails it.
        if type(row) is _tuple and len(row) >= row_len and type(row[0]) is _str:
            toks = row[1]
            if type(toks) is _tuple and len(toks) <= max_tokens:
                for t in toks:
                    if type(t) is not _int or t < 0 or t > max_id:
                        break
                else:
                    fr = row[5]
                    sr = row[6]
                    ps = row[11]
                    if (
                        (fr is None or (type(fr) is _int and 0 <= fr <= 4))
                        and (sr is None or type(sr) is _str or (type(sr) is _int and 0 <= sr <= max_id))
                        and (ps is None or (type(ps) is _dict and _prefill_stats_ok(ps, max_id)))
                    ):
                        if out is not None:
                            out.append(row)
                        continue
        if out is None:
            out = list(rows[:i])
        problem = _row_problem(row, max_tokens, max_id)
        if type(problem) is _tuple:
            out.append(problem)  # a short row, padded with vLLM's defaults
            continue
        rid = row[0] if type(row) is _tuple and row and type(row[0]) is _str else None
        (bad := bad or []).append((rid, _bad_output(i, problem)))

    return EngineCoreOutputs(
        engine_index,
        rows if out is None else tuple(out),
        stats,
        timestamp,
        utility,
        finished,
        wave_complete,
        start_wave,
        weight_version,
        frames,
        tuple(bad) if bad else (),
    )


def _row_problem(row: Any, max_tokens: int, max_id: int) -> Any:
    """An output row that :func:`decode_outputs`' fast test did not accept: the
    row padded to :data:`ROW_LEN` if it is only short, else what is wrong (str)."""
    if type(row) is not tuple or len(row) < 2:
        return "row: expected an array of >= 2 elements"
    if type(row[0]) is not str:
        return "request_id: expected a str"
    toks = row[1]
    if type(toks) is not tuple or len(toks) > max_tokens:
        return f"new_token_ids: expected an array of at most {max_tokens} ints"
    for t in toks:
        if type(t) is not int or t < 0 or t > max_id:
            return f"new_token_ids: {t!r} is not a token id (0..{max_id})"
    if len(row) < ROW_LEN:
        row += _ROW_PADS[len(row)]
    fr = row[O_FINISH_REASON]
    if fr is not None and (type(fr) is not int or fr < 0 or fr > 4):
        return f"finish_reason: {fr!r} is not nil or 0..4"
    sr = row[O_STOP_REASON]
    if sr is not None and type(sr) is not str and (type(sr) is not int or sr < 0 or sr > max_id):
        return "stop_reason: expected nil, a token id or a str"
    ps = row[O_PREFILL_STATS]
    if ps is not None and (type(ps) is not dict or not _prefill_stats_ok(ps, max_id)):
        return "prefill_stats: expected nil or a map of non-negative int counts"
    return row


def _prefill_stats_ok(ps: dict, max_count: int) -> bool:
    for key in ("num_prompt_tokens", "num_cached_tokens"):
        v = ps.get(key)
        if v is not None and (type(v) is not int or v < 0 or v > max_count):
            return False
    return True


# --------------------------------------------------------------------------- logprobs


@attrs.define(slots=True)
class LogprobsLists:
    """Logprobs of N positions as Python lists (vLLM ``LogprobsLists`` / ``LogprobsTensors``).

    Attributes:
        token_ids: N rows of K+1 token ids; column 0 is the sampled token (for prompt
            logprobs: the actual prompt token), columns 1..K the top-K in rank order.
        logprobs: N rows of K+1 float32 log-probabilities, aligned with ``token_ids``.
        ranks: N vocabulary ranks (>= 1) of the column-0 token.
        cu_num_generated_tokens: vLLM's batch offsets; nil for per-request outputs.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    cu_num_generated_tokens: list[int] | None = None


def _decode_logprobs(raw: Any, frames: Sequence[Any], field: str) -> LogprobsLists:
    if type(raw) not in (tuple, list) or len(raw) < 3:
        raise RemoteProtocolError(f"{field}: expected a [token_ids, logprobs, ranks, ...] array")
    ids = decode_tensor(raw[0], frames, field=f"{field}.logprob_token_ids")
    lps = decode_tensor(raw[1], frames, field=f"{field}.logprobs")
    ranks = decode_tensor(raw[2], frames, field=f"{field}.ranks")
    if ids.info.kind not in "iu" or ranks.info.kind not in "iu" or lps.info.kind != "f":
        raise RemoteProtocolError(f"{field}: expected int ids, float logprobs and int ranks")
    if len(ids.shape) != 2 or ids.shape != lps.shape or len(ranks.shape) != 1 or ranks.shape[0] != ids.shape[0]:
        raise RemoteProtocolError(
            f"{field}: shapes disagree: ids {list(ids.shape)}, logprobs {list(lps.shape)}, ranks {list(ranks.shape)}"
        )
    cu = raw[3] if len(raw) > 3 else None
    if cu is not None:
        if type(cu) not in (tuple, list) or not all(type(x) is int for x in cu):
            raise RemoteProtocolError(f"{field}.cu_num_generated_tokens: expected an array of int or nil")
        cu = list(cu)
    return LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist(), cu)


def decode_logprobs_lists(raw: Any, frames: Sequence[bytes]) -> LogprobsLists:
    """Decode ``row[O_NEW_LOGPROBS]`` (sample logprobs) into lists.

    Wire: vLLM 0.32.0 ``LogprobsLists`` NamedTuple as an array ``[ids ndarray int32 [n, k+1],
    logprobs ndarray float32 [n, k+1], ranks ndarray int64 [n], cu_num_generated_tokens|nil]``,
    each array inline (ext 3) or in an aux frame of ``frames``.

    Raises:
        RemoteProtocolError: malformed tensors, or shapes that disagree (rows and columns).
    """
    return _decode_logprobs(raw, frames, "new_logprobs")


def decode_logprobs_tensors(raw: Any, frames: Sequence[bytes]) -> LogprobsLists:
    """Decode ``row[O_NEW_PROMPT_LOGPROBS]`` (prompt logprobs) into lists.

    Wire: vLLM 0.32.0 ``LogprobsTensors`` NamedTuple ``[ids tensor int32 [P-1, k+1],
    logprobs tensor float32 [P-1, k+1], ranks tensor int32 [P-1], nil, nil]`` (torch dtype
    names). Row i scores prompt token i+1. Raises RemoteProtocolError like
    :func:`decode_logprobs_lists`.
    """
    return _decode_logprobs(raw, frames, "new_prompt_logprobs_tensors")


def _encode_logprobs(lp: LogprobsLists, aux: list, *, tensors: bool) -> list:
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
    body = [
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

    def _to_wire(self) -> dict:
        return _struct_to_map(self, omit_defaults=False)


@attrs.frozen(kw_only=True)
class EngineCoreEvent:
    """``EngineCoreOutput.events`` entry ``{"type": 1|2|3, "timestamp": monotonic float}``."""

    type: EventType = _field(kind=_k_enum(EventType))
    timestamp: float = _field(kind=_k_float, converter=_conv_float)

    def _to_wire(self) -> dict:
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

    def _to_wire(self) -> dict:
        return _struct_to_map(self, omit_defaults=False)


@attrs.define(kw_only=True, slots=True)
class EngineCoreOutput:
    """One request's output of one step (vLLM 0.32.0 ``EngineCoreOutput``, 18 fields).

    Used to *encode* outputs (mock engine, tests) and by :meth:`from_row` for a typed
    view of a decoded row; the router reads raw rows instead. ``new_token_ids`` holds
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
    def from_row(cls, row: Sequence[Any], frames: Sequence[bytes]) -> "EngineCoreOutput":
        """Typed view of a raw row from :func:`decode_outputs` (not for the hot path).

        Logprobs become :class:`LogprobsLists`, tensors :class:`Tensor`, maps their attrs
        types. Raises RemoteProtocolError for a malformed field.
        """
        if len(row) < 2:
            raise RemoteProtocolError("EngineCoreOutput: expected >= 2 elements")
        row = tuple(row) + _ROW_DEFAULTS[len(row):]

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
            "events", lambda v: [_struct_from_map(EngineCoreEvent, e) for e in _k_seq(_k_any)(v)], row[O_EVENTS]
        )
        fr = row[O_FINISH_REASON]
        return cls(
            request_id=row[O_REQUEST_ID],
            new_token_ids=row[O_NEW_TOKEN_IDS],
            new_logprobs=None if row[2] is None else decode_logprobs_lists(row[2], frames),
            new_prompt_logprobs_tensors=None if row[3] is None else decode_logprobs_tensors(row[3], frames),
            pooling_output=tensor("pooling_output", row[O_POOLING_OUTPUT]),
            finish_reason=None if fr is None else FinishReason(fr),
            stop_reason=row[O_STOP_REASON],
            events=events,
            kv_transfer_params=row[O_KV_TRANSFER_PARAMS],
            ec_transfer_params=row[O_EC_TRANSFER_PARAMS],
            trace_headers=row[O_TRACE_HEADERS],
            prefill_stats=typed("prefill_stats", lambda v: _struct_from_map(PrefillStats, v), row[O_PREFILL_STATS]),
            routed_experts=tensor("routed_experts", row[O_ROUTED_EXPERTS]),
            num_nans_in_logits=typed("num_nans_in_logits", _k_int, row[O_NUM_NANS]),
            mm_cache_miss_hashes=row[O_MM_CACHE_MISS_HASHES],
            new_sampling_mask=row[O_NEW_SAMPLING_MASK],
            spec_decode_metrics=row[O_SPEC_DECODE_METRICS],
            prompt_token_id_logprobs=tensor("prompt_token_id_logprobs", row[O_PROMPT_TOKEN_ID_LOGPROBS]),
            error=typed("error", lambda v: _struct_from_map(OutputError, v), output_error(row)),
        )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _encode_output(o: EngineCoreOutput, aux: list, with_error: bool) -> list:
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
            None if utility_output is None else utility_output._to_wire(),
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


# =========================================================================== handshake


@attrs.frozen(kw_only=True)
class HandshakeStatus:
    """HELLO / READY on the handshake socket (engine -> front-end), a plain map.

    ``local=True, headless=False`` for a co-located engine, ``local=False,
    headless=True`` for ``vllm serve --headless``. ``parallel_config_hash`` only with
    MoE DP > 1. Extra keys (elastic EP) are ignored.
    """

    status: str
    local: bool = False
    headless: bool = False
    parallel_config_hash: str | None = None


def _encode_status(status: str, local: bool, headless: bool, parallel_config_hash: str | None) -> bytes:
    try:
        body: dict[str, Any] = {"status": status, "local": _k_bool(local), "headless": _k_bool(headless)}
        if parallel_config_hash is not None:
            body["parallel_config_hash"] = _k_str(parallel_config_hash)
    except _Bad as exc:
        raise LocalProtocolError(f"handshake {status}: {exc}") from None
    return _pack(body)


def encode_hello(local: bool, headless: bool) -> bytes:
    """HELLO map ``{"status": "HELLO", "local": .., "headless": ..}`` (plain msgspec map)."""
    return _encode_status("HELLO", local, headless, None)


def encode_ready(local: bool, headless: bool, parallel_config_hash: str | None = None) -> bytes:
    """READY map; ``parallel_config_hash`` is only added when given (MoE DP > 1)."""
    return _encode_status("READY", local, headless, parallel_config_hash)


def decode_handshake_status(payload: bytes) -> HandshakeStatus:
    """Decode HELLO/READY. ``status`` is required; ``local``/``headless`` default False.

    Raises:
        RemoteProtocolError: not a map, no str ``status``, or a key of the wrong type.
    """
    obj = _unpack(payload, "handshake message")
    if type(obj) is not dict:
        raise RemoteProtocolError("handshake message: expected a map")
    status = obj.get("status")
    if type(status) is not str:
        raise RemoteProtocolError("handshake message: missing str 'status'")
    try:
        local = _k_bool(obj.get("local", False))
        headless = _k_bool(obj.get("headless", False))
        pch = _k_opt(_k_str)(obj.get("parallel_config_hash"))
    except _Bad as exc:
        raise RemoteProtocolError(f"handshake message: {exc}") from None
    return HandshakeStatus(status=status, local=local, headless=headless, parallel_config_hash=pch)


@attrs.frozen(kw_only=True)
class HandshakeInit:
    """The front-end's reply to HELLO (vLLM ``EngineHandshakeMetadata``).

    ``inputs[i]`` / ``outputs[i]`` are the sockets of front-end client i (an engine's
    ``client_index`` selects ``outputs[i]``); ``parallel_config`` is ``{}`` except for
    MoE DP.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None
    parallel_config: dict[str, Any] = attrs.field(factory=dict)


def encode_init(
    inputs: Sequence[str],
    outputs: Sequence[str],
    coordinator_input: str | None = None,
    coordinator_output: str | None = None,
    frontend_stats_publish_address: str | None = None,
    parallel_config: dict[str, Any] | None = None,
) -> bytes:
    """INIT map ``{"addresses": {inputs, outputs, coordinator_input, coordinator_output,
    frontend_stats_publish_address}, "parallel_config": {...}}``, all keys written.

    Raises LocalProtocolError for non-str addresses.
    """
    try:
        addresses = {
            "inputs": list(_k_seq(_k_str)(list(inputs))),
            "outputs": list(_k_seq(_k_str)(list(outputs))),
            "coordinator_input": _k_opt(_k_str)(coordinator_input),
            "coordinator_output": _k_opt(_k_str)(coordinator_output),
            "frontend_stats_publish_address": _k_opt(_k_str)(frontend_stats_publish_address),
        }
        pc = _k_map({} if parallel_config is None else parallel_config)
    except _Bad as exc:
        raise LocalProtocolError(f"handshake INIT: {exc}") from None
    return _pack({"addresses": addresses, "parallel_config": pc})


def decode_init(payload: bytes) -> HandshakeInit:
    """Decode INIT (used by the mock engine). ``addresses.inputs``/``outputs`` required.

    Raises RemoteProtocolError.
    """
    obj = _unpack(payload, "handshake INIT")
    addr = obj.get("addresses") if type(obj) is dict else None
    if type(addr) is not dict:
        raise RemoteProtocolError("handshake INIT: expected a map with an 'addresses' map")
    try:
        return HandshakeInit(
            inputs=_k_seq(_k_str)(addr.get("inputs")),
            outputs=_k_seq(_k_str)(addr.get("outputs")),
            coordinator_input=_k_opt(_k_str)(addr.get("coordinator_input")),
            coordinator_output=_k_opt(_k_str)(addr.get("coordinator_output")),
            frontend_stats_publish_address=_k_opt(_k_str)(addr.get("frontend_stats_publish_address")),
            parallel_config=_k_map(obj.get("parallel_config", {})),
        )
    except _Bad as exc:
        raise RemoteProtocolError(f"handshake INIT: {exc}") from None


def _positive(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class EngineCoreReadyResponse:
    """The engine's first message on each input socket (vLLM ``EngineCoreReadyResponse``).

    A full map, in this field order (vLLM 0.32.0, byte-checked against a real engine).
    ``max_model_len`` (tokens, > 0) is the only required key: it bounds prompt +
    ``max_tokens``. Missing keys take the defaults below, unknown keys (0.33.0's
    ``coord_store_port``/``coordinator_*_address``, TokenSpeed's extras) are ignored,
    and TokenSpeed's ``prefix_granularity`` is read as ``block_size``.
    ``data_parallel_size > 1`` means MoE lock-step waves. ``max_num_batched_tokens`` is
    signed (TokenSpeed sends -1).
    """

    max_model_len: int = attrs.field(validator=_positive)
    num_gpu_blocks: int = 0
    block_size: int = 0
    dp_stats_address: str | None = None
    dtype: str = ""
    vllm_version: str = ""
    world_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_rank: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    instance_id: str = ""
    supports_lora: bool = False
    max_loras: int = 0
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None


def _strict(kind: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(v: Any, _type: Any) -> Any:
        try:
            return kind(v)
        except _Bad as exc:
            raise TypeError(str(exc)) from None

    return hook


# cattrs belongs here (handshake/config), not on the per-tick path. Its default
# hooks call int()/str() and would turn 1.5 into 1 or 5 into "5"; these are strict.
_handshake_converter = cattrs.Converter(forbid_extra_keys=False)
_handshake_converter.register_structure_hook(int, _strict(_k_int))
_handshake_converter.register_structure_hook(float, _strict(_k_float))
_handshake_converter.register_structure_hook(bool, _strict(_k_bool))
_handshake_converter.register_structure_hook(str, _strict(_k_str))


def encode_ready_response(resp: EngineCoreReadyResponse) -> bytes:
    """The ready-response map, every field in declaration order (vector
    ``handshake_ready_response``). Raises LocalProtocolError if a value cannot be packed."""
    body = _handshake_converter.unstructure(resp)
    if type(body.get("kv_cache_max_concurrency")) is int:
        body["kv_cache_max_concurrency"] = float(body["kv_cache_max_concurrency"])
    return _pack(body)


def decode_ready_response(payload: bytes) -> EngineCoreReadyResponse:
    """Decode the ready response an engine sends on the input socket.

    Raises:
        RemoteProtocolError: not a map, ``max_model_len`` missing / not an int > 0, or a
            known key of the wrong type (message lists the offending paths).
    """
    obj = _unpack(payload, "EngineCoreReadyResponse")
    if type(obj) is not dict:
        raise RemoteProtocolError("EngineCoreReadyResponse: expected a map")
    mml = obj.get("max_model_len")
    if type(mml) is not int or mml <= 0:
        raise RemoteProtocolError(f"EngineCoreReadyResponse.max_model_len: expected an int > 0, got {mml!r}")
    if "block_size" not in obj and "prefix_granularity" in obj:
        obj = dict(obj, block_size=obj["prefix_granularity"])
    try:
        return _handshake_converter.structure(obj, EngineCoreReadyResponse)
    except Exception as exc:  # cattrs ClassValidationError (an ExceptionGroup) and friends
        try:
            detail = "; ".join(cattrs.transform_error(exc))
        except Exception:
            detail = str(exc)
        raise RemoteProtocolError(f"EngineCoreReadyResponse: {detail}") from None
