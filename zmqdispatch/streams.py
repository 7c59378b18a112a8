"""The three ways to read an engine's outputs, all opened from the client.

=========================  ==========================================  ==========================
opened with                what it is                                  iteration yields
=========================  ==========================================  ==========================
``client.generate(r)``     :class:`RequestStream`: one request         :class:`OutputDelta`
``client.generate_samples  :class:`SampleStream`: the ``n`` sibling    ``(index, OutputDelta)``
(rs)``                     samples of one parent, merged, aborted
                           together
``client.stream_group()``  :class:`StreamGroup`: many requests read    ``[(GroupMember, item)]``
                           by one task, one batch per wake-up
=========================  ==========================================  ==========================

All three are ``async with`` context managers with ``abort()`` (synchronous)
and ``aclose()``; nothing is sent before the block is entered, and leaving it
(normally, on an error, cancelled) aborts on the engine whatever is still
live, in one batched ABORT. Aborting goes by handle (the stream, the sample
index, the group member), never by id: an id may already belong to a newer
request that reused it.

Errors are the classes of :mod:`zmqdispatch.errors`, reaching the caller one
way per shape:

- :class:`RequestStream` and :class:`SampleStream` raise them from
  ``receive()`` / iteration, after the deltas received before the failure.
- :class:`StreamGroup` raises from ``receive()`` only what concerns the group
  itself (closed, busy). A member's error is that member's **terminal item**
  in the batch, ``(member, error)``, the same instance a
  :class:`RequestStream` would raise: raising it would lose the other
  members' deltas of that batch. ``isinstance(item, OutputDelta)`` tells them
  apart; after its terminal item (a delta with ``finish_reason`` or an error)
  a member is done.

The client side of these streams is :class:`StreamHost`, which
:class:`~zmqdispatch.client.EngineClient` implements; the per-delivery path
touches only the request's :class:`~zmqdispatch.protocol.mailbox.Mailbox`
(its ``waiter`` hook wakes the reader: one task reschedule per delivery for a
stream, one per batch for a group).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, Self, TypeAlias

import trio

from .errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    LocalProtocolError,
    RequestRejected,
    RequestStreamClosed,
    ZmqDispatchError,
)
from .protocol.deadlines import Deadlines
from .protocol.engine import Outgoing, SendState
from .protocol.mailbox import Mailbox, OutputDelta
from .protocol.runtime import Runtime
from .wire import tokenspeed as _ts
from .wire import vllm as _vllm

__all__ = [
    "EngineRequest",
    "GroupItem",
    "GroupMember",
    "RequestStream",
    "SampleStream",
    "StreamGroup",
    "StreamHost",
]

#: A request on the engine's own wire, what ``generate`` accepts: vLLM's
#: ``EngineCoreRequest`` or TokenSpeed's ``TokenizedGenerateReqInput``
#: (``zmqdispatch.translate_vllm_request`` / ``translate_tokenspeed_request``
#: build them from the gateway's proto).
EngineRequest: TypeAlias = _vllm.EngineCoreRequest | _ts.TokenizedGenerateReqInput


class StreamHost(Protocol):
    """What a stream needs from its engine link (:class:`~zmqdispatch.client.EngineClient`
    provides one per client). Synchronous calls, from the client's trio thread."""

    @property
    def runtime(self) -> Runtime:
        """The engine's dialect (request type, request id field)."""
        ...

    def validate(self, request: EngineRequest, deadlines: Deadlines | None) -> Deadlines | None:
        """Check *request* for this engine without sending it; return the
        deadlines in force for it (``ClientConfig`` defaults applied).

        Raises: ``RuntimeMismatchError``, ``RequestRejected`` (and subclasses),
        ``DuplicateRequestIdError`` (the id is live), ``EngineDeadError``."""
        ...

    def is_live(self, request_id: str) -> bool:
        """Whether a request of this id is registered (queued or running)."""
        ...

    def open(self, request: EngineRequest, deadlines: Deadlines | None) -> Mailbox:
        """Register a validated *request* and queue its ADD; start its deadlines.

        Raises: ``DuplicateRequestIdError``, ``EngineDeadError`` (nothing registered)."""
        ...

    def abort(self, mailbox: Mailbox) -> None:
        """Abort the request owning *mailbox* if it is still live (batched,
        synchronous); what it had received stays in the mailbox."""
        ...

    def check_alive(self) -> None:
        """Raise the engine's ``EngineDeadError`` if it is dead or the client closed."""
        ...


async def _wait_sent(add: Outgoing) -> None:
    """Park until the input pump settles *add* (its ``waiter`` hook)."""
    task = trio.lowlevel.current_task()

    def wake() -> None:
        trio.lowlevel.reschedule(task)

    def abort_fn(_: Any) -> trio.lowlevel.Abort:
        add.waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    add.waiter = wake
    await trio.lowlevel.wait_task_rescheduled(abort_fn)


# ---------------------------------------------------------------------- one request


class RequestStream:
    """One request's outputs: ``async with`` it, then iterate.

    ::

        async with client.generate(request) as stream:
            async for delta in stream:       # OutputDelta, merged if you lag
                ...

    Nothing is sent before the stream is entered: entering registers the
    request, queues its ADD and waits until the socket accepted it (a stream
    that is never entered costs nothing on the engine). Iteration yields
    :class:`OutputDelta` objects and stops after the one whose
    ``finish_reason`` is set. Leaving the block before that (``break``, an
    exception, a cancellation) or :meth:`abort` aborts the request on the
    engine: the ABORT is queued synchronously, batched with others, and sent
    by the input pump.

    Raises (from ``__aenter__`` or ``receive()`` / iteration):
        DuplicateRequestIdError: (entering) the ``request_id`` is live.
        RequestRejected: (entering) the request passed validation but could
            not be encoded for the wire (nothing was sent).
        DeadlineExceeded: the request went past one of its ``deadlines``
            (it was aborted on the engine).
        EngineDeadError: the engine died (every open stream gets one).
        EngineRequestError: the engine finished the request with an error.
        SlowConsumerError: the consumer fell behind ``max_pending_tokens``.
        RemoteProtocolError: this request's output did not decode, or the
            engine's output connection dropped (a frame above
            ``limits.MAX_FRAME_BYTES``) and its outputs may be lost.
        RequestStreamClosed: iterating a stream that was aborted.
    """

    __slots__ = (
        "_aborter", "_closed", "_deadlines", "_entered", "_eof", "_host", "_mailbox", "_receiving", "_request",
        "_task", "_waker", "request_id",
    )

    def __init__(self, host: StreamHost, request_id: str, request: EngineRequest | None,
                 deadlines: Deadlines | None = None) -> None:
        self._host = host
        #: the request's id (``request_id`` / TokenSpeed ``rid``)
        self.request_id = request_id
        self._request = request  # validated; submitted by __aenter__
        self._deadlines = deadlines
        self._mailbox: Mailbox | None = None
        self._eof = False  # the final delta was handed to the consumer
        self._closed = False  # aborted / exited before the final delta
        self._entered = False
        self._receiving = False
        # The parked consumer and its wake / abort hooks, bound once per stream
        # (a park per delivery is the hot path: no closures per park).
        self._task: Any = None
        self._waker = self._wake
        self._aborter = self._abort_park

    def __repr__(self) -> str:
        return f"<RequestStream {self.request_id!r} eof={self._eof} closed={self._closed} {self._mailbox!r}>"

    async def __aenter__(self) -> Self:
        if self._entered:
            raise LocalProtocolError(f"request {self.request_id!r}: a stream can be entered once")
        self._entered = True
        if self._closed:
            raise RequestStreamClosed(
                f"request {self.request_id!r}: the stream was closed before it was entered (nothing was sent)",
                request_id=self.request_id,
            )
        if self._mailbox is None:
            await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sends nothing
            self._open()  # raises DuplicateRequestIdError / EngineDeadError: nothing to undo
        assert self._mailbox is not None
        add: Outgoing = self._mailbox.add
        try:
            while add.state is SendState.QUEUED or add.state is SendState.SENDING:
                await _wait_sent(add)
            if add.state is SendState.FAILED:
                self._closed = True
                self._host.check_alive()
                raise EngineDeadError("engine died before the request was sent", reason="closed")
            if add.state is SendState.REJECTED:
                self._closed = True
                assert add.error is not None
                raise add.error  # RequestRejected: the request could not be encoded, nothing was sent
            if add.state is SendState.CANCELLED:
                self._closed = True
                raise RequestStreamClosed(
                    f"request {self.request_id!r} was aborted before it was sent", request_id=self.request_id
                )
            # Inside the try: a cancellation landing on this last checkpoint
            # leaves without __aexit__, so it must abort here (no leak).
            await trio.lowlevel.checkpoint()
        except BaseException:
            self.abort()
            raise
        return self

    def _open(self) -> None:
        """Register the request and queue its ADD now (``__aenter__`` does it;
        :class:`SampleStream` does it for every sample first, so their ADDs go
        out in order and together). Idempotent."""
        if self._mailbox is None and not self._closed:
            assert self._request is not None
            self._mailbox = self._host.open(self._request, self._deadlines)
            self._request = None

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def abort(self) -> None:
        """Abort the request now unless it already finished. Synchronous,
        idempotent, never raises; iteration afterwards raises
        :class:`RequestStreamClosed`."""
        if not self._eof and not self._closed:
            self._closed = True
            if self._mailbox is not None:
                self._host.abort(self._mailbox)

    async def aclose(self) -> None:
        """:meth:`abort`, then a checkpoint."""
        self.abort()
        await trio.lowlevel.checkpoint()

    @property
    def finished(self) -> bool:
        """True once the final output was received or the stream was aborted."""
        return self._eof or self._closed

    async def receive(self) -> OutputDelta:
        """The next :class:`OutputDelta` (merged ticks if the consumer lagged).

        Cancellation: atomic; a cancelled receive leaves the pending delta in
        the mailbox.

        Raises:
            trio.EndOfChannel: after the final delta was returned.
            LocalProtocolError: the stream was not entered with ``async with``
                (the request is aborted).
            trio.BusyResourceError: another task is receiving on this stream.
            plus the errors listed on the class.
        """
        if not self._entered:
            # Iterating without `async with` would leave nothing to abort the
            # request when the caller stops: refuse, and abort it now.
            self.abort()
            raise LocalProtocolError(
                f"request {self.request_id!r}: enter the stream first (`async with client.generate(...) as stream`)"
            )
        if self._receiving:
            raise trio.BusyResourceError(f"another task is already receiving on request {self.request_id!r}")
        self._receiving = True
        try:
            return await self._receive()
        finally:
            self._receiving = False

    def _wake(self) -> None:  # the mailbox's waiter: called once by the router task
        task = self._task
        self._task = None
        trio.lowlevel.reschedule(task)

    def _abort_park(self, _: Any) -> trio.lowlevel.Abort:
        assert self._mailbox is not None
        self._mailbox.waiter = None
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _receive(self) -> OutputDelta:
        mb: Mailbox = self._mailbox  # type: ignore[assignment]  # set once entered; no assert per delivery
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self._eof:
                raise trio.EndOfChannel
            if self._closed:
                raise RequestStreamClosed(f"request {self.request_id!r}: stream was aborted",
                                          request_id=self.request_id)
            delta = mb.take()  # raises the stream's error once nothing is pending
            if delta is not None:
                if delta.finish_reason is not None:
                    self._eof = True
                if not parked:
                    # Nothing waited yet: give the scheduler its turn. After a
                    # park that turn was the park (one scheduler pass, not two).
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return delta
            self._task = trio.lowlevel.current_task()
            mb.waiter = self._waker
            await trio.lowlevel.wait_task_rescheduled(self._aborter)
            parked = True

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> OutputDelta:
        # receive() without its frame: the per-delivery path
        if not self._entered or self._receiving:
            try:
                return await self.receive()  # raises the misuse errors
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
        self._receiving = True
        try:
            return await self._receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        finally:
            self._receiving = False


# ---------------------------------------------------------------------- n > 1


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


# ---------------------------------------------------------------------- many requests, one reader


class GroupMember:
    """One request of a :class:`StreamGroup`: the handle its batch entries
    carry and :meth:`abort` takes. Hashable by identity (a key for the
    caller's own per-request state).

    Attributes:
        request_id: the request's id (``request_id`` / TokenSpeed ``rid``).
    """

    # ``hook`` (this member's bound ``_queue``, made once) is its mailbox's
    # waiter. A bound method touches two objects per delivery; a closure would
    # touch the function, its cells and the member, and the router visits a
    # thousand members per step, none of them in cache.
    __slots__ = ("_group", "_hook", "_live", "_mailbox", "_queued", "request_id")

    def __init__(self, group: StreamGroup, request_id: str, mailbox: Mailbox) -> None:
        self.request_id = request_id
        self._mailbox = mailbox
        self._queued = False
        self._live = True  # False once aborted or its terminal item was taken
        self._group = group
        self._hook = self._queue

    def __repr__(self) -> str:
        return f"<GroupMember {self.request_id!r} live={self._live}>"

    @property
    def finished(self) -> bool:
        """True once its terminal item was received, or it was aborted."""
        return not self._live

    def abort(self) -> None:
        """Abort this request (batched with other aborts, synchronous,
        idempotent, never raises); it delivers nothing more, no terminal item
        either."""
        self._group._abort_member(self)

    def _queue(self) -> None:  # the mailbox's waiter: called by the router task
        if not self._queued:
            self._queued = True
            group = self._group
            ready = group._ready
            if not ready:
                # Only the first member queued since the reader last took
                # needs to wake it: the reader parks only on an empty queue.
                group._wake()
            ready.append(self)


#: One entry of a :class:`StreamGroup` batch: the member, and its new output
#: (merged ticks) or the typed error that ended it.
GroupItem: TypeAlias = tuple[GroupMember, OutputDelta | ZmqDispatchError]


class StreamGroup:
    """Requests whose outputs one task receives in batches. Open with
    :meth:`EngineClient.stream_group <zmqdispatch.EngineClient.stream_group>`.

    ::

        async with client.stream_group() as group:
            member = group.generate(request)       # from any task, at any time
            async for batch in group:              # [(GroupMember, OutputDelta | error), ...]
                for member, item in batch:
                    if isinstance(item, OutputDelta):
                        ...                        # item.finish_reason set: that request is done
                    else:
                        ...                        # its typed error: that request is done, the others go on

    A :class:`RequestStream` wakes its own consumer task for every delivery
    (several µs each in trio); a group wakes its one reader once per batch,
    for a gateway that writes many streams from one task (an HTTP/2
    connection, a batching front end).

    Per member the semantics are :class:`RequestStream`'s: deltas in order,
    merged when the reader lags (bounded by ``max_pending_tokens``), exactly
    one terminal item (a delta with ``finish_reason``, or the typed error a
    stream would raise: ``EngineDeadError``, ``EngineRequestError``,
    ``SlowConsumerError``, ``DeadlineExceeded``, ...), after which it leaves
    the group. :meth:`GroupMember.abort`, :meth:`abort` and leaving the block
    (normally, on error or cancelled) abort in one batched ABORT,
    synchronously; an aborted member delivers nothing more.
    """

    def __init__(self, host: StreamHost) -> None:
        self._host = host
        self._members: dict[str, GroupMember] = {}
        self._ready: deque[GroupMember] = deque()
        self._task: Any = None
        self._closed = False
        self._receiving = False

    def __repr__(self) -> str:
        return f"<StreamGroup members={len(self._members)} ready={len(self._ready)} closed={self._closed}>"

    def __len__(self) -> int:
        """Members that have not delivered their terminal item (nor were aborted)."""
        return len(self._members)

    def _wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)

    def _abort_park(self, _: Any) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def generate(self, request: EngineRequest, *, deadlines: Deadlines | None = None) -> GroupMember:
        """Validate and submit *request* now (synchronous, from any task);
        return its member handle.

        *deadlines* (:class:`~zmqdispatch.Deadlines`): past one, the request
        is aborted on the engine and its terminal item is ``DeadlineExceeded``.

        Raises: what :meth:`EngineClient.generate <zmqdispatch.EngineClient.generate>`
        raises (``RequestRejected``, ``RuntimeMismatchError``,
        ``DuplicateRequestIdError``, ``EngineDeadError``);
        ``DuplicateRequestIdError`` also while a member of that id is still in
        the group (until its terminal item was received); ``LocalProtocolError``
        after the group was closed.
        """
        if self._closed:
            raise LocalProtocolError("the stream group is closed")
        host = self._host
        runtime = host.runtime
        runtime.check_type(request)
        rid = runtime.request_id(request)
        if rid in self._members:
            # The engine may be done with it, but its last items are not received
            # yet: a second member under the same id would mix the two.
            raise DuplicateRequestIdError(
                f"request_id {rid!r} is still in this stream group (its terminal item is not received yet)",
                request_id=rid,
                field="request_id",
            )
        mailbox = host.open(request, host.validate(request, deadlines))
        member = GroupMember(self, rid, mailbox)
        self._members[rid] = member
        mailbox.waiter = member._hook
        if mailbox.pending is not None or mailbox.finished:
            member._hook()
        return member

    def _abort_member(self, member: GroupMember) -> None:
        if not member._live:
            return
        member._live = False  # if it is queued, the reader skips it
        del self._members[member.request_id]
        mb = member._mailbox
        mb.waiter = None
        self._host.abort(mb)

    def abort(self, members: Iterable[GroupMember] | None = None) -> None:
        """Abort these members (default: every live one) in one batched
        ABORT. Synchronous, idempotent, never raises; they deliver nothing more."""
        for member in list(self._members.values()) if members is None else list(members):
            if member._group is self:
                self._abort_member(member)

    async def receive(self) -> list[GroupItem]:
        """The next batch: ``(member, OutputDelta)`` for every member with new
        output, ``(member, error)`` for every member that failed (see the class).

        Waits while nothing is ready (also while the group is empty: another
        task may add requests). Cancellation: atomic (a cancelled receive
        takes nothing).

        Raises:
            trio.EndOfChannel: the group was closed.
            trio.BusyResourceError: another task is receiving.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream group")
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            parked = False
            while not self._ready:
                if self._closed:
                    raise trio.EndOfChannel
                self._task = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_park)
                parked = True
            batch = self._take_ready()
            if not parked:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return batch
        finally:
            self._receiving = False

    def _take_ready(self) -> list[GroupItem]:
        batch: list[GroupItem] = []
        ready = self._ready
        members = self._members
        while ready:
            member = ready.popleft()
            member._queued = False
            if not member._live:
                continue  # aborted meanwhile
            mb = member._mailbox
            delta = mb.pending
            if delta is not None:  # Mailbox.take(), inlined for the common case
                mb.pending = None
                mb.pending_tokens = 0
                batch.append((member, delta))
                if delta.finish_reason is not None:
                    member._live = False
                    del members[member.request_id]
                    continue
            if mb.finished:
                try:
                    mb.take()  # the stream's error, after the tokens it had
                except ZmqDispatchError as exc:  # a typed error ending this member only
                    batch.append((member, exc))
                    member._live = False
                    del members[member.request_id]
                    continue
            mb.waiter = member._hook  # re-armed before any await: no lost wake-up
        return batch

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> list[GroupItem]:
        while True:
            try:
                batch = await self.receive()
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
            if batch:
                return batch

    def close(self) -> None:
        """Abort every live member; iteration then ends and :meth:`generate`
        refuses. Synchronous, idempotent."""
        self._closed = True
        self.abort()
        self._wake()

    async def aclose(self) -> None:
        """:meth:`close`, then a checkpoint."""
        self.close()
        await trio.lowlevel.checkpoint()
