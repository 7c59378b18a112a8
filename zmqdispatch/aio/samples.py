"""``n > 1`` samples of one parent request, for asyncio: :class:`AsyncSampleStream`.

The same rules as :class:`zmqdispatch.SampleStream` (validation of every
sample by :func:`zmqdispatch.sample_stream.open_samples` before any is sent,
one engine, ADDs in index order, one batched ABORT, the first sample's error
raised once after what the samples had received). Without a task per sample:
each sample's mailbox ``waiter`` queues its index and wakes the one reader,
which takes from the mailboxes directly (as :class:`~.group.AsyncStreamGroup`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Self

import trio

from ..errors import LocalProtocolError, RequestStreamClosed, ZmqDispatchError
from ..protocol.deadlines import Deadlines
from ..protocol.engine import SendState
from ..protocol.mailbox import Mailbox, OutputDelta
from ..request_stream import EngineRequest, StreamHost, unsent_error
from ..sample_stream import SampleStream

__all__ = ["AsyncSampleStream"]


class AsyncSampleStream:
    """The ``n`` sibling samples of one parent request merged into one asyncio
    stream. Open with ``client.generate_samples(requests)``.

    ::

        async with client.generate_samples(requests) as samples:
            async for index, delta in samples:     # in order within a sample
                ...

    Entering queues every sample's ADD in index order and waits until the
    socket took them. Iteration yields ``(index, OutputDelta)`` and stops once
    every sample delivered its final delta. Leaving the block (normally, on an
    error, cancelled), :meth:`abort` or :meth:`aclose` abort every live sample
    in one batched ABORT; :meth:`abort_sample` aborts one, the others go on.

    Raises (from iteration): the first failing sample's error, once
    (``EngineDeadError``, ``EngineRequestError``, ``SlowConsumerError``,
    ``DeadlineExceeded``, ``RequestRejected``, ...), after every delta the
    samples had received before it (its live siblings are aborted at once);
    ``RequestStreamClosed`` after :meth:`abort` ended live samples;
    ``LocalProtocolError`` when iterated without ``async with``.
    Backpressure: each sample's ticks merge in its own mailbox, bounded by
    ``max_pending_tokens``.
    """

    def __init__(self, host: StreamHost, parts: Sequence[tuple[str, EngineRequest, Deadlines | None]]) -> None:
        self._host = host
        self._parts: list[tuple[str, EngineRequest, Deadlines | None]] | None = list(parts)
        self._ids = [rid for rid, _, _ in parts]
        self._mailboxes: list[Mailbox] = []
        #: samples still to read to their end, index -> request_id
        self._live: dict[int, str] = {}
        #: samples not yet read to their end (live, or aborted after a sibling failed: their backlog drains)
        self._open: set[int] = set()
        self._ready: deque[int] = deque()
        self._queued: list[bool] = [False] * len(parts)
        self._hooks: list[Callable[[], None]] = [partial(self._queue, i) for i in range(len(parts))]
        self._error: BaseException | None = None
        self._fut: asyncio.Future[None] | None = None
        self._entered = False
        self._aborted = False

    @classmethod
    def of(cls, stream: SampleStream) -> AsyncSampleStream:
        """The asyncio stream of a trio :class:`SampleStream` never entered
        (its samples validated; they are detached from it)."""
        host, parts = stream.detach()
        return cls(host, parts)

    def __repr__(self) -> str:
        return f"<AsyncSampleStream n={len(self._ids)} live={sorted(self._live)} error={self._error!r}>"

    @property
    def request_ids(self) -> list[str]:
        """The samples' request ids, in index order."""
        return list(self._ids)

    @property
    def live_indices(self) -> list[int]:
        """Indices whose final delta has not been received yet."""
        return sorted(self._live)

    def _queue(self, index: int) -> None:  # a sample mailbox's waiter, called by the trio output router
        if not self._queued[index]:
            self._queued[index] = True
            if not self._ready:
                fut = self._fut
                if fut is not None and not fut.done():
                    fut.set_result(None)
            self._ready.append(index)

    async def __aenter__(self) -> Self:
        if self._entered:
            raise LocalProtocolError("a sample stream can be entered once")
        self._entered = True
        parts, self._parts = self._parts, None
        assert parts is not None
        try:
            for rid, request, deadlines in parts:  # every ADD now, in index order
                self._mailboxes.append(self._host.open(request, deadlines))
                i = len(self._mailboxes) - 1
                self._live[i] = rid
                self._open.add(i)
        except BaseException:
            self._abort_live()
            raise
        loop = asyncio.get_running_loop()
        try:
            for mb in self._mailboxes:
                add = mb.add
                while add.state is SendState.QUEUED or add.state is SendState.SENDING:
                    fut: asyncio.Future[None] = loop.create_future()
                    add.waiter = partial(_resolve, fut)
                    try:
                        await fut
                    finally:
                        add.waiter = None
        except BaseException:
            self._abort_live()
            raise
        for i, mb in enumerate(self._mailboxes):
            add = mb.add
            error = unsent_error(add, self._ids[i], self._host)
            if error is not None and (add.state is not SendState.CANCELLED or i in self._live):
                self._fail(i, error)
        for i in sorted(self._open):
            mb = self._mailboxes[i]
            mb.waiter = self._hooks[i]
            if mb.pending is not None or mb.finished:
                self._queue(i)
        return self

    def _fail(self, index: int, exc: BaseException) -> None:
        """Sample *index* failed: the parent's error (the first wins); its live
        siblings are aborted, their backlog still read."""
        self._open.discard(index)
        self._live.pop(index, None)
        if self._error is None:
            self._error = exc
        self._abort_live(drain=True)

    def _abort_live(self, *, drain: bool = False) -> None:
        for index in list(self._live):
            if index < len(self._mailboxes):
                mb = self._mailboxes[index]
                if not drain:
                    mb.waiter = None
                    self._open.discard(index)
                self._host.abort(mb)
        self._live.clear()

    async def __aexit__(self, *exc: object) -> None:
        self._abort_live()

    def abort_sample(self, index: int) -> None:
        """Abort sample *index* now and stop reading it (synchronous,
        idempotent); the others go on."""
        if self._live.pop(index, None) is not None:
            mb = self._mailboxes[index]
            mb.waiter = None
            self._host.abort(mb)
        self._open.discard(index)

    def abort(self) -> None:
        """Abort every live sample in one batched ABORT (synchronous,
        idempotent, never raises); reading again then raises
        ``RequestStreamClosed`` if a sample was still live."""
        if self._live:
            self._aborted = True
        self._abort_live()
        self._open.clear()

    async def aclose(self) -> None:
        """:meth:`abort` (awaitable, for ``contextlib.aclosing``)."""
        self.abort()

    def __aiter__(self) -> Self:
        return self

    async def receive(self) -> tuple[int, OutputDelta]:
        """The next ``(index, delta)``. Raises ``StopAsyncIteration`` once
        every sample finished, and the errors listed on the class."""
        return await self.__anext__()

    async def __anext__(self) -> tuple[int, OutputDelta]:
        if not self._entered or self._parts is not None:
            raise LocalProtocolError("enter the sample stream first (`async with client.generate_samples(...)`)")
        if self._fut is not None:
            raise trio.BusyResourceError("another task is already receiving on this sample stream")
        while True:
            if self._aborted:
                raise RequestStreamClosed(f"samples {self._ids!r}: stream was aborted", request_id=self._ids[0])
            item = self._take()
            if item is not None:
                return item
            if not self._open:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            fut = self._fut = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                self._fut = None

    def _take(self) -> tuple[int, OutputDelta] | None:
        ready = self._ready
        while ready:
            i = ready.popleft()
            self._queued[i] = False
            if i not in self._open:
                continue  # aborted on purpose, or already ended
            mb = self._mailboxes[i]
            try:
                delta = mb.take()
            except ZmqDispatchError as exc:
                self._open.discard(i)
                if i in self._live:
                    self._fail(i, exc)  # this sample failed: the parent's error
                continue  # a drained sibling's own RequestStreamClosed: aborted on purpose
            if delta is None:
                mb.waiter = self._hooks[i]
                continue
            if delta.finish_reason is not None:
                self._live.pop(i, None)
                self._open.discard(i)
            elif mb.finished:
                self._queue(i)  # its error comes after these tokens
            else:
                mb.waiter = self._hooks[i]
            return i, delta
        return None


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
