"""Client side of TokenSpeed's direct msgpack ZMQ wire (TokenSpeed 0.1.1, ``--zmq-msgpack``), sans-IO.

What a front-end sends and reads, in one import: :func:`encode_add`, :func:`encode_abort`
and :func:`decode_outputs` (the hot path, once per scheduler step; defined with the output
batch in :mod:`zmqdispatch.wire.tokenspeed_outputs` and re-exported), plus the
ready-response view (:func:`decode_ready_response`, :func:`is_tokenspeed`). The
engine's side (decoding ADD / ABORT as TokenSpeed's receiver does, encoding output
batches and TokenSpeed's handshake maps: the mock engine and tests) is
:mod:`zmqdispatch.wire.tokenspeed_engine`; what TokenSpeed's ingress refuses is
:mod:`zmqdispatch.protocol.checks_tokenspeed`. Nothing here touches a socket. Sources of
the format (facts, not code): ``docs/tokenspeed-wire.md`` §1, checked against
TokenSpeed 0.1.1's own wire modules (``runtime/engine/{zmq_wire,zmq_msgpack,io_struct}.py``,
``runtime/sampling/sampling_params.py``). :func:`encode_add`, :func:`encode_abort` and
the engine-side encoders reproduce that encoder's golden bytes
(``tests/wire/vectors/tokenspeed_0.1.1.json``) byte for byte.

What TokenSpeed shares with vLLM's EngineCore, and is therefore reused from
:mod:`zmqdispatch.wire.vllm` / :mod:`zmqdispatch.wire.vllm_handshake`: the socket
topology and 2-byte identities, the HELLO / INIT / READY handshake maps, the
ready-response map (TokenSpeed names ``block_size`` ``prefix_granularity``;
:func:`decode_ready_response` reads either), the ABORT payload (an array of request-id
strings) and the raw ``ENGINE_CORE_DEAD`` sentinel frame. The ``0x00`` ADD / ``0x01``
ABORT type bytes have vLLM's values too, but TokenSpeed knows no other type, so
:class:`RequestType` here has only those two.

What differs (all here):

- ADD payload: the msgspec *tagged* array ``["TokenizedGenerateReqInput", rid, ...]``
  (tag + 24 fields in 0.1.1) with a nested *untagged* 29-element ``SamplingParams``
  array. Decoders take any prefix of at least 6 elements (up to ``sampling_params``)
  and ignore extra trailing elements; the nested arrays are prefix tolerant as well.
- Output: one single-frame ``["BatchTokenIDOutSlim", rids, output_ids, finished_reasons,
  prompt_tokens, completion_tokens, cached_tokens, logprob_vals, logprob_ids,
  engine_index, num_running, num_waiting, kv_active_pages, kv_total_pages]`` per
  scheduler step; columns are parallel to ``rids``. Older engines sent the 9- (no
  ``engine_index``) and 10-element (no load) prefixes; those still decode.
- No utility, wave, health or control messages exist on this wire.

Type rules (msgspec's, which TokenSpeed's decoder applies): bool fields refuse ints,
int fields refuse floats and bools, float fields accept ints, strings are msgpack
``str`` (never ``bin``), map keys of ``logit_bias`` / ``custom_params`` are strings.
Floats are written as float64, ints in their smallest form.

Errors: every decoder raises only :class:`~zmqdispatch.errors.RemoteProtocolError` for
bytes that do not decode; every encoder raises
:class:`~zmqdispatch.errors.LocalProtocolError` for a value the wire cannot carry.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Sequence
from typing import Any

import attrs

from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.wire import vllm as _vllm
from zmqdispatch.wire import vllm_handshake as _handshake
from zmqdispatch.wire.schema import (
    ENGINE_CORE_DEAD,
    _Bad,
    _conv_float,
    _conv_nested_tuple,
    _conv_tuple,
    _field,
    _int_seq,
    _k_bool,
    _k_float,
    _k_int,
    _k_map,
    _k_opt,
    _k_seq,
    _k_str,
    _opt_int,
    _opt_str,
    _pack,
    _positional,
    _prep,
    _same,
    _spec,
    _tname,
    _to_positional,
    is_dead_sentinel,
)
# The multimodal payload's structs (wire.tokenspeed_multimodal), re-exported: a client builds them.
from zmqdispatch.wire.tokenspeed_multimodal import (  # re-exports (`x as x`)
    DataItem as DataItem,
    Modality as Modality,
    MultimodalInputs as MultimodalInputs,
    pad_input_ids as pad_input_ids,
    pad_value as pad_value,
)
from zmqdispatch.wire.tokenspeed_multimodal import to_wire as _mm_to_wire
from zmqdispatch.wire.vllm_handshake import EngineCoreReadyResponse
# The output side (decode_outputs and what it returns) lives in wire.tokenspeed_outputs;
# re-exported so that this module stays the client side of the wire in one import.
from zmqdispatch.wire.tokenspeed_outputs import (  # re-exports (`x as x`), private ones included
    BATCH_ELEMENTS as BATCH_ELEMENTS,
    BATCH_MIN_ELEMENTS as BATCH_MIN_ELEMENTS,
    BATCH_TAG as BATCH_TAG,
    FINISH_ABORT as FINISH_ABORT,
    FINISH_LENGTH as FINISH_LENGTH,
    FINISH_RUNNING as FINISH_RUNNING,
    FINISH_STOP as FINISH_STOP,
    LoadSnapshot as LoadSnapshot,
    TokenSpeedBatch as TokenSpeedBatch,
    TokenSpeedOutput as TokenSpeedOutput,
    _COLUMNS as _COLUMNS,
    _INT_T as _INT_T,
    _NUM_T as _NUM_T,
    _SCALARS as _SCALARS,
    _STR_T as _STR_T,
    _TAIL_PADS as _TAIL_PADS,
    _TUPLE_T as _TUPLE_T,
    _U32 as _U32,
    _bad_batch as _bad_batch,
    _check_flat_column as _check_flat_column,
    _check_logprob_columns as _check_logprob_columns,
    _check_nested_column as _check_nested_column,
    _decode_outputs_msgpack as _decode_outputs_msgpack,
    _first_bad as _first_bad,
    _max_token_id as _max_token_id,
    _out_of_range as _out_of_range,
    decode_outputs as decode_outputs,
)

__all__ = [
    "BATCH_ELEMENTS",
    "BATCH_MIN_ELEMENTS",
    "BATCH_TAG",
    "DataItem",
    "ENGINE_CORE_DEAD",
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_RUNNING",
    "FINISH_STOP",
    "FORCE_STREAM_INTERVAL",
    "REQUEST_ELEMENTS",
    "REQUEST_MIN_ELEMENTS",
    "REQUEST_TAG",
    "SAMPLING_EPS",
    "SAMPLING_PARAMS_LEN",
    # constants
    "TOKENSPEED_VERSION",
    "TOP_K_DISABLED",
    "TOP_K_FUSED_MAX",
    "LoadSnapshot",
    "Modality",
    "MultimodalInputs",
    "RequestType",
    "SessionParams",
    # outputs
    "TokenSpeedBatch",
    "TokenSpeedOutput",
    # requests
    "TokenSpeedSamplingParams",
    "TokenizedGenerateReqInput",
    "decode_outputs",
    # handshake
    "decode_ready_response",
    "encode_abort",
    "encode_add",
    "finalize_add",
    "is_dead_sentinel",
    "is_tokenspeed",
    "pad_input_ids",
    "pad_value",
]

#: The TokenSpeed release whose wire this module speaks (and whose vectors it matches).
TOKENSPEED_VERSION = "0.1.1"

# =========================================================================== constants


class RequestType(enum.IntEnum):
    """Request-type byte, the first frame of every input message (``zmq_wire.REQ_TYPE_*``).

    The values coincide with vLLM's ``ADD``/``ABORT``; TokenSpeed has no other type and
    drops (with only a log line) any message whose first frame is anything else.
    ``.frame`` is the one-byte frame.
    """

    ADD = 0
    ABORT = 1

    @property
    def frame(self) -> bytes:
        """The one-byte frame for this type (``b"\\x00"`` for ADD)."""
        return _TYPE_FRAMES[self]


_TYPE_FRAMES = {t: bytes((t,)) for t in RequestType}


#: Element 0 of an ADD payload.
REQUEST_TAG = "TokenizedGenerateReqInput"

#: ``top_k`` value meaning "disabled" after TokenSpeed's derivation (the API's -1).
TOP_K_DISABLED = 1 << 30
#: A finite ``top_k`` must stay below this (TokenSpeed's fused top-k/top-p kernel limit).
TOP_K_FUSED_MAX = 128
#: A temperature below this means greedy (temperature 1.0, top_k 1, seed 0).
SAMPLING_EPS = 1e-6
#: A non-streaming request still emits at its first token and every this many tokens
#: (TokenSpeed ``DEFAULT_FORCE_STREAM_INTERVAL``); for the mock engine.
FORCE_STREAM_INTERVAL = 50

#: Positions of the nested ``SamplingParams`` array in 0.1.1.
SAMPLING_PARAMS_LEN = 29
#: Elements of a full 0.1.1 ADD payload (tag + 24 fields).
REQUEST_ELEMENTS = 25
#: Shortest ADD payload TokenSpeed decodes: tag .. ``sampling_params`` (no default).
REQUEST_MIN_ELEMENTS = 6


# =========================================================================== field kinds

# Field kinds: each checks one value (decoded, or handed to an encoder) and returns it
# normalised, or raises _Bad. Same rules both ways, so whatever encodes also decodes.


def _k_array(v: Any) -> tuple[Any, ...]:
    if type(v) not in (list, tuple):
        raise _Bad(f"expected an array, got {_tname(v)}")
    return tuple(v)


def _k_str_map(v: Any) -> dict[str, Any]:
    m = _k_map(v)
    for k in m:
        if type(k) is not str:
            raise _Bad(f"map keys must be str, got {_tname(k)}")
    return m


def _k_float_map(v: Any) -> dict[str, float]:
    # logit_bias: dict[str, float] -- keys are stringified token ids.
    m = _k_str_map(v)
    return {k: _k_float(x) for k, x in m.items()}


def _k_str_or_strs(v: Any) -> str | tuple[str, ...]:
    # stop / stop_strs: str | list[str] (nil handled by _k_opt)
    return v if type(v) is str else _k_seq(_k_str)(v)


def _k_id_set(v: Any) -> tuple[int, ...]:
    # stop_token_ids is a Python set in TokenSpeed: msgspec builds it from the array
    # (duplicates collapse) and writes it in set-iteration order. Order carries no
    # meaning (the engine tests membership) and CPython's set order depends on how the
    # set was built, so we keep first occurrences in wire order: deterministic and
    # idempotent.
    return tuple(dict.fromkeys(_k_seq(_k_int)(v)))


def _conv_id_set(v: Any) -> Any:
    if isinstance(v, (set, frozenset)):
        return tuple(v)  # set-iteration order, what TokenSpeed's encoder writes
    return _conv_tuple(v)


def _conv_float_map(v: Any) -> Any:
    return {k: _conv_float(x) for k, x in v.items()} if isinstance(v, dict) else v


# =========================================================================== SamplingParams


@attrs.frozen(kw_only=True)
class TokenSpeedSamplingParams:
    """TokenSpeed 0.1.1 ``SamplingParams``: all 29 positions, in wire order, TokenSpeed defaults.

    Wire form: an *untagged* positional array of all 29 fields (nested in the ADD
    payload). Decoding is prefix tolerant (even ``[]`` decodes to the defaults) and
    ignores extra trailing elements.

    This class holds exactly what travels, nothing is derived at construction (unlike
    TokenSpeed's struct, whose ``__post_init__`` runs on construction and decode). The
    engine's three derivation steps are explicit methods:

    - :meth:`derive` -- ``__post_init__`` (skipped when ``is_normalized``): ``stop_strs =
      stop``; ``stop_token_ids`` deduplicated, empty -> None; ``temperature < 1e-6`` ->
      temperature 1.0 and top_k 1 (any temperature below that, negatives included);
      ``top_k == 1`` -> ``seed = 0`` (even an explicit seed); ``top_k == -1`` ->
      :data:`TOP_K_DISABLED`.
    - :meth:`resolve_seed` -- a nil seed becomes ``crc32(rid utf-8)``.
    - :meth:`normalize` -- :meth:`derive`, then ``stop_strs`` as a list (``[]`` when nil),
      ``stop_str_max_len`` = longest stop string in characters (no tokenizer on this
      path), ``is_normalized = True``. A sender that sends ``is_normalized = True`` must
      have derived (TokenSpeed keeps a normalized ``top_k = -1`` as -1).

    :func:`zmqdispatch.protocol.checks_tokenspeed.sampling_params_error` mirrors
    ``SamplingParams.verify``; the engine turns a failure into a terminal ``"abort"`` frame.
    Sequences are tuples; ``stop`` and ``stop_strs`` keep a lone ``str`` a ``str`` (it
    travels as one). An int given for a float field is stored as a float.
    """

    max_new_tokens: int | None = _field(None, _opt_int)
    stop: str | tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    stop_token_ids: tuple[int, ...] | None = _field(None, _k_opt(_k_id_set), converter=_conv_id_set)
    temperature: float = _field(1.0, _k_float, converter=_conv_float)
    top_p: float = _field(1.0, _k_float, converter=_conv_float)
    top_k: int = _field(-1, _k_int)
    min_p: float = _field(0.0, _k_float, converter=_conv_float)
    frequency_penalty: float = _field(0.0, _k_float, converter=_conv_float)
    presence_penalty: float = _field(0.0, _k_float, converter=_conv_float)
    repetition_penalty: float = _field(1.0, _k_float, converter=_conv_float)
    min_new_tokens: int = _field(0, _k_int)
    json_schema: str | None = _field(None, _opt_str)
    regex: str | None = _field(None, _opt_str)
    ebnf: str | None = _field(None, _opt_str)
    structural_tag: str | None = _field(None, _opt_str)
    ignore_eos: bool = _field(False, _k_bool)
    skip_special_tokens: bool = _field(True, _k_bool)
    spaces_between_special_tokens: bool = _field(True, _k_bool)
    no_stop_trim: bool = _field(False, _k_bool)
    thinking_budget: int | None = _field(None, _opt_int)
    custom_params: dict[str, Any] | None = _field(None, _k_opt(_k_str_map))
    stream_interval: int | None = _field(None, _opt_int)
    logit_bias: dict[str, float] | None = _field(None, _k_opt(_k_float_map), converter=_conv_float_map)
    seed: int | None = _field(None, _opt_int)
    logprobs: int | None = _field(None, _opt_int)
    n: int = _field(1, _k_int)
    stop_strs: str | tuple[str, ...] | None = _field(None, _k_opt(_k_str_or_strs), converter=_conv_tuple)
    stop_str_max_len: int = _field(0, _k_int)
    is_normalized: bool = _field(False, _k_bool)

    def derive(self) -> TokenSpeedSamplingParams:
        """What TokenSpeed's ``__post_init__`` makes of these values (run on every decode).

        A no-op when ``is_normalized``; idempotent otherwise.
        """
        if self.is_normalized:
            return self
        changes: dict[str, Any] = {"stop_strs": self.stop}
        changes["stop_token_ids"] = _k_id_set(self.stop_token_ids) if self.stop_token_ids else None
        temperature, top_k, seed = self.temperature, self.top_k, self.seed
        if temperature < SAMPLING_EPS:
            temperature, top_k = 1.0, 1
        if top_k == 1:
            seed = 0  # greedy: TokenSpeed pins the seed so exact ties break the same way
        if top_k == -1:
            top_k = TOP_K_DISABLED
        changes.update(temperature=temperature, top_k=top_k, seed=seed)
        return attrs.evolve(self, **changes)

    def resolve_seed(self, rid: str) -> TokenSpeedSamplingParams:
        """A nil seed becomes ``crc32(rid.encode("utf-8"))`` (so the rid fixes the random stream)."""
        if self.seed is not None:
            return self
        return attrs.evolve(self, seed=zlib.crc32(rid.encode("utf-8")) & 0xFFFFFFFF)

    def normalize(self) -> TokenSpeedSamplingParams:
        """:meth:`derive` then TokenSpeed's ``normalize(tokenizer=None)``; sets ``is_normalized``."""
        sp = self.derive()
        strs = sp.stop_strs
        if strs is None:
            return attrs.evolve(sp, stop_strs=(), stop_str_max_len=0, is_normalized=True)
        if type(strs) is str:
            strs = (strs,)
        max_len = max((len(s) for s in strs), default=0)
        return attrs.evolve(sp, stop_strs=strs, stop_str_max_len=max_len, is_normalized=True)

    def _to_wire(self) -> list[Any]:
        return _to_positional(self, "sampling_params")


def _k_sampling_params(v: Any) -> TokenSpeedSamplingParams:
    if isinstance(v, TokenSpeedSamplingParams):
        return v
    raise _Bad(f"expected TokenSpeedSamplingParams, got {_tname(v)}")


# =========================================================================== ADD


@attrs.frozen(kw_only=True)
class SessionParams:
    """``TokenizedGenerateReqInput.session_params``: an untagged array ``[id, rid, offset,
    replace]``, prefix tolerant. Sessions do not exist on this path: a non-nil ``id``
    makes the engine abort the request."""

    id: str | None = _field(None, _opt_str)
    rid: str | None = _field(None, _opt_str)
    offset: int | None = _field(None, _opt_int)
    replace: bool | None = _field(None, _k_opt(_k_bool))


def _k_session(v: Any) -> Any:
    if v is None or isinstance(v, SessionParams):
        return v
    return _positional(SessionParams, v, "session_params")


def _k_multimodal(v: Any) -> Any:
    # MultimodalInputs is an untagged array whose first field (mm_items) has no
    # default, so TokenSpeed needs at least one element. A typed
    # wire.tokenspeed_multimodal.MultimodalInputs (what a client sends), else kept as
    # raw msgpack values (what decode_add leaves).
    if v is None or isinstance(v, MultimodalInputs):
        return v
    if type(v) not in (list, tuple) or not v:
        raise _Bad("expected a non-empty array or nil")
    return v


@attrs.frozen(kw_only=True)
class TokenizedGenerateReqInput:
    """TokenSpeed 0.1.1 ``TokenizedGenerateReqInput``, the ADD payload (tag + 24 fields).

    Wire form: ``["TokenizedGenerateReqInput", rid, http_worker_ipc, input_text,
    input_ids, [29 sampling values], return_logprob, ...]`` in this field order
    (``BaseReq``'s ``rid``/``http_worker_ipc`` first). Only ``sampling_params`` has no
    default. On this path ``rid`` must be a str (TokenSpeed derives the seed from it),
    ``input_ids`` carries the prompt (``input_text`` is unused), and the engine checks
    neither prompt length, empty prompts nor duplicate rids: the frontend must.

    Engine-side meaning of the knobs (``docs/tokenspeed-wire.md`` §1.9):
    ``return_logprob`` needs ``--enable-output-logprobs``; with it, ``top_logprobs_num``
    != 0, a non-empty ``token_ids_logprob`` or a ``logprob_start_len`` that asks for
    prompt logprobs abort the request. ``stream`` only changes the emission cadence.
    ``bootstrap_*`` are PD rendezvous fields, ``data_parallel_rank`` is not used for
    routing by the engine here (the client places by it), ``validation_error`` (set by a sender) forces an abort.
    ``multimodal_inputs``: to send, a
    :class:`~zmqdispatch.wire.tokenspeed_multimodal.MultimodalInputs` (with the padded
    ``input_ids`` and the original ones in ``input_ids_unpadded``,
    ``docs/multimodal.md``) or raw msgpack values (tensors inside may be
    :class:`~zmqdispatch.wire.tensors.Tensor` objects); decoded, the raw values
    (:func:`~zmqdispatch.wire.tokenspeed_multimodal.decode_multimodal_inputs` reads them).
    """

    rid: str = _field(kind=_k_str)
    http_worker_ipc: str | None = _field(None, _opt_str)
    input_text: str | None = _field(None, _opt_str)
    input_ids: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    sampling_params: TokenSpeedSamplingParams = _field(kind=_k_sampling_params)
    return_logprob: bool = _field(False, _k_bool)
    logprob_start_len: int = _field(-1, _k_int)
    top_logprobs_num: int = _field(0, _k_int)
    token_ids_logprob: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    stream: bool = _field(False, _k_bool)
    input_embeds: tuple[Any, ...] | None = _field(None, _k_opt(_k_array), converter=_conv_tuple)
    session_params: SessionParams | None = _field(None, _k_session)
    custom_logit_processor: str | None = _field(None, _opt_str)
    return_hidden_states: bool = _field(False, _k_bool)
    created_time: float = _field(0.0, _k_float, converter=_conv_float)
    bootstrap_host: str | None = _field(None, _opt_str)
    bootstrap_port: int | None = _field(None, _opt_int)
    bootstrap_room: int | None = _field(None, _opt_int)
    input_multi_ids: tuple[tuple[int, ...], ...] | None = _field(
        None, _k_opt(_k_seq(_int_seq)), converter=_conv_nested_tuple
    )
    input_extra_infos: tuple[dict[str, Any], ...] | None = _field(None, _k_opt(_k_seq(_k_map)), converter=_conv_tuple)
    input_ids_unpadded: tuple[int, ...] | None = _field(None, _k_opt(_int_seq), converter=_conv_tuple)
    multimodal_inputs: Any = _field(None, _k_multimodal)
    validation_error: str | None = _field(None, _opt_str)
    data_parallel_rank: int | None = _field(None, _opt_int)


_REQUEST_SPEC = _spec(TokenizedGenerateReqInput)
assert len(_REQUEST_SPEC) == REQUEST_ELEMENTS - 1
assert len(_spec(TokenSpeedSamplingParams)) == SAMPLING_PARAMS_LEN


def encode_add(req: TokenizedGenerateReqInput, *, elements: int = REQUEST_ELEMENTS) -> list[bytes]:
    """Encode an ADD payload: ``[payload, *aux]`` (send after ``RequestType.ADD.frame``).

    The payload is the tagged array TokenSpeed's ``MsgpackEncoder`` writes: by default
    all 25 elements (``dc0019``...), the nested sampling array always all 29. A shorter
    ``elements`` (>= 6) writes that prefix, e.g. 11 as SMG does (tag .. ``stream``) or 24
    for an engine older than ``data_parallel_rank``; the fields left out must hold
    their defaults (the engine would default them). Aux frames appear only for tensors
    inside ``multimodal_inputs`` (256 bytes or more).

    Raises:
        LocalProtocolError: a field of the wrong type (the message names it), a dropped
            field that is not at its default, an ``elements`` outside 6..25, or
            ``multimodal_inputs`` that cannot be sent
            (:func:`~zmqdispatch.wire.tokenspeed_multimodal.to_wire`).
    """
    if not isinstance(req, TokenizedGenerateReqInput):
        raise LocalProtocolError(f"expected a TokenizedGenerateReqInput, got {_tname(req)}")
    if not REQUEST_MIN_ELEMENTS <= elements <= REQUEST_ELEMENTS:
        raise LocalProtocolError(f"elements must be in {REQUEST_MIN_ELEMENTS}..{REQUEST_ELEMENTS}, got {elements}")
    aux: list[Any] = []
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
        if name == "sampling_params":
            body.append(v._to_wire())  # noqa: SLF001  (a wire struct's encoding hook, wire.schema's)
        elif name == "session_params" and v is not None:
            body.append(_to_positional(v, "session_params"))
        elif name == "multimodal_inputs":
            body.append(_prep(_mm_to_wire(v) if isinstance(v, MultimodalInputs) else v, aux))
        else:
            body.append(v)
    return [_pack(body), *aux]


def finalize_add(req: TokenizedGenerateReqInput) -> TokenizedGenerateReqInput:
    """What TokenSpeed's msgpack transport does to a decoded ADD before admitting it.

    ``resolve_seed(rid)``, then ``normalize()``, then ``n != 1`` sets ``validation_error``
    (overwriting one the sender set) so the request ends in a terminal ``"abort"``
    instead of being dropped.
    """
    sp = req.sampling_params.resolve_seed(req.rid).normalize()
    changes: dict[str, Any] = {"sampling_params": sp}
    if sp.n != 1:
        changes["validation_error"] = f"n={sp.n} is not supported on the msgpack wire; fan out n > 1 in the frontend"
    return attrs.evolve(req, **changes)


def encode_abort(request_ids: Sequence[str]) -> bytes:
    """ABORT payload: a msgpack array of request-id strings (``["r1"]`` -> ``91a27231``).

    Send after ``RequestType.ABORT.frame``. TokenSpeed then never sends another frame
    for those rids, not even a terminal one: retire them locally when sending. An
    abort for an unknown rid is parked by the engine for 300 s and applied if that rid
    arrives later. Raises LocalProtocolError for a bare str or a non-str id.
    """
    return _vllm.encode_abort(request_ids)


# =========================================================================== handshake


def decode_ready_response(payload: bytes) -> EngineCoreReadyResponse:
    """Decode a ready response; the vLLM decoder already reads TokenSpeed's map.

    ``prefix_granularity`` lands in ``block_size``; ``multimodal_encoder_dtype`` (the
    dtype of the model's vision / audio tower, nil for a text model) in the field of
    that name; ``vllm_version`` is ``"tokenspeed-<version>"`` (see :func:`is_tokenspeed`).
    Note ``max_model_len`` is the model's context length, not what the cache admits.
    Raises RemoteProtocolError.
    """
    return _handshake.decode_ready_response(payload)


def is_tokenspeed(resp: EngineCoreReadyResponse) -> bool:
    """True when a ready response came from TokenSpeed (``vllm_version`` ``"tokenspeed-..."``)."""
    return resp.vllm_version.startswith("tokenspeed-")


