"""The engine's output connection drops (issue 7): nothing is lost unseen.

libzmq closes the output PULL's connection to the engine itself when a frame
exceeds ``MAXMSGSIZE`` (= ``limits.MAX_FRAME_BYTES``): the frame and whatever
the engine had already written after it are gone, and the engine's PUSH
reconnects 100 ms later as if nothing happened. Measured with libzmq 4.3.5 (ipc and tcp):
the PULL's monitor sees ``EVENT_DISCONNECTED`` for that connection (no other
event), the same as when the engine closes it; a connection that never
completed its ZMTP handshake (a probe) gets ``EVENT_HANDSHAKE_FAILED_NO_DETAIL``
right before its ``EVENT_DISCONNECTED``.

So the client watches the PULL's monitor too. On a drop it routes what arrived
before it, waits ``limits.OUTPUT_DROP_GRACE`` for a death signal (a dying engine
closes its input connection or exits at the same time: that stays a death with
``EngineDeadError``), and otherwise fails every request whose ADD reached the
engine and every pending utility call with ``RemoteProtocolError`` naming the
limit, and aborts the requests. The link stays up while the engine's PUSH reconnects (within
``limits.OUTPUT_RECONNECT_GRACE``); an output connection that never comes back
is death (``reason="output_disconnected"``, with ``death_on_disconnect``).
"""

from __future__ import annotations

import socket

import pytest
import trio

from zmqdispatch import EngineDeadError, RemoteProtocolError, limits
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine

from ..helpers import GUARD, make_request

SMALL_LIMIT = 4096
BIG = list(range(3, 2003))  # ~6 KB of msgpack: above SMALL_LIMIT


@pytest.fixture
def small_frames(monkeypatch):
    monkeypatch.setattr(limits, "MAX_FRAME_BYTES", SMALL_LIMIT)  # read by connect() for MAXMSGSIZE


async def collect_until_error(stream) -> tuple[list[int], BaseException]:
    tokens: list[int] = []
    with pytest.raises((RemoteProtocolError, EngineDeadError)) as ei:
        async for delta in stream:
            tokens += delta.token_ids
    return tokens, ei.value


async def test_an_oversized_frame_fails_the_requests_in_flight_keeps_what_came_before_and_aborts_them(small_frames):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1", max_tokens=1000)) as s1, \
                    client.generate(make_request("r2", max_tokens=1000)) as s2:
                assert {(await engine.receive_add()).request_id for _ in range(2)} == {"r1", "r2"}
                await engine.send_tokens("r1", [1, 2])
                await engine.send_tokens("r2", BIG)  # dropped with the connection
                await engine.send_tokens("r1", [3], finish=wire.FinishReason.STOP)  # after it: maybe lost
                t0 = trio.current_time()
                tokens, exc = await collect_until_error(s1)
                assert tokens == [1, 2]  # what arrived before the drop is delivered
                assert type(exc) is RemoteProtocolError
                assert f"MAX_FRAME_BYTES ({SMALL_LIMIT} bytes" in str(exc) and "output connection" in str(exc)
                assert "'r1'" in str(exc)
                assert trio.current_time() - t0 < limits.OUTPUT_DROP_GRACE + 1.0
                assert (await collect_until_error(s2))[0] == []
                assert set(await engine.receive_abort()) == {"r1", "r2"}
            assert client.is_alive and client.protocol.output_drops == 1 and client.protocol.inflight == 0
            # The engine's PUSH reconnected by itself: the link serves on.
            async with client.generate(make_request("r3")) as s3:
                await engine.receive_add()
                await engine.send_tokens("r3", [9], finish=wire.FinishReason.STOP)
                assert [d.token_ids async for d in s3] == [[9]]


async def test_a_pending_utility_call_fails_at_once_instead_of_timing_out(small_frames):
    async with fake_pair(utility_timeout=60) as (engine, client):
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                async def call() -> None:
                    with pytest.raises(RemoteProtocolError, match=r"'is_sleeping'.*MAX_FRAME_BYTES"):
                        await client.call_utility("is_sleeping")

                nursery.start_soon(call)
                msg = await engine.receive()
                assert msg.kind == wire.RequestType.UTILITY
                await engine.send_tokens("nobody", BIG)
            assert client.is_alive and client.protocol.pending_utility_calls == 0


async def test_a_drop_with_nothing_in_flight_is_only_counted(small_frames):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            await engine.send_tokens("gone", BIG)
            while client.protocol.output_drops == 0:
                await trio.sleep(0.01)  # waits for the drop to be seen, nothing else
            assert client.is_alive
            async with client.generate(make_request("r1")) as s:
                await engine.receive_add()
                await engine.send_tokens("r1", [4], finish=wire.FinishReason.STOP)
                assert [d.token_ids async for d in s] == [[4]]
            assert client.protocol.output_drops == 1


async def test_drops_in_a_row_never_kill_an_engine_that_reconnects(small_frames):
    # The engine's PUSH reconnects and its next frame is oversized too: the
    # reconnect and the second drop can both be seen before the output pump
    # runs. The engine is back each time: never a death. (Over real sockets
    # the ordering is not forced; three rounds of back-to-back drops make it
    # likely.)
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            for _ in range(3):
                drops = client.protocol.output_drops
                await engine.send_tokens("gone", BIG)
                await engine.send_tokens("gone", BIG)
                while client.protocol.output_drops == drops or not client.engine()._output_links:
                    await trio.sleep(0.01)  # waits for a drop and the reconnect to be seen
            # longer than the reconnect grace after the first drop
            with trio.move_on_after(limits.OUTPUT_RECONNECT_GRACE + 0.5):
                await client.wait_dead()
            assert client.is_alive, client.death
            assert client.protocol.output_drops >= 3
            async with client.generate(make_request("r1")) as s:
                await engine.receive_add()
                await engine.send_tokens("r1", [4], finish=wire.FinishReason.STOP)
                assert [d.token_ids async for d in s] == [[4]]


async def test_a_stray_connection_to_the_output_socket_fails_nothing():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1")) as s:
                await engine.receive_add()
                for payload in (b"", b"not zmtp at all" * 10):
                    stray = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    stray.connect(client.engine()._bound_output[len("ipc://"):])
                    if payload:
                        stray.send(payload)
                    stray.close()
                while client.engine().stray_output_connections < 2:
                    await trio.sleep(0.01)  # waits for both probes to be seen
                await engine.send_tokens("r1", [5], finish=wire.FinishReason.STOP)
                assert [d.token_ids async for d in s] == [[5]]
            assert client.protocol.output_drops == 0 and client.is_alive


async def test_an_engine_closing_both_connections_is_death_for_every_stream_never_a_protocol_error():
    # The output drop and the input disconnect reach the client in either
    # order; the grace keeps it one death with one cause.
    for round_ in range(10):
        async with fake_pair() as (engine, client):
            with trio.fail_after(GUARD):
                streams = [client.generate(make_request(f"r{i}", max_tokens=1000)) for i in range(5)]
                for s in streams:
                    await s.__aenter__()
                for _ in streams:
                    await engine.receive_add()
                await engine.send_outputs([wire_engine.EngineCoreOutput(request_id=f"r{i}", new_token_ids=(i,))
                                           for i in range(5)])
                engine.close()
                for s in streams:
                    tokens, exc = await collect_until_error(s)
                    assert type(exc) is EngineDeadError, (round_, exc)
                    assert exc.reason in ("disconnected", "unreachable")
                    await s.__aexit__(None, None, None)
                assert client.death.reason in ("disconnected", "unreachable")


async def test_an_output_connection_that_never_comes_back_is_death_not_a_healthy_client(mock_clock):
    # Only the engine's output socket closed (its output thread is gone): the
    # requests in flight fail at once, and since no output connection comes
    # back within OUTPUT_RECONNECT_GRACE the engine is declared dead, so new
    # requests are refused instead of waiting for silence_timeout.
    async with fake_pair(silence_timeout=600) as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1", max_tokens=1000)) as s:
                await engine.receive_add()
                engine.socks.output.close()
                t0 = trio.current_time()
                tokens, exc = await collect_until_error(s)
                assert tokens == [] and type(exc) is RemoteProtocolError
            cause = await client.wait_dead()
            assert cause.reason == "output_disconnected" and "did not come back" in str(cause)
            waited = trio.current_time() - t0
            grace = limits.OUTPUT_RECONNECT_GRACE
            assert grace <= waited < grace + limits.OUTPUT_DROP_GRACE + 0.5
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                client.generate(make_request("r2"))


async def test_without_death_on_disconnect_a_vanished_engine_fails_its_streams_at_once_not_after_silence():
    async with fake_pair(death_on_disconnect=False, silence_timeout=600) as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1", max_tokens=1000)) as s:
                await engine.receive_add()
                await engine.send_tokens("r1", [1])
                engine.close()
                t0 = trio.current_time()
                tokens, exc = await collect_until_error(s)
                assert tokens == [1] and type(exc) is RemoteProtocolError and "output connection" in str(exc)
                assert trio.current_time() - t0 < limits.OUTPUT_DROP_GRACE + 1.0
            # The link is not declared dead on a drop alone (a tcp link may come
            # back); the next send finds the engine gone.
            assert client.protocol.output_drops == 1
