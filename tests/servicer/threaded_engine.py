"""A scripted :class:`~zmqdispatch.testing.FakeEngine` in a thread of its own
(its own trio run), for tests whose client side is asyncio (the servicer over
``zmqdispatch.aio``): it records every request id it is sent and every id it
is told to ABORT, as the engine sees them on the wire.

Script: a request with ``max_tokens`` <= ``finish_at`` gets its tokens and a
LENGTH finish at once; a longer one gets one token and stays open (until an
ABORT). :meth:`die` sends the ``ENGINE_CORE_DEAD`` sentinel.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import trio

from zmqdispatch.testing import FakeEngine
from zmqdispatch.testing.dial import ready_response
from zmqdispatch.wire import vllm as wire


class ThreadedFakeEngine:
    def __init__(self, handshake_address: str, *, max_model_len: int = 4096, finish_at: int = 16,
                 dtype: str = "float32") -> None:
        self.handshake_address = handshake_address
        self.max_model_len = max_model_len
        self.dtype = dtype
        #: ``(mm_features, frames)`` of each ADD, in order (features None for a text request)
        self.mm_features: queue.Queue[Any] = queue.Queue()
        self.finish_at = finish_at
        self.adds: queue.Queue[str] = queue.Queue()
        self.aborts: queue.Queue[str] = queue.Queue()
        self._token: Any = None
        self._started = threading.Event()
        self._engine: FakeEngine | None = None
        self._cancel: trio.CancelScope | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    def __enter__(self) -> ThreadedFakeEngine:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self._stop, trio_token=self._token)
        self._thread.join(10)

    def _stop(self) -> None:
        assert self._cancel is not None
        self._cancel.cancel()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._cancel:
            self._started.set()
            engine = self._engine = FakeEngine(self.handshake_address, ready=ready_response(self.max_model_len,
                                                                                        dtype=self.dtype))
            await engine.run_handshake()
            try:
                while True:
                    msg = await engine.receive()
                    if msg.kind == wire.RequestType.ADD:
                        req: Any = msg.value
                        self.adds.put(req.request_id)
                        self.mm_features.put((req.mm_features, msg.frames))
                        n = req.sampling_params.max_tokens
                        if n <= self.finish_at:
                            await engine.send_tokens(req.request_id, [7] * n, wire.FinishReason.LENGTH)
                        else:
                            await engine.send_tokens(req.request_id, [7])
                    elif msg.kind == wire.RequestType.ABORT:
                        for rid in msg.value:  # type: ignore[attr-defined]
                            self.aborts.put(rid)
            finally:
                engine.close()

    def die(self) -> None:
        """Send ``ENGINE_CORE_DEAD`` (the engine's own death notice)."""
        assert self._engine is not None
        trio.from_thread.run(self._engine.send_sentinel, trio_token=self._token)
