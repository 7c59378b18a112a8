"""The ``n > 1`` samples of one parent request: :class:`SampleStream`, what
``client.generate_samples(rs)`` opens, and :func:`open_samples`, which
validates them all before any is sent. Each sample is a
:class:`~.request_stream.RequestStream` run as a sibling task; their deltas
merge here, tagged with the sample's index, and they are aborted together.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Self

import trio

from .errors import (
    DuplicateRequestIdError,
    LocalProtocolError,
    RequestRejected,
    RequestStreamClosed,
    ZmqDispatchError,
)
from .protocol.deadlines import Deadlines
from .protocol.mailbox import OutputDelta
from .request_stream import EngineRequest, RequestStream, StreamHost

__all__ = ["SampleStream", "open_samples"]


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in _leaves(sub)]
    return [e]


def _unwrap(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error a caller should see out of a nursery's group: the first
    that is not a cancellation, else a cancellation."""
    leaves = _leaves(eg)
    for e in leaves:
        if not isinstance(e, trio.Cancelled):
            return e
    return leaves[0]


class SampleStream:
    """The ``n`` sibling samples of one parent request, merged into one stream.
    Open with :meth:`EngineClient.generate_samples <zmqdispatch.EngineClient.generate_samples>`.

    ::

        async with client.generate_samples([s.request for s in samples]) as merged:
            async for index, delta in merged:      # in order within a sample
                ...

    Entering queues every sample's ADD, in index order, and runs each sample
    as a sibling task; their deltas merge here tagged with the sample's index
    (in order within a sample, no order across samples). Iteration stops once
    every sample delivered its final delta: an early-finishing sample does not
    finish the parent.

    Aborting: leaving the block (normally, on error, cancelled) or
    :meth:`abort` aborts every live sample in **one** batched ABORT;
    :meth:`abort_sample` aborts one (a client-side stop string ended it) and
    the others go on.

    Raises (from ``receive()`` / iteration): the first failing sample's error
    (``EngineDeadError``, ``EngineRequestError``, ``SlowConsumerError``,
    ``DeadlineExceeded``, ...), once, never an ``ExceptionGroup``. Its live
    siblings are aborted on the engine at once, but every delta the samples had
    received before the failure comes first (a sample that finished just
    before an engine death still delivers its final delta).

    Backpressure: a sample forwards into a channel of size ``n``; when the
    consumer lags, samples wait there and their engine ticks merge in their
    own mailboxes, bounded by ``ClientConfig.max_pending_tokens``.
    """

    def __init__(self, host: StreamHost, streams: Sequence[RequestStream]) -> None:
        self._host = host
        self._streams = list(streams)
        self._live: dict[int, str] = {i: s.request_id for i, s in enumerate(streams)}
        self._scopes: list[trio.CancelScope] = [trio.CancelScope() for _ in streams]
        self._send, self._recv = trio.open_memory_channel[tuple[int, OutputDelta]](len(streams))
        self._error: BaseException | None = None
        # samples aborted on purpose: their RequestStreamClosed is not an error
        self._retired: set[int] = set()
        self._cm: Any = None  # the running _run() context while entered
        self._entered = False
        self._aborted = False  # abort() / aclose() ended live samples: reading again raises

    def __repr__(self) -> str:
        return f"<SampleStream n={len(self._streams)} live={sorted(self._live)} error={self._error!r}>"

    def detach(self) -> tuple[StreamHost, list[tuple[str, EngineRequest, Deadlines | None]]]:
        """Hand these validated, never-entered samples to another shell:
        ``(host, [(request_id, request, deadlines in force), ...])`` in index
        order. The asyncio facade (:mod:`zmqdispatch.aio`) reads the same
        mailboxes through the same :class:`StreamHost`. Nothing was sent; this
        stream cannot be entered afterwards.

        Raises:
            LocalProtocolError: the stream was entered or already detached.
        """
        if self._entered:
            raise LocalProtocolError("only a sample stream never entered can be detached")
        self._entered = True
        parts = []
        for s in self._streams:
            _, request, deadlines = s.detach()
            parts.append((s.request_id, request, deadlines))
        return self._host, parts

    @property
    def request_ids(self) -> list[str]:
        """The samples' request ids, in index order."""
        return [s.request_id for s in self._streams]

    @property
    def live_indices(self) -> list[int]:
        """Indices whose final delta has not been received yet."""
        return sorted(self._live)

    def abort_sample(self, index: int) -> None:
        """Abort sample *index* now and stop forwarding its deltas.
        Synchronous, idempotent; the other samples go on, and iteration ends
        when they are done."""
        rid = self._live.pop(index, None)
        self._retired.add(index)
        if rid is not None:
            self._streams[index].abort()  # by stream: its id may be someone else's by now
        self._scopes[index].cancel()

    def abort(self) -> None:
        """Abort every live sample in one batched ABORT (synchronous,
        idempotent, never raises). If a sample was still live, reading again
        raises ``RequestStreamClosed`` (deltas not yet read are dropped), as
        for :class:`RequestStream`; after every sample's final delta it is a
        no-op."""
        if self._live:
            self._aborted = True
        self._abort_live()

    async def aclose(self) -> None:
        """:meth:`abort`, then a checkpoint."""
        self.abort()
        await trio.lowlevel.checkpoint()

    def _abort_live(self, *, drain: bool = False) -> None:
        """Abort every live sample (the aborts of one call share one ABORT
        frame), then cancel every sample's task.

        ``drain`` (a sibling failed, the consumer reads on): nobody is
        cancelled. The live samples are aborted on the engine by mailbox, which
        keeps what they had received, so every sample forwards what arrived
        before the failure and then ends by itself at once; the parent raises
        the error after."""
        for index in self._live:
            self._retired.add(index)
            stream = self._streams[index]
            if drain and stream._mailbox is not None:
                self._host.abort(stream._mailbox)
            else:
                stream.abort()
        self._live.clear()
        if not drain:
            for scope in self._scopes:
                scope.cancel()

    async def _sample(self, index: int, stream: RequestStream, send: trio.MemorySendChannel[tuple[int, OutputDelta]]
                      ) -> None:
        async with send:
            with self._scopes[index]:
                try:
                    async with stream:
                        try:
                            async for delta in stream:
                                if delta.finish_reason is not None:
                                    self._live.pop(index, None)
                                await send.send((index, delta))
                        except trio.Cancelled:
                            # A cancellation from outside reaches every sample; the
                            # first one to see it aborts all live siblings in one
                            # call (one ABORT frame), before any stream exits alone.
                            # A sample aborted on its own (abort_sample) aborts nobody else.
                            if index not in self._retired:
                                self._abort_live()
                            raise
                except trio.Cancelled:
                    raise
                except ZmqDispatchError as exc:
                    if isinstance(exc, RequestStreamClosed) and index in self._retired:
                        return  # aborted on purpose
                    if self._error is None:
                        self._error = exc
                    self._live.pop(index, None)
                    self._abort_live(drain=True)

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[None]:
        try:
            for s in self._streams:  # every sample's ADD now, in order (tasks would start them in any order)
                s._open()
        except BaseException:
            for s in self._streams:
                s.abort()
            raise
        try:
            async with trio.open_nursery() as nursery:
                async with self._send:
                    for i, s in enumerate(self._streams):
                        nursery.start_soon(self._sample, i, s, self._send.clone())
                try:
                    yield
                finally:
                    self._abort_live()
        except BaseExceptionGroup as eg:
            raise _unwrap(eg) from None

    async def __aenter__(self) -> Self:
        if self._entered:
            raise LocalProtocolError("a sample stream can be entered once")
        self._entered = True
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sends nothing
        cm = self._run()
        await cm.__aenter__()
        self._cm = cm
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        cm, self._cm = self._cm, None
        if cm is None:
            return None
        return await cm.__aexit__(*exc)  # type: ignore[no-any-return]

    async def receive(self) -> tuple[int, OutputDelta]:
        """The next ``(index, delta)``.

        Cancellation: atomic (a cancelled receive takes nothing).

        Raises:
            trio.EndOfChannel: every sample finished.
            RequestStreamClosed: :meth:`abort` ended samples that were live.
            LocalProtocolError: the stream was not entered with ``async with``.
            the first sample's error (see the class).
        """
        if not self._entered:
            raise LocalProtocolError("enter the sample stream first (`async with client.generate_samples(...)`)")
        if self._aborted:
            await trio.lowlevel.checkpoint_if_cancelled()
            ids = self.request_ids
            raise RequestStreamClosed(f"samples {ids!r}: stream was aborted", request_id=ids[0])
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            raise

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[int, OutputDelta]:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


def open_samples(host: StreamHost, requests: Sequence[EngineRequest], deadlines: Deadlines | None) -> SampleStream:
    """Validate every sample of one parent (nothing is sent) and return their
    :class:`SampleStream`; what ``EngineClient.generate_samples`` runs."""
    if not requests:
        raise RequestRejected("n must be >= 1: no samples requested", field="sampling_params.n")
    runtime = host.runtime
    for r in requests:
        runtime.check_type(r)
    seen: set[str] = set()
    for r in requests:
        rid = runtime.request_id(r)
        if rid in seen or host.is_live(rid):
            raise DuplicateRequestIdError(
                f"sample request_id {rid!r} collides with a live request or a sibling",
                request_id=rid,
                field="request_id",
            )
        seen.add(rid)
    streams = []
    for r in requests:  # all validated before any is queued
        in_force = host.validate(r, deadlines)
        streams.append(RequestStream(host, runtime.request_id(r), r, in_force))
    return SampleStream(host, streams)
