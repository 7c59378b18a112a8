"""TokenSpeed output batches, client side (TokenSpeed 0.1.1 ``BatchTokenIDOutSlim``), sans-IO.

:func:`decode_outputs` (the hot path, once per scheduler step) turns one output message
into a :class:`TokenSpeedBatch` of parallel columns; :class:`TokenSpeedOutput` is the
per-request view, :class:`LoadSnapshot` the scheduler load a batch carries. Every name
here is also importable from :mod:`zmqdispatch.wire.tokenspeed` (the client side of the
wire as one module), where the request side lives. Format: ``docs/tokenspeed-wire.md`` §1.

Errors: the decoder raises only :class:`~zmqdispatch.errors.RemoteProtocolError` for
bytes that do not decode.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any

import attrs
import msgspec

from zmqdispatch import limits as _limits
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire.schema import _tname, _unpack_output_message, msgpack_array_len

#: Element 0 of an output batch.
BATCH_TAG = "BatchTokenIDOutSlim"
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


_DECODERS: dict[tuple[int, int, int], msgspec.msgpack.Decoder[Any]] = {}


def _batch_decoder(max_rows: int, max_tokens: int, max_id: int) -> msgspec.msgpack.Decoder[Any]:
    """A typed decoder for :class:`_Batch` with these limits as ``msgspec.Meta`` constraints
    (cached; the limits are read on every call, so a changed limit takes effect)."""
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
            ("prompt_tokens", tuple[tid, ...]),
            ("completion_tokens", tuple[tid, ...]),
            ("cached_tokens", tuple[tid, ...]),
            ("logprob_vals", tuple[vals, ...]),
            ("logprob_ids", tuple[toks, ...]),
            *((name, non_neg, 0) for name in _SCALARS),
        ]
        cls = msgspec.defstruct("_Batch", fields, array_like=True, tag=BATCH_TAG, gc=False)
        dec = _DECODERS[key] = msgspec.msgpack.Decoder(cls)
    return dec


def decode_outputs(frames: Sequence[bytes]) -> TokenSpeedBatch:
    """Decode one output message ``[payload, *aux]`` (the hot path: once per engine step).

    Wire format: TokenSpeed 0.1.1 ``BatchTokenIDOutSlim`` (tagged, array_like). One
    ``msgspec`` typed decode (the checks below are its types and ``Meta`` constraints,
    as TokenSpeed's own decoder reads the struct), then the ragged-column checks on the
    decoded tuples, which become the batch's columns as they are. A message the typed
    decode refuses (and one with more than 14 elements, whose tail msgspec would skip
    unread) goes through :func:`_decode_outputs_msgpack`, the msgpack reference
    decoder, which raises the error naming the field (or, should it accept what msgspec
    refused, returns its batch): the errors are that decoder's. 9- and 10-element legacy
    batches take 0 for the missing tail; elements after the 14th and aux frames after the
    payload are ignored.

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
    max_frame = _limits.MAX_FRAME_BYTES
    if frames and all(len(f) <= max_frame for f in frames):
        payload = frames[0]
        n = msgpack_array_len(payload)
        if BATCH_MIN_ELEMENTS <= n <= BATCH_ELEMENTS:
            max_tokens = _limits.MAX_TOKENS_PER_TICK
            try:
                b = _batch_decoder(_limits.MAX_OUTPUTS_PER_MESSAGE, max_tokens, _max_token_id()).decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                b = None
            if b is not None:
                m = len(b.rids)
                lp_vals, lp_ids = b.logprob_vals, b.logprob_ids
                if (
                    len(b.output_ids) == m == len(b.finished_reasons) == len(b.prompt_tokens)
                    and len(b.completion_tokens) == m == len(b.cached_tokens) == len(lp_vals) == len(lp_ids)
                    and (
                        (lp_vals.count(()) == m == lp_ids.count(()))
                        or tuple(map(len, lp_vals)) == tuple(map(len, lp_ids))
                    )
                ):
                    return TokenSpeedBatch(
                        engine_index=b.engine_index,
                        rids=b.rids,
                        output_ids=b.output_ids,
                        finished_reasons=b.finished_reasons,
                        prompt_tokens=b.prompt_tokens,
                        completion_tokens=b.completion_tokens,
                        cached_tokens=b.cached_tokens,
                        logprob_vals=lp_vals,
                        logprob_ids=lp_ids,
                        num_running=b.num_running,
                        num_waiting=b.num_waiting,
                        kv_active_pages=b.kv_active_pages,
                        kv_total_pages=b.kv_total_pages,
                        wire_elements=n,
                    )
    return _decode_outputs_msgpack(frames)


def _decode_outputs_msgpack(frames: Sequence[bytes]) -> TokenSpeedBatch:
    """:func:`decode_outputs` with ``msgpack.unpackb`` and Python checks: the reference
    decoder, and the path of every message the typed decode refuses (its errors name
    the column and index).

    One ``msgpack.unpackb`` (arrays as tuples) and a fixed number of C-level passes over
    the columns (``set(map(type, col))``, ``min``, ``max(map(len, col))``): no per-token
    Python objects, no per-row Python loop.
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
