"""Client side of the SGLang scheduler's msgpack ZMQ wire (SGLang 0.5.21), sans-IO.

An SGLang scheduler joins this transport through the reference gateway's SGLang
plugin (``smg-grpc-servicer`` 0.14.1, ``smg_grpc_servicer/sglang/zmq_msgpack.py``):
the plugin runs the handshake inside the scheduler process, decodes ADD payloads
with SGLang's own ``io_struct`` classes and slices each step's output into a slim
batch. ``docs/sglang.md`` describes the whole wire; this module is what a front-end
sends, and, re-exported from :mod:`zmqdispatch.wire.sglang_outputs`, what it reads.
The scheduler's side (the mock engine and tests) is :mod:`zmqdispatch.wire.sglang_engine`.

Shared with vLLM's and TokenSpeed's wire (reused from :mod:`zmqdispatch.wire.vllm`):
the socket topology and 2-byte identities, the HELLO / INIT / READY maps, the
ready-response map, the ABORT payload (an array of rid strings) and the raw
``ENGINE_CORE_DEAD`` sentinel. What is SGLang's own:

- type bytes ``0x00`` ADD, ``0x01`` ABORT and ``0x02`` CONTROL (:class:`RequestType`);
- ADD: SGLang's tagged positional ``TokenizedGenerateReqInput`` (tag + 48 fields in
  0.5.21, ``BaseReq``'s ``rid`` / ``http_worker_ipc`` first) with a nested untagged
  32-field ``SamplingParams``. :func:`encode_add` writes all of them by default, byte
  for byte what SGLang's msgspec encoder writes for the same struct
  (``tests/wire/vectors/sglang_0.5.21.json``); the scheduler accepts any prefix of
  at least 14 elements (tag .. ``stream``, the fields without a default);
- CONTROL: ``[call_id, method, args]`` (:func:`encode_control`), answered by a
  ``ControlReplySlim`` under the call id;
- the ready response's ``positional_layouts``: the field order of every positional
  struct the scheduler decodes, by class name. :func:`check_layouts` compares it with
  what :func:`encode_add` writes; a scheduler whose layout differs is refused at the
  handshake, the first differing field named, instead of failing every request.

Sampling values are written in the form SGLang's ``SamplingParams.__post_init__``
leaves them (:meth:`SGLangSamplingParams.derive`), as SGLang's own front end sends
them: ``stop_strs`` = ``stop``, ``top_k`` -1 as SGLang's "whole vocabulary" value,
a temperature in ``[0, 1e-6)`` as greedy (temperature 1.0, ``top_k`` 1). The
scheduler re-runs that derivation on decode (idempotent) and then ``normalize()``
and ``verify()``; a request they refuse, ``n != 1`` and empty ``input_ids`` end in a
terminal ``"abort"`` output with status 400, never in silence.

Errors: encoders raise :class:`~zmqdispatch.errors.LocalProtocolError` for a value
the wire cannot carry; :func:`check_layouts` raises :class:`LayoutMismatch`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.wire import vllm as _vllm
from zmqdispatch.wire.schema import (
    ENGINE_CORE_DEAD,
    _Bad,
    _conv_float,
    _conv_tuple,
    _field,
    _int_seq,
    _k_bool,
    _k_float,
    _k_int,
    _k_opt,
    _k_str,
    _opt_int,
    _opt_str,
    _pack,
    _same,
    _spec,
    _tname,
    _to_positional,
    is_dead_sentinel,
)
# The output side lives in wire.sglang_outputs; re-exported so that this module is
# the client side of the wire in one import.
from zmqdispatch.wire.sglang_outputs import (  # re-exports (`x as x`)
    BATCH_MIN_ELEMENTS as BATCH_MIN_ELEMENTS,
    BATCH_TAG as BATCH_TAG,
    CONTROL_TAG as CONTROL_TAG,
    EMBEDDING_TAG as EMBEDDING_TAG,
    ControlReply as ControlReply,
    SGLangBatch as SGLangBatch,
    SGLangLoad as SGLangLoad,
    decode_outputs as decode_outputs,
)
from zmqdispatch.wire.tokenspeed import _conv_float_map, _conv_id_set, _k_float_map, _k_str_map, _k_str_or_strs
from zmqdispatch.wire.vllm_handshake import EngineCoreReadyResponse

__all__ = [
    "BATCH_MIN_ELEMENTS",
    "BATCH_TAG",
    "CONTROL_TAG",
    "ENGINE_CORE_DEAD",
    "REQUEST_ELEMENTS",
    "REQUEST_LAYOUT",
    "REQUEST_MIN_ELEMENTS",
    "REQUEST_TAG",
    "SAMPLING_LAYOUT",
    "SGLANG_VERSION",
    "TOP_K_ALL",
    "ControlReply",
    "LayoutMismatch",
    "RequestType",
    "SGLangBatch",
    "SGLangLoad",
    "SGLangSamplingParams",
    "TokenizedGenerateReqInput",
    "check_layouts",
    "decode_outputs",
    "encode_abort",
    "encode_add",
    "encode_control",
    "is_dead_sentinel",
    "is_sglang",
]

#: The SGLang release whose wire this module speaks (and whose vectors it matches).
SGLANG_VERSION = "0.5.21"
#: ``vllm_version`` prefix of an SGLang scheduler's ready response.
VERSION_PREFIX = "sglang-"


class RequestType(enum.IntEnum):
    """Request-type byte, the first frame of every input message (the plugin's
    ``REQ_TYPE_*``). Any other byte is dropped by the scheduler with a log line.
    ``.frame`` is the one-byte frame."""

    ADD = 0
    ABORT = 1
    CONTROL = 2

    @property
    def frame(self) -> bytes:
        """The one-byte frame for this type (``b"\\x02"`` for CONTROL)."""
        return bytes((self.value,))


#: Element 0 of an ADD payload.
REQUEST_TAG = "TokenizedGenerateReqInput"
#: SGLang's ``top_k`` for "the whole vocabulary" (what ``-1`` becomes in ``__post_init__``).
TOP_K_ALL = 1 << 30
#: A temperature in ``[0, SAMPLING_EPS)`` means greedy.
SAMPLING_EPS = 1e-6
#: Elements of a full 0.5.21 ADD payload (tag + 48 fields).
REQUEST_ELEMENTS = 49
#: Shortest ADD payload the scheduler decodes: tag .. ``stream``.
REQUEST_MIN_ELEMENTS = 14


# =========================================================================== field kinds


def _k_nil(v: Any) -> None:
    # A slot whose values (SGLang's multimodal, session, KV-hint and pickled
    # structs) this client does not produce: only nil travels.
    if v is not None:
        raise _Bad(f"not carried by this client (expected nil, got {_tname(v)})")
    return None


def _k_prompt(v: Any) -> Any:
    # input_text: str | list[str | list[str]]; this client sends ids, so only a str or nil.
    return _k_str(v)


# =========================================================================== SamplingParams


@attrs.frozen(kw_only=True)
class SGLangSamplingParams:
    """SGLang 0.5.21 ``SamplingParams``: all 32 positions, in wire order, SGLang defaults.

    Wire form: an *untagged* positional array (SGLang's ``kw_only``, ``array_like``
    msgspec struct), nested in the ADD payload. The values are the caller's; the
    encoder writes :meth:`derive`'s form. ``stop_strs`` .. ``is_normalized`` are
    derived by SGLang (``normalize()`` runs on the scheduler); leave them at their
    defaults. ``ebnf_full_assistant`` is an ordinary option. Sequences are tuples; a
    lone ``stop`` string stays a str. An int given for a float field is stored as a
    float.
    """

    max_new_tokens: int | None = _field(128, _opt_int)
    stop: str | tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    stop_token_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_id_set)
    stop_regex: str | tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    temperature: float = _field(1.0, _k_float, converter=_conv_float)
    top_p: float = _field(1.0, _k_float, converter=_conv_float)
    top_k: int = _field(-1, _k_int)
    min_p: float = _field(0.0, _k_float, converter=_conv_float)
    frequency_penalty: float = _field(0.0, _k_float, converter=_conv_float)
    presence_penalty: float = _field(0.0, _k_float, converter=_conv_float)
    repetition_penalty: float = _field(1.0, _k_float, converter=_conv_float)
    min_new_tokens: int = _field(0, _k_int)
    n: int = _field(1, _k_int)
    beam_width: int | None = _field(None, _opt_int)
    json_schema: str | None = _field(None, _opt_str)
    regex: str | None = _field(None, _opt_str)
    ebnf: str | None = _field(None, _opt_str)
    structural_tag: str | None = _field(None, _opt_str)
    ignore_eos: bool = _field(False, _k_bool)
    skip_special_tokens: bool = _field(True, _k_bool)
    spaces_between_special_tokens: bool = _field(True, _k_bool)
    no_stop_trim: bool = _field(False, _k_bool)
    stream_interval: int | None = _field(None, _opt_int)
    logit_bias: dict[str, float] | None = _field(None, _k_opt(_k_float_map), converter=_conv_float_map)
    sampling_seed: int | None = _field(None, _opt_int)
    custom_params: dict[str, Any] | None = _field(None, _k_opt(_k_str_map))
    stop_strs: str | tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    stop_regex_strs: str | tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    stop_str_max_len: int = _field(0, _k_int)
    stop_regex_max_len: int = _field(0, _k_int)
    is_normalized: bool = _field(False, _k_bool)
    ebnf_full_assistant: bool = _field(False, _k_bool)

    def derive(self) -> SGLangSamplingParams:
        """What SGLang's ``__post_init__`` makes of these values (run on construction
        and on every decode; a no-op when ``is_normalized``, idempotent otherwise):
        ``stop_strs = stop``, ``stop_regex_strs = stop_regex``; ``stop_token_ids`` as
        SGLang's set (its iteration order), empty -> None; empty grammars -> None; a
        temperature in ``[0, 1e-6)`` -> temperature 1.0 and ``top_k`` 1; ``top_k`` -1
        -> :data:`TOP_K_ALL`. Deriving again changes nothing but, possibly, the order
        of the stop id set (which carries no meaning)."""
        if self.is_normalized:
            return self
        ids = self.stop_token_ids
        stop_ids = tuple({int(t) for t in set(ids)}) if ids else None
        temperature, top_k = self.temperature, self.top_k
        if 0 <= temperature < SAMPLING_EPS:
            temperature, top_k = 1.0, 1
        if top_k == -1:
            top_k = TOP_K_ALL
        return attrs.evolve(
            self,
            stop_strs=self.stop,
            stop_regex_strs=self.stop_regex,
            stop_token_ids=stop_ids,
            temperature=temperature,
            top_k=top_k,
            json_schema=self.json_schema or None,
            regex=self.regex or None,
            ebnf=self.ebnf or None,
            structural_tag=self.structural_tag or None,
        )

    def _to_wire(self) -> list[Any]:
        return _to_positional(self.derive(), "sampling_params")


def _k_sampling_params(v: Any) -> SGLangSamplingParams:
    if isinstance(v, SGLangSamplingParams):
        return v
    raise _Bad(f"expected SGLangSamplingParams, got {_tname(v)}")


# =========================================================================== ADD


@attrs.frozen(kw_only=True)
class TokenizedGenerateReqInput:
    """SGLang 0.5.21 ``TokenizedGenerateReqInput``, the ADD payload (tag + 48 fields).

    Wire form: ``["TokenizedGenerateReqInput", rid, http_worker_ipc, input_text,
    input_ids, input_embeds, mm_inputs, token_type_ids, [32 sampling values],
    return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, stream,
    ...]`` in this field order. SGLang gives the fields from ``input_text`` to
    ``stream`` no default; here they have the values a plain text request uses.

    On this wire ``rid`` names the request (the scheduler aborts by rid *prefix*),
    ``input_ids`` carries the prompt (sent as a plain int array; the plugin widens it
    to SGLang's ``array('q')``), ``input_text`` is not used. ``logprob_start_len`` -1
    means no prompt logprobs. ``routed_dp_rank`` is the scheduler's DP routing hint
    (None on this wire: each scheduler rank is its own engine). Slots holding SGLang
    structs this client does not build (``mm_inputs``, ``session_params``,
    ``positional_embed_overrides``, ``num_items_assigned``, ``time_stats``,
    ``kv_hints``, ``input_embeds``) only carry nil. ``data_parallel_rank`` is the
    client's placement pin, never sent.
    """

    rid: str = _field(kind=_k_str)
    http_worker_ipc: str | None = _field(None, _opt_str)
    input_text: str | None = _field(None, _k_opt(_k_prompt))
    input_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    input_embeds: None = _field(None, _k_nil)
    mm_inputs: None = _field(None, _k_nil)
    token_type_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    sampling_params: SGLangSamplingParams = _field(kind=_k_sampling_params)
    return_logprob: bool = _field(False, _k_bool)
    logprob_start_len: int = _field(-1, _k_int)
    top_logprobs_num: int = _field(0, _k_int)
    token_ids_logprob: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    stream: bool = _field(False, _k_bool)
    return_sampling_mask: bool = _field(False, _k_bool)
    return_flat_raw_top_logprobs: bool = _field(False, _k_bool)
    return_hidden_states: bool = _field(False, _k_bool)
    return_routed_experts: bool = _field(False, _k_bool)
    routed_experts_start_len: int = _field(0, _k_int)
    return_indexer_topk: bool = _field(False, _k_bool)
    session_id: str | None = _field(None, _opt_str)
    session_params: None = _field(None, _k_nil)
    lora_id: str | None = _field(None, _opt_str)
    custom_logit_processor: str | None = _field(None, _opt_str)
    positional_embed_overrides: None = _field(None, _k_nil)
    bootstrap_host: str | None = _field(None, _opt_str)
    bootstrap_port: int | None = _field(None, _opt_int)
    bootstrap_room: int | None = _field(None, _opt_int)
    bootstrap_pair_key: str | None = _field(None, _opt_str)
    decode_tp_size: int | None = _field(None, _opt_int)
    routed_dp_rank: int | None = _field(None, _opt_int)
    disagg_prefill_dp_rank: int | None = _field(None, _opt_int)
    routing_key: str | None = _field(None, _opt_str)
    require_reasoning: bool = _field(False, _k_bool)
    priority: int | None = _field(None, _opt_int)
    extra_key: str | None = _field(None, _opt_str)
    no_logs: bool = _field(False, _k_bool)
    return_bytes: bool = _field(False, _k_bool)
    return_entropy: bool = _field(False, _k_bool)
    need_wait_for_mm_inputs: bool | None = _field(None, _k_opt(_k_bool))
    num_items_assigned: None = _field(None, _k_nil)
    encoder_urls: tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    multi_item_delimiter_indices: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    token_indices_to_pool: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    time_stats: None = _field(None, _k_nil)
    cache_salt: str | None = _field(None, _opt_str)
    kv_hints: None = _field(None, _k_nil)
    pp_prefetch_ticketed: bool = _field(False, _k_bool)
    sampling_logprobs_mode: str = _field("selected", _k_str)
    #: Not on the wire: the scheduler rank (engine index) a many-engine client must
    #: place this request on (the proto's ``data_parallel_rank``); None: any.
    data_parallel_rank: int | None = _field(None, _opt_int)


_REQUEST_SPEC = tuple(f for f in _spec(TokenizedGenerateReqInput) if f.name != "data_parallel_rank")
_SAMPLING_SPEC = _spec(SGLangSamplingParams)
#: Field order of SGLang 0.5.21's ``TokenizedGenerateReqInput`` (tag not counted).
REQUEST_LAYOUT: tuple[str, ...] = tuple(f.name for f in _REQUEST_SPEC)
#: Field order of SGLang 0.5.21's ``SamplingParams``.
SAMPLING_LAYOUT: tuple[str, ...] = tuple(f.name for f in _SAMPLING_SPEC)
assert len(REQUEST_LAYOUT) == REQUEST_ELEMENTS - 1 and len(SAMPLING_LAYOUT) == 32


def encode_add(req: TokenizedGenerateReqInput, *, elements: int = REQUEST_ELEMENTS) -> list[bytes]:
    """Encode an ADD payload: ``[payload]`` (send after ``RequestType.ADD.frame``).

    By default all 49 elements, the bytes SGLang's msgspec encoder writes for the
    same struct (``dc0031``...); the nested sampling array always has all 32. A
    shorter ``elements`` (>= 14) writes that prefix (SMG writes 14, or 34 to carry
    ``require_reasoning``); the fields left out must hold their defaults.

    Raises:
        LocalProtocolError: a field of the wrong type (the message names it), a
            dropped field that is not at its default, or ``elements`` outside 14..49.
    """
    if not isinstance(req, TokenizedGenerateReqInput):
        raise LocalProtocolError(f"expected an SGLang TokenizedGenerateReqInput, got {_tname(req)}")
    if not REQUEST_MIN_ELEMENTS <= elements <= REQUEST_ELEMENTS:
        raise LocalProtocolError(f"elements must be in {REQUEST_MIN_ELEMENTS}..{REQUEST_ELEMENTS}, got {elements}")
    body: list[Any] = [REQUEST_TAG]
    for i, (name, _wire, default, kind, _always) in enumerate(_REQUEST_SPEC, start=1):
        v = getattr(req, name)
        if i >= elements:
            if not _same(v, default):
                raise LocalProtocolError(
                    f"TokenizedGenerateReqInput.{name} is set but a {elements}-element payload does not carry it"
                )
            continue
        try:
            v = kind(v)
        except _Bad as exc:
            raise LocalProtocolError(f"TokenizedGenerateReqInput.{name}: {exc}") from None
        body.append(v._to_wire() if name == "sampling_params" else v)  # noqa: SLF001  (wire.schema's hook)
    return [_pack(body)]


def encode_abort(request_ids: Sequence[str]) -> bytes:
    """ABORT payload: a msgpack array of rid strings (``["r1"]`` -> ``91a27231``).

    Send after ``RequestType.ABORT.frame``. The scheduler answers nothing for an
    ABORT of its own (a request aborted this way may still send outputs already in
    flight), and matches rids by *prefix*: an ABORT of ``"r-1"`` also aborts a
    running ``"r-10"``. Raises LocalProtocolError for a bare str or a non-str id.
    """
    return _vllm.encode_abort(request_ids)


def encode_control(call_id: int, method: str, args: Sequence[Any] = ()) -> bytes:
    """CONTROL payload ``[call_id, method, args]`` (send after ``RequestType.CONTROL.frame``).

    The scheduler answers one ``ControlReplySlim`` under *call_id*
    (:class:`ControlReply`); an unknown method is answered ``success=False``.
    Methods the plugin maps: ``flush_cache(timeout_s)``, ``start_profile(options)``,
    ``stop_profile()`` (:mod:`zmqdispatch.protocol.control`).

    Raises:
        LocalProtocolError: *call_id* not an int in 0..2**63-1, *method* not a str,
            or an argument msgpack cannot carry.
    """
    if type(call_id) is not int or not 0 <= call_id < 2**63:
        raise LocalProtocolError(f"call_id: expected an int in 0..2**63-1, got {call_id!r}")
    if type(method) is not str:
        raise LocalProtocolError(f"method: expected a str, got {_tname(method)}")
    return _pack([call_id, method, list(args)])


# =========================================================================== handshake


def is_sglang(resp: EngineCoreReadyResponse) -> bool:
    """True when a ready response came from an SGLang scheduler (``vllm_version`` ``"sglang-..."``)."""
    return resp.vllm_version.startswith(VERSION_PREFIX)


class LayoutMismatch(ValueError):
    """The scheduler's ``positional_layouts`` differ from what :func:`encode_add` writes.

    Attributes:
        struct: the class whose layout differs (``"SamplingParams"``).
        index: the first differing position (0 = the first field, tag not counted).
        expected: our field name there (None: the scheduler has more fields than
            we know before a difference; never for a prefix we do not write).
        actual: the scheduler's field name there (None: its layout is shorter).
    """

    def __init__(self, message: str, *, struct: str, index: int, expected: str | None, actual: str | None) -> None:
        super().__init__(message)
        self.struct = struct
        self.index = index
        self.expected = expected
        self.actual = actual


def check_layouts(positional_layouts: Mapping[str, Sequence[str]] | None, *,
                  request_elements: int = REQUEST_ELEMENTS) -> bool:
    """Compare a scheduler's announced layouts with what :func:`encode_add` writes.

    Every field we write must sit at the same position on the scheduler:
    ``TokenizedGenerateReqInput``'s first ``request_elements - 1`` fields and all of
    ``SamplingParams``'s. Fields the scheduler has after those are fine (a release
    that appends a defaulted field still decodes our prefix).

    Returns:
        True when checked; False when the scheduler announced nothing (``None`` or
        an empty map: an older plugin), so only the version guard applies.

    Raises:
        LayoutMismatch: a layout that differs (the message names the struct, the
            position and both field names), a struct missing from a non-empty map,
            or a layout that is not a list of field names.
    """
    if not positional_layouts:
        return False
    for struct, ours in (("TokenizedGenerateReqInput", REQUEST_LAYOUT[: request_elements - 1]),
                         ("SamplingParams", SAMPLING_LAYOUT)):
        theirs = positional_layouts.get(struct)
        if theirs is None:
            raise LayoutMismatch(
                f"the scheduler's positional_layouts declare no {struct} (it declares "
                f"{', '.join(sorted(positional_layouts))})", struct=struct, index=0, expected=ours[0], actual=None)
        if not isinstance(theirs, (list, tuple)) or not all(type(n) is str for n in theirs):
            raise LayoutMismatch(f"positional_layouts[{struct!r}]: expected a list of field names",
                                 struct=struct, index=0, expected=ours[0], actual=None)
        for i, name in enumerate(ours):
            actual = theirs[i] if i < len(theirs) else None
            if actual != name:
                where = f"has {actual!r} there" if actual is not None else f"has only {len(theirs)} fields"
                raise LayoutMismatch(
                    f"{struct} field {i} differs: zmqdispatch writes {name!r} (SGLang {SGLANG_VERSION}'s layout), "
                    f"the scheduler {where}; its release moved or removed a field, and every request would be "
                    "misread",
                    struct=struct, index=i, expected=name, actual=actual,
                )
    return True
