"""One request's stream: :class:`RequestStream`, what ``client.generate(r)``
opens (the shapes and their errors: :mod:`zmqdispatch.streams`), and
:class:`StreamHost`, what every stream needs from the client
(:class:`~zmqdispatch.client.EngineClient` implements it). The per-delivery
path touches only the request's :class:`~zmqdispatch.protocol.mailbox.Mailbox`:
its ``waiter`` hook reschedules the parked consumer, one task reschedule per
delivery. :mod:`.sample_stream` and :mod:`.stream_group` are built on it.
"""

from __future__ import annotations

from typing import Any, Protocol, Self, TypeAlias

import trio

from .errors import (
    EngineDeadError,
    LocalProtocolError,
    RequestStreamClosed,
)
from .protocol.deadlines import Deadlines
from .protocol.engine import Outgoing, SendState
from .protocol.mailbox import Mailbox, OutputDelta
from .protocol.runtime import Runtime
from .wire import sglang as _sg
from .wire import tokenspeed as _ts
from .wire import vllm as _vllm

__all__ = ["EngineRequest", "RequestStream", "StreamHost", "unsent_error"]

#: A request on the engine's own wire, what ``generate`` accepts: vLLM's
#: ``EngineCoreRequest`` or TokenSpeed's ``TokenizedGenerateReqInput``
#: (``zmqdispatch.translate_vllm_request`` / ``translate_tokenspeed_request``
#: build them from the gateway's proto).
EngineRequest: TypeAlias = _vllm.EngineCoreRequest | _ts.TokenizedGenerateReqInput | _sg.TokenizedGenerateReqInput


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



def unsent_error(add: Outgoing, request_id: str, host: StreamHost) -> BaseException | None:
    """The error an ADD that settled without being sent stands for, None while
    it is queued, being sent, or once sent: ``FAILED`` the engine's death
    (``host.check_alive()``'s ``EngineDeadError``), ``REJECTED`` the encoder's
    ``RequestRejected``, ``CANCELLED`` ``RequestStreamClosed``. Every shell's
    streams (trio, asyncio, samples) read a settled ADD through this."""
    state = add.state
    if state is SendState.FAILED:
        try:
            host.check_alive()
        except EngineDeadError as exc:
            return exc
        return EngineDeadError("engine died before the request was sent", reason="closed")
    if state is SendState.REJECTED:
        assert add.error is not None
        return add.error  # the request could not be encoded, nothing was sent
    if state is SendState.CANCELLED:
        return RequestStreamClosed(f"request {request_id!r} was aborted before it was sent", request_id=request_id)
    return None


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
            error = unsent_error(add, self.request_id, self._host)
            if error is not None:
                self._closed = True
                raise error
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

    def detach(self) -> tuple[StreamHost, EngineRequest, Deadlines | None]:
        """Hand this validated, never-entered stream's parts to another shell:
        ``(host, request, deadlines in force)``. The asyncio facade
        (:mod:`zmqdispatch.aio`) drives the same :class:`StreamHost` calls from
        asyncio, so validation and placement stay the client's. Nothing was
        sent; this stream is closed (entering it raises ``RequestStreamClosed``).

        Raises:
            LocalProtocolError: the stream was entered or already detached.
        """
        if self._entered or self._request is None or self._mailbox is not None:
            raise LocalProtocolError(f"request {self.request_id!r}: only a stream never entered can be detached")
        request, self._request = self._request, None
        self._closed = True
        return self._host, request, self._deadlines

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

