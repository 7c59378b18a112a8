"""Client side of TokenSpeed's direct msgpack ZMQ wire (TokenSpeed 0.1.1, ``--zmq-msgpack``), sans-IO.

What a front-end sends and reads, in one file: :func:`encode_add`, :func:`encode_abort`
and :func:`decode_outputs` (the hot path, once per scheduler step), plus the
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

import array
import enum
import itertools
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from zmqdispatch import limits as _limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
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
    _unpack_output_message,
    is_dead_sentinel,
)
from zmqdispatch.wire.vllm_handshake import EngineCoreReadyResponse

__all__ = [
    "BATCH_ELEMENTS",
    "BATCH_MIN_ELEMENTS",
    "BATCH_TAG",
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
#: Element 0 of an output batch.
BATCH_TAG = "BatchTokenIDOutSlim"

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
#: Elements of a 0.1.1 output batch (tag + 13 fields).
BATCH_ELEMENTS = 14
#: Shortest output batch that decodes: tag + the 8 columns without a default.
BATCH_MIN_ELEMENTS = 9

#: ``finished_reasons`` entry of a request that is still running.
FINISH_RUNNING = ""
#: Matched stop token / EOS / stop string / grammar termination (the token is in ``output_ids``).
FINISH_STOP = "stop"
#: ``max_new_tokens`` reached.
FINISH_LENGTH = "length"
#: Any engine-side abort: ingress validation failure, grammar failure, pause-abort. A
#: client ABORT produces no frame at all.
FINISH_ABORT = "abort"


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
    # default, so TokenSpeed needs at least one element. Kept as raw msgpack values.
    if v is None:
        return None
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
    routing here, ``validation_error`` (set by a sender) forces an abort.
    ``multimodal_inputs`` is kept as raw msgpack values (tensors inside may be
    :class:`~zmqdispatch.wire.tensors.Tensor` objects when encoding).
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
            field that is not at its default, or an ``elements`` outside 6..25.
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
            body.append(_prep(v, aux))
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


# =========================================================================== outputs


@attrs.frozen
class LoadSnapshot:
    """The scheduler load an output batch carries (only when ``kv_total_pages > 0``).

    Recorded each scheduler round, so only as fresh as the last output: an idle engine
    sends nothing. ``kv_usage`` = active / total pages.
    """

    engine_index: int
    num_running: int
    num_waiting: int
    kv_active_pages: int
    kv_total_pages: int

    @property
    def kv_usage(self) -> float:
        """Fraction of KV pages in use (0..1); only for a snapshot with pages."""
        return self.kv_active_pages / self.kv_total_pages


@attrs.frozen
class TokenSpeedOutput:
    """One request's slice of a batch (a convenience view; the hot path reads columns).

    ``finish_reason`` is None while running, else the wire string (``"stop"``,
    ``"length"``, ``"abort"``; other strings are passed through).
    """

    rid: str
    output_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprob_vals: tuple[float, ...]
    logprob_ids: tuple[int, ...]


@attrs.define(slots=True, kw_only=True)
class TokenSpeedBatch:
    """One decoded output message (TokenSpeed 0.1.1 ``BatchTokenIDOutSlim``).

    Every column is a tuple parallel to ``rids`` (checked). Attributes:
        engine_index: the producing rank's identity index (the output PULL carries no
            identity); 0 on a 9-element legacy batch.
        rids: requests that emit this step (each rid at most once per batch in practice).
        output_ids: per rid, the tokens generated since its previous frame (several with
            speculative decoding; the token that caused a ``"stop"`` is included).
        finished_reasons: per rid, ``""`` while running, else ``"stop"``/``"length"``/
            ``"abort"``. Exactly one non-empty reason per request, on its last frame.
        prompt_tokens: per rid, the prompt length (multimodal: padded).
        completion_tokens: per rid, the *cumulative* generated count.
        cached_tokens: per rid, prefix-cache hit tokens.
        logprob_vals / logprob_ids: per rid, the sampled tokens' logprobs (float) and ids,
            parallel to each other; ``()`` when the request did not ask. They may be
            shorter than ``output_ids`` (TokenSpeed ships one less when a PD prefill peer
            sent no logprob for its bootstrap token).
        num_running, num_waiting, kv_active_pages, kv_total_pages: the load snapshot;
            ``kv_total_pages == 0`` means none (always so on 9/10-element batches).
        wire_elements: how many array elements the message had (9, 10, 14, or more from
            a newer engine); not part of equality.
    """

    engine_index: int = 0
    rids: tuple[str, ...] = ()
    output_ids: tuple[tuple[int, ...], ...] = ()
    finished_reasons: tuple[str, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    completion_tokens: tuple[int, ...] = ()
    cached_tokens: tuple[int, ...] = ()
    logprob_vals: tuple[tuple[float, ...], ...] = ()
    logprob_ids: tuple[tuple[int, ...], ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    kv_active_pages: int = 0
    kv_total_pages: int = 0
    wire_elements: int = attrs.field(default=BATCH_ELEMENTS, eq=False)

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def load(self) -> LoadSnapshot | None:
        """The load snapshot, or None when the batch carries none (``kv_total_pages == 0``)."""
        if self.kv_total_pages <= 0:
            return None
        return LoadSnapshot(
            self.engine_index, self.num_running, self.num_waiting, self.kv_active_pages, self.kv_total_pages
        )

    def finished_rids(self) -> tuple[str, ...]:
        """Rids whose reason is non-empty (there is no separate finished list on this wire)."""
        return tuple([r for r, f in zip(self.rids, self.finished_reasons) if f])

    def outputs(self) -> Iterator[TokenSpeedOutput]:
        """Per-request views, in column order."""
        for row in zip(
            self.rids,
            self.output_ids,
            self.finished_reasons,
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            self.logprob_vals,
            self.logprob_ids,
        ):
            yield TokenSpeedOutput(row[0], row[1], row[2] or None, *row[3:])


_COLUMNS = (
    "rids",
    "output_ids",
    "finished_reasons",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "logprob_vals",
    "logprob_ids",
)
_SCALARS = ("engine_index", "num_running", "num_waiting", "kv_active_pages", "kv_total_pages")
# _TAIL_PADS[n] pads an n-element batch (9 <= n < 14) to 14 with the defaults (0).
_TAIL_PADS = {n: (0,) * (BATCH_ELEMENTS - n) for n in range(BATCH_MIN_ELEMENTS, BATCH_ELEMENTS)}
_STR_T: set[type] = {str}
_INT_T: set[type] = {int}
_TUPLE_T: set[type] = {tuple}
_NUM_T: set[type] = {int, float}


def _bad_batch(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"BatchTokenIDOutSlim.{what}")


def _first_bad(col: Sequence[Any], ok: Callable[[Any], bool]) -> int:
    return next((i for i, x in enumerate(col) if not ok(x)), -1)


def _max_token_id() -> int:
    # Token ids and counts travel on as uint32 (the gateway protos), so larger ones are
    # refused here rather than failing later outside the RemoteProtocolError contract.
    return getattr(_limits, "MAX_TOKEN_ID", 2**32 - 1)


_U32 = array.array("I").itemsize == 4


def _out_of_range(values: Callable[[], Any], bound: int) -> bool:
    """True if some int of ``values()`` is outside 0..bound (types already checked).

    For the usual uint32 bound, one ``array("I", ...)`` conversion (C-level, refuses
    negatives and anything above 2**32-1) replaces a ``min`` and a ``max`` pass.
    """
    if bound == 0xFFFFFFFF and _U32:
        try:
            array.array("I", values())
        except OverflowError:
            return True
        return False
    return min(values(), default=0) < 0 or max(values(), default=0) > bound


def _check_flat_column(name: str, col: Any, m: int, types: set[type], *, bound: int | None) -> None:
    if type(col) is not tuple or len(col) != m:
        raise _bad_batch(f"{name}: expected an array of {m} elements (ragged columns), got "
                         f"{len(col) if type(col) is tuple else _tname(col)}")
    if not set(map(type, col)) <= types:
        i = _first_bad(col, lambda x: type(x) in types)
        raise _bad_batch(f"{name}[{i}]: expected {'/'.join(sorted(t.__name__ for t in types))}, got {_tname(col[i])}")
    if bound is not None and m and _out_of_range(lambda: col, bound):
        i = _first_bad(col, lambda x: 0 <= x <= bound)
        raise _bad_batch(f"{name}[{i}]: {col[i]} is not in 0..{bound}")


def _check_nested_column(name: str, col: Any, m: int, types: set[type], *, bound: int | None, max_len: int) -> None:
    if type(col) is not tuple or len(col) != m:
        raise _bad_batch(f"{name}: expected an array of {m} elements (ragged columns), got "
                         f"{len(col) if type(col) is tuple else _tname(col)}")
    if not m:
        return
    if not set(map(type, col)) <= _TUPLE_T:
        i = _first_bad(col, lambda x: type(x) is tuple)
        raise _bad_batch(f"{name}[{i}]: expected an array, got {_tname(col[i])}")
    if max(map(len, col)) > max_len:
        i = _first_bad(col, lambda x: len(x) <= max_len)
        raise _bad_batch(f"{name}[{i}]: {len(col[i])} entries exceed MAX_TOKENS_PER_TICK ({max_len})")
    if not set(map(type, itertools.chain.from_iterable(col))) <= types:
        i = _first_bad(col, lambda row: all(type(x) in types for x in row))
        raise _bad_batch(f"{name}[{i}]: expected an array of {'/'.join(sorted(t.__name__ for t in types))}")
    if bound is not None and _out_of_range(lambda: itertools.chain.from_iterable(col), bound):
        i = _first_bad(col, lambda row: all(0 <= x <= bound for x in row))
        raise _bad_batch(f"{name}[{i}]: a token id outside 0..{bound}")


def decode_outputs(frames: Sequence[bytes]) -> TokenSpeedBatch:
    """Decode one output message ``[payload, *aux]`` (the hot path: once per engine step).

    Wire format: TokenSpeed 0.1.1 ``BatchTokenIDOutSlim`` (tagged, array_like). One
    ``msgpack.unpackb`` (arrays as tuples) and a fixed number of C-level passes over the
    columns (``set(map(type, col))``, ``min``, ``max(map(len, col))``): no per-token
    Python objects, no per-row Python loop. The decoded tuples become the batch's
    columns as they are. 9- and 10-element legacy batches take 0 for the missing tail;
    elements after the 14th and aux frames after the payload are ignored.

    Checked: the tag; ``rids`` an array of str of at most ``limits.MAX_OUTPUTS_PER_MESSAGE``;
    every column exactly ``len(rids)`` long (the two logprob columns included);
    ``finished_reasons`` str; counts ints in ``0..limits.MAX_TOKEN_ID`` (uint32, what the
    gateway protos carry); ``output_ids`` and ``logprob_ids`` arrays of ints in that
    range, ``logprob_vals`` arrays of numbers (ints are accepted,
    as msgspec does, and left as ints), each at most ``limits.MAX_TOKENS_PER_TICK`` long;
    ``logprob_vals[i]`` and ``logprob_ids[i]`` of equal length; the five scalars
    non-negative ints.

    Raises:
        RemoteProtocolError: the ``ENGINE_CORE_DEAD`` sentinel (check
            :func:`is_dead_sentinel` first), no frames, a frame over
            ``limits.MAX_FRAME_BYTES``, undecodable msgpack, a pickle/unknown ext type,
            a wrong tag ("wrong msgspec tag"), fewer than 9 elements, or any check above
            (the message names the column and index).
    """
    obj = _unpack_output_message(frames, "BatchTokenIDOutSlim")
    if type(obj) is not tuple or not obj:
        raise RemoteProtocolError(f"BatchTokenIDOutSlim: expected a tagged array, got {_tname(obj)}")
    tag = obj[0]
    if type(tag) is not str or tag != BATCH_TAG:
        raise RemoteProtocolError(f"wrong msgspec tag: expected {BATCH_TAG!r}, got {tag!r:.60}")
    n = len(obj)
    if n != BATCH_ELEMENTS:
        if n < BATCH_MIN_ELEMENTS:
            raise RemoteProtocolError(
                f"BatchTokenIDOutSlim: missing positional field {_COLUMNS[n - 1]!r} "
                f"(got {n} elements, need >= {BATCH_MIN_ELEMENTS})"
            )
        obj = obj[:BATCH_ELEMENTS] if n > BATCH_ELEMENTS else obj + _TAIL_PADS[n]
    (_tag, rids, output_ids, reasons, prompt, completion, cached, lp_vals, lp_ids,
     engine_index, num_running, num_waiting, kv_active, kv_total) = obj

    for name, v in zip(_SCALARS, (engine_index, num_running, num_waiting, kv_active, kv_total)):
        if type(v) is not int or v < 0:
            raise _bad_batch(f"{name}: expected a non-negative int, got {v!r:.40}")
    if type(rids) is not tuple:
        raise _bad_batch(f"rids: expected an array, got {_tname(rids)}")
    m = len(rids)
    if m > _limits.MAX_OUTPUTS_PER_MESSAGE:
        raise _bad_batch(f"rids: {m} requests exceed MAX_OUTPUTS_PER_MESSAGE")
    max_tokens = _limits.MAX_TOKENS_PER_TICK
    max_id = _max_token_id()
    _check_flat_column("rids", rids, m, _STR_T, bound=None)
    _check_nested_column("output_ids", output_ids, m, _INT_T, bound=max_id, max_len=max_tokens)
    _check_flat_column("finished_reasons", reasons, m, _STR_T, bound=None)
    _check_flat_column("prompt_tokens", prompt, m, _INT_T, bound=max_id)
    _check_flat_column("completion_tokens", completion, m, _INT_T, bound=max_id)
    _check_flat_column("cached_tokens", cached, m, _INT_T, bound=max_id)
    if (
        type(lp_vals) is tuple
        and type(lp_ids) is tuple
        and len(lp_vals) == m == len(lp_ids)
        and lp_vals.count(()) == m == lp_ids.count(())
    ):
        pass  # the common case, no request asked for logprobs: every row is empty
    else:
        _check_logprob_columns(lp_vals, lp_ids, m, max_tokens, max_id)
    return TokenSpeedBatch(
        engine_index=engine_index,
        rids=rids,
        output_ids=output_ids,
        finished_reasons=reasons,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        logprob_vals=lp_vals,
        logprob_ids=lp_ids,
        num_running=num_running,
        num_waiting=num_waiting,
        kv_active_pages=kv_active,
        kv_total_pages=kv_total,
        wire_elements=n,
    )


def _check_logprob_columns(lp_vals: Any, lp_ids: Any, m: int, max_tokens: int, max_id: int) -> None:
    _check_nested_column("output_token_logprobs_val", lp_vals, m, _NUM_T, bound=None, max_len=max_tokens)
    _check_nested_column("output_token_logprobs_idx", lp_ids, m, _INT_T, bound=max_id, max_len=max_tokens)
    if m and tuple(map(len, lp_vals)) != tuple(map(len, lp_ids)):
        i = _first_bad(range(m), lambda k: len(lp_vals[k]) == len(lp_ids[k]))
        raise _bad_batch(
            f"output_token_logprobs_val[{i}]: {len(lp_vals[i])} values for {len(lp_ids[i])} token ids"
        )


# =========================================================================== handshake


def decode_ready_response(payload: bytes) -> EngineCoreReadyResponse:
    """Decode a ready response; the vLLM decoder already reads TokenSpeed's map.

    ``prefix_granularity`` lands in ``block_size``; ``multimodal_encoder_dtype`` is
    ignored; ``vllm_version`` is ``"tokenspeed-<version>"`` (see :func:`is_tokenspeed`).
    Note ``max_model_len`` is the model's context length, not what the cache admits.
    Raises RemoteProtocolError.
    """
    return _handshake.decode_ready_response(payload)


def is_tokenspeed(resp: EngineCoreReadyResponse) -> bool:
    """True when a ready response came from TokenSpeed (``vllm_version`` ``"tokenspeed-..."``)."""
    return resp.vllm_version.startswith("tokenspeed-")


