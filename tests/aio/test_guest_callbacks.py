"""The guest run's callbacks on a loop that closes under it (zmqdispatch/aio/_guest.py):
a dropped callback is seen, and trio's guest state is never freed by the
garbage collector, so it is never finalized outside the loop's thread."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest

from zmqdispatch.aio._guest import TrioGuest


class _State:
    """Stands in for trio's guest state: the first tick is its bound method."""

    def __init__(self) -> None:
        self.ticks = 0

    def guest_tick(self) -> None:
        self.ticks += 1


def _closed_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "event loop closed" in r.getMessage()]


def test_a_tick_that_runs_is_not_a_dropped_one(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    guest = TrioGuest(loop)
    state = _State()
    guest._tick_soon(state.guest_tick)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    gc.collect()
    assert state.ticks == 1
    assert _closed_warnings(caplog) == []


def test_a_tick_dropped_by_close_stops_the_engines_and_keeps_the_state(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "zmqdispatch.aio")
    loop = asyncio.new_event_loop()
    guest = TrioGuest(loop)
    state = _State()
    alive = weakref.ref(state)
    guest._tick_soon(state.guest_tick)
    del state
    loop.close()  # drops the pending tick
    gc.collect()
    assert len(_closed_warnings(caplog)) == 1
    assert alive() is not None, "the guest state must outlive the dropped tick"


def test_an_event_handed_back_after_close_is_refused_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "zmqdispatch.aio")
    loop = asyncio.new_event_loop()
    guest = TrioGuest(loop)
    loop.close()
    guest._to_host(_State().guest_tick)
    guest._to_host(_State().guest_tick)
    gc.collect()
    assert len(_closed_warnings(caplog)) == 1
