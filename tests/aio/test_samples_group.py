"""asyncio samples, stream groups and the control plane over a scripted
engine, under both loops."""

from __future__ import annotations

import asyncio

import pytest

from zmqdispatch import EngineDeadError, OutputDelta, RequestStreamClosed, UtilityCallError
from zmqdispatch.aio.testing import open_fake_engine_pair
from zmqdispatch.wire.vllm import FinishReason, RequestType

from ..helpers import make_request, out
from .conftest import Runner, wait_until


def test_samples_merge_by_index_and_abort_together(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            requests = [make_request(f"p-{i}", max_tokens=100) for i in range(3)]
            got: dict[int, list[int]] = {0: [], 1: [], 2: []}
            finished = asyncio.Event()

            async def consume() -> None:
                async with client.generate_samples(requests) as samples:
                    assert samples.request_ids == ["p-0", "p-1", "p-2"]
                    async for index, delta in samples:
                        got[index].extend(delta.token_ids)
                        if delta.finish_reason is not None:
                            finished.set()

            task = asyncio.create_task(consume())
            assert [(await engine.receive_add()).request_id for _ in range(3)] == ["p-0", "p-1", "p-2"]
            await engine.send_outputs([out("p-0", [1]), out("p-1", [2]), out("p-2", [3])])
            await engine.send_outputs([out("p-1", [4], FinishReason.STOP)])
            await finished.wait()
            assert got == {0: [1], 1: [2, 4], 2: [3]}
            task.cancel()
            assert sorted(await engine.receive_abort()) == ["p-0", "p-2"]  # one ABORT for both live samples
            await asyncio.wait([task])
            assert task.cancelled() and client.trio.protocol.inflight == 0

    run(main)


def test_samples_end_when_every_sample_finished_and_fail_with_the_first_error(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            async with client.generate_samples([make_request(f"q-{i}", max_tokens=9) for i in range(2)]) as s:
                for _ in range(2):
                    await engine.receive_add()
                await engine.send_outputs([out("q-0", [1], FinishReason.LENGTH), out("q-1", [2], FinishReason.STOP)])
                items = [(i, d.token_ids, d.finish_reason) async for i, d in s]
            assert sorted(items) == [(0, [1], FinishReason.LENGTH), (1, [2], FinishReason.STOP)]

            async with client.generate_samples([make_request(f"e-{i}", max_tokens=9) for i in range(2)]) as s:
                for _ in range(2):
                    await engine.receive_add()
                await engine.send_outputs([out("e-0", [5])])
                await engine.send_sentinel()
                seen = []
                with pytest.raises(EngineDeadError):
                    async for i, d in s:
                        seen.append((i, d.token_ids))
                assert seen == [(0, [5])]  # what arrived before the death comes first

            with pytest.raises(EngineDeadError):
                client.generate_samples([make_request("late")])

    run(main)


def test_sample_abort_then_reading_raises(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            async with client.generate_samples([make_request(f"a-{i}", max_tokens=9) for i in range(2)]) as s:
                for _ in range(2):
                    await engine.receive_add()
                s.abort_sample(1)
                assert await engine.receive_abort() == ("a-1",)
                await engine.send_outputs([out("a-0", [1]), out("a-1", [2])])
                i, d = await s.__anext__()
                assert (i, d.token_ids) == (0, [1])
                s.abort()
                with pytest.raises(RequestStreamClosed):
                    await s.__anext__()
            assert await engine.receive_abort() == ("a-0",)

    run(main)


def test_stream_group_batches_and_aborts_on_exit(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            async with client.stream_group() as group:
                members = {f"g{i}": group.generate(make_request(f"g{i}", max_tokens=50)) for i in range(4)}
                ids = [(await engine.receive_add()).request_id for _ in range(4)]
                await engine.send_outputs([out(rid, [int(rid[1:])]) for rid in ids])
                await engine.send_outputs([out("g0", [10], FinishReason.LENGTH)])
                seen: dict[str, list[int]] = {rid: [] for rid in ids}
                while len(seen["g0"]) < 2 or any(not seen[r] for r in ids):
                    for member, item in await group.__anext__():
                        assert isinstance(item, OutputDelta)
                        seen[member.request_id].extend(item.token_ids)
                assert seen == {"g0": [0, 10], "g1": [1], "g2": [2], "g3": [3]}
                assert members["g0"].finished and len(group) == 3
                members["g1"].abort()
                assert await engine.receive_abort() == ("g1",)
            assert sorted(await engine.receive_abort()) == ["g2", "g3"]
            with pytest.raises(StopAsyncIteration):
                await group.receive()

    run(main)


def test_a_cancelled_group_reader_takes_nothing(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            async with client.stream_group() as group:
                group.generate(make_request("c1", max_tokens=50))
                await engine.receive_add()
                reader = asyncio.create_task(group.receive())
                await wait_until(lambda: group._fut is not None)  # the reader parked (nothing is ready)
                reader.cancel()
                await asyncio.wait([reader])
                assert reader.cancelled()
                await engine.send_tokens("c1", [1, 2])
                batch = await group.__anext__()
                assert [(m.request_id, d.token_ids) for m, d in batch] == [("c1", [1, 2])]  # type: ignore[union-attr]

    run(main)


def test_control_plane_calls_reach_the_engine(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            call = asyncio.create_task(client.reset_prefix_cache())
            msg = await engine.receive()
            assert msg.kind == RequestType.UTILITY and msg.value.method == "reset_prefix_cache"  # type: ignore[attr-defined]
            await engine.reply_utility(msg.value.call_id, True)  # type: ignore[attr-defined]
            assert await call is True

            every = asyncio.create_task(client.call_all("is_sleeping"))
            msg = await engine.receive()
            await engine.reply_utility(msg.value.call_id, False)  # type: ignore[attr-defined]
            assert await every == {0: False}

            loras = asyncio.create_task(client.list_loras())
            msg = await engine.receive()
            await engine.reply_utility(msg.value.call_id, failure="LoRA is not enabled")  # type: ignore[attr-defined]
            with pytest.raises(UtilityCallError, match="LoRA is not enabled"):
                await loras

            # a cancelled call leaves the client serving
            sleeping = asyncio.create_task(client.is_sleeping())
            msg = await engine.receive()
            sleeping.cancel()
            await asyncio.wait([sleeping])
            assert sleeping.cancelled() and client.is_alive
            assert client.trio.protocol.pending_utility_calls == 0
            assert set(client.stats()) == {0} and client.max_model_len == 1024

    run(main)
