"""Misuse and shutdown: closing a client with open streams aborts
them; streams refuse use without ``async with`` and concurrent receivers; a
second Ctrl-C during engine shutdown still kills the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import trio
import trio.testing

import zmqdispatch
from zmqdispatch import LocalProtocolError, connect
from zmqdispatch._engine_lifecycle import terminate
from zmqdispatch.testing import FakeEngine
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request

GUARD = 10


async def test_closing_the_client_aborts_streams_still_open_elsewhere(tmp_path):
    addr = f"ipc://{tmp_path}/hs.sock"
    engine = FakeEngine(addr)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as n:
            n.start_soon(engine.run_handshake)
            errors = []
            async with zmqdispatch.connect(addr) as client:
                await engine.handshake_done.wait()
                streams = [client.generate(make_request(f"r{i}")) for i in range(3)]
                for s in streams:
                    await s.__aenter__()
                for _ in streams:
                    await engine.receive_add()

                async def held_elsewhere(s):
                    try:
                        await s.receive()
                    except zmqdispatch.EngineDeadError as exc:
                        errors.append(exc.reason)

                async with trio.open_nursery() as inner:
                    for s in streams:
                        inner.start_soon(held_elsewhere, s)
                    await trio.testing.wait_all_tasks_blocked()
                    inner.cancel_scope.cancel()
                # the client block ends with the three streams never exited
            assert sorted(await engine.receive_abort()) == ["r0", "r1", "r2"]
            for s in streams:
                with pytest.raises(zmqdispatch.EngineDeadError) as ei:
                    await s.receive()
                assert ei.value.reason == "closed"
        engine.close()


async def test_iterating_without_async_with_is_refused_and_aborts_the_request():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            stream = client.generate(make_request("r1"))
            with pytest.raises(LocalProtocolError, match="async with"):
                async for _ in stream:
                    pass  # pragma: no cover
            assert not client.protocol.is_live("r1")
            # the id is free again
            async with client.generate(make_request("r1")):
                assert (await engine.receive_add()).request_id == "r1"


async def test_two_tasks_receiving_on_one_stream_is_a_typed_misuse():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1")) as s:
                await engine.receive_add()
                async with trio.open_nursery() as n:
                    n.start_soon(s.receive)
                    await trio.testing.wait_all_tasks_blocked()
                    with pytest.raises(trio.BusyResourceError):
                        await s.receive()
                    await engine.send_tokens("r1", [1], wire.FinishReason.STOP)
            with pytest.raises(LocalProtocolError):
                await s.__aenter__()


async def test_a_second_interrupt_during_engine_shutdown_kills_the_process_group():
    ignore_term = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(600)")
    proc = await trio.lowlevel.open_process([sys.executable, "-c", ignore_term], start_new_session=True,
                                            stdout=subprocess.PIPE)
    assert (await proc.stdout.receive_some(2)) == b"up"
    real_wait = proc.wait

    async def interrupted_wait():
        raise KeyboardInterrupt  # what a second Ctrl-C delivers inside the grace wait

    proc.wait = interrupted_wait  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        await terminate(proc, grace=30.0)
    proc.wait = real_wait  # type: ignore[method-assign]
    with trio.fail_after(GUARD):
        code = await proc.wait()
    assert code == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


@pytest.mark.parametrize("launch", ["", "   ", [], "echo 'unterminated", [""]])
async def test_a_malformed_launch_command_is_refused_before_anything_is_bound(launch):
    with pytest.raises(ValueError, match="launch"):
        async with connect("tcp://127.0.0.1:0", launch=launch):
            pass  # pragma: no cover


async def test_a_single_engine_client_refuses_a_pin_to_another_engine():
    import attrs

    from zmqdispatch import RequestRejected

    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            assert client.engine_index == 0
            for pin in (1, 5):
                with pytest.raises(RequestRejected, match=r"valid ranks: \[?0") as info:
                    client.generate(attrs.evolve(make_request("p"), data_parallel_rank=pin))
                assert info.value.field == "data_parallel_rank"
            # nothing was sent; a pin to this engine is served
            async with client.generate(attrs.evolve(make_request("ok"), data_parallel_rank=0)):
                add = await engine.receive_add()
            assert add.request_id == "ok" and add.data_parallel_rank == 0
