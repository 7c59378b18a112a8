"""The set of engines one client serves (sans-IO): their states, and which request is on which.

One client may front several engines: the data-parallel ranks behind one handshake
(vLLM: identity = DP rank; TokenSpeed: identity = ``zmq_engine_index + dp_rank``), or
independent engines on other hosts. Each engine is known by its ``engine_index`` and is
in one of three states (:class:`EngineState`):

- ``up``: eligible for new requests;
- ``draining``: keeps serving what it has, takes nothing new; *drained* once its
  in-flight count reaches 0 (:meth:`EngineSet.is_drained`);
- ``dead``: gone, with a reason (``"sentinel"``, ``"process_exit"``, ... as in
  :class:`~zmqdispatch.errors.EngineDeadError`).

Events the shell reports: :meth:`~EngineSet.add_engine` (handshake done),
:meth:`~EngineSet.engine_died`, :meth:`~EngineSet.engine_returned` (a new incarnation),
:meth:`~EngineSet.drain` / :meth:`~EngineSet.undrain`, :meth:`~EngineSet.request_started`
and :meth:`~EngineSet.request_finished`. The request table is keyed by ``request_id``,
never by counters: a request can end several racing ways (its terminal output, an abort,
a failed send, its engine's death) and only the first counts, so in-flight counts return
to exactly zero however requests end, and never go negative.

A death takes the dead engine's requests out of the table and hands them back (the shell
fails exactly those with ``EngineDeadError(engine_index=...)``). A returned engine starts a
new incarnation with an empty table: no request id of the old incarnation is routed to it
(:meth:`~EngineSet.route` no longer knows them), and a late finish reported for the old
incarnation is ignored. Rules and the failures they prevent: ``docs/many-engines.md``.

No I/O, no clock; every request event is O(1) (it also keeps the engine's load current for
:mod:`~zmqdispatch.protocol.placement`); :meth:`~EngineSet.engine_died` is O(requests on that
engine), state changes and snapshots O(engines).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import attrs

from ..errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineDrainingError,
    LocalProtocolError,
)

__all__ = ["EngineSet", "EngineState", "EngineStatus", "Route", "format_ranks"]


class EngineState(enum.Enum):
    """Supervision state of one engine."""

    UP = "up"
    DRAINING = "draining"
    DEAD = "dead"


@attrs.frozen
class EngineStatus:
    """One engine's state, as :meth:`EngineSet.snapshot` reports it.

    Attributes:
        engine_index: the engine's identity index (vLLM DP rank; TokenSpeed
            ``zmq_engine_index + dp_rank``), offset by 65536 per handshake
            address after the first (``zmqdispatch.multi.ADDRESS_INDEX_STRIDE``).
        state: up, draining or dead.
        incarnation: 0 for the first handshake, +1 per :meth:`EngineSet.engine_returned`.
        in_flight: this client's requests on the engine (its current incarnation).
        reason: why it died (``EngineDeadError.reason``), None unless dead.
        drained: draining with nothing in flight.
    """

    engine_index: int
    state: EngineState
    incarnation: int
    in_flight: int
    reason: str | None = None

    @property
    def drained(self) -> bool:
        return self.state is EngineState.DRAINING and self.in_flight == 0


class Route(NamedTuple):
    """Where a request went: the engine and the incarnation it was sent to."""

    engine_index: int
    incarnation: int


class EngineRecord:
    """Mutable per-engine record: the set's own, which :class:`~zmqdispatch.protocol.placement.Placement`
    reads and changes only through :class:`EngineSet`'s ``records`` / ``up_records`` /
    ``start_on`` / ``set_extra``."""

    __slots__ = ("extra", "idle_epoch", "incarnation", "index", "pos", "reason", "requests", "state")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = EngineState.UP
        self.incarnation = 0
        self.reason: str | None = None
        # Insertion-ordered set of the request ids on this engine's current incarnation.
        self.requests: dict[str, None] = {}
        # Bumped whenever the in-flight count returns to 0 (or the engine dies): what was
        # learnt about the engine's queue while it held our requests is void after that.
        self.idle_epoch = 0
        # The placement policy's load beyond ``requests`` (from the engine's last report);
        # 0.0 again whenever ``requests`` empties or the engine dies.
        self.extra = 0.0
        # Position in ``EngineSet._up`` / ``_up_scores``, -1 when not up.
        self.pos = -1


def format_ranks(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3, 7"`` (for messages naming the valid ranks)."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts) if parts else "none"


class EngineSet:
    """Supervision state of the engines of one client, and the request -> engine table.

    Raises :class:`~zmqdispatch.errors.LocalProtocolError` for events that contradict the
    state (adding a known engine, a death of an unknown one, ...): those are bugs of the
    caller, not conditions of the engines.
    """

    __slots__ = ("_engines", "_table", "_up", "_up_scores")

    def __init__(self) -> None:
        self._engines: dict[int, EngineRecord] = {}
        self._table: dict[str, EngineRecord] = {}
        # The up engines by index, and each one's load (``len(requests) + extra``) kept
        # current on every start, finish and report, so a placement is a ``min`` over a list
        # of floats. Rebuilt on every state change (rare).
        self._up: list[EngineRecord] = []
        self._up_scores: list[float] = []

    def _state_changed(self) -> None:
        for e in self._engines.values():
            e.pos = -1
        self._up = [e for _, e in sorted(self._engines.items()) if e.state is EngineState.UP]
        for i, e in enumerate(self._up):
            e.pos = i
        self._up_scores = [len(e.requests) + e.extra for e in self._up]

    def set_extra(self, e: EngineRecord, extra: float) -> None:
        """Placement: set engine *e*'s load term beyond its own requests (its score follows)."""
        e.extra = extra
        if e.pos >= 0:
            self._up_scores[e.pos] = len(e.requests) + extra

    # ------------------------------------------------------------------ engine events

    def add_engine(self, engine_index: int) -> Route:
        """An engine completed its handshake: it is ``up``, incarnation 0.

        Raises:
            LocalProtocolError: the index is already known (use :meth:`engine_returned`
                for a dead engine that came back), or is not a non-negative int.
        """
        if type(engine_index) is not int or engine_index < 0:
            raise LocalProtocolError(f"engine_index must be a non-negative int, got {engine_index!r}")
        if engine_index in self._engines:
            raise LocalProtocolError(f"engine {engine_index} is already known")
        self._engines[engine_index] = EngineRecord(engine_index)
        self._state_changed()
        return Route(engine_index, 0)

    def engine_died(self, engine_index: int, reason: str) -> tuple[str, ...]:
        """The engine is gone. Returns the request ids that were on it, in start order.

        Those ids leave the table (their later finishes are no-ops; :meth:`route` no
        longer knows them): fail each with ``EngineDeadError(engine_index=engine_index,
        reason=reason)``. A second death of a dead engine returns ``()`` and keeps the
        first reason.
        """
        e = self._get(engine_index)
        if e.state is EngineState.DEAD:
            return ()
        e.state = EngineState.DEAD
        e.reason = reason
        lost = tuple(e.requests)
        table = self._table
        for rid in lost:
            del table[rid]
        e.requests = {}
        e.idle_epoch += 1
        e.extra = 0.0
        self._state_changed()
        return lost

    def engine_returned(self, engine_index: int) -> Route:
        """A dead engine completed a new handshake: ``up`` again, next incarnation, nothing in flight.

        Raises:
            LocalProtocolError: the engine is unknown or not dead.
        """
        e = self._get(engine_index)
        if e.state is not EngineState.DEAD:
            raise LocalProtocolError(f"engine {engine_index} is {e.state.value}, not dead: it cannot return")
        e.state = EngineState.UP
        e.reason = None
        e.incarnation += 1
        self._state_changed()
        return Route(engine_index, e.incarnation)

    def drain(self, engine_index: int) -> bool:
        """Stop placing new requests on the engine; returns whether it is already drained.

        Pinned requests to it then fail with ``EngineDrainingError``. Idempotent.

        Raises:
            LocalProtocolError: the engine is unknown or dead.
        """
        e = self._get(engine_index)
        if e.state is EngineState.DEAD:
            raise LocalProtocolError(f"engine {engine_index} is dead: nothing to drain")
        e.state = EngineState.DRAINING
        self._state_changed()
        return not e.requests

    def undrain(self, engine_index: int) -> None:
        """Cancel a drain: the engine is ``up`` again. Idempotent on an up engine.

        Raises:
            LocalProtocolError: the engine is unknown or dead.
        """
        e = self._get(engine_index)
        if e.state is EngineState.DEAD:
            raise LocalProtocolError(f"engine {engine_index} is dead: it cannot be undrained")
        e.state = EngineState.UP
        self._state_changed()

    # ------------------------------------------------------------------ request events

    def check_can_start(self, engine_index: int, request_id: str = "") -> None:
        """Raise the typed error for a request that cannot go to this known engine.

        Raises:
            EngineDeadError: the engine is dead (``reason`` is its death's).
            EngineDrainingError: the engine is draining.
        """
        e = self._engines[engine_index]
        if e.state is EngineState.UP:
            return
        if e.state is EngineState.DEAD:
            raise EngineDeadError(
                f"engine {engine_index} is dead ({e.reason}); request {request_id!r} not sent",
                engine_index=engine_index,
                reason=e.reason or "",
            )
        raise EngineDrainingError(
            f"engine {engine_index} is draining; request {request_id!r} not sent", engine_index=engine_index
        )

    def check_new_ids(self, request_ids: Sequence[str]) -> None:
        """Refuse ids that are live anywhere in the set, or repeated among themselves.

        Raises:
            DuplicateRequestIdError: naming the id and, when live, the engine holding it.
        """
        table = self._table
        if len(request_ids) == 1 and request_ids[0] not in table:
            return
        seen: set[str] = set()
        for rid in request_ids:
            e = table.get(rid)
            if e is not None:
                raise DuplicateRequestIdError(
                    f"request_id {rid!r} is still live on engine {e.index}", request_id=rid, field="request_id"
                )
            if rid in seen:
                raise DuplicateRequestIdError(
                    f"request_id {rid!r} appears twice in one placement", request_id=rid, field="request_id"
                )
            seen.add(rid)

    def request_started(self, request_id: str, engine_index: int) -> Route:
        """Record that ``request_id`` was placed on the engine (before its ADD is sent).

        Raises:
            DuplicateRequestIdError: the id is live on some engine.
            EngineDeadError / EngineDrainingError: the engine cannot take it.
            LocalProtocolError: the engine is unknown.
        """
        e = self._get(engine_index)
        if request_id in self._table:
            self.check_new_ids((request_id,))
        if e.state is not EngineState.UP:
            self.check_can_start(engine_index, request_id)
        e.requests[request_id] = None
        self._table[request_id] = e
        if e.pos >= 0:
            self._up_scores[e.pos] = len(e.requests) + e.extra
        return Route(engine_index, e.incarnation)

    def request_finished(self, request_id: str, route: Route | None = None) -> int | None:
        """The request ended, however (finished, aborted, failed, its send failed).

        Idempotent: returns the engine index it was on, or None when the id is not live
        (already finished, or its engine died). With ``route`` (the one the request was
        started with), a finish reported for another engine or an older incarnation is
        ignored (None), so a stale event cannot retire a newer request reusing the id.
        Check :meth:`is_drained` afterwards for a draining engine.
        """
        e = self._table.get(request_id)
        if e is None:
            return None
        if route is not None and (route[0] != e.index or route[1] != e.incarnation):
            return None
        del self._table[request_id]
        requests = e.requests
        del requests[request_id]
        if not requests:
            e.idle_epoch += 1
            e.extra = 0.0
        if e.pos >= 0:
            self._up_scores[e.pos] = len(requests) + e.extra
        return e.index

    # ------------------------------------------------------------------ queries

    def route(self, request_id: str) -> Route | None:
        """Where a live request is (to route its abort), None when not live."""
        e = self._table.get(request_id)
        return None if e is None else Route(e.index, e.incarnation)

    def in_flight(self, engine_index: int) -> int:
        """This client's requests on the engine's current incarnation."""
        return len(self._get(engine_index).requests)

    def requests_on(self, engine_index: int) -> tuple[str, ...]:
        """The live request ids on the engine, in start order."""
        return tuple(self._get(engine_index).requests)

    def state(self, engine_index: int) -> EngineStatus:
        """One engine's status. Raises LocalProtocolError for an unknown index."""
        e = self._get(engine_index)
        return EngineStatus(e.index, e.state, e.incarnation, len(e.requests), e.reason)

    def snapshot(self) -> tuple[EngineStatus, ...]:
        """Every engine's status, by ``engine_index``."""
        return tuple(
            EngineStatus(e.index, e.state, e.incarnation, len(e.requests), e.reason)
            for _, e in sorted(self._engines.items())
        )

    def is_drained(self, engine_index: int) -> bool:
        """Draining with nothing in flight (the shell may now close its link)."""
        e = self._get(engine_index)
        return e.state is EngineState.DRAINING and not e.requests

    @property
    def indices(self) -> frozenset[int]:
        """Every known engine index (the valid ``data_parallel_rank`` values)."""
        return frozenset(self._engines)

    @property
    def up_count(self) -> int:
        return len(self._up)

    @property
    def live_count(self) -> int:
        """Engines up or draining (the client lives while this is > 0)."""
        return sum(1 for e in self._engines.values() if e.state is not EngineState.DEAD)

    def has_quorum(self, k: int) -> bool:
        """At least ``k`` engines are up."""
        return len(self._up) >= k

    @property
    def total_in_flight(self) -> int:
        return len(self._table)

    # ------------------------------------------------------------------ internal (placement)

    def _get(self, engine_index: int) -> EngineRecord:
        try:
            return self._engines[engine_index]
        except KeyError:
            raise LocalProtocolError(
                f"engine {engine_index!r} is not known (known: {format_ranks(self._engines)})"
            ) from None

    def records(self) -> dict[int, EngineRecord]:
        """Placement: every engine's record, by ``engine_index`` (the set's own dict: read only)."""
        return self._engines

    def up_records(self) -> tuple[list[EngineRecord], list[float]]:
        """Placement: the ``up`` engines' records and their scores, index-aligned
        (the set's own lists: read only)."""
        return self._up, self._up_scores

    def start_one(self, e: EngineRecord, request_id: str) -> None:
        """Placement: :meth:`start_on` for one id, refusing a live one.

        Raises:
            DuplicateRequestIdError: the id is live on some engine (nothing recorded).
        """
        table = self._table
        if request_id in table:
            self.check_new_ids((request_id,))
        requests = e.requests
        requests[request_id] = None
        table[request_id] = e
        if e.pos >= 0:
            self._up_scores[e.pos] = len(requests) + e.extra

    def start_on(self, e: EngineRecord, request_ids: Iterable[str]) -> None:
        """Placement: *request_ids* start on engine *e* (placed, checked by the caller)."""
        table = self._table
        requests = e.requests
        for rid in request_ids:
            requests[rid] = None
            table[rid] = e
        if e.pos >= 0:
            self._up_scores[e.pos] = len(requests) + e.extra
