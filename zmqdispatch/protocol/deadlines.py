"""Per-request deadlines (sans-IO): limits, the timing rule, one scheduler per link.

A request may carry :class:`Deadlines`: a limit on the time to its first token,
on its total time, and on a stall between tokens. Times are the client's clock
(the trio clock in :mod:`zmqdispatch.client`), measured from the moment the
request's ADD was queued (entering its stream) and from the receipt of the
output messages that carried its tokens.

The rule, checked by :meth:`DeadlineScheduler.pop_expired`:

- ``first_token``: no token received within that many seconds of the submit;
- ``total``: the request has not ended within that many seconds of the submit;
- ``stall``: after its first token, no new token for that many seconds (before
  the first token, only ``first_token`` and ``total`` apply).

A request past a limit is failed with :class:`~zmqdispatch.errors.DeadlineExceeded`
(after the tokens it had received) and aborted on the engine; the shell does
that (``EngineProtocol.abort_mailbox``).

Cost: nothing for requests without deadlines. A request with deadlines gets a
:class:`TimedMailbox` (which records the receipt time of its outputs: one
attribute store per output) and at most three heap entries at a time; a stall
entry that finds progress is pushed again at the new due time (one heap
operation per ``stall`` seconds of a live request). Entries of requests that
ended are dropped when they come up, or swept when they outnumber the live
ones. One task per link sleeps until the earliest entry (no timer per request).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import DeadlineExceeded, RequestRejected
from ..wire.vllm import EngineCoreOutputRow
from .mailbox import Mailbox

__all__ = ["Deadlines", "DeadlineScheduler", "TimedMailbox", "LIMITS", "effective_deadlines"]

#: The limit names, as in ``DeadlineExceeded.limit`` and :class:`Deadlines`' fields.
LIMITS = ("first_token", "total", "stall")


def _check_limit(instance: Any, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestRejected(
            f"deadlines.{attribute.name} must be a number of seconds or None, got {type(value).__name__}",
            field=f"deadlines.{attribute.name}",
        )
    if not math.isfinite(value) or value <= 0:
        raise RequestRejected(
            f"deadlines.{attribute.name} must be > 0 and finite (seconds), got {value!r}",
            field=f"deadlines.{attribute.name}",
        )


@attrs.frozen(kw_only=True)
class Deadlines:
    """Time limits of one request, in seconds (``None``: no limit).

    Attributes:
        first_token: from the submit (its ADD queued) to the receipt of its
            first token.
        total: from the submit to its final output.
        stall: between two receipts of tokens, after the first one.

    Raises:
        RequestRejected: a limit that is not a positive finite number
            (``field`` names it, e.g. ``"deadlines.stall"``).
    """

    first_token: float | None = attrs.field(default=None, validator=_check_limit)
    total: float | None = attrs.field(default=None, validator=_check_limit)
    stall: float | None = attrs.field(default=None, validator=_check_limit)

    @property
    def any(self) -> bool:
        """True when at least one limit is set."""
        return self.first_token is not None or self.total is not None or self.stall is not None


def effective_deadlines(deadlines: Any) -> Deadlines | None:
    """*deadlines* when it sets a limit, else ``None`` (nothing to track).

    Raises:
        RequestRejected: *deadlines* is not a :class:`Deadlines` (``field="deadlines"``).
    """
    if deadlines is None:
        return None
    if not isinstance(deadlines, Deadlines):
        raise RequestRejected(
            f"deadlines must be a zmqdispatch.Deadlines, got {type(deadlines).__name__}", field="deadlines"
        )
    return deadlines if deadlines.any else None


class TimedMailbox(Mailbox):
    """A :class:`Mailbox` that records when its request's outputs arrived.

    Attributes:
        submitted_at: when the request's ADD was queued (set by the scheduler).
        first_token_at / last_token_at: receipt time of the first / newest
            output carrying tokens (``None`` before one).
        deadlines: the request's :class:`Deadlines`.

    *clock_source* is any object whose ``now`` attribute holds the receipt
    time of the message being routed (``EngineProtocol.now``).
    """

    __slots__ = ("_source", "submitted_at", "first_token_at", "last_token_at", "deadlines")

    def __init__(self, request_id: str, max_pending_tokens: int, clock_source: Any, deadlines: Deadlines) -> None:
        super().__init__(request_id, max_pending_tokens)
        self._source = clock_source
        self.deadlines = deadlines
        self.submitted_at = 0.0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def _tokens_at(self) -> None:
        now = self._source.now
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now

    def put(self, row: EngineCoreOutputRow, frames: Any, timestamp: float) -> int:
        if row.new_token_ids:
            self._tokens_at()
        return Mailbox.put(self, row, frames, timestamp)

    def put_tokens(self, tokens: tuple[int, ...], *args: Any, **kwargs: Any) -> int:
        if tokens:
            self._tokens_at()
        return Mailbox.put_tokens(self, tokens, *args, **kwargs)


class DeadlineScheduler:
    """The deadline heap of one link.

    :meth:`add` a request's :class:`TimedMailbox` when its ADD is queued;
    :meth:`pop_expired` returns the requests past a limit (with the error to
    fail them with). :attr:`waiter` is called (then cleared) when a new entry
    becomes the earliest, so the shell's one timer task can sleep until
    :meth:`next_deadline`.
    """

    def __init__(self) -> None:
        # [when, seq, limit, mailbox]; seq breaks ties (mailboxes do not compare)
        self._heap: list[list[Any]] = []
        self._seq = itertools.count()
        #: called once when the earliest deadline moved earlier; set by the shell.
        self.waiter: Callable[[], None] | None = None

    def __len__(self) -> int:
        """Heap entries (live requests have at most three; ended ones linger
        until they come up or are swept)."""
        return len(self._heap)

    def next_deadline(self) -> float | None:
        """The earliest time an entry comes up, or ``None``."""
        return self._heap[0][0] if self._heap else None

    def add(self, mailbox: TimedMailbox, now: float, live: int) -> None:
        """Start *mailbox*'s limits at *now* (its ADD was queued); *live*:
        requests live on the link (bounds the heap: module doc)."""
        d = mailbox.deadlines
        mailbox.submitted_at = now
        heap = self._heap
        if len(heap) > 3 * live + 64:
            self._heap = heap = [e for e in heap if not e[3].finished]
            heapq.heapify(heap)
        before = heap[0][0] if heap else math.inf
        if d.first_token is not None:
            self._push(now + d.first_token, "first_token", mailbox)
        if d.total is not None:
            self._push(now + d.total, "total", mailbox)
        if d.stall is not None:
            # Checked once the first token came (before it, it polls: cheap).
            self._push(now + d.stall, "stall", mailbox)
        if heap and heap[0][0] < before:
            w = self.waiter
            if w is not None:
                self.waiter = None
                w()

    def _push(self, when: float, limit: str, mailbox: TimedMailbox) -> None:
        heapq.heappush(self._heap, [when, next(self._seq), limit, mailbox])

    def pop_expired(self, now: float) -> list[tuple[TimedMailbox, DeadlineExceeded]]:
        """Every live request past a limit at *now*, with its error. Entries
        of ended requests are dropped; a stall entry of a request that made
        progress is pushed again at its new due time."""
        heap = self._heap
        expired: list[tuple[TimedMailbox, DeadlineExceeded]] = []
        while heap and heap[0][0] <= now:
            when, _, limit, mb = heapq.heappop(heap)
            if mb.finished:
                continue
            d = mb.deadlines
            if limit == "first_token":
                if mb.first_token_at is not None:
                    continue
                seconds = d.first_token
                what = f"no first token within {seconds} s"
            elif limit == "total":
                seconds = d.total
                what = f"not finished within {seconds} s"
            else:
                seconds = d.stall
                last = mb.last_token_at
                due = (now if last is None else last) + seconds
                if due > now:
                    self._push(due, limit, mb)  # progress since: look again then
                    continue
                what = f"no new token for {now - last:.3f} s (limit {seconds} s)"
            expired.append((mb, DeadlineExceeded(
                f"request {mb.request_id!r}: {what} (deadlines.{limit}={seconds}); request aborted",
                request_id=mb.request_id, limit=limit, seconds=seconds, elapsed=now - mb.submitted_at,
            )))
        return expired
