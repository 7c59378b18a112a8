"""The asyncio streams of :mod:`zmqdispatch.aio`: the same requests, rules and
errors as the trio streams (:mod:`zmqdispatch.streams`), read from asyncio.

:class:`AsyncRequestStream` reads its request's sans-IO
:class:`~zmqdispatch.protocol.mailbox.Mailbox` directly: the mailbox's
``waiter`` hook, called by the trio output router (in the loop's thread, the
guest run being in it), resolves the asyncio future the consumer awaits. So a
delivery costs one future, as a trio delivery costs one task reschedule; no
task or queue sits between. Opening and aborting are the synchronous
:class:`~zmqdispatch.streams.StreamHost` calls the trio
:class:`~zmqdispatch.RequestStream` makes (validation, placement, merging,
deadlines and the ABORT all stay the client's).
"""

from __future__ import annotations

import asyncio
from typing import Any, Self

import trio

from ..errors import LocalProtocolError, RequestStreamClosed
from ..protocol.deadlines import Deadlines
from ..protocol.engine import Outgoing, SendState
from ..protocol.mailbox import Mailbox, OutputDelta
from ..request_stream import EngineRequest, StreamHost, unsent_error

__all__ = ["AsyncRequestStream"]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait_sent(add: Outgoing, loop: asyncio.AbstractEventLoop) -> None:
    """Wait until the input pump settles *add* (its ``waiter`` hook)."""
    fut: asyncio.Future[None] = loop.create_future()
    add.waiter = lambda: _resolve(fut)
    try:
        await fut
    finally:
        add.waiter = None


class AsyncRequestStream:
    """One request's outputs, for asyncio: ``async with`` it, then iterate.

    ::

        async with client.generate(request) as stream:
            async for delta in stream:       # OutputDelta, merged if you lag
                ...

    As :class:`zmqdispatch.RequestStream`: nothing is sent before the stream
    is entered; entering registers the request, queues its ADD and waits until
    the socket accepted it. Iteration yields :class:`OutputDelta` objects
    (merged ticks when the consumer lags, bounded by ``max_pending_tokens``)
    and stops after the one whose ``finish_reason`` is set.

    Cancellation: leaving the block before the end (``break``, an exception,
    the task cancelled), :meth:`abort` or :meth:`aclose` abort the request on
    the engine (the ABORT is queued synchronously and sent by the input pump)
    and free its state. A cancelled ``__anext__`` leaves the pending delta in
    the mailbox.

    Raises: what :class:`zmqdispatch.RequestStream` raises, the same types
    (``DuplicateRequestIdError``, ``RequestRejected``, ``DeadlineExceeded``,
    ``EngineDeadError``, ``EngineRequestError``, ``SlowConsumerError``,
    ``RemoteProtocolError``, ``RequestStreamClosed``); ``LocalProtocolError``
    when iterated without ``async with``; ``trio.BusyResourceError`` when two
    tasks iterate it at once.
    """

    __slots__ = ("_closed", "_deadlines", "_entered", "_eof", "_fut", "_host", "_loop", "_mailbox", "_receiving",
                 "_request", "_waker", "request_id")

    def __init__(self, host: StreamHost, request_id: str, request: EngineRequest | None,
                 deadlines: Deadlines | None, loop: asyncio.AbstractEventLoop) -> None:
        self._host = host
        #: the request's id (``request_id`` / TokenSpeed ``rid``)
        self.request_id = request_id
        self._request = request
        self._deadlines = deadlines
        self._mailbox: Mailbox | None = None
        self._eof = False
        self._closed = False
        self._entered = False
        self._receiving = False
        #: the client's event loop (its trio guest run's): the only one it may be read from
        self._loop = loop
        self._fut: asyncio.Future[None] | None = None
        self._waker = self._wake

    def __repr__(self) -> str:
        return f"<AsyncRequestStream {self.request_id!r} eof={self._eof} closed={self._closed} {self._mailbox!r}>"

    @property
    def finished(self) -> bool:
        """True once the final output was received or the stream was aborted."""
        return self._eof or self._closed

    def _open(self) -> Mailbox:
        """Register the request and queue its ADD now (idempotent)."""
        if self._mailbox is None:
            assert self._request is not None
            self._mailbox = self._host.open(self._request, self._deadlines)
            self._request = None
        return self._mailbox

    async def __aenter__(self) -> Self:
        if self._entered:
            raise LocalProtocolError(f"request {self.request_id!r}: a stream can be entered once")
        self._entered = True
        if self._closed:
            raise RequestStreamClosed(
                f"request {self.request_id!r}: the stream was closed before it was entered (nothing was sent)",
                request_id=self.request_id,
            )
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._closed = True
            raise LocalProtocolError(
                f"request {self.request_id!r}: its client belongs to another event loop (nothing was sent)"
            )
        add: Outgoing = self._open().add  # raises DuplicateRequestIdError / EngineDeadError: nothing to undo
        try:
            while add.state is SendState.QUEUED or add.state is SendState.SENDING:
                await _wait_sent(add, loop)
            error = unsent_error(add, self.request_id, self._host)
            if error is not None:
                self._closed = True
                raise error
        except BaseException:
            self.abort()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def abort(self) -> None:
        """Abort the request now unless it already finished. Synchronous,
        idempotent, never raises; iteration afterwards raises
        :class:`RequestStreamClosed`."""
        if not self._eof and not self._closed:
            self._closed = True
            mb = self._mailbox
            if mb is not None:
                mb.waiter = None
                self._host.abort(mb)

    async def aclose(self) -> None:
        """:meth:`abort` (awaitable, for ``contextlib.aclosing``)."""
        self.abort()

    def _wake(self) -> None:  # the mailbox's waiter: called once, by the trio output router
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def receive(self) -> OutputDelta:
        """The next :class:`OutputDelta` (merged ticks if the consumer lagged).

        Raises:
            StopAsyncIteration: after the final delta was returned.
            plus the errors listed on the class.
        """
        return await self.__anext__()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> OutputDelta:
        mb = self._mailbox
        if not self._entered or mb is None:
            self.abort()
            raise LocalProtocolError(
                f"request {self.request_id!r}: enter the stream first (`async with client.generate(...) as stream`)"
            )
        if self._receiving:
            raise trio.BusyResourceError(f"another task is already receiving on request {self.request_id!r}")
        while True:
            if self._eof:
                raise StopAsyncIteration
            if self._closed:
                raise RequestStreamClosed(f"request {self.request_id!r}: stream was aborted",
                                          request_id=self.request_id)
            delta = mb.take()  # raises the stream's error once nothing is pending
            if delta is not None:
                if delta.finish_reason is not None:
                    self._eof = True
                return delta
            fut = self._fut = self._loop.create_future()
            mb.waiter = self._waker
            self._receiving = True
            try:
                await fut
            except BaseException:
                mb.waiter = None
                raise
            finally:
                self._receiving = False
                self._fut = None


def stream_parts(stream: Any) -> tuple[StreamHost, str, EngineRequest, Deadlines | None]:
    """``(host, request_id, request, deadlines)`` of a trio stream never entered
    (:meth:`zmqdispatch.RequestStream.detach`)."""
    host, request, deadlines = stream.detach()
    return host, stream.request_id, request, deadlines
