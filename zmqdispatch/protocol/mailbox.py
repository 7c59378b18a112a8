"""Per-request coalescing mailbox: the router's side never waits (sans-IO).

The output router calls :meth:`Mailbox.put` synchronously for every engine
output of this request. When the consumer keeps up, every tick becomes one
:class:`OutputDelta`; when it lags, the queued ticks merge into the one pending
delta (token ids concatenated, logprob rows appended, the newest prefill
stats kept), so delivery cost stays O(new data) and the router never blocks on
a slow consumer (the idea of vLLM's ``RequestOutputCollector``;
``docs/trio-and-zmq.md`` rule 4, ``docs/known-failures.md`` K4 and K5).

Bound: a consumer that lets more than ``max_pending_tokens`` tokens pile up is
failed with :class:`~zmqdispatch.errors.SlowConsumerError` (only that request;
the protocol then aborts it on the engine).

Ordering guarantees: merging never crosses a finish boundary (a terminal tick is
always the last thing in a mailbox), and an error is delivered *after* any
tokens that arrived before it, except for ``SlowConsumerError`` which drops
the backlog it complains about.

Wake-ups: the mailbox holds an opaque ``waiter`` callable set by the I/O shell
while a consumer is parked; ``put`` / ``fail`` call it once. No trio import here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

from ..errors import EngineRequestError, MultiModalCacheMissError, RemoteProtocolError, SlowConsumerError
from ..wire import vllm as wire

__all__ = ["OutputDelta", "Mailbox", "PUT_MORE", "PUT_FINISHED", "PUT_OVERFLOW"]

#: :meth:`Mailbox.put` results.
PUT_MORE = 0  # the request is still running
PUT_FINISHED = 1  # this output was terminal: retire the request
PUT_OVERFLOW = 2  # the consumer fell behind the bound: retire and abort

_ERROR = int(wire.FinishReason.ERROR)
_FINISH_REASONS = tuple(wire.FinishReason)


class OutputDelta:
    """What the engine produced for one request since the consumer last took.

    Attributes:
        request_id: the engine-side request id.
        token_ids: new token ids, in order (a delta, never cumulative).
        finish_reason: set on the last delta of a stream, else ``None``.
            ``FinishReason.ERROR`` never appears here: it is raised as
            :class:`~zmqdispatch.errors.EngineRequestError`.
        stop_reason: the matched stop token id (int) or string, from the
            engine's ``EngineCoreOutput.stop_reason``; ``None`` for EOS,
            length, abort, and always on TokenSpeed (whose ``"stop"`` ends on
            the stopping token without naming it).
        logprobs: sample logprobs, one row per entry of ``token_ids`` (only when
            the request asked for logprobs); each row is ``K+1`` columns with
            column 0 the sampled token (TokenSpeed: one column, no ``ranks``).
        prompt_logprobs: prompt logprobs, one row per prompt position after the
            first (only when requested; may arrive over several deltas with
            chunked prefill).
        num_prompt_tokens / num_cached_tokens: from the engine's
            ``prefill_stats`` (first output of a request), else ``None``.
        ticks: engine outputs merged into this delta (1 when the consumer keeps up).
        engine_timestamp: ``EngineCoreOutputs.timestamp`` of the newest merged
            output: the engine's ``time.monotonic()``, comparable on one host
            (0.0 on TokenSpeed, whose batches carry no timestamp).

    A plain class, not attrs: a delta is created once per delivery on the hot
    path, where the plain constructor below (or the mailbox's three-attribute
    fast path over the class-level defaults) costs about a third less than a
    generated ``__init__`` of ten fields. Deltas compare by identity; use
    :meth:`replace` for a modified copy.
    """

    # Class-level defaults: an instance stores only what differs (the mailbox's
    # hot path sets request_id, token_ids and engine_timestamp).
    request_id: str
    token_ids: list[int]
    finish_reason: wire.FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: wire.LogprobsLists | None = None
    prompt_logprobs: wire.LogprobsLists | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    ticks: int = 1
    engine_timestamp: float = 0.0

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        finish_reason: wire.FinishReason | None = None,
        stop_reason: int | str | None = None,
        logprobs: wire.LogprobsLists | None = None,
        prompt_logprobs: wire.LogprobsLists | None = None,
        num_prompt_tokens: int | None = None,
        num_cached_tokens: int | None = None,
        ticks: int = 1,
        engine_timestamp: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.ticks = ticks
        self.engine_timestamp = engine_timestamp

    #: the field names, in constructor order (for replace and repr)
    _FIELDS: ClassVar[tuple[str, ...]] = tuple(inspect.signature(__init__).parameters)[1:]

    def replace(self, **changes: Any) -> OutputDelta:
        """A copy with *changes* applied (field names as in the constructor).

        Raises:
            TypeError: an unknown field name.
        """
        unknown = set(changes) - set(self._FIELDS)
        if unknown:
            raise TypeError(f"OutputDelta has no field(s) {sorted(unknown)}")
        values = {name: getattr(self, name) for name in self._FIELDS}
        values.update(changes)
        return OutputDelta(**values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"OutputDelta({inner})"


_new_delta = object.__new__


def _extend_lists(acc: wire.LogprobsLists | None, new: wire.LogprobsLists) -> wire.LogprobsLists:
    if acc is None:
        return new
    acc.token_ids.extend(new.token_ids)
    acc.logprobs.extend(new.logprobs)
    acc.ranks.extend(new.ranks)
    return acc


class Mailbox:
    """The single slot between the output router and one request's consumer.

    Not thread-safe and not task-safe by itself: the router (one task) puts,
    one consumer takes; the I/O shell parks the consumer via ``waiter``.
    """

    __slots__ = (
        "request_id",
        "max_pending_tokens",
        "pending",
        "pending_tokens",
        "error",
        "finished",
        "waiter",
        "add",
        "wire_id",
    )

    def __init__(self, request_id: str, max_pending_tokens: int) -> None:
        self.request_id = request_id
        self.max_pending_tokens = max_pending_tokens
        self.pending: OutputDelta | None = None
        self.pending_tokens = 0
        self.error: BaseException | None = None
        #: True once a terminal output or an error was put: nothing more comes.
        self.finished = False
        self.waiter: Callable[[], None] | None = None
        #: the request's ADD message (``EngineProtocol``'s ``Outgoing``), set on submit
        self.add: Any = None
        #: the id the engine knows the request by: ``request_id`` unless
        #: ``EngineProtocol.submit`` had to give it a fresh one
        self.wire_id = request_id

    def __repr__(self) -> str:
        return (
            f"<Mailbox {self.request_id!r} pending_tokens={self.pending_tokens}"
            f" finished={self.finished} error={type(self.error).__name__ if self.error else None}>"
        )

    # ------------------------------------------------------------ router side

    def put(self, row: wire.EngineCoreOutputRow, frames: Any, timestamp: float) -> int:
        """Merge one decoded ``EngineCoreOutput`` row into the pending delta.

        Args:
            row: one decoded row of :func:`zmqdispatch.wire.vllm.decode_outputs`.
            frames: the message's frames (aux tensors are resolved from them).
            timestamp: the message's ``EngineCoreOutputs.timestamp``.

        Returns:
            ``PUT_MORE``, ``PUT_FINISHED`` or ``PUT_OVERFLOW`` (see module doc).

        Raises:
            RemoteProtocolError: a logprobs tensor in the row does not decode.
        """
        if self.finished:
            return PUT_FINISHED
        tokens = row.new_token_ids
        finish = row.finish_reason
        if (
            finish is None
            and row.new_logprobs is None
            and row.new_prompt_logprobs_tensors is None
            and row.prefill_stats is None
        ):
            # The hot path, a plain decode tick: new tokens only.
            d = self.pending
            if d is None:
                # Equivalent to OutputDelta(request_id, list(tokens),
                # engine_timestamp=timestamp): the other fields keep their
                # class-level defaults, so only three attributes are stored.
                self.pending = d = _new_delta(OutputDelta)
                d.request_id = self.request_id
                d.token_ids = list(tokens)
                d.engine_timestamp = timestamp
                n = self.pending_tokens = len(tokens)  # 0 while nothing is pending
            else:
                d.token_ids += tokens
                d.ticks += 1
                d.engine_timestamp = timestamp
                n = self.pending_tokens = self.pending_tokens + len(tokens)
            if n > self.max_pending_tokens:
                return self._overflow()
            w = self.waiter
            if w is not None:
                self.waiter = None
                w()
            return PUT_MORE
        if finish == _ERROR:
            self._put_engine_error(row)
            return PUT_FINISHED
        d = self.pending
        if d is None:
            d = self.pending = OutputDelta(self.request_id, list(tokens), engine_timestamp=timestamp)
        else:
            d.token_ids += tokens
            d.ticks += 1
            d.engine_timestamp = timestamp
        self.pending_tokens += len(tokens)
        lp = row.new_logprobs
        if lp is not None:
            lists = wire.decode_logprobs_lists(lp, frames)
            if len(lists.token_ids) != len(tokens):
                # One row per new token (vLLM LogprobsLists): anything else is a
                # broken peer, and unbounded rows would bypass max_pending_tokens
                # (found by fuzzing: rows over one shared aux frame).
                raise RemoteProtocolError(
                    f"request {self.request_id!r}: {len(lists.token_ids)} logprob rows for {len(tokens)} new tokens"
                )
            d.logprobs = _extend_lists(d.logprobs, lists)
        plp = row.new_prompt_logprobs_tensors
        if plp is not None:
            d.prompt_logprobs = _extend_lists(d.prompt_logprobs, wire.decode_logprobs_tensors(plp, frames))
        stats = row.prefill_stats
        if stats is not None:
            d.num_prompt_tokens = stats.get("num_prompt_tokens", d.num_prompt_tokens)
            d.num_cached_tokens = stats.get("num_cached_tokens", d.num_cached_tokens)
        if finish is not None:
            d.finish_reason = _FINISH_REASONS[finish]
            d.stop_reason = row.stop_reason
            self.finished = True
            self._wake()
            return PUT_FINISHED
        if self.pending_tokens > self.max_pending_tokens:
            return self._overflow()
        self._wake()
        return PUT_MORE

    def put_tokens(
        self,
        tokens: tuple[int, ...],
        finish: wire.FinishReason | None,
        logprob_vals: tuple[float, ...],
        logprob_ids: tuple[int, ...],
        num_prompt_tokens: int | None,
        num_cached_tokens: int | None,
        *,
        top_vals: tuple[tuple[float, ...], ...] | None = None,
        top_ids: tuple[tuple[int, ...], ...] | None = None,
        stop_reason: int | str | None = None,
    ) -> int:
        """Merge one TokenSpeed or SGLang output (one column slice of its batch).

        Args:
            tokens: this frame's new token ids.
            finish: STOP / LENGTH on the terminal frame, else ``None`` (the
                caller turns ``"abort"`` / ``"error"`` into :meth:`fail`).
            logprob_vals / logprob_ids: the sampled tokens' logprobs, one per
                token, or empty when the request did not ask; become one-column
                ``logprobs`` rows (``ranks`` stay empty: TokenSpeed sends none).
            num_prompt_tokens / num_cached_tokens: the engine's counts when > 0.
            top_vals / top_ids: SGLang's ranked candidates per token (``()`` when not
                asked); each logprob row becomes the sampled token then these.
            stop_reason: the stop token id or string SGLang named (terminal only).

        Returns:
            ``PUT_MORE``, ``PUT_FINISHED`` or ``PUT_OVERFLOW``.

        Raises:
            RemoteProtocolError: logprob values that do not match the tokens.
        """
        if self.finished:
            return PUT_FINISHED
        if logprob_vals and len(logprob_vals) != len(tokens):
            raise RemoteProtocolError(
                f"request {self.request_id!r}: {len(logprob_vals)} logprobs for {len(tokens)} new tokens"
            )
        d = self.pending
        if d is None:
            if not tokens and finish is None:
                return PUT_MORE  # nothing to deliver (the counts ride every later frame too)
            d = self.pending = OutputDelta(self.request_id, list(tokens))
        else:
            d.token_ids += tokens
            d.ticks += 1
        self.pending_tokens += len(tokens)
        if logprob_vals:
            if top_vals:
                if top_ids is None or len(top_vals) != len(logprob_vals):
                    raise RemoteProtocolError(
                        f"request {self.request_id!r}: {len(top_vals)} top-logprob rows for {len(logprob_vals)} tokens"
                    )
                lists = wire.LogprobsLists(
                    token_ids=[[t, *c] for t, c in zip(logprob_ids, top_ids)],
                    logprobs=[[v, *c] for v, c in zip(logprob_vals, top_vals)], ranks=[],
                )
            else:
                lists = wire.LogprobsLists(
                    token_ids=[[t] for t in logprob_ids], logprobs=[[v] for v in logprob_vals], ranks=[]
                )
            d.logprobs = _extend_lists(d.logprobs, lists)
        if num_prompt_tokens is not None:
            d.num_prompt_tokens = num_prompt_tokens
        if num_cached_tokens is not None:
            d.num_cached_tokens = num_cached_tokens
        if finish is not None:
            d.finish_reason = finish
            if stop_reason is not None:
                d.stop_reason = stop_reason
            self.finished = True
            self._wake()
            return PUT_FINISHED
        if self.pending_tokens > self.max_pending_tokens:
            return self._overflow()
        self._wake()
        return PUT_MORE

    def _overflow(self) -> int:
        self.fail(
            SlowConsumerError(
                f"request {self.request_id!r}: consumer fell {self.pending_tokens} tokens behind"
                f" (limit max_pending_tokens={self.max_pending_tokens}); request aborted",
                request_id=self.request_id,
                pending_tokens=self.pending_tokens,
                limit=self.max_pending_tokens,
            ),
            drop_pending=True,
        )
        return PUT_OVERFLOW

    def finish(self, reason: wire.FinishReason) -> None:
        """Terminate the stream with *reason* and no new tokens (engine-side
        abort listed only in ``finished_requests``)."""
        if self.finished:
            return
        d = self.pending
        if d is None:
            d = self.pending = OutputDelta(self.request_id, [])
        d.finish_reason = reason
        self.finished = True
        self._wake()

    def fail(self, exc: BaseException, *, drop_pending: bool = False) -> None:
        """Terminate the stream with *exc*, raised after any pending tokens
        (or instead of them with ``drop_pending``). The first error wins."""
        if self.error is not None or (self.finished and not drop_pending):
            return  # a terminal output (or an earlier error) already ended the stream
        if drop_pending:
            self.pending = None
            self.pending_tokens = 0
        self.error = exc
        self.finished = True
        self._wake()

    def _put_engine_error(self, row: wire.EngineCoreOutputRow) -> None:
        code = retryable = None
        message = "engine finished the request with an error (see engine logs)"
        miss = row.mm_cache_miss_hashes
        if type(miss) in (list, tuple) and miss and all(type(h) is str for h in miss):
            self.fail(MultiModalCacheMissError(
                f"request {self.request_id!r}: the engine's multimodal cache misses {miss}: resend with data",
                request_id=self.request_id, mm_hashes=tuple(miss)))
            return
        err = row.error
        if isinstance(err, dict):
            code = err.get("code") if isinstance(err.get("code"), str) else None
            retryable = err.get("retryable") if isinstance(err.get("retryable"), bool) else None
            if isinstance(err.get("message"), str):
                message = f"engine error {code or ''}: {err['message']}".replace("  ", " ")
        self.fail(
            EngineRequestError(
                f"request {self.request_id!r}: {message}",
                request_id=self.request_id,
                code=code,
                retryable=retryable,
            )
        )

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            w()

    # ------------------------------------------------------------ consumer side

    def take(self) -> OutputDelta | None:
        """Take the pending delta, or ``None`` if nothing is ready and the
        stream is not finished.

        Raises:
            the stored error once no delta is pending (``EngineDeadError``,
            ``EngineRequestError``, ``SlowConsumerError``, ...).
        """
        d = self.pending
        if d is not None:
            self.pending = None
            self.pending_tokens = 0
            return d
        if self.error is not None:
            raise self.error
        return None
