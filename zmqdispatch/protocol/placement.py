"""Which engine takes a request (sans-IO): least loaded, randomized ties, pins, colocated samples.

:class:`Placement` picks an engine of an :class:`~zmqdispatch.protocol.engines.EngineSet`
for each request and records the request there in the same call, so the next decision
already counts it. The rules (why each, and which failure it prevents:
``docs/many-engines.md``):

1. Only ``up`` engines are eligible; none up -> :class:`~zmqdispatch.errors.NoEngineAvailableError`.
2. ``data_parallel_rank`` pins the request to that engine: an unknown rank ->
   :class:`~zmqdispatch.errors.RequestRejected` (``field="data_parallel_rank"``, the
   message lists the valid ranks); a dead pinned engine ->
   :class:`~zmqdispatch.errors.EngineDeadError`, a draining one ->
   :class:`~zmqdispatch.errors.EngineDrainingError`.
3. Otherwise the engine with the lowest *load* wins; a tie is broken uniformly at random
   (an injectable :class:`random.Random`).
4. The samples of one request (``n > 1``: several request ids) all go to one engine, to
   share its prefix cache.

The load of an engine is::

    in_flight + other + kv_penalty

- ``in_flight``: this client's requests on the engine, exact and current (the
  :class:`EngineSet` table). It counts a request from the moment it is placed, so a burst
  placed before any engine has reported spreads evenly, and it returns to zero when the
  requests end, however they end.
- ``other``: what the engine's last load report holds beyond this client's own requests,
  ``max(0, running + waiting - in_flight_at_report)``, fixed when the report is applied
  (another client's requests on a shared engine; requests the engine still holds after
  this client retired them, e.g. an abort it has not read yet). A report never replaces
  ``in_flight``, so requests placed after the report was taken keep counting whatever it
  says. The part is void once ``in_flight`` returns to zero (an idle engine sends no
  report, so its last one would otherwise show its final requests forever), when the
  engine dies, and when a newer report arrives; a report of an engine this client has
  nothing on is not kept.
- ``kv_penalty``: ``waiting * KV_PRESSURE_WEIGHT * max(0, kv_cache_usage - 0.5)`` from the
  same report: a queue on an engine whose KV cache is more than half full drains slowly.

Apply the report an output message carries *before* the finishes that message carries
(the engine took its snapshot before those requests finished).

Report sources: vLLM ``EngineCoreOutputs.scheduler_stats`` (present only when the engine
logs stats: ``num_running_reqs``, ``num_waiting_reqs``, ``kv_cache_usage``;
:meth:`Placement.report_scheduler_stats`) and TokenSpeed 0.1.1 ``BatchTokenIDOutSlim``'s
load tail (:class:`~zmqdispatch.wire.tokenspeed.LoadSnapshot`;
:meth:`Placement.report_tokenspeed_load`). Without reports the policy places by
``in_flight`` alone.

Cost: the engine set keeps every up engine's load current in a list of floats (one store
per start, finish and report), so a decision is ``min`` / ``count`` / ``index`` over that
list, in C, plus one ``index`` per skipped tie; no allocation. Measured in
``benchmarks/placement_cost.py``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import NoEngineAvailableError, RequestRejected
from ..wire.tokenspeed import LoadSnapshot
from .engines import EngineSet, EngineState, Route, EngineRecord, format_ranks

__all__ = ["KV_PRESSURE_WEIGHT", "EngineLoad", "Placement"]

#: Scale of the KV-pressure term: at a full KV cache each waiting request weighs
#: ``1 + 0.5 * KV_PRESSURE_WEIGHT`` = 4 in-flight requests; below half full, 1.
KV_PRESSURE_WEIGHT = 6.0


@attrs.frozen
class EngineLoad:
    """One engine's load as :meth:`Placement.loads` sees it.

    Attributes:
        engine_index: the engine.
        state: its supervision state.
        in_flight: this client's requests on it.
        other: the last report's requests beyond this client's own (0 without a live report).
        kv_penalty: the last report's KV-pressure term (0.0 without a live report).
        reported_running / reported_waiting / kv_cache_usage: the last live report as sent
            (None without one).
    """

    engine_index: int
    state: EngineState
    in_flight: int
    other: int
    kv_penalty: float
    reported_running: int | None
    reported_waiting: int | None
    kv_cache_usage: float | None

    @property
    def score(self) -> float:
        return self.in_flight + self.other + self.kv_penalty


class _Report:
    __slots__ = ("epoch", "extra", "incarnation", "kv", "other", "penalty", "running", "timestamp", "waiting")

    def __init__(
        self,
        incarnation: int,
        epoch: int,
        timestamp: float | None,
        running: int,
        waiting: int,
        kv: float | None,
        other: int,
        penalty: float,
    ) -> None:
        self.incarnation = incarnation
        self.epoch = epoch
        self.timestamp = timestamp
        self.running = running
        self.waiting = waiting
        self.kv = kv
        self.other = other
        self.penalty = penalty
        self.extra = other + penalty


class Placement:
    """The placement policy over one :class:`EngineSet` (which it updates on each placement).

    Args:
        engines: the engine set; the policy records each placed request in it.
        rng: the tie-break's random source (``random.Random(seed)`` in tests); a fresh
            unseeded one by default.
    """

    __slots__ = ("_reports", "_rng", "engines")

    def __init__(self, engines: EngineSet, *, rng: random.Random | None = None) -> None:
        self.engines = engines
        self._rng = rng if rng is not None else random.Random()
        self._reports: dict[int, _Report] = {}

    # ------------------------------------------------------------------ placing

    def place(
        self,
        request_ids: str | Sequence[str],
        *,
        data_parallel_rank: int | None = None,
    ) -> Route:
        """Pick the engine for a request (all its sample ids) and record them there.

        Args:
            request_ids: the engine request id, or the ids of the ``n > 1`` samples of one
                request (all placed on the same engine).
            data_parallel_rank: pin to this engine index, or None to pick the least loaded.

        Returns:
            The :class:`Route` (engine index, incarnation) every id was recorded on. Call
            :meth:`EngineSet.request_finished` for each id when it ends, however it ends
            (a failed send included).

        Raises:
            RequestRejected: ``data_parallel_rank`` is not a known engine index
                (``field="data_parallel_rank"``), or no request id was given.
            DuplicateRequestIdError: an id is live on some engine, or repeated.
            EngineDeadError / EngineDrainingError: the pinned engine cannot take it.
            NoEngineAvailableError: unpinned, and no engine is up.

        Nothing is recorded when it raises.
        """
        ids: Sequence[str] = (request_ids,) if isinstance(request_ids, str) else request_ids
        first = ids[0] if ids else ""
        if not ids:
            raise RequestRejected("a placement needs at least one request_id", field="request_id")
        engines = self.engines
        engines.check_new_ids(ids)
        records = engines.records()
        if data_parallel_rank is not None:
            e = self._pinned(records, data_parallel_rank, first)
        else:
            e = self._least_loaded()
        engines.start_on(e, ids)
        return Route(e.index, e.incarnation)

    def place_one(self, request_id: str, data_parallel_rank: int | None = None) -> EngineRecord:
        """:meth:`place` for one request id (the path of every ``generate``): the
        same choice, checks and errors; returns the engine's record."""
        e = (self._least_loaded() if data_parallel_rank is None
             else self._pinned(self.engines.records(), data_parallel_rank, request_id))
        self.engines.start_one(e, request_id)
        return e

    def choose(self) -> int:
        """The engine an unpinned request would go to now, without recording anything.

        Raises:
            NoEngineAvailableError: no engine is up.
        """
        return self._least_loaded().index

    def _pinned(self, records: dict[int, EngineRecord], rank: Any, request_id: str) -> EngineRecord:
        if type(rank) is not int or rank not in records:
            raise RequestRejected(
                f"data_parallel_rank: {rank!r} is not an engine of this client; valid ranks: "
                f"{format_ranks(records)}",
                request_id=request_id,
                field="data_parallel_rank",
            )
        e = records[rank]
        if e.state is not EngineState.UP:
            self.engines.check_can_start(rank, request_id)
        return e

    def _least_loaded(self) -> EngineRecord:
        ups, scores = self.engines.up_records()
        if not ups:
            words = self._state_words()
            raise NoEngineAvailableError(
                "no engine is up to take the request: " + ", ".join(f"engine {i} {w}" for i, w in words.items()),
                states=words,
            )
        if len(ups) == 1:
            return ups[0]
        # The loads are kept current by the engine set: min / count / index run in C.
        best = min(scores)
        n = scores.count(best)
        pos = scores.index(best)
        if n > 1:
            for _ in range(self._rng.randrange(n)):
                pos = scores.index(best, pos + 1)
        return ups[pos]

    def _state_words(self) -> dict[int, str]:
        return {
            s.engine_index: s.state.value if s.reason is None else f"{s.state.value}: {s.reason}"
            for s in self.engines.snapshot()
        }

    # ------------------------------------------------------------------ reports

    def report_load(
        self,
        engine_index: int,
        incarnation: int,
        *,
        num_running: int,
        num_waiting: int,
        kv_cache_usage: float | None = None,
        timestamp: float | None = None,
    ) -> bool:
        """Apply an engine's load report; returns whether it was applied.

        Apply it before the finishes of the message that carried it. Ignored (False):
        an unknown or dead engine, another incarnation, an engine ``timestamp`` older than
        the last applied report's (the engine's own clock, compared only with its own
        reports), counts that are not non-negative ints, or an engine this client has no
        request on (the report is read relative to those; it also voids the previous one).
        """
        e = self.engines.records().get(engine_index)
        if e is None or e.state is EngineState.DEAD or e.incarnation != incarnation:
            return False
        if type(num_running) is not int or type(num_waiting) is not int or num_running < 0 or num_waiting < 0:
            return False
        kv: float | None = None
        if kv_cache_usage is not None and type(kv_cache_usage) in (int, float) and 0.0 <= kv_cache_usage <= 1.0:
            kv = float(kv_cache_usage)
        prev = self._reports.get(engine_index)
        if (
            timestamp is not None
            and prev is not None
            and prev.incarnation == incarnation
            and prev.timestamp is not None
            and timestamp < prev.timestamp
        ):
            return False
        own = len(e.requests)
        if not own:
            # The report is read relative to this client's requests on the engine; with none
            # there it would outlive its meaning (an idle engine sends no newer one).
            self._reports.pop(engine_index, None)
            self.engines.set_extra(e, 0.0)
            return False
        other = max(0, num_running + num_waiting - own)
        penalty = num_waiting * KV_PRESSURE_WEIGHT * max(0.0, kv - 0.5) if kv is not None and num_waiting else 0.0
        self._reports[engine_index] = _Report(
            incarnation, e.idle_epoch, timestamp, num_running, num_waiting, kv, other, penalty
        )
        self.engines.set_extra(e, other + penalty)
        return True

    def report_scheduler_stats(
        self, engine_index: int, incarnation: int, scheduler_stats: Mapping[str, Any], timestamp: float | None = None
    ) -> bool:
        """Apply a vLLM ``EngineCoreOutputs.scheduler_stats`` map (vLLM 0.32 / 0.33 ``SchedulerStats``).

        Reads ``num_running_reqs``, ``num_waiting_reqs`` and ``kv_cache_usage`` (0..1);
        pass the message's ``timestamp``. False when a count is missing or malformed.
        """
        running: Any = scheduler_stats.get("num_running_reqs")
        waiting: Any = scheduler_stats.get("num_waiting_reqs")
        return self.report_load(
            engine_index,
            incarnation,
            num_running=running,
            num_waiting=waiting,
            kv_cache_usage=scheduler_stats.get("kv_cache_usage"),
            timestamp=timestamp,
        )

    def report_tokenspeed_load(self, incarnation: int, load: LoadSnapshot) -> bool:
        """Apply a TokenSpeed 0.1.1 load snapshot (``TokenSpeedBatch.load``; its
        ``engine_index`` names the engine). TokenSpeed stamps no time: batches arrive in order."""
        return self.report_load(
            load.engine_index,
            incarnation,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_usage if load.kv_total_pages > 0 else None,
        )

    # ------------------------------------------------------------------ queries

    def loads(self) -> tuple[EngineLoad, ...]:
        """Every engine's load terms, by ``engine_index`` (for metrics and logs)."""
        out = []
        for idx, e in sorted(self.engines.records().items()):
            r = self._reports.get(idx)
            live = r is not None and r.epoch == e.idle_epoch and r.incarnation == e.incarnation
            out.append(
                EngineLoad(
                    idx,
                    e.state,
                    len(e.requests),
                    r.other if live and r is not None else 0,
                    r.penalty if live and r is not None else 0.0,
                    r.running if live and r is not None else None,
                    r.waiting if live and r is not None else None,
                    r.kv if live and r is not None else None,
                )
            )
        return tuple(out)
