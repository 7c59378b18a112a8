"""The engine doubles of :mod:`zmqdispatch.testing`, for asyncio tests.

:func:`open_fake_engine_pair` is :func:`zmqdispatch.testing.open_fake_engine_pair`
with an :class:`~zmqdispatch.aio.AsyncEngineClient`: the scripted
:class:`~zmqdispatch.testing.FakeEngine` runs in the loop's trio guest run,
and :class:`AsyncFakeEngine` awaits its methods from asyncio
(``await engine.receive_add()``, ``await engine.send_tokens(...)``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from ..config import ClientConfig
from ..testing.dial import ready_response
from ..testing.fake_engine import FakeEngine
from ..wire import vllm_handshake
from ._guest import TrioGuest, acquire, release
from .client import AsyncEngineClient, connect

__all__ = ["AsyncFakeEngine", "open_fake_engine_pair"]


class AsyncFakeEngine:
    """A :class:`~zmqdispatch.testing.FakeEngine` seen from asyncio: its async
    methods awaited in the guest run, its attributes read as they are
    (``engine.trio`` is the FakeEngine)."""

    def __init__(self, engine: FakeEngine, guest: TrioGuest) -> None:
        self.trio = engine
        self._guest = guest

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.trio, name)
        if inspect.iscoroutinefunction(attr):
            @functools.wraps(attr)
            async def call(*args: Any, **kwargs: Any) -> Any:
                return await self._guest.run(functools.partial(attr, *args, **kwargs))
            return call
        return attr


@asynccontextmanager
async def open_fake_engine_pair(
    *,
    max_model_len: int = 1024,
    ready: vllm_handshake.EngineCoreReadyResponse | None = None,
    engine_kw: Mapping[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[tuple[AsyncFakeEngine, AsyncEngineClient]]:
    """Yield ``(engine, client)`` once the handshake completed; arguments and
    errors as :func:`zmqdispatch.testing.open_fake_engine_pair`. On exit the
    client closes, then the engine's sockets close."""
    cfg = ClientConfig(**config)
    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    engine = FakeEngine(addr, ready=ready or ready_response(max_model_len), **(engine_kw or {}))
    guest = await acquire()
    try:
        handshake = asyncio.ensure_future(guest.run(engine.run_handshake))
        try:
            async with connect(addr, config=cfg) as client:
                await handshake
                yield AsyncFakeEngine(engine, guest), client
        finally:
            if not handshake.done():
                handshake.cancel()
            await asyncio.wait([handshake])
            if not handshake.cancelled():
                handshake.exception()  # its own outcome: connect() raised what matters
    finally:
        engine.close()
        shutil.rmtree(d, ignore_errors=True)
        await release(guest)
