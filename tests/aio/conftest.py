"""The asyncio tests run each scenario under asyncio's default loop and uvloop
(the ``run`` fixture)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

#: a hang guard only: every test awaits explicit events, never sleeps to let things settle
HANG_GUARD_S = 20.0

Runner = Callable[[Callable[[], Coroutine[Any, Any, Any]]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def run(loop_kind: str) -> Runner:
    """``run(main)``: ``asyncio.run(main())`` on the loop under test, under a hang guard."""

    def runner(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        async def guarded() -> Any:
            async with asyncio.timeout(HANG_GUARD_S):
                return await main()

        factory = uvloop.new_event_loop if loop_kind == "uvloop" else None
        with asyncio.Runner(loop_factory=factory) as r:
            return r.run(guarded())

    return runner


async def wait_until(condition: Callable[[], bool]) -> None:
    """Wait until *condition* holds (re-checked every loop turn and every
    millisecond), for state that has no event of its own (a mailbox filling);
    the ``run`` fixture's hang guard bounds it."""
    while not condition():
        await asyncio.sleep(0.001)
