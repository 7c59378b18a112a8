"""One client, many engines (``zmqdispatch.multi``, ``docs/many-engines.md``), over
real ipc sockets against in-process mock ranks: each rank dials the one handshake
address with its own identity and is served on a socket pair of its own."""

from __future__ import annotations

import functools
import logging
import random
from typing import Any
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import attrs
import pytest
import trio
import trio.testing

from zmqdispatch import ClientConfig, connect, limits
from zmqdispatch.errors import (
    EngineDeadError,
    EngineDrainingError,
    EngineHandshakeError,
    EngineHandshakeTimeout,
    NoEngineAvailableError,
    RequestRejected,
)
from zmqdispatch.mock.server import MockEngineConfig, serve_mock_ranks, start_mock_engine
from zmqdispatch.multi import ADDRESS_INDEX_STRIDE, MultiEngineClient, connect_engines
from zmqdispatch.protocol.engines import EngineState
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.testing import dial, ready_response
from zmqdispatch.testing.processes import external_mock
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire.vllm_handshake import EngineCoreReadyResponse

from ..helpers import GUARD
from ..helpers import make_request as _make_request
from ..helpers import make_ts_request


def make_request(rid: str, *, data_parallel_rank: int | None = None, **sp: object) -> wire.EngineCoreRequest:
    return attrs.evolve(_make_request(rid, **sp), data_parallel_rank=data_parallel_rank)


def rank_cfg(address: str, rank: int, **kw: object) -> MockEngineConfig:
    kw.setdefault("step_interval", 0)
    return MockEngineConfig(handshake_address=address, engine_index=rank, **kw)  # type: ignore[arg-type]


async def start_rank(nursery: trio.Nursery, cfg: MockEngineConfig) -> trio.CancelScope:
    """Run one in-process mock rank (one engine, one client) in a cancel scope of its own."""
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            engine = await start_mock_engine(cfg, in_process=True)
            await engine.run()

    nursery.start_soon(run)
    return scope


@asynccontextmanager
async def ranks_and_client(tmp_path, n: int, *, faults: dict[int, tuple] | None = None, step: float = 0,
                           **kw: object) -> AsyncIterator[tuple[MultiEngineClient, trio.Nursery, str]]:
    address = f"ipc://{tmp_path}/hs.sock"
    async with trio.open_nursery() as nursery:
        for r in range(n):
            await start_rank(nursery, rank_cfg(address, r, faults=(faults or {}).get(r, ()), step_interval=step))
        async with connect_engines(address, data_parallel_size=n, **kw) as client:  # type: ignore[arg-type]
            yield client, nursery, address
        nursery.cancel_scope.cancel()


async def run_one(client, rid: str, max_tokens: int = 4, **kw: object) -> list[int]:
    tokens: list[int] = []
    async with client.generate(make_request(rid, max_tokens=max_tokens, **kw)) as stream:
        async for delta in stream:
            tokens += delta.token_ids
    return tokens


async def run_recording(client, requests: list[Any]) -> tuple[dict[str, int], dict[str, object]]:
    """Run *requests* at once, each read to its end; return the engine each
    was placed on and its outcome ("done", or the ``EngineDeadError`` it raised)."""
    outcome: dict[str, object] = {}
    where: dict[str, int] = {}

    async def go(request: Any) -> None:
        rid = client.runtime.request_id(request)
        try:
            async with client.generate(request) as stream:
                where[rid] = client.engine_of(rid)
                async for _ in stream:
                    pass
            outcome[rid] = "done"
        except EngineDeadError as exc:
            outcome[rid] = exc

    async with trio.open_nursery() as nursery:
        for request in requests:
            nursery.start_soon(go, request)
    return where, outcome


async def test_requests_spread_over_n_ranks_with_the_same_tokens(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 3) as (client, _, _):
            assert isinstance(client, MultiEngineClient)
            assert [s.state for s in client.states()] == [EngineState.UP] * 3
            # every rank has its own socket pair
            inputs = {e._bound_input for e in client.engines.values()}
            outputs = {e._bound_output for e in client.engines.values()}
            assert len(inputs) == len(outputs) == 3
            results: dict[str, list[int]] = {}
            placed: dict[str, int | None] = {}
            async with trio.open_nursery() as nursery:
                for i in range(9):
                    rid = f"r{i}"
                    stream = client.generate(make_request(rid, max_tokens=4))

                    async def go(rid=rid, stream=stream) -> None:
                        toks: list[int] = []
                        async with stream:
                            placed[rid] = client.engine_of(rid)
                            async for d in stream:
                                toks += d.token_ids
                        results[rid] = toks

                    nursery.start_soon(go)
            assert len({tuple(t) for t in results.values()}) == 1  # the same tokens on every rank
            counts = [sum(1 for e in placed.values() if e == r) for r in range(3)]
            assert counts == [3, 3, 3], counts  # a burst spreads evenly (placement counts its own)
            assert [s.in_flight for s in client.states()] == [0, 0, 0]
            assert sorted(client.stats()) == [0, 1, 2]
            assert await client.call_all("is_sleeping") == {0: False, 1: False, 2: False}


async def test_one_rank_dies_mid_stream_only_its_requests_fail(tmp_path):
    with trio.fail_after(GUARD):
        # rank 1 sends ENGINE_CORE_DEAD at its 20th step and exits; rank 0 goes on
        async with ranks_and_client(tmp_path, 2, faults={1: (("sentinel", 20),)}, step=0.002,
                                    rng=random.Random(0)) as (client, _, _):
            where, outcome = await run_recording(client, [make_request(f"r{i}", max_tokens=60) for i in range(4)])
            on1 = [r for r, e in where.items() if e == 1]
            on0 = [r for r, e in where.items() if e == 0]
            assert len(on0) == len(on1) == 2
            for rid in on0:
                assert outcome[rid] == "done"
            for rid in on1:
                exc = outcome[rid]
                assert isinstance(exc, EngineDeadError) and exc.engine_index == 1 and exc.reason == "sentinel"
            state1 = client.states()[1]
            assert state1.state is EngineState.DEAD and state1.reason == "sentinel"
            assert client.is_alive  # quorum 1: one engine up
            # new requests go to the live rank at once
            for i in range(3):
                async with client.generate(make_request(f"n{i}", max_tokens=2)) as stream:
                    assert client.engine_of(f"n{i}") == 0
                    async for _ in stream:
                        pass
            # a pin to the dead rank names it
            with pytest.raises(EngineDeadError) as info:
                client.generate(make_request("p", data_parallel_rank=1))
            assert info.value.engine_index == 1


async def test_a_restarted_rank_rejoins_with_a_new_incarnation_and_socket_pair(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 2, faults={1: (("sentinel", 3),)}) as (client, nursery, address):
            old_pair = client.engine(1)._bound_input
            with pytest.raises(EngineDeadError) as info:
                await run_one(client, "x", max_tokens=50, data_parallel_rank=1)
            assert info.value.engine_index == 1
            assert client.states()[1].state is EngineState.DEAD
            await start_rank(nursery, rank_cfg(address, 1))  # the same identity dials again
            await client.wait_for_engines(2)
            status = client.states()[1]
            assert (status.state, status.incarnation) == (EngineState.UP, 1)
            assert client.engine(1)._bound_input != old_pair
            assert len(await run_one(client, "x", max_tokens=3, data_parallel_rank=1)) == 3


async def test_drain_waits_for_in_flight_and_places_nothing_new(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 2, step=0.002) as (client, _, _):
            drained = trio.Event()
            finished: list[str] = []

            async def long_on_0() -> None:
                await run_one(client, "long", max_tokens=30, data_parallel_rank=0)
                finished.append("long")

            async def drain() -> None:
                await client.drain(0)
                drained.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_on_0)
                while client.engine_of("long") is None:
                    await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(drain)
                await trio.testing.wait_all_tasks_blocked()
                assert client.states()[0].state is EngineState.DRAINING
                assert not drained.is_set()
                for i in range(3):  # new requests go elsewhere
                    await run_one(client, f"n{i}", max_tokens=2)
                with pytest.raises(EngineDrainingError):
                    client.generate(make_request("p", data_parallel_rank=0))
            assert drained.is_set() and finished == ["long"]
            assert client.states()[0].drained
            client.undrain(0)
            assert client.states()[0].state is EngineState.UP


async def test_pins_out_of_range_rank_is_rejected_naming_the_field_and_ranks(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 2) as (client, _, _):
            for rank in (0, 1, 1, 0):
                rid = f"p{rank}{random.random()}"
                async with client.generate(make_request(rid, max_tokens=2, data_parallel_rank=rank)) as s:
                    assert client.engine_of(rid) == rank
                    async for _ in s:
                        pass
            with pytest.raises(RequestRejected) as info:
                client.generate(make_request("bad", data_parallel_rank=5))
            assert info.value.field == "data_parallel_rank" and "0-1" in str(info.value)


async def test_samples_of_one_request_go_to_one_engine(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 3) as (client, _, _):
            reqs = [make_request(f"s.{i}", max_tokens=3) for i in range(4)]
            seen: set[int] = set()
            async with client.generate_samples(reqs) as merged:
                seen = {client.engine_of(f"s.{i}") for i in range(4)} - {None}
                async for _ in merged:
                    pass
            assert len(seen) == 1
            assert [s.in_flight for s in client.states()] == [0, 0, 0]


async def test_quorum_refuses_new_requests_below_it(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 2, faults={1: (("sentinel", 2),)}, quorum=2) as (client, _, _):
            with pytest.raises(EngineDeadError):
                await run_one(client, "x", max_tokens=20, data_parallel_rank=1)
            assert not client.has_quorum and not client.is_alive
            with pytest.raises(NoEngineAvailableError, match="quorum of 2"):
                client.generate(make_request("y"))


async def test_an_engine_dialing_in_later_is_placed(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 1) as (client, nursery, address):
            assert [s.engine_index for s in client.states()] == [0]
            await start_rank(nursery, rank_cfg(address, 7))  # scale out: a new identity
            await client.wait_for_engines(2)
            assert len(await run_one(client, "late", max_tokens=3, data_parallel_rank=7)) == 3


async def test_startup_waits_for_n_engines_and_times_out_naming_the_count(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_rank(nursery, rank_cfg(address, 0))
            with pytest.raises(EngineHandshakeTimeout, match="1 of 2 engine"):
                async with connect(address, data_parallel_size=2, config=ClientConfig(handshake_timeout=0.5)):
                    pass
            nursery.cancel_scope.cancel()


async def test_a_lock_step_rank_is_refused_at_the_handshake(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    ready = attr_evolve(ready_response(rank_cfg(address, 0).max_model_len, build="zmqdispatch.mock"),
                        data_parallel_size=2)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dial_and_hold, address, ready)
            with pytest.raises(EngineHandshakeError, match="lock-step") as info:
                async with connect_engines(address, data_parallel_size=1):
                    pass
            assert "wave protocol" in str(info.value)
            nursery.cancel_scope.cancel()


async def dial_and_hold(address: str, ready: EngineCoreReadyResponse) -> None:
    """An engine that dials in and keeps its sockets until cancelled (sockets
    left to the garbage collector close with linger 0 and can discard the
    ready response before it left)."""
    sockets = await dial(address, ready, engine_index=0)
    try:
        await trio.sleep_forever()
    finally:
        sockets.close()


def attr_evolve(ready: EngineCoreReadyResponse, **changes: object) -> EngineCoreReadyResponse:
    return attrs.evolve(ready, **changes)


async def test_bad_arguments_are_refused_before_anything_is_bound():
    with pytest.raises(ValueError, match="data_parallel_size"):
        async with connect(data_parallel_size=0):
            pass
    with pytest.raises(ValueError, match="quorum"):
        async with connect(data_parallel_size=2, quorum=0):
            pass
    with pytest.raises(ValueError, match="data_parallel_size"):
        async with connect(quorum=2):
            pass


def test_cli_generate_with_data_parallel_size_runs_n_mock_ranks(tmp_path):
    import json
    import subprocess
    import sys

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"request_id": f"q{i}", "tokenized": {"input_ids": [1, 2, 3]},
                    "sampling_params": {"max_tokens": 3}}) + "\n" for i in range(4)))
    done = subprocess.run(
        [sys.executable, "-m", "zmqdispatch", "generate", "--data-parallel-size", "2", "--requests", str(requests),
         "--log-level", "info"],
        capture_output=True, text=True, timeout=GUARD, check=False,
    )
    assert done.returncode == 0, done.stderr
    completes = [json.loads(line) for line in done.stdout.splitlines() if '"complete"' in line]
    assert sorted(c["request_id"] for c in completes) == ["q0", "q1", "q2", "q3"]
    assert "engine 0 ready" in done.stderr and "engine 1 ready" in done.stderr


async def test_data_plane_host_binds_each_pair_on_tcp(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 2, data_plane_host="127.0.0.1") as (client, _, _):
            bound = [e._bound_input for e in client.engines.values()] + [e._bound_output
                                                                         for e in client.engines.values()]
            assert all(a.startswith("tcp://127.0.0.1:") for a in bound) and len(set(bound)) == 4
            assert len(await run_one(client, "t", max_tokens=3)) == 3


async def test_a_stream_group_places_each_member_and_aborts_by_handle(tmp_path):
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 2, step=0.002) as (client, _, _):
            async with client.stream_group() as group:
                members = [group.generate(make_request(f"g{i}", max_tokens=3)) for i in range(4)]
                long = group.generate(make_request("long", max_tokens=500, data_parallel_rank=1))
                assert {client.engine_of(f"g{i}") for i in range(4)} == {0, 1}
                assert client.engine_of("long") == 1
                done: set[object] = set()
                while len(done) < 4:
                    for member, item in await group.receive():
                        if getattr(item, "finish_reason", None) is not None:
                            done.add(member)
                assert done == set(members)
                group.abort([long])
                await trio.testing.wait_all_tasks_blocked()
                assert client.engine_of("long") is None
            assert [s.in_flight for s in client.states()] == [0, 0]


async def test_independent_engines_on_two_handshake_addresses_both_rank_0(tmp_path):
    """Two independent engines (two ``vllm serve``, each DP rank 0) dial two
    handshake addresses: both are served, indexed by address position; one
    dies, the other keeps serving."""
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_rank(nursery, rank_cfg(a, 0, step_interval=0.002))
            await start_rank(nursery, rank_cfg(b, 0, step_interval=0.002, faults=(("sentinel", 15),)))
            async with connect_engines([a, b], data_parallel_size=2, rng=random.Random(0)) as client:
                second = ADDRESS_INDEX_STRIDE
                assert [s.engine_index for s in client.states()] == [0, second]
                assert client.origin(0) == (a, 0) and client.origin(second) == (b, 0)
                # both serve: a pin to each, and an unpinned pair spreads over both
                assert len(await run_one(client, "pa", max_tokens=2, data_parallel_rank=0)) == 2
                assert len(await run_one(client, "pb", max_tokens=2, data_parallel_rank=second)) == 2
                where, outcome = await run_recording(client, [make_request(f"r{i}", max_tokens=60) for i in range(2)])
                assert sorted(where.values()) == [0, second]
                for rid, engine in where.items():
                    if engine == 0:
                        assert outcome[rid] == "done"
                    else:
                        exc = outcome[rid]
                        assert isinstance(exc, EngineDeadError) and exc.engine_index == second
                assert client.states()[1].state is EngineState.DEAD
                for i in range(3):  # the engine of the other address keeps serving
                    async with client.generate(make_request(f"n{i}", max_tokens=2)) as stream:
                        assert client.engine_of(f"n{i}") == 0
                        async for _ in stream:
                            pass
            nursery.cancel_scope.cancel()


def ts_rank_cfg(address: str, rank: int, **kw: object) -> MockEngineConfig:
    return rank_cfg(address, rank, runtime="tokenspeed", data_parallel_size=2, **kw)


async def run_ts(client, rid: str, max_new_tokens: int = 4, **kw: object) -> list[int]:
    tokens: list[int] = []
    async with client.generate(attrs.evolve(make_ts_request(rid, max_new_tokens=max_new_tokens), **kw)) as stream:
        async for delta in stream:
            tokens += delta.token_ids
    return tokens


async def test_tokenspeed_ranks_spread_and_their_load_snapshots_reach_placement(tmp_path):
    """``zmqdispatch mock-engine --runtime tokenspeed --data-parallel-size 2``
    (its ranks, :func:`serve_mock_ranks`) behind one client."""
    address = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=address, runtime="tokenspeed", data_parallel_size=2,
                           data_parallel_size_local=2, step_interval=0.003)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(serve_mock_ranks, cfg, in_process=True))
            async with connect_engines(address, data_parallel_size=2, rng=random.Random(0)) as client:
                assert client.runtime is Runtime.TOKENSPEED
                assert [s.engine_index for s in client.states()] == [0, 1]
                first_tokens = 0
                seen_all = trio.Event()
                where: dict[str, int] = {}
                results: dict[str, list[int]] = {}

                async def go(rid: str) -> None:
                    nonlocal first_tokens
                    toks: list[int] = []
                    async with client.generate(make_ts_request(rid, max_new_tokens=80)) as stream:
                        where[rid] = client.engine_of(rid)
                        async for delta in stream:
                            if not toks:
                                first_tokens += 1
                                if first_tokens == 4:
                                    seen_all.set()
                            toks += delta.token_ids
                    results[rid] = toks

                async with trio.open_nursery() as inner:
                    for i in range(4):
                        inner.start_soon(go, f"t{i}")
                    await seen_all.wait()
                    # each rank's batches carry its load tail; placement holds it
                    # while this client has requests there
                    loads = client.loads()
                    assert [(lo.engine_index, lo.in_flight) for lo in loads] == [(0, 2), (1, 2)]
                    assert [lo.reported_running for lo in loads] == [2, 2], loads
                    assert all(lo.kv_cache_usage is not None for lo in loads)
                assert sorted(where.values()) == [0, 0, 1, 1]  # spread
                assert len({tuple(t) for t in results.values()}) == 1 and len(results["t0"]) == 80
                # no request left: the reports are void again
                assert [(lo.in_flight, lo.reported_running) for lo in client.loads()] == [(0, None), (0, None)]
            nursery.cancel_scope.cancel()


async def test_a_tokenspeed_rank_death_fails_only_its_requests(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_rank(nursery, ts_rank_cfg(address, 0, step_interval=0.002))
            await start_rank(nursery, ts_rank_cfg(address, 1, step_interval=0.002, faults=(("sentinel", 20),)))
            async with connect_engines(address, data_parallel_size=2, rng=random.Random(0)) as client:
                requests = [make_ts_request(f"t{i}", max_new_tokens=60) for i in range(4)]
                where, outcome = await run_recording(client, requests)
                assert sorted(where.values()) == [0, 0, 1, 1]
                for rid, engine in where.items():
                    if engine == 0:
                        assert outcome[rid] == "done"
                    else:
                        exc = outcome[rid]
                        assert isinstance(exc, EngineDeadError) and exc.engine_index == 1, exc
                assert [s.state for s in client.states()] == [EngineState.UP, EngineState.DEAD]
                assert len(await run_ts(client, "after", 3)) == 3 and client.states()[0].in_flight == 0
                with pytest.raises(EngineDeadError):
                    client.generate(attrs.evolve(make_ts_request("pin"), data_parallel_rank=1))
            nursery.cancel_scope.cancel()


async def test_pending_handshakes_are_capped_and_one_that_hangs_is_dropped_at_the_timeout_and_can_return(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(limits, "MAX_PENDING_HANDSHAKES", 2)
    caplog.set_level(logging.WARNING, logger="zmqdispatch")
    with logged("refused: 2 handshakes are under way") as refused:  # the refusal's WARNING is its only sign
        await _capped_handshakes(tmp_path, caplog, refused)


@contextmanager
def logged(text: str) -> Iterator[trio.Event]:
    """An Event set once a ``zmqdispatch`` log record's message contains *text*
    (for a state change the client shows only in its log)."""
    seen = trio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    watch = Watch()
    logging.getLogger("zmqdispatch").addHandler(watch)
    try:
        yield seen
    finally:
        logging.getLogger("zmqdispatch").removeHandler(watch)


async def _capped_handshakes(tmp_path, caplog, refused: trio.Event) -> None:
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 1, config=ClientConfig(handshake_timeout=1.0)) as (
                client, nursery, address):
            # three engines dial after startup and never say READY (stuck mid-handshake, connected)
            doomed = [await start_rank(nursery, rank_cfg(address, r, faults=(("no-ready", 0),))) for r in (5, 6, 7)]
            await refused.wait()  # the third HELLO arrives after the other two
            assert len(client.pending_handshakes) == 2  # the cap: no third socket pair
            held = list(client._serving.pending.values())
            assert all(not s.closed for p in held for s in p.sockets())
            while client.pending_handshakes:  # dropped at handshake_timeout
                await client._changed.wait()
            assert all(s.closed for p in held for s in p.sockets())  # their pairs are closed
            assert "handshake timed out" in caplog.text
            for scope in doomed:
                scope.cancel()
            assert [s.engine_index for s in client.states()] == [0]
            # the same identity dials again, whole this time: served
            await start_rank(nursery, rank_cfg(address, held[0].engine_index))
            await client.wait_for_engines(2)
            rid_rank = held[0].engine_index
            assert len(await run_one(client, "back", max_tokens=3, data_parallel_rank=rid_rank)) == 3


async def test_an_engine_that_dies_mid_handshake_frees_its_slot_at_once_and_its_restart_is_served(
        tmp_path, monkeypatch, caplog):
    """Its handshake connection closes before READY (the handshake ROUTER's
    monitor): the handshake fails after the drop grace, not at handshake_timeout
    (far beyond GUARD here), its socket pair closes, and the engine dialing
    again with the same identity gets the slot."""
    monkeypatch.setattr(limits, "MAX_PENDING_HANDSHAKES", 1)
    caplog.set_level(logging.INFO, logger="zmqdispatch")
    with logged("HELLO from engine identity 0500") as hello:  # the pending handshake's INFO line is its only sign
        await _dies_mid_handshake(tmp_path, caplog, hello)


async def _dies_mid_handshake(tmp_path, caplog, hello: trio.Event) -> None:
    with trio.fail_after(GUARD):
        async with ranks_and_client(tmp_path, 1, config=ClientConfig(handshake_timeout=100 * GUARD)) as (
                client, nursery, address):
            doomed = await start_rank(nursery, rank_cfg(address, 5, faults=(("no-ready", 0),)))
            await hello.wait()
            assert client.pending_handshakes == (5,)
            (held,) = client._serving.pending.values()
            assert held.handshake_fd >= 0  # the HELLO's connection is known
            doomed.cancel()  # its process vanishes: the handshake connection closes
            while client.pending_handshakes:
                await client._changed.wait()
            assert all(s.closed for s in held.sockets())
            assert "closed its handshake connection while the handshake waited for READY" in caplog.text
            assert [s.engine_index for s in client.states()] == [0]
            await start_rank(nursery, rank_cfg(address, 5))
            await client.wait_for_engines(2)
            assert len(await run_one(client, "back", max_tokens=3, data_parallel_rank=5)) == 3


async def test_ranks_serving_clients_in_turn_reach_the_next_client(tmp_path):
    """A mock rank dials the handshake address again as soon as its client's
    input connection closes; the closing client must not read that HELLO (its
    handshake sockets close before the engines' data sockets), so the next
    client gets every rank, the one that served a request included."""
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with external_mock(address, "--data-parallel-size", "2", "--step-interval-ms", "0"):
            for turn in range(4):
                async with connect_engines(address, data_parallel_size=2,
                                           config=ClientConfig(handshake_timeout=10)) as client:
                    assert len(await run_one(client, f"turn-{turn}", data_parallel_rank=0)) == 4
                    assert len(await run_one(client, f"turn-{turn}-b", data_parallel_rank=1)) == 4
