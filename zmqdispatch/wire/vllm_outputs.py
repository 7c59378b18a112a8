"""vLLM v1 EngineCore output messages, client side (vLLM 0.32.0; 0.33.0 tolerated), sans-IO.

:func:`decode_outputs` (the hot path, once per engine step) turns one output message
``[payload, *aux]`` into an :class:`EngineCoreOutputs`; the raw rows are indexed with
the ``O_*`` constants; :class:`UtilityOutput` is the reply to a UTILITY call;
:func:`decode_logprobs_lists` / :func:`decode_logprobs_tensors` read a row's logprobs.
Every name here is also importable from :mod:`zmqdispatch.wire.vllm` (the client side
of the wire as one module); the request side lives there. Wire rules and sources: see
that module's docstring and ``docs/vllm-wire.md`` §5.

Errors: every decoder raises only :class:`~zmqdispatch.errors.RemoteProtocolError` for
bytes that do not decode (the connection counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from zmqdispatch import limits as _limits
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire.schema import (
    _k_int,
    _k_opt,
    _k_str,
    _to_wire,
    _unpack_output_message,
)
from zmqdispatch.wire.tensors import decode_tensor

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
        result = UtilityResult(result[1], result[0])
    return UtilityOutput(call_id=raw[0], failure_message=failure, result=result)


@attrs.define(slots=True)
class EngineCoreOutputs:
    """One decoded output message (vLLM ``EngineCoreOutputs``, array_like, 9 fields).

    Attributes:
        engine_index: the sending engine's index (DP rank).
        outputs: raw ``EngineCoreOutput`` rows, each a tuple of at least :data:`ROW_LEN`
            elements indexed with the ``O_*`` constants (``O_ERROR``: :func:`output_error`).
            Checked: ``[O_REQUEST_ID]`` str,
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
    if finished is not None and (type(finished) is not tuple or not all(type(r) is str for r in finished)):
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


