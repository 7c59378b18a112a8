"""Per-engine counters and latency histograms (sans-IO).

:class:`LinkStats` is owned by :class:`~.engine.EngineProtocol`, which feeds it
at a few points: a request queued (:meth:`LinkStats.submitted`), one output
message routed (:meth:`LinkStats.routed`), a request ended
(:meth:`LinkStats.finished`). Its public, immutable view is
:class:`zmqdispatch.metrics.EngineStats` (``EngineClient.stats()``).

Cost on the hot path, by design (measured in ``docs/operations.md``):

- **Time to first token** (TTFT): seconds from the request's ADD being queued
  to the receipt of the output message that carried its first token. Requests
  waiting for their first token sit in a small map; after a message is routed,
  only ``min(rows in the message, requests waiting)`` of them are looked at, so
  a step of running requests with none waiting costs nothing.
- **Inter-token latency** (ITL): measured per output message, not per row: the
  seconds since the previous message that carried rows, counted once for every
  row of a request that already had its first token (one histogram update per
  message). This is exact when the engine steps every running request each
  step (vLLM's and TokenSpeed's continuous batching while decoding); a request
  that skipped steps (preempted, a TokenSpeed ``--stream-interval`` above 1) is
  counted at the step interval. Times are the client's receipt times (the
  batch of messages one wake of the output pump received shares one time), so
  the figure includes the client's own queueing, which is what a consumer sees.

Histograms have fixed buckets (:data:`TTFT_BUCKETS`, :data:`ITL_BUCKETS`,
seconds, upper bounds inclusive as Prometheus' ``le``).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

__all__ = ["Histogram", "LinkStats", "TTFT_BUCKETS", "ITL_BUCKETS"]

_log = logging.getLogger("zmqdispatch.protocol")
_DEBUG = logging.DEBUG

#: Upper bounds (seconds) of the time-to-first-token buckets: a GPU engine's
#: first token takes milliseconds to seconds (queueing and long prefills up to
#: minutes); the last finite bound is the default ``silence_timeout``.
TTFT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)

#: Upper bounds (seconds) of the inter-token-latency buckets: a decode step of
#: a GPU engine takes a few to a few hundred milliseconds.
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0,
)


class Histogram:
    """Counts of observations per fixed bucket.

    ``counts[i]`` counts values ``v`` with ``bounds[i-1] < v <= bounds[i]``;
    the last entry (``counts[len(bounds)]``) counts values above every bound.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def observe(self, value: float, n: int = 1) -> None:
        """Count *value* (seconds) *n* times."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n


class LinkStats:
    """Counters and histograms of one engine link (read by ``metrics.EngineStats``).

    Attributes:
        requests: requests whose ADD was queued.
        finishes: finish_reason name (``"stop"``, ``"length"``, ``"abort"``)
            -> requests the engine finished with it.
        aborts: requests the client aborted before their end (a stream left
            early, ``abort()``, a deadline, the client closing).
        slow_consumers: requests failed with ``SlowConsumerError``.
        deadlines_exceeded: limit (``"first_token"``, ``"total"``, ``"stall"``) -> count.
        deaths: ``EngineDeadError.reason`` -> count (at most one per link).
        ttft / itl: :class:`Histogram` of seconds (module doc).
    """

    __slots__ = (
        "requests", "finishes", "aborts", "slow_consumers", "deadlines_exceeded", "deaths", "ttft", "itl",
        "_awaiting", "_last_rows_at",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.finishes: dict[str, int] = {}
        self.aborts = 0
        self.slow_consumers = 0
        self.deadlines_exceeded: dict[str, int] = {}
        self.deaths: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        # engine-side id -> (mailbox, time its ADD was queued): no token received yet
        self._awaiting: dict[str, tuple[Any, float]] = {}
        self._last_rows_at: float | None = None  # receipt time of the last message with rows

    @property
    def awaiting_first_token(self) -> int:
        """Requests tracked as waiting for their first token (an upper bound:
        retired ones are dropped lazily)."""
        return len(self._awaiting)

    def submitted(self, wire_id: str, mailbox: Any, now: float, live: int) -> None:
        """A request's ADD was queued at *now*; *live* requests are on the link."""
        self.requests += 1
        awaiting = self._awaiting
        if len(awaiting) > 2 * live + 64:
            # Retired requests that never got a row (aborted while queued) are
            # dropped here, so the map stays O(live requests), amortized O(1).
            self._awaiting = awaiting = {w: e for w, e in awaiting.items() if not e[0].finished}
        awaiting[wire_id] = (mailbox, now)

    def aborted(self, wire_id: str) -> None:
        """The client aborted *wire_id*'s request before its end; it is no
        longer awaited (a request aborted before its first token would
        otherwise keep its mailbox until the next lazy sweep)."""
        self.aborts += 1
        self._awaiting.pop(wire_id, None)

    def routed(self, outputs: Sequence[Any], rows: int, now: float) -> None:
        """One output message with *rows* routed rows was received at *now*.

        *outputs*: the message's rows (vLLM ``EngineCoreOutputRow``, the
        engine-side id in ``request_id``), or its ids (TokenSpeed ``rids``).
        Called after routing: a mailbox's pending delta holds what this
        message gave it (nothing runs in between)."""
        firsts = self._first_tokens(outputs, now) if self._awaiting else 0
        if rows:
            # ITL, inlined (once per message): Histogram.observe(now - last, continuing)
            last = self._last_rows_at
            self._last_rows_at = now
            continuing = rows - firsts
            if last is not None and continuing > 0:
                itl = self.itl
                gap = now - last
                itl.counts[bisect_left(itl.bounds, gap)] += continuing
                itl.sum += gap * continuing

    def _first_tokens(self, outputs: Sequence[Any], now: float) -> int:
        """Observe the TTFT of awaited requests that got a token in *outputs*;
        return how many did."""
        firsts = 0
        awaiting = self._awaiting
        if awaiting:
            if len(awaiting) <= len(outputs):
                candidates = list(awaiting)  # also drops retired entries
            else:
                candidates = [w for w in (o if type(o) is str else o.request_id for o in outputs) if w in awaiting]
            debug = _log.isEnabledFor(_DEBUG)
            ttft = self.ttft
            for wire_id in candidates:
                entry = awaiting.get(wire_id)
                if entry is None:
                    continue  # a second row of this request in the message
                mb, t0 = entry
                d = mb.pending
                if d is not None and d.token_ids:
                    del awaiting[wire_id]
                    ttft.observe(now - t0)
                    firsts += 1
                    if debug:
                        _log.debug("request %r: first token after %.3f s", mb.request_id, now - t0)
                elif mb.finished:
                    del awaiting[wire_id]  # ended without a token (abort, error)
        return firsts

    def forget_all(self) -> None:
        """The link died: nothing is awaited any more."""
        self._awaiting.clear()

    def count_finish(self, mailbox: Any) -> None:
        """*mailbox*'s request just got its terminal output (or an error, not
        counted here: slow consumers, deaths etc. have their own counters)."""
        d = mailbox.pending
        reason = d.finish_reason if d is not None and mailbox.error is None else None
        if reason is None:
            return
        name = reason.name.lower()
        self.finishes[name] = self.finishes.get(name, 0) + 1
        if _log.isEnabledFor(_DEBUG):
            _log.debug("request %r: finished, finish_reason=%s", mailbox.request_id, name)
