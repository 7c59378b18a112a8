"""The engine set of a many-engine client (zmqdispatch/protocol/engines.py): states, deaths,
incarnations, drains, quorum, and the request table that keeps in-flight counts exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineDrainingError,
    LocalProtocolError,
)
from zmqdispatch.protocol.engines import (
    EngineSet,
    EngineState,
    EngineStatus,
    Route,
    format_ranks,
)


def make(n: int = 3) -> EngineSet:
    s = EngineSet()
    for i in range(n):
        s.add_engine(i)
    return s


def test_added_engines_are_up_with_incarnation_zero() -> None:
    s = make(2)
    assert s.snapshot() == (
        EngineStatus(0, EngineState.UP, 0, 0),
        EngineStatus(1, EngineState.UP, 0, 0),
    )
    assert s.indices == {0, 1}
    with pytest.raises(LocalProtocolError, match="already known"):
        s.add_engine(1)
    with pytest.raises(LocalProtocolError):
        s.add_engine(-1)


def test_death_returns_exactly_the_requests_on_the_dead_engine() -> None:
    s = make(2)
    s.request_started("a", 0)
    s.request_started("b", 1)
    s.request_started("c", 0)
    assert s.engine_died(0, "sentinel") == ("a", "c")
    assert s.state(0) == EngineStatus(0, EngineState.DEAD, 0, 0, "sentinel")
    assert s.route("a") is None and s.route("b") == Route(1, 0)
    # Their later finishes are no-ops; a second death changes nothing.
    assert s.request_finished("a") is None
    assert s.engine_died(0, "process_exit") == ()
    assert s.state(0).reason == "sentinel"
    assert s.total_in_flight == 1


def test_a_request_cannot_start_on_a_dead_or_draining_engine() -> None:
    s = make(2)
    s.engine_died(0, "silence")
    with pytest.raises(EngineDeadError) as dead:
        s.request_started("x", 0)
    assert dead.value.engine_index == 0 and dead.value.reason == "silence"
    s.drain(1)
    with pytest.raises(EngineDrainingError) as draining:
        s.request_started("x", 1)
    assert draining.value.engine_index == 1
    assert s.total_in_flight == 0


def test_a_returned_engine_is_a_new_incarnation_that_never_sees_old_ids() -> None:
    s = make(1)
    old = s.request_started("r1", 0)
    assert s.engine_died(0, "process_exit") == ("r1",)
    new = s.engine_returned(0)
    assert new == Route(0, 1) and old == Route(0, 0)
    assert s.state(0) == EngineStatus(0, EngineState.UP, 1, 0)
    assert s.route("r1") is None  # an abort of the old id is not routed to the new incarnation
    # The id may be reused on the new incarnation; a late finish of the old one cannot retire it.
    assert s.request_started("r1", 0) == new
    assert s.request_finished("r1", old) is None
    assert s.in_flight(0) == 1
    assert s.request_finished("r1", new) == 0
    with pytest.raises(LocalProtocolError, match="not dead"):
        s.engine_returned(0)


def test_drain_completes_when_in_flight_reaches_zero() -> None:
    s = make(2)
    s.request_started("a", 0)
    s.request_started("b", 0)
    assert s.drain(0) is False
    assert not s.is_drained(0) and not s.state(0).drained
    s.request_finished("a")
    assert not s.is_drained(0)
    assert s.request_finished("b") == 0
    assert s.is_drained(0) and s.state(0).drained
    assert s.drain(1) is True  # nothing in flight: drained at once
    s.undrain(1)
    assert s.state(1).state is EngineState.UP
    s.engine_died(0, "closed")
    with pytest.raises(LocalProtocolError):
        s.drain(0)


def test_quorum_and_liveness() -> None:
    s = make(3)
    assert s.has_quorum(3) and not s.has_quorum(4)
    s.drain(2)
    assert s.up_count == 2 and s.live_count == 3 and not s.has_quorum(3)
    s.engine_died(0, "sentinel")
    s.engine_died(1, "sentinel")
    assert s.up_count == 0 and s.live_count == 1  # the client lives on the draining engine
    s.engine_died(2, "closed")
    assert s.live_count == 0


def test_duplicate_live_ids_are_refused_across_engines() -> None:
    s = make(2)
    s.request_started("a", 0)
    with pytest.raises(DuplicateRequestIdError, match="engine 0") as e:
        s.request_started("a", 1)
    assert e.value.field == "request_id" and e.value.request_id == "a"
    with pytest.raises(DuplicateRequestIdError, match="twice"):
        s.check_new_ids(["b", "b"])
    s.request_finished("a")
    s.request_started("a", 1)  # reusable once finished


def test_unknown_engines_are_caller_bugs() -> None:
    s = make(2)
    with pytest.raises(LocalProtocolError, match="known: 0-1"):
        s.engine_died(5, "x")
    with pytest.raises(LocalProtocolError):
        s.request_started("a", 5)


def test_format_ranks() -> None:
    assert format_ranks([3, 0, 1, 2, 7, 9, 10]) == "0-3, 7, 9-10"
    assert format_ranks([]) == "none"
    assert format_ranks([4]) == "4"


# --------------------------------------------------------------------------- invariants

_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 3), st.integers(0, 30)),
        st.tuples(st.just("finish"), st.integers(0, 3), st.integers(0, 30)),
        st.tuples(st.just("die"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("return"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("drain"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("undrain"), st.integers(0, 3), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(_EVENTS)
def test_counts_match_the_table_never_go_negative_and_return_to_zero(events: list[tuple[str, int, int]]) -> None:
    s = make(4)
    live: dict[str, int] = {}  # model: request id -> engine
    failed: set[str] = set()
    for kind, eng, n in events:
        rid = f"r{n}"
        st_ = s.state(eng).state
        if kind == "start":
            if rid in live or st_ is not EngineState.UP:
                with pytest.raises((DuplicateRequestIdError, EngineDeadError, EngineDrainingError)):
                    s.request_started(rid, eng)
            else:
                s.request_started(rid, eng)
                live[rid] = eng
        elif kind == "finish":
            assert s.request_finished(rid) == live.pop(rid, None)
        elif kind == "die":
            lost = s.engine_died(eng, "sentinel")
            expected = [r for r, e in live.items() if e == eng] if st_ is not EngineState.DEAD else []
            assert sorted(lost) == sorted(expected)
            for r in lost:
                del live[r]
            failed.update(lost)
        elif kind == "return":
            if st_ is EngineState.DEAD:
                s.engine_returned(eng)
        elif kind == "drain":
            if st_ is not EngineState.DEAD:
                assert s.drain(eng) == (not any(e == eng for e in live.values()))
        elif kind == "undrain" and st_ is not EngineState.DEAD:
            s.undrain(eng)
        for status in s.snapshot():
            assert status.in_flight == sum(1 for e in live.values() if e == status.engine_index) >= 0
            if status.state is EngineState.DEAD:
                assert status.in_flight == 0
        assert all(s.route(r) is None for r in failed if r not in live)
    # Finishing everything (or the engines dying) brings every count back to zero.
    for rid in list(live):
        s.request_finished(rid)
    assert s.total_in_flight == 0
    assert all(status.in_flight == 0 for status in s.snapshot())
