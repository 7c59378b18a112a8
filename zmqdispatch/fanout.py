"""n > 1: sibling sub-requests, merged into one stream, cancelled together.

:func:`generate_parallel` submits the ``n`` single-sample requests of one
parent (see ``translate_parallel`` in :mod:`zmqdispatch.translate.vllm` and
:mod:`zmqdispatch.translate.tokenspeed`; one code path for both runtimes) and runs
each child stream as a sibling task in one nursery. Their deltas merge into
the parent's :class:`ParallelStream` tagged with the child's index, in order
within each child (no order across children).

Rules (``docs/reference-gateway-lessons.md`` §1.1, ``docs/known-failures.md`` K6):

- Admission is all or nothing: every child id is checked against the live
  requests (and the others) before any ADD is queued.
- An early-finishing child does not finish the parent; iteration ends when
  every child delivered its final delta (one finish per index).
- Leaving or cancelling the parent aborts every child still live in **one**
  batched ABORT (one synchronous ``abort`` call before the children are
  cancelled, so their own exits find nothing left to abort).
- A child that fails (engine error finish, slow consumer, engine death)
  aborts its live siblings in one batched ABORT, and the parent raises that
  **one** typed error, never an ``ExceptionGroup``, after the deltas every
  sample had received before it: the siblings are aborted by mailbox, not
  cancelled, so they forward what they hold and end at once (a sample that
  finished on the engine just before a death still delivers its final delta).

Backpressure: a child forwards into a channel of size ``n``; when the parent's
consumer lags, children wait there and their engine ticks merge in their own
mailboxes, bounded by ``ClientConfig.max_pending_tokens``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from .client import EngineClient, RequestStream, _unwrap
from .errors import DuplicateRequestIdError, RequestRejected, RequestStreamClosed
from .protocol.deadlines import Deadlines
from .protocol.mailbox import OutputDelta

__all__ = ["ParallelStream", "generate_parallel"]


class ParallelStream:
    """The merged stream of one parent's samples.

    Iterate for ``(index, OutputDelta)`` pairs; iteration stops once every
    child has delivered its final delta.

    Raises (from iteration):
        the first child's error (``EngineDeadError``, ``EngineRequestError``,
        ``SlowConsumerError``, ...), once, after its siblings were aborted.
    """

    def __init__(self, client: EngineClient, streams: Sequence[RequestStream]) -> None:
        self._client = client
        self._streams = list(streams)
        self._live: dict[int, str] = {i: s.request_id for i, s in enumerate(streams)}
        self._scopes: list[trio.CancelScope] = [trio.CancelScope() for _ in streams]
        self._send, self._recv = trio.open_memory_channel[tuple[int, OutputDelta]](len(streams))
        self._error: BaseException | None = None
        # children we aborted on purpose: their RequestStreamClosed is not an error
        self._retired: set[int] = set()

    def __repr__(self) -> str:
        return f"<ParallelStream n={len(self._streams)} live={sorted(self._live)} error={self._error!r}>"

    @property
    def live_indices(self) -> list[int]:
        """Indices whose final delta has not been received yet."""
        return sorted(self._live)

    def close_child(self, index: int) -> None:
        """Abort sample *index* now and stop forwarding its deltas (e.g. a
        client-side stop string ended it). Synchronous, idempotent; the other
        samples go on, and iteration ends when they are done."""
        rid = self._live.pop(index, None)
        self._retired.add(index)
        if rid is not None:
            # By stream, not by id: if this sample already finished on the
            # engine, its id may belong to someone else's request by now.
            self._streams[index].abort()
        self._scopes[index].cancel()

    def _abort_live(self, *, drain: bool = False) -> None:
        """One batched ABORT for every live child, then cancel every child
        (leaving the parent, an outside cancellation).

        ``drain`` (a sibling failed, the consumer reads on): nobody is
        cancelled. The live samples are aborted on the engine by mailbox, which
        keeps what they had received (a stream's tokens come before its
        abort), so every child forwards what arrived before the failure (a
        final delta of a sample that finished just before a death included)
        and then ends by itself at once; the parent raises the error after."""
        if self._live:
            protocol = self._client._protocol
            for index in self._live:  # by stream/mailbox (see close_child); one ABORT frame still
                self._retired.add(index)
                stream = self._streams[index]
                if drain and stream._mailbox is not None:
                    protocol.abort_mailbox(stream._mailbox)
                else:
                    stream.abort()
            self._live.clear()
        if not drain:
            for scope in self._scopes:
                scope.cancel()

    async def _child(self, index: int, stream: RequestStream, send: trio.MemorySendChannel) -> None:
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
                            # A cancellation from outside reaches every child; the
                            # first one to see it aborts all live siblings in one
                            # call (one ABORT frame), before any stream exits alone.
                            # A child closed on its own (close_child) aborts nobody else.
                            if index not in self._retired:
                                self._abort_live()
                            raise
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    if isinstance(exc, RequestStreamClosed) and index in self._retired:
                        return  # we aborted it on purpose
                    if self._error is None:
                        self._error = exc
                    self._live.pop(index, None)
                    self._abort_live(drain=True)

    async def receive(self) -> tuple[int, OutputDelta]:
        """The next ``(index, delta)``.

        After a child failed, every delta the samples had received before
        the failure comes first, then the error.

        Raises:
            trio.EndOfChannel: every child finished.
            the first child error (see the class).
        """
        try:
            item = await self._recv.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            raise
        return item

    def __aiter__(self) -> ParallelStream:
        return self

    async def __anext__(self) -> tuple[int, OutputDelta]:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


@asynccontextmanager
async def generate_parallel(
    client: EngineClient, requests: Sequence[Any], *, deadlines: Deadlines | None = None
) -> AsyncIterator[ParallelStream]:
    """Submit the samples of one parent and merge their streams.

    Args:
        client: a connected :class:`~zmqdispatch.EngineClient`.
        requests: the ``n`` single-sample requests, in index order, of the
            client's runtime (from :func:`zmqdispatch.translate.vllm.translate_parallel`
            or :func:`zmqdispatch.translate.tokenspeed.translate_parallel`).
        deadlines: time limits applied to every sample
            (:class:`~zmqdispatch.Deadlines`); a sample past one fails the
            parent with ``DeadlineExceeded`` like any failing sample.

    Raises:
        RequestRejected: ``requests`` is empty (n = 0), or one fails validation
            (nothing is sent for any of them).
        RuntimeMismatchError: a request is for the other runtime.
        DuplicateRequestIdError: two children share an id, or one is live.
        EngineDeadError: the engine is dead.

    Cancellation: leaving the block (normally, on error, or cancelled) sends
    one ABORT for the children still live.
    """
    if not requests:
        raise RequestRejected("n must be >= 1: no samples requested", field="sampling_params.n")
    for r in requests:
        client.runtime.check_type(r)
    ids = [client.runtime.request_id(r) for r in requests]
    seen: set[str] = set()
    for rid in ids:
        if rid in seen or client.protocol.is_live(rid):
            raise DuplicateRequestIdError(
                f"sample request_id {rid!r} collides with a live request or a sibling",
                request_id=rid,
                field="request_id",
            )
        seen.add(rid)
    for r in requests:  # validate all before queuing any ADD
        client.check_request(r)
    streams: list[RequestStream] = []
    try:
        for r in requests:
            stream = client.generate(r, deadlines=deadlines)
            stream._queue()  # every sample's ADD now, in order (entering would queue them as tasks start)
            streams.append(stream)
    except BaseException:
        for s in streams:
            s.abort()
        raise
    merged = ParallelStream(client, streams)
    try:
        async with trio.open_nursery() as nursery:
            async with merged._send:
                for i, s in enumerate(streams):
                    nursery.start_soon(merged._child, i, s, merged._send.clone())
            try:
                yield merged
            finally:
                merged._abort_live()
    except BaseExceptionGroup as eg:
        raise _unwrap(eg) from None
