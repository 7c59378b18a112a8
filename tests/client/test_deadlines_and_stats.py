"""Per-request deadlines, client.engine().stats() and the Prometheus collector against a
scripted fake engine over real sockets; virtual time (MockClock, autojump)."""

from __future__ import annotations

import logging

import pytest
import trio

from zmqdispatch import Deadlines, DeadlineExceeded, EngineStats, RequestError
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine

from ..helpers import make_request
from zmqdispatch.testing import open_fake_engine_pair as fake_pair

GUARD = 60  # virtual seconds


async def test_first_token_deadline_aborts_on_the_engine_and_raises_a_typed_error(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            t0 = trio.current_time()
            async with client.generate(make_request("r1"), deadlines=Deadlines(first_token=5.0)) as stream:
                await engine.receive_add()
                with pytest.raises(DeadlineExceeded) as ei:
                    await stream.receive()
            assert trio.current_time() - t0 == pytest.approx(5.0, abs=0.2)
            exc = ei.value
            assert isinstance(exc, RequestError) and isinstance(exc, TimeoutError)
            assert exc.limit == "first_token" and exc.seconds == 5.0 and exc.request_id == "r1"
            assert await engine.receive_abort() == ("r1",)
            stats = client.engine().stats()
            assert dict(stats.deadlines_exceeded) == {"first_token": 1} and stats.aborts == 1
            assert client.is_alive  # one request failed, not the engine


async def test_stall_deadline_delivers_the_tokens_received_then_fails(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1"), deadlines=Deadlines(stall=2.0, first_token=30.0)) as stream:
                await engine.receive_add()
                got: list[int] = []
                for tok in (1, 2, 3):
                    await engine.send_tokens("r1", [tok])
                    got += (await stream.receive()).token_ids
                    await trio.sleep(1.5)  # gaps under the limit keep it alive
                t_last = trio.current_time() - 1.5
                with pytest.raises(DeadlineExceeded) as ei:
                    await stream.receive()
                assert got == [1, 2, 3]
                assert ei.value.limit == "stall"
                assert trio.current_time() - t_last == pytest.approx(2.0, abs=0.2)
            assert await engine.receive_abort() == ("r1",)


async def test_total_deadline_and_a_request_that_finishes_in_time(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("ok"), deadlines=Deadlines(total=10.0)) as stream:
                await engine.receive_add()
                await engine.send_tokens("ok", [1, 2], finish=wire.FinishReason.STOP)
                assert [d.token_ids async for d in stream] == [[1, 2]]
            await trio.sleep(20)  # its deadline passes after it finished: nothing happens
            async with client.generate(make_request("long"), deadlines=Deadlines(total=10.0)) as stream:
                await engine.receive_add()
                with pytest.raises(DeadlineExceeded) as ei:
                    async for _ in stream:
                        await engine.send_tokens("long", [7])
                        await trio.sleep(1.0)
                assert ei.value.limit == "total" and ei.value.elapsed == pytest.approx(10.0, abs=0.2)
            assert await engine.receive_abort() == ("long",)
            assert dict(client.engine().stats().deadlines_exceeded) == {"total": 1}


async def test_an_earlier_deadline_submitted_later_wakes_the_one_timer_task(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("far"), deadlines=Deadlines(total=40.0)) as far:
                async with client.generate(make_request("near"), deadlines=Deadlines(first_token=3.0)) as near:
                    t0 = trio.current_time()
                    with pytest.raises(DeadlineExceeded):
                        await near.receive()
                    assert trio.current_time() - t0 == pytest.approx(3.0, abs=0.2)
                assert not far.finished


async def test_deadlines_in_a_stream_group_and_in_fan_out(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.stream_group() as group:
                group.generate(make_request("g1"), deadlines=Deadlines(first_token=2.0))
                group.generate(make_request("g2"))
                await engine.receive_add()
                await engine.receive_add()
                ((member, item),) = await group.receive()
                assert member.request_id == "g1" and isinstance(item, DeadlineExceeded)
                assert len(group) == 1
                assert await engine.receive_abort() == ("g1",)
            assert await engine.receive_abort() == ("g2",)  # left the group
            async with client.generate_samples([make_request("p-0"), make_request("p-1")],
                                         deadlines=Deadlines(stall=1.0)) as merged:
                for _ in range(2):
                    await engine.receive_add()
                await engine.send_outputs([wire_engine.EngineCoreOutput(request_id="p-0", new_token_ids=(1,)),
                                           wire_engine.EngineCoreOutput(request_id="p-1", new_token_ids=(2,))])
                seen = [await merged.receive(), await merged.receive()]
                assert sorted((i, d.token_ids) for i, d in seen) == [(0, [1]), (1, [2])]
                with pytest.raises(DeadlineExceeded):
                    await merged.receive()


async def test_deadlines_of_the_wrong_type_are_refused_before_anything_is_sent():
    from zmqdispatch import RequestRejected

    async with fake_pair() as (engine, client):
        with pytest.raises(RequestRejected) as ei:
            client.generate(make_request("r1"), deadlines={"total": 1.0})
        assert ei.value.field == "deadlines"
        async with client.stream_group() as group:
            with pytest.raises(RequestRejected):
                group.generate(make_request("r2"), deadlines=5)
        assert client.engine().stats().requests == 0


async def test_stats_snapshot_after_a_request(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1")) as stream:
                await engine.receive_add()
                await trio.sleep(0.5)
                for tok in range(4):
                    await engine.send_tokens("r1", [tok])
                    await stream.receive()
                    await trio.sleep(0.25)
                await engine.send_tokens("r1", [9], finish=wire.FinishReason.LENGTH)
                await stream.receive()
            live = client.engine().stats()
    assert live.state == "ready" and live.death_reason is None
    s = client.engine().stats()  # after the client closed
    assert isinstance(s, EngineStats)
    assert (s.engine_index, s.runtime, s.requests, s.in_flight) == (0, "vllm", 1, 0)
    assert dict(s.finishes) == {"length": 1} and s.output_messages == 5
    ttft, itl = s.time_to_first_token, s.inter_token_latency
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.5, abs=0.1)
    assert itl.count == 4 and itl.sum == pytest.approx(1.0, abs=0.2)
    assert itl.quantile(0.5) == 0.3  # 0.25 s gaps: the (0.2, 0.3] bucket
    assert s.state == "dead" and dict(s.deaths) == {"closed": 1}  # taken after the client closed
    with pytest.raises(attrs_frozen_error()):
        s.requests = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.finishes["stop"] = 1  # type: ignore[index]


def attrs_frozen_error() -> type[Exception]:
    import attrs

    return attrs.exceptions.FrozenInstanceError


async def test_prometheus_collector_exports_conventional_names():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from zmqdispatch.metrics import StatsCollector

    registry = prometheus_client.CollectorRegistry()
    collector = StatsCollector()
    registry.register(collector)
    async with fake_pair() as (engine, client):
        with trio.fail_after(20):
            collector.add(client)
            async with client.generate(make_request("r1")) as stream:
                await engine.receive_add()
                await engine.send_tokens("r1", [1])
                await stream.receive()
                await engine.send_tokens("r1", [2], finish=wire.FinishReason.STOP)
                await stream.receive()
            text = prometheus_client.generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }
    e0 = (("engine_index", "0"),)
    assert samples[("zmqdispatch_requests_total", e0)] == 1
    assert samples[("zmqdispatch_requests_finished_total", (("engine_index", "0"), ("finish_reason", "stop")))] == 1
    assert samples[("zmqdispatch_requests_in_flight", e0)] == 0
    assert samples[("zmqdispatch_engine_up", e0)] == 1
    assert samples[("zmqdispatch_decode_errors_total", e0)] == 0
    assert samples[("zmqdispatch_time_to_first_token_seconds_count", e0)] == 1
    assert samples[("zmqdispatch_inter_token_latency_seconds_count", e0)] == 1
    assert samples[("zmqdispatch_time_to_first_token_seconds_bucket", (("engine_index", "0"), ("le", "+Inf")))] == 1
    assert "# TYPE zmqdispatch_inter_token_latency_seconds histogram" in text
    collector.remove(client)
    assert "engine_index" not in prometheus_client.generate_latest(registry).decode()


def test_prometheus_collector_tells_engines_of_the_same_index_apart_by_extra_labels():
    prometheus_client = pytest.importorskip("prometheus_client")
    from zmqdispatch.metrics import StatsCollector

    class Fake:
        def __init__(self, requests: int) -> None:
            self.requests = requests

        def stats(self) -> dict[int, EngineStats]:
            from zmqdispatch.metrics import HistogramSnapshot

            h = HistogramSnapshot(bounds=(0.1,), counts=(0, 0), sum=0.0, count=0)
            return {0: EngineStats(
                engine_index=0, runtime="vllm", state="ready", death_reason=None, in_flight=0,
                pending_utility_calls=0, requests=self.requests, finishes={}, aborts=0, abort_ids_sent=0,
                decode_errors=0, deaths={}, output_drops=0, slow_consumers=0, renamed_requests=0,
                unknown_outputs=0, deadlines_exceeded={}, output_messages=0, time_to_first_token=h,
                inter_token_latency=h,
            )}

    registry = prometheus_client.CollectorRegistry()
    collector = StatsCollector()
    registry.register(collector)
    collector.add(Fake(3), engine="a")
    collector.add(Fake(5), engine="b")
    with pytest.raises(ValueError):
        collector.add(Fake(1))  # no "engine" label: the families' label names would differ
    text = prometheus_client.generate_latest(registry).decode()
    assert 'zmqdispatch_requests_total{engine="a",engine_index="0"} 3.0' in text
    assert 'zmqdispatch_requests_total{engine="b",engine_index="0"} 5.0' in text


async def test_lifecycle_and_request_life_are_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="zmqdispatch"):
        async with fake_pair() as (engine, client):
            with trio.fail_after(20):
                async with client.generate(make_request("r1")) as stream:
                    await engine.receive_add()
                    await engine.send_tokens("r1", [1], finish=wire.FinishReason.STOP)
                    await stream.receive()
                async with client.generate(make_request("r2")) as stream:
                    await engine.receive_add()
                await engine.send_sentinel()
                await client.wait_dead()
    text = "\n".join(f"{r.levelname} {r.name} {r.getMessage()}" for r in caplog.records)
    for expected in (
        "INFO zmqdispatch.client bound handshake ipc://",
        "INFO zmqdispatch.client waiting for an engine at ipc://",
        "INFO zmqdispatch.client handshake: HELLO from engine identity 0000",
        "INFO zmqdispatch.client engine 0 ready (identity 0000): vllm, version 0.32.0",
        ", incarnation 0, input ipc://",
        "DEBUG zmqdispatch.protocol request 'r1': submitted to engine 0",
        "DEBUG zmqdispatch.protocol request 'r1': first token after",
        "DEBUG zmqdispatch.protocol request 'r1': finished, finish_reason=stop",
        "DEBUG zmqdispatch.protocol request 'r2': aborted",
        "INFO zmqdispatch.protocol engine 0 dead (reason sentinel)",
    ):
        assert expected in text, expected
    # The engine's death is the one warning: it leaves placement.
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("engine 0 out of placement (sentinel)"), text
