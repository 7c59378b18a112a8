"""A client connected to a scripted FakeEngine over real ipc sockets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from zmqdispatch import ClientConfig, EngineClient, connect
from zmqdispatch.testing.fake_engine import FakeEngine, default_ready


@asynccontextmanager
async def fake_pair(
    *, max_model_len: int = 1024, ready: object = None, engine_kw: dict | None = None, **config: object
) -> AsyncIterator[tuple[FakeEngine, EngineClient]]:
    """Yield ``(engine, client)`` after a completed handshake. ``ready``: the
    engine's ready response (default: ``default_ready(max_model_len)``)."""
    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    engine = FakeEngine(addr, ready=ready or default_ready(max_model_len), **(engine_kw or {}))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            async with connect(addr, config=ClientConfig(**config)) as client:
                await engine.handshake_done.wait()
                yield engine, client
            engine.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pair():
    return fake_pair


@pytest.fixture
def mock_clock():
    """Virtual time that jumps only after 50 ms of real idleness, so real socket
    I/O (sub-millisecond here) always completes before a timeout fires."""
    import trio.testing

    return trio.testing.MockClock(autojump_threshold=0.05)


@asynccontextmanager
async def mock_pair(
    *, runtime: str = "vllm", max_model_len: int = 1024, engine_kw: dict | None = None, **config: object
) -> AsyncIterator[tuple[object, EngineClient]]:
    """Yield ``(engine, client)``: the mock engine of *runtime* running in-process
    (its scheduler state in ``engine.core``) and a client connected to it."""
    from zmqdispatch.mock.server import MockEngineConfig, start_mock_engine

    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    kw = {"step_interval": 0.001, **(engine_kw or {})}
    cfg = MockEngineConfig(handshake_address=addr, runtime=runtime, max_model_len=max_model_len, **kw)
    box: dict[str, object] = {}
    try:
        async with trio.open_nursery() as nursery:

            async def engine_side() -> None:
                box["engine"] = engine = await start_mock_engine(cfg, in_process=True)
                try:
                    await engine.run()
                finally:
                    engine.socks.close()

            nursery.start_soon(engine_side)
            async with connect(addr, config=ClientConfig(**config)) as client:
                yield box["engine"], client
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def tokenspeed_pair(**kw: object):
    """:func:`mock_pair` with the TokenSpeed mock."""
    return mock_pair(runtime="tokenspeed", **kw)
