"""Placement of requests over several engines (zmqdispatch/protocol/placement.py; rules and the
failures they prevent: docs/many-engines.md)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineDrainingError,
    NoEngineAvailableError,
    RequestRejected,
)
from zmqdispatch.protocol.engines import EngineSet, EngineState, Route
from zmqdispatch.protocol.placement import KV_PRESSURE_WEIGHT, Placement
from zmqdispatch.wire.tokenspeed import LoadSnapshot


def make(n: int = 4, seed: int = 0, indices: list[int] | None = None) -> Placement:
    s = EngineSet()
    for i in indices if indices is not None else range(n):
        s.add_engine(i)
    return Placement(s, rng=random.Random(seed))


def counts(p: Placement) -> list[int]:
    return [status.in_flight for status in p.engines.snapshot()]


def scores(p: Placement) -> dict[int, float]:
    return {load.engine_index: load.score for load in p.loads()}


# --------------------------------------------------------------------------- examples


def test_least_loaded_engine_wins() -> None:
    p = make(3)
    for i in range(4):
        p.place(f"a{i}", data_parallel_rank=0)
    p.place("b0", data_parallel_rank=1)
    assert p.place("x").engine_index == 2
    assert p.place("y").engine_index in (1, 2)


def test_a_cold_burst_spreads_evenly_before_any_report() -> None:
    p = make(4)
    for i in range(10):
        p.place(f"r{i}")
    assert sorted(counts(p)) == [2, 2, 3, 3]


def test_a_stale_report_does_not_erase_requests_placed_since() -> None:
    # Engine 0 reports 5 requests when this client had 1 there (4 are another client's, or
    # ones it retired that the engine has not dropped yet); 3 more are placed on it after
    # the snapshot was taken. The snapshot must not hide those 3.
    p = make(2)
    p.place("mine", data_parallel_rank=0)
    assert p.report_load(0, 0, num_running=5, num_waiting=0)
    for i in range(3):
        p.place(f"since{i}", data_parallel_rank=0)
    assert scores(p)[0] == 5 + 3
    # Engine 1, idle, takes the next 8 unpinned requests before engine 0 takes another.
    got = [p.place(f"u{i}").engine_index for i in range(8)]
    assert got == [1] * 8


def test_a_report_below_the_own_count_changes_nothing() -> None:
    # The engine has not read our last ADDs yet: it reports fewer than we have there.
    p = make(2)
    for i in range(4):
        p.place(f"a{i}", data_parallel_rank=0)
    p.report_load(0, 0, num_running=1, num_waiting=0)
    assert scores(p) == {0: 4, 1: 0}


def test_an_idle_engine_sheds_its_last_report() -> None:
    # An engine reports nothing once idle: a report that counted requests this client has
    # since finished must not keep it looking busy.
    p = make(2)
    p.place("a", data_parallel_rank=0)
    p.report_load(0, 0, num_running=4, num_waiting=0)  # 3 beyond ours
    assert scores(p)[0] == 4
    p.engines.request_finished("a")
    assert scores(p)[0] == 0
    assert [p.place(f"n{i}").engine_index for i in range(2)] in ([0, 1], [1, 0])


def test_another_clients_load_steers_requests_away() -> None:
    p = make(2)
    p.place("mine", data_parallel_rank=1)
    p.report_load(1, 0, num_running=4, num_waiting=0)
    assert [p.place(f"r{i}").engine_index for i in range(4)] == [0, 0, 0, 0]


def test_a_report_of_an_engine_without_our_requests_is_not_kept() -> None:
    # Read relative to this client's requests there; with none, nothing says when it would
    # stop being true (an idle engine sends no newer report).
    p = make(2)
    assert not p.report_load(1, 0, num_running=3, num_waiting=0)
    assert scores(p) == {0: 0, 1: 0}
    p.place("a", data_parallel_rank=1)
    assert scores(p)[1] == 1


def test_kv_pressure_penalizes_a_queue_on_a_full_cache() -> None:
    p = make(2)
    p.place("a", data_parallel_rank=0)
    p.place("b", data_parallel_rank=1)
    p.report_load(0, 0, num_running=0, num_waiting=1, kv_cache_usage=1.0)
    p.report_load(1, 0, num_running=0, num_waiting=1, kv_cache_usage=0.5)
    assert scores(p) == {0: 1 + 0.5 * KV_PRESSURE_WEIGHT, 1: 1}
    assert [p.place(f"c{i}").engine_index for i in range(3)] == [1, 1, 1]


def test_reports_that_are_older_from_another_incarnation_or_malformed_are_ignored() -> None:
    p = make(2)
    p.place("a", data_parallel_rank=0)
    assert p.report_load(0, 0, num_running=3, num_waiting=0, timestamp=10.0)
    assert not p.report_load(0, 0, num_running=0, num_waiting=0, timestamp=9.0)
    assert scores(p)[0] == 3
    assert not p.report_load(0, 1, num_running=9, num_waiting=0)  # not its incarnation
    assert not p.report_load(0, 0, num_running=-1, num_waiting=0)
    assert not p.report_load(0, 0, num_running=True, num_waiting=0)
    assert not p.report_load(7, 0, num_running=1, num_waiting=0)
    assert scores(p)[0] == 3
    # After a death and return, the old incarnation's report is void.
    p.engines.engine_died(0, "sentinel")
    assert not p.report_load(0, 0, num_running=1, num_waiting=0)
    p.engines.engine_returned(0)
    assert scores(p)[0] == 0
    p.place("b", data_parallel_rank=0)
    assert p.report_load(0, 1, num_running=2, num_waiting=0, timestamp=0.5)  # its clock restarted
    assert scores(p)[0] == 2


def test_vllm_scheduler_stats_and_tokenspeed_load_are_read() -> None:
    p = make(2)
    p.place("a", data_parallel_rank=0)
    p.place("b", data_parallel_rank=1)
    stats = {"num_running_reqs": 2, "num_waiting_reqs": 1, "kv_cache_usage": 0.75, "step_counter": 9}
    assert p.report_scheduler_stats(0, 0, stats, timestamp=1.0)
    load0 = p.loads()[0]
    assert (load0.reported_running, load0.reported_waiting, load0.kv_cache_usage) == (2, 1, 0.75)
    assert load0.score == 3 + 1 * KV_PRESSURE_WEIGHT * 0.25
    assert not p.report_scheduler_stats(0, 0, {"num_running_reqs": 1}, timestamp=2.0)
    assert p.report_tokenspeed_load(0, LoadSnapshot(1, 1, 3, 75, 100))
    load1 = p.loads()[1]
    assert (load1.reported_running, load1.reported_waiting, load1.kv_cache_usage) == (1, 3, 0.75)


def test_pin_goes_to_its_engine_even_when_busier() -> None:
    p = make(3)
    for i in range(5):
        assert p.place(f"r{i}", data_parallel_rank=2) == Route(2, 0)
    assert counts(p) == [0, 0, 5]


def test_a_pin_outside_the_engines_is_rejected_naming_the_field_and_the_ranks() -> None:
    p = make(indices=[0, 1, 2, 3, 8])
    for bad in (4, -1, 99, True, "1"):
        with pytest.raises(RequestRejected) as e:
            p.place("r", data_parallel_rank=bad)  # type: ignore[arg-type]
        assert e.value.field == "data_parallel_rank"
        assert e.value.request_id == "r"
        assert "valid ranks: 0-3, 8" in str(e.value)
    assert p.engines.total_in_flight == 0


def test_a_pin_to_a_dead_or_draining_engine_is_a_typed_error() -> None:
    p = make(3)
    p.engines.engine_died(1, "process_exit")
    with pytest.raises(EngineDeadError) as dead:
        p.place("r", data_parallel_rank=1)
    assert dead.value.engine_index == 1 and dead.value.reason == "process_exit"
    p.engines.drain(2)
    with pytest.raises(EngineDrainingError) as draining:
        p.place("r", data_parallel_rank=2)
    assert draining.value.engine_index == 2
    assert p.engines.total_in_flight == 0


def test_only_up_engines_take_unpinned_requests() -> None:
    p = make(3)
    p.engines.engine_died(0, "sentinel")
    p.engines.drain(1)
    assert {p.place(f"r{i}").engine_index for i in range(10)} == {2}
    p.engines.drain(2)
    with pytest.raises(NoEngineAvailableError) as e:
        p.place("x")
    assert e.value.states == {0: "dead: sentinel", 1: "draining", 2: "draining"}
    with pytest.raises(NoEngineAvailableError):
        p.choose()


def test_samples_of_one_request_share_an_engine() -> None:
    p = make(4)
    p.place("busy", data_parallel_rank=0)
    route = p.place(["s0", "s1", "s2"])
    assert route.engine_index != 0
    assert {p.engines.route(r) for r in ("s0", "s1", "s2")} == {route}
    assert p.engines.in_flight(route.engine_index) == 3
    # Pinned samples go to the pin.
    assert p.place(["t0", "t1"], data_parallel_rank=0).engine_index == 0


def test_a_refused_placement_records_nothing() -> None:
    p = make(2)
    p.place("a")
    with pytest.raises(DuplicateRequestIdError):
        p.place(["b", "a"])
    with pytest.raises(DuplicateRequestIdError):
        p.place(["c", "c"])
    with pytest.raises(RequestRejected):
        p.place([])
    assert p.engines.total_in_flight == 1 and p.engines.route("b") is None


def test_choose_does_not_record() -> None:
    p = make(2)
    p.choose()
    assert counts(p) == [0, 0]


# --------------------------------------------------------------------------- tie-break statistics


def test_ties_spread_uniformly_over_engines() -> None:
    # Every decision is a 4-way tie (the previous request finished): each engine should get
    # about a quarter. Binomial(4000, 1/4): sd ~27; the bounds are > 7 sd away.
    p = make(4, seed=1)
    got: Counter[int] = Counter()
    for i in range(4000):
        got[p.place(f"r{i}").engine_index] += 1
        p.engines.request_finished(f"r{i}")
    assert all(800 <= got[e] <= 1200 for e in range(4)), got


def test_a_periodic_workload_does_not_pin_the_long_requests_to_one_engine() -> None:
    # Each cycle places a long request (a tie: both engines idle) then a short one, and ends
    # both. A tie-break that rotates a start index by one per decision sees an even number
    # of decisions per cycle and so resolves every long request's tie to the same engine.
    p = make(2, seed=2)
    long_on: Counter[int] = Counter()
    for c in range(1000):
        long_on[p.place(f"long{c}").engine_index] += 1
        p.place(f"short{c}")
        p.engines.request_finished(f"short{c}")
        p.engines.request_finished(f"long{c}")
    assert 400 <= long_on[0] <= 600, long_on


# --------------------------------------------------------------------------- invariants


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_any_burst_before_reports_is_within_one(n: int, m: int, seed: int) -> None:
    p = make(n, seed=seed)
    for i in range(m):
        p.place(f"r{i}")
    c = counts(p)
    assert max(c) - min(c) <= 1 and sum(c) == m


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 40), st.none() | st.integers(0, 4), st.integers(1, 3)),
        st.tuples(st.just("finish"), st.integers(0, 40), st.none(), st.just(0)),
        st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 20), st.integers(0, 20)),
        st.tuples(st.just("die"), st.integers(0, 3), st.none(), st.just(0)),
        st.tuples(st.just("return"), st.integers(0, 3), st.none(), st.just(0)),
        st.tuples(st.just("drain"), st.integers(0, 3), st.none(), st.just(0)),
        st.tuples(st.just("undrain"), st.integers(0, 3), st.none(), st.just(0)),
    ),
    max_size=150,
)

_RAISES = (RequestRejected, EngineDeadError, EngineDrainingError, NoEngineAvailableError)


@settings(max_examples=300, deadline=None)
@given(_OPS, st.integers(0, 2**32 - 1))
# an own finish after a report lowers the count below what was reported
@example([("die", 1, None, 0), ("die", 2, None, 0), ("die", 3, None, 0), ("place", 0, None, 1),
          ("place", 1, None, 1), ("report", 0, 0, 2), ("finish", 0, None, 0)], 0)
def test_placement_invariants_under_any_event_sequence(ops: list[tuple[object, ...]], seed: int) -> None:
    p = make(4, seed=seed)
    es = p.engines
    # For each engine: the report applied last, and the placements on it and
    # the finishes of its requests since.
    since: dict[int, tuple[int, int, int]] = {}
    for op in ops:
        kind = op[0]
        if kind == "place":
            _, n, pin, samples = op
            ids = [f"r{n}.{k}" for k in range(samples)]  # type: ignore[str-bytes-safe]
            before = {s.engine_index: s for s in es.snapshot()}
            ups = [i for i, s in before.items() if s.state is EngineState.UP]
            live_best = min((scores(p)[i] for i in ups), default=None)
            try:
                route = p.place(ids, data_parallel_rank=pin)  # type: ignore[arg-type]
            except (*_RAISES, DuplicateRequestIdError):
                assert es.snapshot() == tuple(before.values())  # nothing recorded
                continue
            e = route.engine_index
            # Never a non-up engine; the pin respected; else the least loaded.
            assert before[e].state is EngineState.UP
            if pin is not None:
                assert e == pin
            else:
                assert scores(p)[e] - samples == live_best
            # All samples on the one engine.
            assert {es.route(r) for r in ids} == {route}
            if e in since:
                reported, placed, finished = since[e]
                since[e] = (reported, placed + samples, finished)
        elif kind == "finish":
            for k in range(3):
                where = es.route(f"r{op[1]}.{k}")
                es.request_finished(f"r{op[1]}.{k}")
                if where is not None and where.engine_index in since \
                        and where.incarnation == es.state(where.engine_index).incarnation:
                    reported, placed, finished = since[where.engine_index]
                    since[where.engine_index] = (reported, placed, finished + 1)
        elif kind == "report":
            _, reporter, running, waiting = op
            if p.report_load(reporter, es.state(reporter).incarnation,  # type: ignore[arg-type]
                             num_running=running, num_waiting=waiting):  # type: ignore[arg-type]
                since[reporter] = (running + waiting, 0, 0)  # type: ignore[index, operator]
        elif kind == "die":
            es.engine_died(op[1], "sentinel")  # type: ignore[arg-type]
            since.pop(op[1], None)  # type: ignore[arg-type]
        elif kind == "return":
            if es.state(op[1]).state is EngineState.DEAD:  # type: ignore[arg-type]
                es.engine_returned(op[1])  # type: ignore[arg-type]
        elif kind == "drain":
            if es.state(op[1]).state is not EngineState.DEAD:  # type: ignore[arg-type]
                es.drain(op[1])  # type: ignore[arg-type]
        elif kind == "undrain" and es.state(op[1]).state is not EngineState.DEAD:  # type: ignore[arg-type]
            es.undrain(op[1])  # type: ignore[arg-type]

        loads = {load.engine_index: load for load in p.loads()}
        # The loads the scan reads (kept current on each event) equal the ones recomputed.
        up_records, kept = es.up_records()
        assert {e.index: score for e, score in zip(up_records, kept)} == {
            i: load.score for i, load in loads.items() if load.state is EngineState.UP
        }
        for i, load in loads.items():
            assert load.in_flight >= 0 and load.other >= 0 and load.kv_penalty >= 0
            assert load.score >= load.in_flight  # a report never lowers the own count
            if load.in_flight == 0:
                since.pop(i, None)  # the report is void once idle
            elif i in since and load.reported_running is not None:
                reported, placed, finished = since[i]
                # a stale report never hides sends since (the own finishes since lower the count)
                assert load.score >= reported + placed - finished
    # Every request ends, however: counts and report terms all return to zero.
    for n in range(41):
        for k in range(3):
            es.request_finished(f"r{n}.{k}")
    assert all(load.in_flight == 0 and load.score == 0 for load in p.loads())


def test_no_drift_after_a_long_mixed_run() -> None:
    # A long run with long and short requests, aborts, failed sends and periodic reports
    # (each a snapshot taken a few events earlier), then all ends: the next burst spreads
    # exactly as on the first day.
    rng = random.Random(7)
    p = make(4, seed=7)
    es = p.engines
    live: list[str] = []
    for i in range(50_000):
        rid = f"r{i}"
        p.place(rid)
        live.append(rid)
        if rng.random() < 0.02:
            e = rng.randrange(4)
            stale = max(0, es.in_flight(e) + rng.randint(-3, 3))
            p.report_load(e, 0, num_running=stale, num_waiting=0)
        while live and rng.random() < 0.5:
            es.request_finished(live.pop(rng.randrange(len(live))))
    for rid in live:
        es.request_finished(rid)
    assert all(load.score == 0 for load in p.loads())
    for i in range(8):
        p.place(f"again{i}")
    assert counts(p) == [2, 2, 2, 2]
