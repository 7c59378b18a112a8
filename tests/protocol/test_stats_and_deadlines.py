"""Statistics (counters, TTFT / ITL histograms), logging and deadlines of one
engine link, sans-IO: no sockets, no trio; time is a number the test sets."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqdispatch.errors import DeadlineExceeded, EngineDeadError, RequestRejected, SlowConsumerError
from zmqdispatch.protocol.deadlines import Deadlines, DeadlineScheduler, TimedMailbox
from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.protocol.stats import ITL_BUCKETS, TTFT_BUCKETS, Histogram
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out, outputs_frames, make_ts_request, ts_batch_frames
from zmqdispatch.protocol.runtime import Runtime


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(p: EngineProtocol) -> None:
    while (o := p.pop_send()) is not None:
        p.send_done(o)


# ---------------------------------------------------------------------- histogram


@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), max_size=50))
def test_histogram_puts_every_value_in_the_first_bucket_whose_bound_holds_it(values):
    h = Histogram(TTFT_BUCKETS)
    for v in values:
        h.observe(v)
    assert sum(h.counts) == h.count == len(values)
    assert math.isclose(h.sum, sum(values), rel_tol=1e-9, abs_tol=1e-9)
    expected = [0] * (len(TTFT_BUCKETS) + 1)
    for v in values:
        expected[next((i for i, b in enumerate(TTFT_BUCKETS) if v <= b), len(TTFT_BUCKETS))] += 1
    assert h.counts == expected


def test_histogram_bounds_must_increase():
    with pytest.raises(ValueError):
        Histogram((0.1, 0.1))
    assert list(ITL_BUCKETS) == sorted(ITL_BUCKETS)


# ---------------------------------------------------------------------- TTFT / ITL


def test_ttft_is_submit_to_first_token_receipt_and_itl_counts_continuing_rows_per_message():
    clock = Clock()
    p = EngineProtocol(timer=clock)
    p.submit(make_request("a"))
    clock.now = 101.0
    p.submit(make_request("b"))
    drain(p)
    # a's first token arrives at 102.0 (2 s after its submit); b has none yet
    p.frames_received(outputs_frames([out("a", [1])]), now=102.0)
    assert p.stats.ttft.count == 1 and p.stats.ttft.sum == 2.0
    assert p.stats.itl.count == 0  # a first token is no inter-token gap
    # next step, 0.5 s later: a continues, b gets its first token (1.5 s after its submit)
    p.frames_received(outputs_frames([out("a", [2]), out("b", [7])]), now=102.5)
    assert p.stats.ttft.count == 2 and p.stats.ttft.sum == 3.5
    assert p.stats.itl.count == 1 and p.stats.itl.sum == 0.5
    # both continue: one observation of 0.25 s per row
    p.frames_received(outputs_frames([out("a", [3]), out("b", [8], wire.FinishReason.STOP)]), now=102.75)
    assert p.stats.itl.count == 3 and p.stats.itl.sum == 1.0
    assert p.stats.itl.counts[ITL_BUCKETS.index(0.3)] == 2 and p.stats.itl.counts[ITL_BUCKETS.index(0.5)] == 1
    assert dict(p.stats.finishes) == {"stop": 1}
    assert p.stats.awaiting_first_token == 0


def test_rows_without_tokens_and_unknown_ids_are_not_first_tokens_or_gaps():
    clock = Clock()
    p = EngineProtocol(timer=clock)
    p.submit(make_request("a"))
    drain(p)
    p.frames_received(outputs_frames([out("a", []), out("gone", [5])]), now=100.5)
    assert p.stats.ttft.count == 0 and p.stats.awaiting_first_token == 1
    p.frames_received(outputs_frames([out("a", [4])]), now=101.0)
    assert p.stats.ttft.count == 1 and p.stats.ttft.sum == pytest.approx(1.0)
    # the "gone" row of the previous message was no continuing request
    assert p.stats.itl.count == 0


def test_tokenspeed_batches_feed_the_same_statistics():
    clock = Clock()
    p = EngineProtocol(runtime=Runtime.TOKENSPEED, timer=clock)
    p.submit(make_ts_request("t1"))
    drain(p)
    p.frames_received(ts_batch_frames([("t1", [5], "", 3, 1)]), now=100.25)
    p.frames_received(ts_batch_frames([("t1", [6], "length", 3, 2)]), now=100.30)
    assert p.stats.ttft.count == 1 and p.stats.ttft.sum == pytest.approx(0.25)
    assert p.stats.itl.count == 1 and p.stats.itl.sum == pytest.approx(0.05)
    assert dict(p.stats.finishes) == {"length": 1}


def test_an_aborted_request_leaves_the_first_token_map_at_once():
    clock = Clock()
    p = EngineProtocol(timer=clock)
    for i in range(500):
        p.submit(make_request(f"r{i}"))
        if i % 2:
            drain(p)  # sent: the abort goes out as an ABORT
        p.abort([f"r{i}"])  # never a row
        # the map holds no retired mailbox (with its frames and error) past its abort
        assert p.stats.awaiting_first_token == 0
    assert p.stats.aborts == 500 and p.stats.requests == 500


def test_requests_that_end_without_a_token_leave_the_first_token_map():
    clock = Clock()
    p = EngineProtocol(timer=clock)
    for i in range(500):
        p.submit(make_request(f"r{i}"))
        drain(p)
        # the engine finishes it without a row of its own (an id in finished_requests)
        p.frames_received(outputs_frames([], finished_requests=[f"r{i}"]), now=clock.now)
    # swept lazily (on submit and routing): bounded by the live requests, not by history
    assert p.inflight == 0
    assert p.stats.awaiting_first_token <= 64 + 1
    assert p.stats.requests == 500


def test_counters_for_slow_consumers_renames_decode_errors_and_deaths(caplog):
    clock = Clock()
    p = EngineProtocol(timer=clock, max_pending_tokens=2, max_decode_errors=2)
    mb, _ = p.submit(make_request("slow"))
    drain(p)
    with caplog.at_level(logging.WARNING, logger="zmqdispatch"):
        p.frames_received(outputs_frames([out("slow", [1, 2, 3])]), now=101.0)
        assert p.stats.slow_consumers == 1 and isinstance(mb.error, SlowConsumerError)
        assert any("fell 3 tokens behind" in r.getMessage() for r in caplog.records)
        # the id was aborted a moment ago: a reuse travels under a fresh id, with a warning
        p.submit(make_request("slow"))
        assert p.renamed_requests == 1
        assert any("'slow~1'" in r.getMessage() for r in caplog.records)
        # an undecodable message: size and first bytes (hex) in the warning
        garbage = b"\xc1" + bytes(range(100))
        p.frames_received([garbage], now=102.0)
        (rec,) = [r for r in caplog.records if "undecodable" in r.getMessage()]
        assert rec.levelno == logging.WARNING
        assert "101 bytes" in rec.getMessage() and (b"\xc1" + bytes(range(31))).hex() + "..." in rec.getMessage()
        p.submit(make_request("live"))
        drain(p)
        p.frames_received([garbage], now=103.0)
    assert p.death is not None and p.death.reason == "decode_errors"
    assert dict(p.stats.deaths) == {"decode_errors": 1}
    (death,) = [r for r in caplog.records if "dead (reason decode_errors)" in r.getMessage()]
    assert death.levelno == logging.WARNING  # a request was lost with it


def test_per_request_debug_records_are_not_built_when_debug_is_off(monkeypatch):
    # The hot path's guard: with DEBUG disabled no per-request record is made
    # (Logger.debug is not even called), while a request lives its whole life.
    calls: list[str] = []
    proto_log = logging.getLogger("zmqdispatch.protocol")
    monkeypatch.setattr(proto_log, "debug", lambda msg, *a, **k: calls.append(msg % a))
    monkeypatch.setattr(proto_log, "level", proto_log.level)  # restored after the test
    proto_log.setLevel(logging.INFO)  # (setLevel clears the loggers' isEnabledFor cache)
    p = EngineProtocol(timer=Clock())
    p.submit(make_request("a"))
    drain(p)
    for i in range(5):
        p.frames_received(outputs_frames([out("a", [i])]), now=101.0 + i)
    p.frames_received(outputs_frames([out("a", [9], wire.FinishReason.LENGTH)]), now=110.0)
    p.submit(make_request("b"))
    p.abort(["b"])
    assert calls == []
    proto_log.setLevel(logging.DEBUG)
    p.submit(make_request("c"))
    drain(p)
    p.frames_received(outputs_frames([out("c", [1])]), now=111.0)
    p.frames_received(outputs_frames([out("c", [2], wire.FinishReason.STOP)]), now=112.0)
    p.submit(make_request("d"))
    p.abort(["d"])
    assert [c.split(": ", 1)[1].split(" ")[0] for c in calls] == ["submitted", "first", "finished,", "submitted",
                                                                   "aborted"]


# ---------------------------------------------------------------------- deadlines


def timed(p: EngineProtocol, rid: str, sched: DeadlineScheduler, now: float, **limits: float) -> TimedMailbox:
    mb = TimedMailbox(rid, p.max_pending_tokens, p, Deadlines(**limits))
    p.submit(make_request(rid), mb)
    sched.add(mb, now, p.inflight)
    return mb


@pytest.mark.parametrize("field", ["first_token", "total", "stall"])
@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, "5", True])
def test_deadline_values_are_refused_by_field_name(field, value):
    with pytest.raises(RequestRejected) as ei:
        Deadlines(**{field: value})
    assert ei.value.field == f"deadlines.{field}"


def test_first_token_deadline_fires_only_without_a_first_token():
    p = EngineProtocol()
    sched = DeadlineScheduler()
    late = timed(p, "late", sched, 0.0, first_token=2.0)
    fine = timed(p, "fine", sched, 0.0, first_token=2.0)
    drain(p)
    p.frames_received(outputs_frames([out("fine", [1])]), now=1.5)
    assert sched.next_deadline() == 2.0
    assert sched.pop_expired(1.99) == []
    ((mb, exc),) = sched.pop_expired(2.0)
    assert mb is late and isinstance(exc, DeadlineExceeded) and isinstance(exc, TimeoutError)
    assert exc.limit == "first_token" and exc.seconds == 2.0 and exc.request_id == "late"
    assert "deadlines.first_token=2.0" in str(exc)
    assert fine.first_token_at == 1.5 and len(sched) == 0


def test_stall_deadline_follows_the_newest_token_and_waits_for_the_first():
    p = EngineProtocol()
    sched = DeadlineScheduler()
    mb = timed(p, "s", sched, 0.0, stall=1.0)
    drain(p)
    # before the first token the stall limit does not apply (it polls)
    assert sched.pop_expired(1.0) == [] and sched.next_deadline() == 2.0
    p.frames_received(outputs_frames([out("s", [1])]), now=1.8)
    p.frames_received(outputs_frames([out("s", [2])]), now=2.5)
    assert sched.pop_expired(2.0) == [] and sched.next_deadline() == 3.5  # pushed to newest + stall
    assert sched.pop_expired(3.4) == []
    ((got, exc),) = sched.pop_expired(3.5)
    assert got is mb and exc.limit == "stall" and "no new token for 1.000 s" in str(exc)


def test_total_deadline_and_requests_that_ended_first():
    p = EngineProtocol()
    sched = DeadlineScheduler()
    slow = timed(p, "slow", sched, 0.0, total=5.0, first_token=1.0)
    timed(p, "done", sched, 0.0, total=5.0)
    drain(p)
    p.frames_received(outputs_frames([out("slow", [1]), out("done", [1], wire.FinishReason.STOP)]), now=0.5)
    ((mb, exc),) = sched.pop_expired(10.0)
    assert mb is slow and exc.limit == "total" and exc.elapsed == 10.0
    assert len(sched) == 0


def test_the_heap_stays_bounded_by_live_requests():
    p = EngineProtocol()
    sched = DeadlineScheduler()
    for i in range(1000):
        timed(p, f"r{i}", sched, float(i), total=3600.0, first_token=600.0, stall=60.0)
        p.abort([f"r{i}"])
    assert len(sched) <= 3 * (p.inflight + 1) + 64 + 3


def test_waiter_is_called_only_when_the_earliest_deadline_moves_earlier():
    p = EngineProtocol()
    sched = DeadlineScheduler()
    woken: list[int] = []
    sched.waiter = lambda: woken.append(1)
    timed(p, "a", sched, 0.0, total=10.0)
    assert woken == [1] and sched.waiter is None
    sched.waiter = lambda: woken.append(2)
    timed(p, "b", sched, 0.0, total=20.0)  # later: no wake-up
    assert woken == [1]
    timed(p, "c", sched, 0.0, first_token=5.0)
    assert woken == [1, 2]


def test_a_dead_link_leaves_nothing_to_expire():
    p = EngineProtocol()
    sched = DeadlineScheduler()
    timed(p, "a", sched, 0.0, total=1.0)
    p.engine_died(EngineDeadError("gone", engine_index=0, reason="sentinel"))
    assert sched.pop_expired(5.0) == []


def test_the_decode_error_preview_spans_frames_and_stops_at_its_length():
    from zmqdispatch.protocol.engine import _preview

    assert _preview([b"ab", b"", b"cdef", b"gh"], 5) == b"abcde"
    assert _preview([b"ab"], 5) == b"ab"
    assert _preview([], 5) == b""
    assert _preview([b"x" * 10_000_000, b"never read"], 32) == b"x" * 32
