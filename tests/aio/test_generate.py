"""The asyncio API over a scripted engine, under both loops: tokens, every way
of leaving a stream early becomes an ABORT on the wire, typed errors,
merging under a slow consumer, many streams, two clients in one process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from zmqdispatch import (
    ContextLengthError,
    DeadlineExceeded,
    Deadlines,
    EngineDeadError,
    LocalProtocolError,
    RequestStreamClosed,
    SlowConsumerError,
    aio,
)
from zmqdispatch.aio import _guest
from zmqdispatch.aio.testing import AsyncFakeEngine, open_fake_engine_pair
from zmqdispatch.wire.vllm import EngineCoreRequest, FinishReason

from ..helpers import make_request, out
from .conftest import Runner, wait_until


def _request(rid: str, max_tokens: int = 100) -> EngineCoreRequest:
    return make_request(rid, max_tokens=max_tokens)


def _tables(client: aio.AsyncEngineClient) -> tuple[int, ...]:
    """What a request holds in the client while live: the engine's request
    table, the engine set's routes, the placement's in-flight count, the
    deadline timers."""
    protocol = client.trio.protocol
    return (protocol.inflight, len(protocol._requests), len(client.trio._set._table),
            sum(load.in_flight for load in client.loads()), len(client.engine()._conn._deadlines))


def test_tokens_reach_the_asyncio_consumer(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            got: list[int] = []

            async def consume() -> FinishReason | None:
                async with client.generate(_request("r1", 3)) as stream:
                    async for delta in stream:
                        got.extend(delta.token_ids)
                        if delta.finish_reason is not None:
                            return delta.finish_reason
                return None

            task = asyncio.create_task(consume())
            add = await engine.receive_add()
            assert add.request_id == "r1" and add.prompt_token_ids == (1, 2, 3)
            await engine.send_tokens("r1", [7, 8])
            await engine.send_tokens("r1", [9], finish=FinishReason.LENGTH)
            assert await task == FinishReason.LENGTH
            assert got == [7, 8, 9]
            assert client.engine_of("r1") is None

    run(main)


async def _started(engine: AsyncFakeEngine, rid: str, first: asyncio.Event) -> None:
    add = await engine.receive_add()
    assert add.request_id == rid
    await engine.send_tokens(rid, [7])
    await first.wait()


@pytest.mark.parametrize("how", ["cancel", "break", "raise", "aclose_generator", "abort"])
def test_leaving_early_aborts_on_the_engine(run: Runner, how: str) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            first = asyncio.Event()
            resume = asyncio.Event()

            async def tokens() -> AsyncGenerator[int, None]:
                async with client.generate(_request("r1")) as stream:
                    async for delta in stream:
                        for t in delta.token_ids:
                            yield t

            async def consume() -> None:
                if how == "aclose_generator":
                    gen = tokens()
                    await gen.__anext__()
                    first.set()
                    await resume.wait()
                    await gen.aclose()
                    return
                async with client.generate(_request("r1")) as stream:
                    async for _ in stream:
                        first.set()
                        if how == "break":
                            await resume.wait()
                            break
                        if how == "raise":
                            await resume.wait()
                            raise KeyError("the caller's own error")
                        if how == "abort":
                            await resume.wait()
                            stream.abort()
                            with pytest.raises(RequestStreamClosed):
                                await stream.__anext__()
                            return

            task = asyncio.create_task(consume())
            await _started(engine, "r1", first)
            if how == "cancel":
                task.cancel()
            else:
                resume.set()
            assert await engine.receive_abort() == ("r1",)
            await asyncio.wait([task])
            if how == "cancel":
                assert task.cancelled()
            elif how == "raise":
                assert isinstance(task.exception(), KeyError)
            else:
                assert task.exception() is None
            assert _tables(client) == (0, 0, 0, 0, 0)

    run(main)


def test_ten_thousand_cancellations_leave_nothing(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            baseline_tasks = len(asyncio.all_tasks())
            n = 0

            async def one(rid: str, entered: asyncio.Event) -> None:
                async with client.generate(_request(rid)) as stream:
                    entered.set()
                    async for _ in stream:
                        pass

            for round_ in range(100):
                entered = [asyncio.Event() for _ in range(100)]
                tasks = [asyncio.create_task(one(f"r{round_}-{i}", e)) for i, e in enumerate(entered)]
                # half are cancelled once their ADD was sent, half while it may still be queued
                for e in entered[:50]:
                    await e.wait()
                assert _tables(client)[0] >= 50
                for t in tasks:
                    t.cancel()
                await asyncio.wait(tasks)
                assert all(t.cancelled() for t in tasks)
                n += len(tasks)
                assert _tables(client) == (0, 0, 0, 0, 0)
            assert n == 10_000
            assert len(asyncio.all_tasks()) == baseline_tasks
            assert client.stats()[0].aborts == 10_000  # those sent were aborted on the engine

    run(main)


def test_errors_are_the_trio_types(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5, max_model_len=16) as (engine, client):
            with pytest.raises(ContextLengthError):
                client.generate(make_request("long", prompt=range(20)))
            stream = client.generate(_request("r0", 4))
            with pytest.raises(LocalProtocolError):
                await stream.__anext__()  # not entered: refused, and nothing was sent

            elsewhere = client.generate(_request("r0", 4))

            async def enter() -> None:
                async with elsewhere:
                    pass

            with pytest.raises(LocalProtocolError, match="another event loop"):
                await asyncio.to_thread(asyncio.run, enter())  # a loop of its own, in another thread
            assert client.engine_of("r0") is None

            with pytest.raises(DeadlineExceeded):
                async with client.generate(_request("slow", 4), deadlines=Deadlines(first_token=0.05)) as s:
                    async for _ in s:
                        pass
            assert await engine.receive_add()
            assert await engine.receive_abort() == ("slow",)

            async def consume() -> None:
                async with client.generate(_request("r1", 4)) as s:
                    async for _ in s:
                        pass

            task = asyncio.create_task(consume())
            await engine.receive_add()
            await engine.send_sentinel()
            with pytest.raises(EngineDeadError):
                await task
            assert not client.is_alive
            assert isinstance(await client.wait_dead(), EngineDeadError)

    run(main)


def test_a_slow_consumer_gets_merged_deltas_then_a_bound(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5, max_pending_tokens=100) as (engine, client):
            async with client.generate(_request("r1", 1000)) as stream:
                await engine.receive_add()
                for i in range(50):
                    await engine.send_tokens("r1", [i])
                mailbox = stream._mailbox
                assert mailbox is not None
                await wait_until(lambda: mailbox.pending_tokens == 50)
                delta = await stream.__anext__()
                assert delta.token_ids == list(range(50)) and delta.ticks == 50
                await engine.send_outputs([out("r1", range(101))])
                with pytest.raises(SlowConsumerError):
                    await stream.__anext__()
            assert await engine.receive_abort() == ("r1",)
            assert _tables(client) == (0, 0, 0, 0, 0)

    run(main)


def test_a_thousand_streams_from_a_thousand_tasks(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            n = 1000

            async def one(i: int) -> list[int]:
                got: list[int] = []
                async with client.generate(_request(f"r{i}", 3)) as stream:
                    async for delta in stream:
                        got.extend(delta.token_ids)
                return got

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            ids = [(await engine.receive_add()).request_id for _ in range(n)]
            assert sorted(ids) == sorted(f"r{i}" for i in range(n))
            await engine.send_outputs([out(rid, [1, 2]) for rid in ids])
            await engine.send_outputs([out(rid, [int(rid[1:])], FinishReason.LENGTH) for rid in ids])
            results = await asyncio.gather(*tasks)
            assert results == [[1, 2, i] for i in range(n)]
            assert _tables(client) == (0, 0, 0, 0, 0)

    run(main)


def test_two_clients_in_one_loop(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (e1, c1), \
                open_fake_engine_pair(handshake_timeout=5) as (e2, c2):

            async def one(client: aio.AsyncEngineClient, rid: str) -> list[int]:
                async with client.generate(_request(rid, 1)) as stream:
                    return [t async for d in stream for t in d.token_ids]

            t1 = asyncio.create_task(one(c1, "a"))
            t2 = asyncio.create_task(one(c2, "b"))
            assert (await e1.receive_add()).request_id == "a"
            assert (await e2.receive_add()).request_id == "b"
            await e2.send_tokens("b", [2], finish=FinishReason.LENGTH)
            await e1.send_tokens("a", [1], finish=FinishReason.LENGTH)
            assert await t1 == [1] and await t2 == [2]
            assert c1._guest is c2._guest  # one trio run for the loop
        assert _guest._guests.get(asyncio.get_running_loop()) is None  # the last one out ended the run
        assert c1._guest.done.done()

    run(main)


def test_run_in_trio_starts_and_ends_a_run_for_the_call(run: Runner) -> None:
    async def main() -> None:
        import trio

        async def in_trio(x: int) -> tuple[int, str]:
            await trio.sleep(0)
            return x + 1, trio.lowlevel.current_task().name

        value, _ = await aio.run_in_trio(in_trio, 1)
        assert value == 2
        assert _guest._guests.get(asyncio.get_running_loop()) is None
        with pytest.raises(KeyError):
            await aio.run_in_trio(_raise_key_error)

    run(main)


async def _raise_key_error() -> None:
    raise KeyError("raised in trio")


def test_a_thread_that_already_runs_trio_gets_a_clear_error(run: Runner) -> None:
    async def main() -> None:
        import trio

        loop = asyncio.get_running_loop()
        done: asyncio.Future[object] = loop.create_future()
        stop = trio.Event()
        trio.lowlevel.start_guest_run(stop.wait, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                                      run_sync_soon_not_threadsafe=loop.call_soon, done_callback=done.set_result,
                                      host_uses_signal_set_wakeup_fd=True)
        try:
            with pytest.raises(aio.GuestRunError, match="a trio run already owns this thread"):
                async with aio.connect():
                    pass
        finally:
            loop.call_soon(stop.set)
            await done

    run(main)
