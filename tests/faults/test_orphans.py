"""Requests a dead link may have left running on the engine are aborted by the
client that resumes its session (issue 7).

A ``send_timeout`` death (the engine froze) leaves every ADD the engine had
received running on it, and drops the ABORTs not yet sent. The dead client's
:class:`EngineSession` carries those ids (``orphan_ids``, at most
``limits.MAX_ORPHAN_IDS``); ``connect(resume=session)`` sends them in one ABORT
before anything else, and its own session stops carrying them once the socket
accepted that frame. End to end against the mock engine process:
``test_wedged_input.py``.
"""

from __future__ import annotations

import math

import pytest
import trio

from zmqdispatch import ClientConfig, EngineDeadError, connect
from zmqdispatch.testing import FakeEngine
from zmqdispatch.wire import vllm as wire

from ..helpers import GUARD, make_request


def fixed(tmp_path, **config: object) -> tuple[str, ClientConfig]:
    """Fixed data-plane addresses (resumable). Real time throughout: the
    closed client's input socket lingers (1 s) and the engine reconnects
    (100 ms) in libzmq's threads, which a mock clock would jump past."""
    cfg = ClientConfig(input_address=f"ipc://{tmp_path}/in.sock", output_address=f"ipc://{tmp_path}/out.sock",
                       handshake_timeout=20, **config)
    return f"ipc://{tmp_path}/hs.sock", cfg


def thaw(nursery: trio.Nursery, engine: FakeEngine) -> trio.MemoryReceiveChannel:
    """The engine reads its input again (its libzmq then notices the closed
    connection and re-dials); what it reads comes out of the returned channel."""
    send, receive = trio.open_memory_channel(math.inf)

    async def read() -> None:
        while True:
            send.send_nowait(await engine.receive())

    nursery.start_soon(read)
    return receive


async def die_of_send_timeout(client) -> list[str]:
    """Submit until the (non-reading) engine's pipes are full and a send times out."""
    ids = []
    with pytest.raises(EngineDeadError):
        for i in range(10_000):
            ids.append(f"r{i}")
            await client.generate(make_request(ids[-1])).__aenter__()
    assert client.death.reason == "send_timeout"
    return ids


async def test_resume_aborts_what_a_send_timeout_death_left_on_the_engine_before_any_new_add(tmp_path):
    hs, cfg = fixed(tmp_path, send_timeout=0.5, send_hwm=1)
    engine = FakeEngine(hs, input_rcvhwm=1)  # never reads until told to
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            async with connect(hs, config=cfg) as client:
                await engine.handshake_done.wait()
                ids = await die_of_send_timeout(client)
                session = client.session
                # every ADD that reached the socket, and the one whose send timed out
                assert session.orphan_ids == tuple(ids)
            assert client.session == session  # nothing more was sent on the way out

            received = thaw(nursery, engine)
            async with connect(config=cfg, resume=session) as client:
                s = client.generate(make_request("r0"))  # reuses an orphan's id
                s._open()  # its ADD now; entered below, once the engine saw it
                got_adds = []
                while (msg := await received.receive()).kind == wire.RequestType.ADD:
                    got_adds.append(msg.value.request_id)  # buffered from the frozen link
                assert msg.kind == wire.RequestType.ABORT and msg.value == tuple(ids)
                assert set(got_adds) <= set(ids)
                msg = await received.receive()
                # after the ABORT, and under a fresh engine-side id: neither the
                # ABORT nor the orphan's late outputs can reach it
                assert msg.kind == wire.RequestType.ADD and msg.value.request_id == "r0~1"
                assert msg.value.external_req_id == "r0"
                assert client.session.orphan_ids == ("r0~1",)  # the stale ids were sent: cleared
                assert client.protocol.aborts_sent == len(ids)
                await s.__aenter__()
                await engine.send_tokens("r0", [9])  # a late output of the orphan: dropped
                await engine.send_tokens("r0~1", [1], finish=wire.FinishReason.STOP)
                assert [d.token_ids async for d in s] == [[1]]
                assert client.session.orphan_ids == ()
            nursery.cancel_scope.cancel()
        engine.close()


async def test_a_resumed_link_that_dies_before_its_abort_went_out_carries_the_ids_on(tmp_path):
    hs, cfg = fixed(tmp_path, send_timeout=0.5, send_hwm=1)
    engine = FakeEngine(hs, input_rcvhwm=1)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            async with connect(hs, config=cfg) as client:
                await engine.handshake_done.wait()
                ids = await die_of_send_timeout(client)
            session = client.session
            received = thaw(nursery, engine)
            async with connect(config=cfg, resume=session) as client:
                # The pumps have not run yet: the ABORT is pending.
                assert client.protocol.pending_abort_ids == list(ids)
                assert client.session.orphan_ids == tuple(ids)
                client.protocol.engine_died(EngineDeadError("died again", engine_index=0, reason="silence"))
                again = client.session
            assert again.orphan_ids == tuple(ids)
            async with connect(config=cfg, resume=again) as client:
                while (msg := await received.receive()).kind == wire.RequestType.ADD:
                    pass
                assert msg.value == tuple(ids)
            nursery.cancel_scope.cancel()
        engine.close()


async def test_a_clean_close_leaves_no_orphans_and_an_alive_session_lists_the_requests_in_flight(tmp_path):
    hs, cfg = fixed(tmp_path)  # default send_hwm: the ABORT at close finds room
    engine = FakeEngine(hs)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            async with connect(hs, config=cfg) as client:
                await engine.handshake_done.wait()
                streams = [client.generate(make_request(f"r{i}", max_tokens=100)) for i in range(3)]
                for s in streams:
                    await s.__aenter__()
                assert client.session.orphan_ids == ("r0", "r1", "r2")
                await streams[1].aclose()  # its ABORT goes out
                assert await engine.receive_add() and await engine.receive_add() and await engine.receive_add()
                assert await engine.receive_abort() == ("r1",)
                assert client.session.orphan_ids == ("r0", "r2")
            # leaving the block aborted r0 and r2 (the socket took the frame)
            assert client.session.orphan_ids == ()
            assert set(await engine.receive_abort()) == {"r0", "r2"}
            engine.close()
