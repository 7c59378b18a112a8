"""A pure-asyncio stand-in for a ``zmqdispatch.aio`` client, for the servicer
shell's own logic (no engine, no trio): each request produces ``tokens``
tokens, one per ``await`` of its stream, and records how its stream ended."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

from zmqdispatch.protocol.engines import EngineState
from zmqdispatch.protocol.mailbox import OutputDelta
from zmqdispatch.wire.vllm import FinishReason


class _Status:
    def __init__(self, i: int, state: EngineState, reason: str | None = None) -> None:
        self.engine_index = i
        self.state = state
        self.reason = reason


class _Engine:
    def __init__(self) -> None:
        self.death: Exception | None = None


class FakeAioClient:
    def __init__(self, *, tokens: int = 4, max_model_len: int = 256, gate: asyncio.Event | None = None) -> None:
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.engine_index = 0
        self.is_alive = True
        self.gate = gate  # when set: each token waits for it
        self.ended: dict[str, str] = {}  # request_id -> "finished" | "left early"
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.dead = asyncio.Event()
        self.up = asyncio.Event()  # set by a test when the engine is up again (wait_for_engines)
        self.the_engine = _Engine()
        self.waiting_dead = asyncio.Event()  # set once wait_dead is awaited
        self.waiting_up = asyncio.Event()  # set once wait_for_engines is awaited

    def states(self) -> list[_Status]:
        if self.is_alive:
            return [_Status(0, EngineState.UP)]
        return [_Status(0, EngineState.DEAD, "process_exit")]

    def engine(self, engine_index: int | None = None) -> _Engine:
        return self.the_engine

    async def wait_for_engines(self, n: int) -> None:
        self.waiting_up.set()
        await self.up.wait()

    def stats(self) -> dict[int, Any]:
        return {}

    def loads(self) -> list[Any]:
        return []

    async def wait_dead(self) -> None:
        self.waiting_dead.set()
        await self.dead.wait()

    async def call_all(self, method: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        self.calls.append((method, args, kwargs))
        return {0: True}

    async def _deltas(self, rid: str):
        for i in range(self.tokens):
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(0)
            last = i == self.tokens - 1
            yield OutputDelta(rid, [10 + i], finish_reason=FinishReason.LENGTH if last else None)

    @asynccontextmanager
    async def generate(self, request: Any, *, deadlines: Any = None):
        rid = getattr(request, "request_id", None) or request.rid
        finished = False

        async def stream():
            nonlocal finished
            async for d in self._deltas(rid):
                if d.finish_reason is not None:
                    finished = True
                yield d

        try:
            yield stream()
        finally:
            self.ended[rid] = "finished" if finished else "left early"
