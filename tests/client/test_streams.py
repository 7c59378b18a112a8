"""Client + FakeEngine over real sockets: streaming, aborts, utility calls.

Known failures replayed (docs/known-failures.md): K2 (cancelled receive loses nothing), K3 (break out of
a stream), K4 (slow consumer does not block others), K6-style batching of
aborts, K7 (cancellation always aborts), K1 (submit while streaming).
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from zmqdispatch import (
    ContextLengthError,
    DuplicateRequestIdError,
    EngineRequestError,
    LocalProtocolError,
    RequestRejected,
    RequestStreamClosed,
    UtilityCallError,
    UtilityCallTimeout,
)
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out

GUARD = 10  # seconds: a hang guard only, never a timing assertion


async def test_generate_streams_deltas_until_finish():
    async with fake_pair() as (engine, client):
        async with client.generate(make_request("r1", max_tokens=3)) as stream:
            add = await engine.receive_add()
            assert add.request_id == "r1" and add.sampling_params.max_tokens == 3
            await engine.send_tokens("r1", [10])
            d1 = await stream.receive()
            await engine.send_tokens("r1", [11, 12], finish=wire.FinishReason.LENGTH)
            d2 = await stream.receive()
            with pytest.raises(trio.EndOfChannel):
                await stream.receive()
        assert d1.token_ids == [10] and d1.finish_reason is None
        assert d2.token_ids == [11, 12] and d2.finish_reason is wire.FinishReason.LENGTH
        assert client.protocol.inflight == 0
        # a finished stream sends no ABORT on exit: the next message is the next ADD
        async with client.generate(make_request("r2")):
            assert (await engine.receive_add()).request_id == "r2"


async def test_async_for_stops_after_the_final_delta():
    async with fake_pair() as (engine, client):
        async with client.generate(make_request("r1")) as stream:
            await engine.receive_add()
            for i in range(5):
                await engine.send_tokens("r1", [i], finish=wire.FinishReason.STOP if i == 4 else None)
            got = []
            async for delta in stream:
                got += delta.token_ids
        assert got == [0, 1, 2, 3, 4]


async def test_break_after_first_tick_aborts_on_the_engine():  # K3
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1", max_tokens=100)) as stream:
                await engine.receive_add()
                await engine.send_tokens("r1", [1])
                async for _ in stream:
                    break
            assert client.protocol.inflight == 0
            assert await engine.receive_abort() == ("r1",)
            # late ticks for the aborted id are dropped and counted
            await engine.send_tokens("r1", [2])
            await engine.send_tokens("other", [3])
            async with client.generate(make_request("r2")) as s2:
                await engine.receive_add()
                await engine.send_tokens("r2", [4], finish=wire.FinishReason.STOP)
                assert (await s2.receive()).token_ids == [4]
            assert client.protocol.unknown_outputs == 2


@pytest.mark.parametrize("where", ["blocked_in_receive", "busy_elsewhere", "before_add_sent"])
async def test_cancellation_always_aborts(where):  # K7
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with trio.CancelScope() as scope:
                if where == "before_add_sent":
                    scope.cancel()  # the submitter is cancelled while its ADD is queued
                async with client.generate(make_request("r1", max_tokens=100)) as stream:
                    await engine.receive_add()
                    await engine.send_tokens("r1", [1, 2])
                    assert (await stream.receive()).token_ids == [1, 2]  # nothing left pending
                    if where == "blocked_in_receive":
                        async with trio.open_nursery() as n:
                            n.start_soon(stream.receive)
                            await trio.testing.wait_all_tasks_blocked()
                            scope.cancel()
                    else:
                        scope.cancel()
                        await trio.sleep_forever()
            assert scope.cancelled_caught
            assert client.protocol.inflight == 0
            if where == "before_add_sent":
                # The ADD never left: the next thing the engine sees is a later message.
                call = client.protocol.start_utility("is_sleeping")
                first = await engine.receive()
                assert first.kind == wire.RequestType.UTILITY
                client.protocol.forget_utility(call)
            else:
                assert await engine.receive_abort() == ("r1",)


async def test_many_stream_exits_in_one_tick_share_one_abort_frame():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            streams = [client.generate(make_request(f"r{i}")) for i in range(5)]
            for s in streams:
                await s.__aenter__()
            for _ in streams:
                await engine.receive_add()
            # all exits happen before the input pump runs again
            for s in streams:
                s.abort()
            assert await engine.receive_abort() == tuple(f"r{i}" for i in range(5))


async def test_cancelled_receives_lose_nothing():  # K2
    n = 5000
    rng = random.Random(1234)
    async with fake_pair(max_model_len=n + 10) as (engine, client):
        with trio.fail_after(60):
            async with client.generate(make_request("r1", max_tokens=n)) as stream:
                await engine.receive_add()

                async def produce():
                    i = 0
                    while i < n:
                        burst = rng.randint(1, 20)
                        for j in range(i, min(n, i + burst)):
                            await engine.send_tokens("r1", [j], finish=wire.FinishReason.LENGTH if j == n - 1 else None)
                        i += burst
                        await trio.sleep(0)

                got: list[int] = []
                cancels = 0
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(produce)
                    while True:
                        with trio.move_on_after(rng.choice([0, 1e-6, 1e-5, 1e-4])) as sc:
                            d = await stream.receive()
                        if sc.cancelled_caught:
                            cancels += 1
                            continue
                        got += d.token_ids
                        if d.finish_reason is not None:
                            break
        assert got == list(range(n))
        assert cancels > 0


async def test_slow_consumer_does_not_block_others_and_gets_everything_merged():  # K4
    ticks = 200
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("A", max_tokens=ticks)) as a, \
                    client.generate(make_request("B", max_tokens=ticks)) as b:
                await engine.receive_add()
                await engine.receive_add()
                got_b = []
                for i in range(ticks):
                    fin = wire.FinishReason.LENGTH if i == ticks - 1 else None
                    await engine.send_outputs([out("A", [i], fin), out("B", [i], fin)])
                    d = await b.receive()  # B keeps up while A's consumer sleeps
                    got_b += d.token_ids
                assert got_b == list(range(ticks))
                da = await a.receive()
                assert da.token_ids == list(range(ticks)) and da.ticks == ticks
                assert da.finish_reason is wire.FinishReason.LENGTH


async def test_submit_burst_while_streaming_completes_everything():  # K1
    extra = 300
    async with fake_pair() as (engine, client):
        with trio.fail_after(60):
            done = []

            async def run(rid: str) -> None:
                async with client.generate(make_request(rid, max_tokens=2)) as s:
                    async for _ in s:
                        pass
                    done.append(rid)

            async def fake_scheduler():
                live: list[str] = []
                total = 4 + extra
                finished = 0
                step = 0
                while finished < total:
                    with trio.move_on_after(0.001):
                        while True:
                            msg = await engine.receive()
                            live.append(msg.value.request_id)
                    step += 1
                    if live:
                        # every live request gets one token; those with 2 finish
                        outs = [out(r, [step], wire.FinishReason.LENGTH) for r in live]
                        finished += len(live)
                        live = []
                        await engine.send_outputs(outs)

            async with trio.open_nursery() as n:
                n.start_soon(fake_scheduler)
                for i in range(4):
                    n.start_soon(run, f"s{i}")
                for i in range(extra):
                    n.start_soon(run, f"x{i}")
        assert len(done) == 4 + extra and client.protocol.inflight == 0


async def test_rejections_send_nothing():  # K11a
    async with fake_pair(max_model_len=64, vocab_size=1000) as (engine, client):
        with pytest.raises(ContextLengthError) as ei:
            client.generate(make_request("r1", prompt=range(64), max_tokens=1))
        assert ei.value.prompt_len == 64 and ei.value.max_model_len == 64
        assert "64" in str(ei.value)
        with pytest.raises(ContextLengthError) as ei:
            client.generate(make_request("r2", prompt=range(60), max_tokens=5))
        assert ei.value.max_tokens == 5
        with pytest.raises(RequestRejected, match="vocab_size=1000"):
            client.generate(make_request("r3", prompt=[5, 1000]))
        with pytest.raises(RequestRejected, match="top_p"):
            client.generate(make_request("r4", top_p=0.0))
        async with client.generate(make_request("ok", prompt=range(63), max_tokens=1)):
            # the first thing the engine ever sees is this valid ADD
            assert (await engine.receive_add()).request_id == "ok"
            with pytest.raises(DuplicateRequestIdError):
                client.generate(make_request("ok"))


async def test_engine_error_finish_raises_typed_error():  # K11c
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1")) as stream:
                await engine.receive_add()
                await engine.send_tokens("r1", [1])
                await engine.send_tokens("r1", [], finish=wire.FinishReason.ERROR)
                assert (await stream.receive()).token_ids == [1]
                with pytest.raises(EngineRequestError) as ei:
                    await stream.receive()
                assert ei.value.request_id == "r1"
            assert client.is_alive


async def test_utility_calls_reply_fail_and_time_out():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as n:
                results = {}

                async def call():
                    results["tasks"] = await client.get_supported_tasks()

                n.start_soon(call)
                msg = await engine.receive()
                assert msg.kind == wire.RequestType.UTILITY
                call = msg.value
                assert (call.client_index, call.method, list(call.args)) == (0, "get_supported_tasks", [])
                await engine.reply_utility(call.call_id, ["generate"])
            assert results["tasks"] == ("generate",)

            async with trio.open_nursery() as n:
                async def failing():
                    with pytest.raises(UtilityCallError, match="boom"):
                        await client.call_utility("reset_prefix_cache")

                n.start_soon(failing)
                msg = await engine.receive()
                await engine.reply_utility(msg.value.call_id, failure="Call to reset_prefix_cache method failed: boom")

            with pytest.raises(UtilityCallTimeout):
                await client.call_utility("is_sleeping", timeout=0.05)
            assert client.protocol.pending_utility_calls == 0


async def test_a_new_client_resumes_a_running_engine_without_a_handshake(tmp_path):
    import zmqdispatch
    from zmqdispatch.testing import FakeEngine, ready_response

    addr = f"ipc://{tmp_path}/hs.sock"
    cfg = zmqdispatch.ClientConfig(input_address=f"ipc://{tmp_path}/in.sock", output_address=f"ipc://{tmp_path}/out.sock")
    engine = FakeEngine(addr, ready=ready_response(77))
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as n:
            n.start_soon(engine.run_handshake)
            async with zmqdispatch.connect(addr, config=cfg) as client:
                await engine.handshake_done.wait()
                session = client.session
        assert session is not None and session.ready.max_model_len == 77
        async with zmqdispatch.connect(config=cfg, resume=session) as client2:
            assert client2.max_model_len == 77
            async with client2.generate(make_request("again")) as s:
                assert (await engine.receive_add()).request_id == "again"
                await engine.send_tokens("again", [1], finish=wire.FinishReason.STOP)
                assert (await s.receive()).token_ids == [1]
        engine.close()


async def test_resume_fails_with_a_typed_timeout_when_no_engine_comes_back(tmp_path):
    import zmqdispatch
    from zmqdispatch.testing import ready_response

    session = zmqdispatch.EngineSession(identity=b"\x00\x00", ready=ready_response(), input_address=f"ipc://{tmp_path}/i",
                                        output_address=f"ipc://{tmp_path}/o")
    with pytest.raises(zmqdispatch.EngineHandshakeTimeout) as ei:
        async with zmqdispatch.connect(resume=session, config=zmqdispatch.ClientConfig(handshake_timeout=0.2)):
            pass  # pragma: no cover
    assert ei.value.stage == "reconnect"


async def test_an_error_in_the_client_block_surfaces_unwrapped():
    import sys

    import zmqdispatch

    launch = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]
    with pytest.raises(KeyError, match="mine"):
        async with zmqdispatch.connect(launch=launch, config=zmqdispatch.ClientConfig(handshake_timeout=60)):
            raise KeyError("mine")


async def test_abort_queued_just_before_the_client_exits_still_reaches_the_engine(tmp_path):
    import zmqdispatch
    from zmqdispatch.testing import FakeEngine

    addr = f"ipc://{tmp_path}/hs.sock"
    engine = FakeEngine(addr)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as n:
            n.start_soon(engine.run_handshake)
            async with zmqdispatch.connect(addr) as client:
                await engine.handshake_done.wait()
                s = client.generate(make_request("r1"))
                await s.__aenter__()
                await engine.receive_add()
                s.abort()  # queued; the client block ends before the input pump runs
            assert await engine.receive_abort() == ("r1",)
        engine.close()


@pytest.mark.parametrize(
    ("pause", "enabled_before", "enabled_while_routing"),
    [(True, True, False), (False, True, True), (True, False, False)],
)
async def test_gc_is_paused_only_while_a_batch_is_routed(
    pause: bool, enabled_before: bool, enabled_while_routing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    seen: list[bool] = []
    was = gc.isenabled()
    try:
        async with fake_pair(pause_gc_while_routing=pause) as (engine, client):
            routed = client.protocol.frames_received

            def spy(frames: list[bytes], *args: object) -> None:
                seen.append(gc.isenabled())
                routed(frames, *args)

            monkeypatch.setattr(client.protocol, "frames_received", spy)
            (gc.enable if enabled_before else gc.disable)()
            async with client.generate(make_request("r1")) as stream:
                await engine.receive_add()
                await engine.send_tokens("r1", [1])
                assert (await stream.receive()).token_ids == [1]
                # restored once the batch is routed: as it was before
                assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()
    assert seen and all(s is enabled_while_routing for s in seen)


async def test_a_stream_never_entered_sends_nothing_and_holds_no_id():
    # If generate() queued the ADD at once, code that raised (or was cancelled)
    # before `async with stream` would leave the request running on the engine
    # with nobody to abort it.
    async with fake_pair() as (engine, client):
        s = client.generate(make_request("r1"))
        assert not client.protocol.is_live("r1") and not client.protocol.wants_send
        del s
        # the id is free, and the first message the engine gets is this ADD
        async with client.generate(make_request("r1")) as stream:
            assert (await engine.receive_add()).request_id == "r1"
            await engine.send_tokens("r1", [5], finish=wire.FinishReason.STOP)
            assert [d.token_ids async for d in stream] == [[5]]
        # a duplicate is still refused at generate() while the id is live
        async with client.generate(make_request("r2")):
            await engine.receive_add()
            with pytest.raises(DuplicateRequestIdError):
                client.generate(make_request("r2"))


async def test_entering_a_stream_closed_before_entry_is_a_typed_error():
    async with fake_pair() as (engine, client):
        s = client.generate(make_request("r1"))
        s.abort()
        with pytest.raises(RequestStreamClosed, match="before it was entered"):
            async with s:
                pass  # pragma: no cover
        s = client.generate(make_request("r1"))
        with pytest.raises(LocalProtocolError):
            await s.receive()  # not entered: refused, and the stream is closed
        with pytest.raises(RequestStreamClosed):
            async with s:
                pass  # pragma: no cover
        assert not client.protocol.is_live("r1") and not client.protocol.wants_send
