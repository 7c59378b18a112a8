"""vLLM v1 EngineCore output messages, client side (vLLM 0.32.0; 0.33.0 tolerated), sans-IO.

:func:`decode_outputs` (the hot path, once per engine step) turns one output message
``[payload, *aux]`` into an :class:`EngineCoreOutputs` of :class:`EngineCoreOutputRow`
rows (a msgspec typed decode; :func:`_decode_outputs_msgpack` is the msgpack reference
and fallback); :class:`UtilityOutput` is the reply to a UTILITY call;
:func:`decode_logprobs_lists` / :func:`decode_logprobs_tensors` read a row's logprobs.
Every name here is also importable from :mod:`zmqdispatch.wire.vllm` (the client side
of the wire as one module); the request side lives there. Wire rules and sources: see
that module's docstring and ``docs/vllm-wire.md`` §5.

Errors: every decoder raises only :class:`~zmqdispatch.errors.RemoteProtocolError` for
bytes that do not decode (the connection counts them).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Annotated, Any

import attrs
import msgpack
import msgspec

from zmqdispatch import limits as _limits
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire.schema import (
    _k_int,
    _k_opt,
    _k_str,
    _to_wire,
    _unpack_output_message,
    msgpack_array_len,
)
from zmqdispatch.wire.tensors import decode_tensor, ext_hook

# =========================================================================== outputs


class EngineCoreOutputRow(msgspec.Struct, array_like=True, gc=False):
    """One ``EngineCoreOutput`` of a decoded message: vLLM 0.32.0's 18 fields in wire
    order (array_like), plus 0.33.0's ``error``; a field the engine omitted (vLLM encodes
    with ``omit_defaults``: trailing defaults may be left out) has vLLM's default.

    Checked by :func:`decode_outputs`: ``request_id`` str; ``new_token_ids`` a tuple of
    at most ``limits.MAX_TOKENS_PER_TICK`` token ids in ``0..limits.MAX_TOKEN_ID`` (the
    step's *new* tokens); ``finish_reason`` nil or 0..4 (:class:`FinishReason`);
    ``stop_reason`` nil, a token id or a str; ``prefill_stats`` nil or a map whose
    ``num_prompt_tokens`` / ``num_cached_tokens`` are nil or counts in ``0..MAX_TOKEN_ID``.
    The other fields are the raw decoded values, arrays as lists (logprobs: see
    :func:`decode_logprobs_lists`; tensors ``[dtype, shape, data]``:
    :func:`~zmqdispatch.wire.tensors.decode_tensor`); ``error`` is a map or None.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    trace_headers: Any = None
    prefill_stats: dict[Any, Any] | None = None
    routed_experts: Any = None
    num_nans_in_logits: Any = 0
    mm_cache_miss_hashes: Any = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None
    error: Any = None


#: Fields of an :class:`EngineCoreOutputRow` (vLLM 0.32.0's 18, then 0.33.0's ``error``).
ROW_FIELDS = EngineCoreOutputRow.__struct_fields__
_ROW_N = len(ROW_FIELDS)
# Positions the typed decode reads as ``Any`` (arrays as lists): the reference decoder
# turns its tuples into lists there, so both decoders build equal rows.
_OPAQUE_POSITIONS = tuple(
    i for i, f in enumerate(ROW_FIELDS) if f not in ("request_id", "new_token_ids", "finish_reason", "stop_reason")
)
# vLLM's defaults for each position (0 and 1 are required).
_ROW_DEFAULTS: tuple[Any, ...] = (None, ()) + tuple(EngineCoreOutputRow.__struct_defaults__)
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

    def _to_wire(self) -> list[Any]:
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
        result = UtilityResult(_as_any(result[1]), _as_any(result[0]))
    return UtilityOutput(call_id=raw[0], failure_message=failure, result=result)

@attrs.define(slots=True)
class EngineCoreOutputs:
    """One decoded output message (vLLM ``EngineCoreOutputs``, array_like, 9 fields).

    Attributes:
        engine_index: the sending engine's index (DP rank).
        outputs: the ``EngineCoreOutput`` rows, as :class:`EngineCoreOutputRow` (fields
            named as vLLM names them; checks: see that class).
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
    outputs: tuple[EngineCoreOutputRow, ...] = ()
    scheduler_stats: dict[str, Any] | None = None
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


def _ext_hook(code: int, data: memoryview) -> bytes:
    return ext_hook(code, bytes(data))


_DECODERS: dict[tuple[int, int, int], tuple[Any, msgspec.msgpack.Decoder[Any]]] = {}


def _typed(max_rows: int, max_tokens: int, max_id: int) -> tuple[Any, msgspec.msgpack.Decoder[Any]]:
    """The row class (an :class:`EngineCoreOutputRow` whose checked fields carry these
    limits as ``msgspec.Meta`` constraints) and the typed ``EngineCoreOutputs`` decoder
    (cached; the limits are read on every call, so a changed limit takes effect)."""
    key = (max_rows, max_tokens, max_id)
    got = _DECODERS.get(key)
    if got is None:
        tid = Annotated[int, msgspec.Meta(ge=0, le=max_id)]
        row = msgspec.defstruct(
            "EngineCoreOutputRow",
            [
                ("new_token_ids", Annotated[tuple[tid, ...], msgspec.Meta(max_length=max_tokens)]),
                ("finish_reason", Annotated[int, msgspec.Meta(ge=0, le=4)] | None, None),
                ("stop_reason", tid | str | None, None),
            ],
            bases=(EngineCoreOutputRow,),
            module=__name__,
            array_like=True,
            gc=False,
        )
        utility = msgspec.defstruct(
            "UtilityOutput",
            [("call_id", int), ("failure_message", str | None, None), ("result", tuple[Any, Any] | None, None)],
            module=__name__,
            array_like=True,
            gc=False,
        )
        envelope = msgspec.defstruct(
            "EngineCoreOutputs",
            [
                ("engine_index", int),
                ("outputs", Annotated[tuple[row, ...], msgspec.Meta(max_length=max_rows)]),  # type: ignore[valid-type]
                ("scheduler_stats", dict[Any, Any] | None, None),
                ("timestamp", float, 0.0),
                ("utility_output", utility | None, None),
                ("finished_requests", tuple[str, ...] | None, None),
                ("wave_complete", int | None, None),
                ("start_wave", int | None, None),
                ("weight_version", str | None, None),
            ],
            module=__name__,
            array_like=True,
            gc=False,
        )
        got = _DECODERS[key] = (row, msgspec.msgpack.Decoder(envelope, ext_hook=_ext_hook))
    return got


_prefill_of = operator.attrgetter("prefill_stats")


def decode_outputs(frames: Sequence[bytes]) -> EngineCoreOutputs:
    """Decode one output message ``[payload, *aux]`` (the hot path: once per engine step).

    Wire format: vLLM 0.32.0 ``vllm/v1/engine/__init__.py`` ``EngineCoreOutputs`` /
    ``EngineCoreOutput`` (array_like, ``omit_defaults``). One ``msgspec`` typed decode
    into :class:`EngineCoreOutputRow` rows (the row checks are its types and ``Meta``
    constraints, as vLLM's own decoder reads these structs), then the prefill counts of
    the rows that carry ``prefill_stats`` (only if the payload holds their keys at all);
    no per-token objects. Envelopes of 2 to 9 elements and rows of 2 to 19 take vLLM's
    defaults for what is missing; elements after a row's 19th (a newer vLLM's fields)
    and after a ``utility_output``'s 3rd are skipped unread, as msgspec skips fields it
    does not know (so junk there, which the reference would refuse, is not seen).

    A message the typed decode refuses (one bad row refuses the whole decode), a bad
    ``prefill_stats``, and an envelope of more than 9 elements go through
    :func:`_decode_outputs_msgpack`, the msgpack reference decoder: it raises the error
    naming the field, or decodes the message with its bad rows set aside in
    :attr:`EngineCoreOutputs.bad_rows`, so the errors and rows are that decoder's.

    Raises:
        RemoteProtocolError: the ``ENGINE_CORE_DEAD`` sentinel (check
            :func:`is_dead_sentinel` first), no frames, a frame over
            ``limits.MAX_FRAME_BYTES``, undecodable msgpack, a pickle/unknown ext type,
            or an envelope field of the wrong shape (message names it). More than
            ``limits.MAX_OUTPUTS_PER_MESSAGE`` rows is also refused. A bad row does not
            raise: it is reported in ``bad_rows``.
    """
    max_frame = _limits.MAX_FRAME_BYTES
    if frames and all(len(f) <= max_frame for f in frames):
        payload = frames[0]
        if 2 <= msgpack_array_len(payload) <= _ENVELOPE_LEN:
            max_id = _limits.MAX_TOKEN_ID
            _row, dec = _typed(_limits.MAX_OUTPUTS_PER_MESSAGE, _limits.MAX_TOKENS_PER_TICK, max_id)
            try:
                m = dec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError, RemoteProtocolError, RecursionError):
                m = None
            if m is not None:
                rows = m.outputs
                # The prefill counts are checked here; a payload in which neither key
                # occurs (a steady decode step) holds none to check.
                if (
                    (type(payload) is bytes and b"num_prompt_tokens" not in payload
                     and b"num_cached_tokens" not in payload)
                    or all(_prefill_stats_ok(ps, max_id) for ps in filter(None, map(_prefill_of, rows)))
                ):
                    u = m.utility_output
                    return EngineCoreOutputs(
                        m.engine_index,
                        rows,
                        m.scheduler_stats,
                        m.timestamp,
                        None if u is None else UtilityOutput(
                            call_id=u.call_id,
                            failure_message=u.failure_message,
                            result=None if u.result is None else UtilityResult(u.result[1], u.result[0]),
                        ),
                        m.finished_requests,
                        m.wave_complete,
                        m.start_wave,
                        m.weight_version,
                        frames,
                    )
    return _decode_outputs_msgpack(frames)


def _decode_outputs_msgpack(frames: Sequence[bytes]) -> EngineCoreOutputs:
    """:func:`decode_outputs` with ``msgpack.unpackb`` and Python checks: the reference
    decoder, and the path of every message the typed decode refuses.

    One ``msgpack.unpackb`` (arrays as tuples), the envelope checks, then every row
    checked on its own: a bad row is set aside in ``bad_rows`` with its request id
    (when readable) and the error naming the field, the others go on. Rows are built
    as the typed decode builds them (arrays in the ``Any`` fields as lists, msgpack
    timestamps as ``datetime``); envelopes longer than 9 elements are accepted.
    Raises RemoteProtocolError like :func:`decode_outputs`.
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
    if stats is not None:
        if type(stats) is not dict:
            raise RemoteProtocolError("EngineCoreOutputs.scheduler_stats: expected a map or nil")
        stats = _as_any(stats)
    if type(timestamp) is not float:
        if type(timestamp) is not int:
            raise RemoteProtocolError("EngineCoreOutputs.timestamp: expected a float")
        timestamp = float(timestamp)
    if utility is not None:
        utility = _decode_utility_output(utility)
    if finished is not None and (type(finished) is not tuple or not all(type(r) is str for r in finished)):
        raise RemoteProtocolError("EngineCoreOutputs.finished_requests: expected an array of str or nil")
    if wave_complete is not None and type(wave_complete) is not int:
        raise RemoteProtocolError("EngineCoreOutputs.wave_complete: expected an int or nil")
    if start_wave is not None and type(start_wave) is not int:
        raise RemoteProtocolError("EngineCoreOutputs.start_wave: expected an int or nil")
    if weight_version is not None and type(weight_version) is not str:
        raise RemoteProtocolError("EngineCoreOutputs.weight_version: expected a str or nil")

    max_tokens = _limits.MAX_TOKENS_PER_TICK
    max_id = _limits.MAX_TOKEN_ID
    row_cls = _typed(_limits.MAX_OUTPUTS_PER_MESSAGE, max_tokens, max_id)[0]
    out: list[EngineCoreOutputRow] = []
    bad: list[tuple[str | None, RemoteProtocolError]] = []
    full = _ROW_N - 1  # 0.32.0's 18 fields
    _tuple, _int, _str, _dict = tuple, int, str, dict
    for i, row in enumerate(rows):
        # The accepted shape of a full row first, one expression per field; the
        # problem (or the padding of a short row) is worked out only for the others.
        if type(row) is _tuple and len(row) >= full and type(row[0]) is _str:
            toks = row[1]
            if type(toks) is _tuple and len(toks) <= max_tokens:
                for t in toks:
                    if type(t) is not _int or t < 0 or t > max_id:
                        break
                else:
                    fr, sr, ps = row[5], row[6], row[11]
                    if (
                        (fr is None or (type(fr) is _int and 0 <= fr <= 4))
                        and (sr is None or type(sr) is _str or (type(sr) is _int and 0 <= sr <= max_id))
                        and (ps is None or (type(ps) is _dict and _prefill_stats_ok(ps, max_id)))
                    ):
                        out.append(_row_struct(row_cls, row))
                        continue
        problem = _row_problem(row, max_tokens, max_id)
        if type(problem) is tuple:
            out.append(_row_struct(row_cls, problem))
            continue
        rid = row[0] if type(row) is tuple and row and type(row[0]) is str else None
        bad.append((rid, _bad_output(i, problem)))

    return EngineCoreOutputs(
        engine_index,
        tuple(out),
        stats,
        timestamp,
        utility,
        finished,
        wave_complete,
        start_wave,
        weight_version,
        frames,
        tuple(bad),
    )


_PLAIN_TAIL = _ROW_DEFAULTS[12:18]
_NONE_3 = (None,) * 3
_NONE_5 = (None,) * 5


def _row_struct(row_cls: Any, row: tuple[Any, ...]) -> EngineCoreOutputRow:
    """A checked raw row (at least 18 elements) as the typed decode builds it."""
    if (
        row[2:5] == _NONE_3
        and row[7:12] == _NONE_5
        and row[12:18] == _PLAIN_TAIL
        and (len(row) < _ROW_N or row[_ROW_N - 1] is None)
    ):
        # A plain decode tick: nothing to convert (no array in an ``Any`` field).
        r0: EngineCoreOutputRow = row_cls(*row[:_ROW_N])
        return r0
    values = list(row[:_ROW_N])
    for i in _OPAQUE_POSITIONS:
        if i < len(values) and values[i] is not None:
            values[i] = _as_any(values[i])
    r: EngineCoreOutputRow = row_cls(*values)
    return r


def _timestamp(ts: msgpack.Timestamp) -> Any:
    try:
        return ts.to_datetime()
    except (OverflowError, ValueError, OSError):
        raise RemoteProtocolError(f"msgpack timestamp out of range: {ts!r:.80}") from None


def _as_any(value: Any) -> Any:
    """*value* (from ``msgpack.unpackb`` with arrays as tuples) as msgspec decodes an
    ``Any``: arrays as lists, timestamps (ext -1) as ``datetime``; map keys are kept
    (msgspec, too, makes array keys tuples). Iterative: msgpack nests up to 1024 deep."""
    t = type(value)
    if t is tuple:
        value = list(value)
    elif t is msgpack.Timestamp:
        return _timestamp(value)
    elif t is not dict:
        return value
    todo: list[Any] = [value]
    while todo:
        c = todo.pop()
        for k, v in (c.items() if type(c) is dict else enumerate(c)):
            t = type(v)
            if t is tuple:
                c[k] = v = list(v)
                todo.append(v)
            elif t is dict:
                todo.append(v)
            elif t is msgpack.Timestamp:
                c[k] = _timestamp(v)
    return value


def _row_problem(row: Any, max_tokens: int, max_id: int) -> Any:
    """One output row checked by the reference decoder: the row padded to 18 elements
    (vLLM 0.32.0's fields) with vLLM's defaults if it is well formed, else what is
    wrong (str)."""
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
    if len(row) < _ROW_N - 1:
        row += _ROW_DEFAULTS[len(row) : _ROW_N - 1]
    fr = row[5]
    if fr is not None and (type(fr) is not int or fr < 0 or fr > 4):
        return f"finish_reason: {fr!r} is not nil or 0..4"
    sr = row[6]
    if sr is not None and type(sr) is not str and (type(sr) is not int or sr < 0 or sr > max_id):
        return "stop_reason: expected nil, a token id or a str"
    ps = row[11]
    if ps is not None and (type(ps) is not dict or not _prefill_stats_ok(ps, max_id)):
        return "prefill_stats: expected nil or a map of non-negative int counts"
    return row


def _prefill_stats_ok(ps: dict[Any, Any], max_count: int) -> bool:
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
    """Decode a row's ``new_logprobs`` (sample logprobs) into lists.

    Wire: vLLM 0.32.0 ``LogprobsLists`` NamedTuple as an array ``[ids ndarray int32 [n, k+1],
    logprobs ndarray float32 [n, k+1], ranks ndarray int64 [n], cu_num_generated_tokens|nil]``,
    each array inline (ext 3) or in an aux frame of ``frames``.

    Raises:
        RemoteProtocolError: malformed tensors, or shapes that disagree (rows and columns).
    """
    return _decode_logprobs(raw, frames, "new_logprobs")


def decode_logprobs_tensors(raw: Any, frames: Sequence[bytes]) -> LogprobsLists:
    """Decode a row's ``new_prompt_logprobs_tensors`` (prompt logprobs) into lists.

    Wire: vLLM 0.32.0 ``LogprobsTensors`` NamedTuple ``[ids tensor int32 [P-1, k+1],
    logprobs tensor float32 [P-1, k+1], ranks tensor int32 [P-1], nil, nil]`` (torch dtype
    names). Row i scores prompt token i+1. Raises RemoteProtocolError like
    :func:`decode_logprobs_lists`.
    """
    return _decode_logprobs(raw, frames, "new_prompt_logprobs_tensors")


