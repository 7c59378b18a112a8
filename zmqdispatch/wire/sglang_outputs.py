"""SGLang scheduler outputs, client side (the SGLang plugin's slim messages), sans-IO.

:func:`decode_outputs` (the hot path, once per scheduler step) reads one output
message: a :class:`SGLangBatch` (``BatchTokenIDSlimOutput``: columns parallel to
``rids``, then a load tail and optional columns) or a :class:`ControlReply`
(``ControlReplySlim``, the answer to a CONTROL call). Every name is also importable
from :mod:`zmqdispatch.wire.sglang`. Format: ``docs/sglang.md``.

Errors: the decoder raises only :class:`~zmqdispatch.errors.RemoteProtocolError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

import attrs
import msgspec

from zmqdispatch import limits as _limits
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire.schema import _tname, _unpack_output_message, msgpack_array_len

__all__ = [
    "BATCH_MIN_ELEMENTS",
    "BATCH_TAG",
    "CONTROL_TAG",
    "EMBEDDING_TAG",
    "ControlReply",
    "SGLangBatch",
    "SGLangLoad",
    "decode_outputs",
]

#: Element 0 of a token output batch.
BATCH_TAG = "BatchTokenIDSlimOutput"
#: Element 0 of a control reply.
CONTROL_TAG = "ControlReplySlim"
#: Element 0 of an embedding batch (never an answer to this client's requests).
EMBEDDING_TAG = "BatchEmbeddingSlimOutput"
#: Shortest batch that decodes: tag + the 10 columns without a default.
BATCH_MIN_ELEMENTS = 11
#: Elements up to ``reasoning_tokens`` (what this decoder reads; later ones are
#: columns of features this client never asks for, checked to be arrays or nil).
_READ_ELEMENTS = 20

_COLUMNS = ("rids", "output_ids", "finished_reasons", "finished_messages", "finished_matched",
            "prompt_tokens", "completion_tokens", "cached_tokens",
            "output_token_logprobs_val", "output_token_logprobs_idx")
_SCALARS = ("engine_index", "num_running", "num_waiting", "kv_used_tokens", "kv_total_tokens")
_OPTIONAL = ("finished_status", "output_top_logprobs_val", "output_top_logprobs_idx", "reasoning_tokens")


@attrs.frozen
class SGLangLoad:
    """The scheduler load a batch carries (only when ``kv_total_tokens > 0``), in **tokens**.

    Sampled at most every 50 ms when the batch was sent; an idle scheduler sends nothing.
    """

    engine_index: int
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (0..1)."""
        return self.kv_used_tokens / self.kv_total_tokens


@attrs.frozen
class ControlReply:
    """``ControlReplySlim``: the scheduler's answer to the CONTROL call ``call_id``.

    ``message`` is the scheduler's text (``""`` or None on most successes).
    """

    call_id: int
    success: bool
    message: str | None
    engine_index: int


@attrs.define(slots=True, kw_only=True)
class SGLangBatch:
    """One ``BatchTokenIDSlimOutput``; every column a tuple parallel to ``rids`` (checked).

    Attributes:
        rids: requests that emit this step.
        output_ids: per rid, the tokens since its previous output (the token that
            ended a ``"stop"`` is included).
        finished_reasons: ``""`` while running, else ``"stop"`` / ``"length"`` /
            ``"abort"``. An ``"abort"`` the client did not ask for (a refused
            request, an engine-side abort) carries its reason in ``finished_messages``
            and an HTTP status in ``finished_status`` (400: the request's fault).
        finished_matched: the stop token id (int) or stop string that ended a
            ``"stop"``; None for EOS, other finishes and running requests.
        prompt_tokens, completion_tokens (cumulative), cached_tokens: counts.
        logprob_vals / logprob_ids: the sampled tokens' logprobs and ids, ``()`` when
            the request did not ask.
        top_logprob_vals / top_logprob_ids: per rid, per new token, the ranked
            candidates (``top_logprobs_num`` of them); ``()`` rows when not asked,
            None when the column is absent.
        finished_status, reasoning_tokens, finished_err_types: optional columns (None
            when absent).
        engine_index, num_running, num_waiting, kv_used_tokens, kv_total_tokens: the
            producing rank and its load (``kv_total_tokens == 0``: no load reported).
        wire_elements: array elements of the message (not part of equality).
    """

    rids: tuple[str, ...] = ()
    output_ids: tuple[tuple[int, ...], ...] = ()
    finished_reasons: tuple[str, ...] = ()
    finished_messages: tuple[str | None, ...] = ()
    finished_matched: tuple[int | str | None, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    completion_tokens: tuple[int, ...] = ()
    cached_tokens: tuple[int, ...] = ()
    logprob_vals: tuple[tuple[float, ...], ...] = ()
    logprob_ids: tuple[tuple[int, ...], ...] = ()
    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    finished_status: tuple[int | None, ...] | None = None
    top_logprob_vals: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    top_logprob_ids: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    reasoning_tokens: tuple[int, ...] | None = None
    finished_err_types: tuple[str | None, ...] | None = None
    wire_elements: int = attrs.field(default=BATCH_MIN_ELEMENTS, eq=False)

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def load(self) -> SGLangLoad | None:
        """The load snapshot, or None when the batch carries none."""
        if self.kv_total_tokens <= 0:
            return None
        return SGLangLoad(self.engine_index, self.num_running, self.num_waiting, self.kv_used_tokens,
                          self.kv_total_tokens)


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"{BATCH_TAG}.{what}")


def _first_bad(col: Sequence[Any], ok: Callable[[Any], bool]) -> int:
    return next((i for i, x in enumerate(col) if not ok(x)), -1)


def _flat(name: str, col: Any, m: int, ok: Callable[[Any], bool], want: str) -> tuple[Any, ...]:
    if type(col) is not tuple or len(col) != m:
        raise _bad(f"{name}: expected an array of {m} elements (ragged columns), got "
                   f"{len(col) if type(col) is tuple else _tname(col)}")
    i = _first_bad(col, ok)
    if i >= 0:
        raise _bad(f"{name}[{i}]: expected {want}, got {col[i]!r:.40}")
    return col


def _nested(name: str, col: Any, m: int, ok: Callable[[Any], bool], want: str) -> tuple[tuple[Any, ...], ...]:
    max_len = _limits.MAX_TOKENS_PER_TICK
    if type(col) is not tuple or len(col) != m:
        raise _bad(f"{name}: expected an array of {m} elements (ragged columns), got "
                   f"{len(col) if type(col) is tuple else _tname(col)}")
    for i, row in enumerate(col):
        if type(row) is not tuple:
            raise _bad(f"{name}[{i}]: expected an array, got {_tname(row)}")
        if len(row) > max_len:
            raise _bad(f"{name}[{i}]: {len(row)} entries exceed MAX_TOKENS_PER_TICK ({max_len})")
        if not all(map(ok, row)):
            raise _bad(f"{name}[{i}]: expected an array of {want}")
    return col


def _is_u32(x: Any) -> bool:
    return type(x) is int and 0 <= x <= _limits.MAX_TOKEN_ID


def _is_num(x: Any) -> bool:
    return type(x) in (int, float)


def _top(name: str, col: Any, m: int, ok: Callable[[Any], bool], want: str) -> tuple[Any, ...]:
    # per rid, per new token, a ranked candidate list
    rows = _nested(name, col, m, lambda step: type(step) is tuple, "arrays")
    for i, row in enumerate(rows):
        for step in row:
            if len(step) > _limits.MAX_TOKENS_PER_TICK or not all(map(ok, step)):
                raise _bad(f"{name}[{i}]: expected arrays of {want}")
    return rows


_DECODERS: dict[tuple[int, int, int], msgspec.msgpack.Decoder[Any]] = {}
#: Elements of the plugin's batch (tag + 27 fields); longer ones go to the reference decoder.
_FULL_ELEMENTS = 28


def _typed_decoder(max_rows: int, max_tokens: int, max_id: int) -> msgspec.msgpack.Decoder[Any]:
    """A typed decoder of the two tagged messages, the value checks as ``msgspec.Meta``
    constraints (cached per limits; the limits are read on every call)."""
    key = (max_rows, max_tokens, max_id)
    dec = _DECODERS.get(key)
    if dec is None:
        tid = Annotated[int, msgspec.Meta(ge=0, le=max_id)]
        toks = Annotated[tuple[tid, ...], msgspec.Meta(max_length=max_tokens)]
        vals = Annotated[tuple[int | float, ...], msgspec.Meta(max_length=max_tokens)]
        non_neg = Annotated[int, msgspec.Meta(ge=0)]
        fields: list[Any] = [
            ("rids", Annotated[tuple[str, ...], msgspec.Meta(max_length=max_rows)]),
            ("output_ids", tuple[toks, ...]),
            ("finished_reasons", tuple[str, ...]),
            ("finished_messages", tuple[str | None, ...]),
            ("finished_matched", tuple[int | str | None, ...]),
            ("prompt_tokens", tuple[tid, ...]),
            ("completion_tokens", tuple[tid, ...]),
            ("cached_tokens", tuple[tid, ...]),
            ("output_token_logprobs_val", tuple[vals, ...]),
            ("output_token_logprobs_idx", tuple[toks, ...]),
            *((name, non_neg, 0) for name in _SCALARS),
            ("finished_status", tuple[int | None, ...] | None, None),
            ("output_top_logprobs_val", tuple[tuple[vals, ...], ...] | None, None),
            ("output_top_logprobs_idx", tuple[tuple[toks, ...], ...] | None, None),
            ("reasoning_tokens", tuple[tid, ...] | None, None),
            # columns of features this client never asks for: skipped unread
            *((f"unread{k}", msgspec.Raw, None) for k in range(20, 26)),
            ("finished_err_types", tuple[str | None, ...] | None, None),
            ("unread27", msgspec.Raw, None),
        ]
        batch = msgspec.defstruct("_Batch", fields, array_like=True, tag=BATCH_TAG, gc=False)
        control = msgspec.defstruct("_Control", [("call_id", non_neg), ("success", bool),
                                                 ("message", str | None, None), ("engine_index", non_neg, 0)],
                                    array_like=True, tag=CONTROL_TAG)
        dec = _DECODERS[key] = msgspec.msgpack.Decoder(batch | control)
    return dec


def _rows_equal(a: tuple[tuple[Any, ...], ...], b: tuple[tuple[Any, ...], ...]) -> bool:
    return tuple(map(len, a)) == tuple(map(len, b))


def decode_outputs(frames: Sequence[bytes]) -> SGLangBatch | ControlReply:
    """Decode one output message ``[payload]`` from the scheduler (the hot path).

    One ``msgspec`` typed decode (the checks below as its types and ``Meta``
    constraints; the unread columns skipped as raw bytes), then the ragged-column
    checks on the decoded tuples. A message the typed decode refuses goes through
    :func:`_decode_outputs_msgpack`, the reference decoder, which raises the error
    naming the field: the errors below are its.

    A ``BatchTokenIDSlimOutput`` of at least 11 elements (the tail takes its
    defaults: rank 0, no load, no optional columns); elements after the 27th and
    extra frames are ignored. Checked: the tag; ``rids`` str, at most
    ``limits.MAX_OUTPUTS_PER_MESSAGE``; every column exactly ``len(rids)`` long;
    token ids and counts ints in ``0..limits.MAX_TOKEN_ID``; at most
    ``limits.MAX_TOKENS_PER_TICK`` tokens per row; logprob values numbers, as many
    as their ids; ``finished_matched`` int, str or nil; the scalars non-negative
    ints; the optional columns nil or of the right shape.

    Raises:
        RemoteProtocolError: the ``ENGINE_CORE_DEAD`` sentinel (check
            :func:`~zmqdispatch.wire.schema.is_dead_sentinel` first), no frames, a
            frame over ``limits.MAX_FRAME_BYTES``, undecodable msgpack, an unknown
            tag ("wrong msgspec tag"), an embedding batch (this client sends no
            embedding requests), a control reply that does not decode, or any
            check above (the message names the column and index).
    """
    max_frame = _limits.MAX_FRAME_BYTES
    if frames and all(len(f) <= max_frame for f in frames):
        payload = frames[0]
        if BATCH_MIN_ELEMENTS <= msgpack_array_len(payload) <= _FULL_ELEMENTS or payload[:1] == b"\x95":
            try:
                b = _typed_decoder(_limits.MAX_OUTPUTS_PER_MESSAGE, _limits.MAX_TOKENS_PER_TICK,
                                   _limits.MAX_TOKEN_ID).decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                b = None
            if b is not None and type(b).__name__ == "_Control":
                return ControlReply(b.call_id, b.success, b.message, b.engine_index)
            if b is not None:
                batch = _checked(b, msgpack_array_len(payload))
                if batch is not None:
                    return batch
    return _decode_outputs_msgpack(frames)


def _checked(b: Any, n: int) -> SGLangBatch | None:
    """The typed decode's batch after the ragged-column checks, or None (the
    reference decoder then names what is wrong)."""
    m = len(b.rids)
    lp_vals, lp_ids = b.output_token_logprobs_val, b.output_token_logprobs_idx
    if not (len(b.output_ids) == m == len(b.finished_reasons) == len(b.finished_messages)
            and len(b.finished_matched) == m == len(b.prompt_tokens) == len(b.completion_tokens)
            and len(b.cached_tokens) == m == len(lp_vals) == len(lp_ids)
            and (lp_vals.count(()) == m == lp_ids.count(()) or _rows_equal(lp_vals, lp_ids))):
        return None
    for col in (b.finished_status, b.reasoning_tokens, b.finished_err_types):
        if col is not None and len(col) != m:
            return None
    top_vals, top_ids = b.output_top_logprobs_val, b.output_top_logprobs_idx
    if top_vals is not None or top_ids is not None:
        if top_vals is None or top_ids is None or len(top_vals) != m or len(top_ids) != m:
            return None
        if not (top_vals.count(()) == m == top_ids.count(())):
            for i in range(m):
                tv, ti = top_vals[i], top_ids[i]
                if not _rows_equal(tv, ti) or (tv and len(tv) != len(lp_vals[i])):
                    return None
    for raw in (b.unread20, b.unread21, b.unread22, b.unread23, b.unread24, b.unread25, b.unread27):
        if raw is not None and memoryview(raw)[0] not in _ARRAY_OR_NIL:
            return None
    return SGLangBatch(
        rids=b.rids, output_ids=b.output_ids, finished_reasons=b.finished_reasons,
        finished_messages=b.finished_messages, finished_matched=b.finished_matched, prompt_tokens=b.prompt_tokens,
        completion_tokens=b.completion_tokens, cached_tokens=b.cached_tokens, logprob_vals=lp_vals,
        logprob_ids=lp_ids, engine_index=b.engine_index, num_running=b.num_running, num_waiting=b.num_waiting,
        kv_used_tokens=b.kv_used_tokens, kv_total_tokens=b.kv_total_tokens, finished_status=b.finished_status,
        top_logprob_vals=top_vals, top_logprob_ids=top_ids, reasoning_tokens=b.reasoning_tokens,
        finished_err_types=b.finished_err_types, wire_elements=n,
    )


#: First bytes of a msgpack array (fixarray, array16, array32) or nil.
_ARRAY_OR_NIL = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD, 0xC0})


def _decode_outputs_msgpack(frames: Sequence[bytes]) -> SGLangBatch | ControlReply:
    """:func:`decode_outputs` with ``msgpack.unpackb`` and Python checks: the
    reference decoder, and the path of every message the typed decode refuses."""
    obj = _unpack_output_message(frames, BATCH_TAG)
    if type(obj) is not tuple or not obj:
        raise RemoteProtocolError(f"{BATCH_TAG}: expected a tagged array, got {_tname(obj)}")
    tag = obj[0]
    if tag == CONTROL_TAG:
        return _control_reply(obj)
    if tag == EMBEDDING_TAG:
        raise RemoteProtocolError(f"{EMBEDDING_TAG}: an embedding output, but this client sends no embedding requests")
    if type(tag) is not str or tag != BATCH_TAG:
        raise RemoteProtocolError(f"wrong msgspec tag: expected {BATCH_TAG!r}, got {tag!r:.60}")
    n = len(obj)
    if n < BATCH_MIN_ELEMENTS:
        raise RemoteProtocolError(
            f"{BATCH_TAG}: missing positional field {_COLUMNS[n - 1]!r} (got {n} elements, "
            f"need >= {BATCH_MIN_ELEMENTS})"
        )
    row = obj[:_READ_ELEMENTS] + (None,) * max(0, _READ_ELEMENTS - n)
    scalars = [0 if v is None and i >= n else v for i, v in enumerate(row[11:16], start=11)]
    for name, v in zip(_SCALARS, scalars):
        if type(v) is not int or v < 0:
            raise _bad(f"{name}: expected a non-negative int, got {v!r:.40}")
    rids = row[1]
    if type(rids) is not tuple:
        raise _bad(f"rids: expected an array, got {_tname(rids)}")
    m = len(rids)
    if m > _limits.MAX_OUTPUTS_PER_MESSAGE:
        raise _bad(f"rids: {m} requests exceed MAX_OUTPUTS_PER_MESSAGE")
    _flat("rids", rids, m, lambda x: type(x) is str, "a str")
    output_ids = _nested("output_ids", row[2], m, _is_u32, "token ids")
    reasons = _flat("finished_reasons", row[3], m, lambda x: type(x) is str, "a str")
    messages = _flat("finished_messages", row[4], m, lambda x: x is None or type(x) is str, "a str or nil")
    matched = _flat("finished_matched", row[5], m, lambda x: x is None or type(x) in (int, str), "an int, str or nil")
    prompt = _flat("prompt_tokens", row[6], m, _is_u32, "a count")
    completion = _flat("completion_tokens", row[7], m, _is_u32, "a count")
    cached = _flat("cached_tokens", row[8], m, _is_u32, "a count")
    lp_vals = _nested("output_token_logprobs_val", row[9], m, _is_num, "numbers")
    lp_ids = _nested("output_token_logprobs_idx", row[10], m, _is_u32, "token ids")
    if m and tuple(map(len, lp_vals)) != tuple(map(len, lp_ids)):
        i = _first_bad(range(m), lambda k: len(lp_vals[k]) == len(lp_ids[k]))
        raise _bad(f"output_token_logprobs_val[{i}]: {len(lp_vals[i])} values for {len(lp_ids[i])} token ids")
    status = row[16]
    if status is not None:
        _flat("finished_status", status, m, lambda x: x is None or type(x) is int, "an int or nil")
    top_vals, top_ids = row[17], row[18]
    if top_vals is not None or top_ids is not None:
        top_vals = _top("output_top_logprobs_val", top_vals, m, _is_num, "numbers")
        top_ids = _top("output_top_logprobs_idx", top_ids, m, _is_u32, "token ids")
        for i in range(m):
            if tuple(map(len, top_vals[i])) != tuple(map(len, top_ids[i])):
                raise _bad(f"output_top_logprobs_val[{i}]: values and token ids differ in length")
            if top_vals[i] and len(top_vals[i]) != len(lp_vals[i]):
                raise _bad(f"output_top_logprobs_val[{i}]: {len(top_vals[i])} positions for "
                           f"{len(lp_vals[i])} sampled logprobs")
    reasoning = row[19]
    if reasoning is not None:
        _flat("reasoning_tokens", reasoning, m, _is_u32, "a count")
    err_types = obj[26] if n > 26 else None
    if err_types is not None:
        _flat("finished_err_types", err_types, m, lambda x: x is None or type(x) is str, "a str or nil")
    for k in range(_READ_ELEMENTS, min(n, 28)):
        if obj[k] is not None and type(obj[k]) is not tuple:
            raise _bad(f"element {k}: expected an array or nil, got {_tname(obj[k])}")
    return SGLangBatch(
        rids=rids, output_ids=output_ids, finished_reasons=reasons, finished_messages=messages,
        finished_matched=matched, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
        logprob_vals=lp_vals, logprob_ids=lp_ids, engine_index=scalars[0], num_running=scalars[1],
        num_waiting=scalars[2], kv_used_tokens=scalars[3], kv_total_tokens=scalars[4], finished_status=status,
        top_logprob_vals=top_vals, top_logprob_ids=top_ids, reasoning_tokens=reasoning,
        finished_err_types=err_types, wire_elements=n,
    )


def _control_reply(obj: tuple[Any, ...]) -> ControlReply:
    if len(obj) < 3:
        raise RemoteProtocolError(f"{CONTROL_TAG}: expected at least call_id and success, got {len(obj) - 1} fields")
    call_id, success = obj[1], obj[2]
    message = obj[3] if len(obj) > 3 else None
    engine_index = obj[4] if len(obj) > 4 else 0
    if type(call_id) is not int or call_id < 0:
        raise RemoteProtocolError(f"{CONTROL_TAG}.call_id: expected a non-negative int, got {call_id!r:.40}")
    if type(success) is not bool:
        raise RemoteProtocolError(f"{CONTROL_TAG}.success: expected a bool, got {_tname(success)}")
    if message is not None and type(message) is not str:
        raise RemoteProtocolError(f"{CONTROL_TAG}.message: expected a str or nil, got {_tname(message)}")
    if type(engine_index) is not int or engine_index < 0:
        raise RemoteProtocolError(f"{CONTROL_TAG}.engine_index: expected a non-negative int, got {engine_index!r:.40}")
    return ControlReply(call_id, success, message, engine_index)

