"""The asyncio API over a scripted engine: tokens, cancellation -> ABORT on the wire."""

from __future__ import annotations

import asyncio

from zmqdispatch.aio.testing import open_fake_engine_pair
from zmqdispatch.wire.vllm import EngineCoreRequest, FinishReason

from ..helpers import make_request
from .conftest import Runner


def _request(rid: str, max_tokens: int = 100) -> EngineCoreRequest:
    return make_request(rid, max_tokens=max_tokens)


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


def test_cancelling_the_task_aborts_on_the_engine(run: Runner) -> None:
    async def main() -> None:
        async with open_fake_engine_pair(handshake_timeout=5) as (engine, client):
            first = asyncio.Event()

            async def consume() -> None:
                async with client.generate(_request("r1")) as stream:
                    async for _ in stream:
                        first.set()

            task = asyncio.create_task(consume())
            await engine.receive_add()
            await engine.send_tokens("r1", [7])
            await first.wait()
            task.cancel()
            assert await engine.receive_abort() == ("r1",)
            assert task.cancelled() or task.done()
            assert client.engine_of("r1") is None
            assert client.trio.protocol.inflight == 0

    run(main)
