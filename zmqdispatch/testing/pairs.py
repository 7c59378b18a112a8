"""A client and an engine double, connected in the caller's trio run.

:func:`open_fake_engine_pair` pairs a client with a scripted
:class:`~zmqdispatch.testing.fake_engine.FakeEngine` (the test decides every
message the engine sends); :func:`open_mock_engine_pair` pairs it with the mock
engine program (:mod:`zmqdispatch.mock`) running in-process, which schedules
and streams on its own. Both use real ``ipc://`` sockets in a private
temporary directory, removed on exit.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import trio

from .._engine_lifecycle import unwrap
from ..client import EngineClient
from ..config import ClientConfig
from ..shell import connect
from ..wire import vllm_handshake
from .dial import ready_response
from .fake_engine import FakeEngine

if TYPE_CHECKING:
    from ..mock.server import _MockEngine, _SGLangMockEngine, _TokenSpeedMockEngine

    MockEngine = _MockEngine | _TokenSpeedMockEngine | _SGLangMockEngine

__all__ = ["open_fake_engine_pair", "open_mock_engine_pair"]


@asynccontextmanager
async def open_fake_engine_pair(
    *,
    max_model_len: int = 1024,
    ready: vllm_handshake.EngineCoreReadyResponse | None = None,
    engine_kw: Mapping[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[tuple[FakeEngine, EngineClient]]:
    """Yield ``(engine, client)`` once the handshake completed.

    Args:
        max_model_len: the engine's context length in tokens (used when
            *ready* is not given).
        ready: the engine's ready response (default:
            ``ready_response(max_model_len)``).
        engine_kw: further :class:`FakeEngine` arguments (``engine_index``,
            ``input_rcvhwm``).
        config: :class:`~zmqdispatch.ClientConfig` fields for the client
            (``handshake_timeout=5``, ``death_on_disconnect=False``, ...).

    Raises:
        TypeError: *config* names a field ``ClientConfig`` lacks.
        EngineHandshakeError: the handshake failed (e.g. the client refused
            the ready response's version).

    On exit the client closes (aborting what is still in flight on the
    engine), then the engine's sockets close. Cancellation: as
    :func:`zmqdispatch.connect`; the temporary directory is removed either way.
    """
    cfg = ClientConfig(**config)
    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    engine = FakeEngine(addr, ready=ready or ready_response(max_model_len), **(engine_kw or {}))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            async with connect(addr, config=cfg) as client:
                await engine.handshake_done.wait()
                yield engine, client
            engine.close()
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None  # the error itself, as connect() raises it
    finally:
        engine.close()  # idempotent; on an error exit the sockets are still open
        shutil.rmtree(d, ignore_errors=True)


@asynccontextmanager
async def open_mock_engine_pair(
    *,
    runtime: Literal["vllm", "tokenspeed", "sglang"] = "vllm",
    max_model_len: int = 1024,
    engine_kw: Mapping[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[tuple[MockEngine, EngineClient]]:
    """Yield ``(engine, client)``: the mock engine of *runtime* running in this
    trio run and a client connected to it.

    The engine steps every millisecond (``engine_kw={"step_interval": ...}``
    changes it; any :class:`zmqdispatch.mock.server.MockEngineConfig` field
    can be given there, ``faults`` included). Its scheduler state is
    ``engine.core`` (requests, aborts, utility calls seen). A fault that makes
    the program exit closes its sockets and ends its task instead.

    Args:
        runtime: ``"vllm"`` (vLLM 0.32 EngineCore wire), ``"sglang"`` (an SGLang
            0.5.21 scheduler behind the SGLang plugin) or ``"tokenspeed"``
            (TokenSpeed 0.1.1).
        max_model_len: the engine's context length in tokens.
        engine_kw: further ``MockEngineConfig`` fields.
        config: ``ClientConfig`` fields for the client.

    Raises:
        TypeError: a field that ``ClientConfig`` / ``MockEngineConfig`` lacks.

    On exit the client closes, then the engine's task is cancelled and its
    sockets closed; the temporary directory is removed either way.
    """
    # Imported here: the mock program imports this package's dialer.
    from ..mock.server import MockEngineConfig, start_mock_engine

    client_config = ClientConfig(**config)
    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    kw: dict[str, Any] = {"step_interval": 0.001, **(engine_kw or {})}
    cfg = MockEngineConfig(handshake_address=addr, runtime=runtime, max_model_len=max_model_len, **kw)
    started: list[MockEngine] = []
    try:
        async with trio.open_nursery() as nursery:

            async def engine_side() -> None:
                engine = await start_mock_engine(cfg, in_process=True)
                started.append(engine)
                try:
                    await engine.run()
                finally:
                    engine.socks.close()

            nursery.start_soon(engine_side)
            async with connect(addr, config=client_config) as client:
                yield started[0], client
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None  # the error itself, as connect() raises it
    finally:
        shutil.rmtree(d, ignore_errors=True)
