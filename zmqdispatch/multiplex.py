"""Many request streams read by one task: :class:`StreamGroup`.

A :class:`~zmqdispatch.client.RequestStream` wakes its own consumer task for
every delivery, and one trio task wake-up costs several microseconds: with
hundreds of streams per engine step, the last consumer of a step waits for all
the others (``benchmarks/README.md``, "Where zmqdispatch's CPU goes"). A
gateway that serves many streams from one task (an HTTP/2 connection writer, a
batching front end) can instead put them in a group and receive every ready
stream's delta in **one** batch per wake-up::

    async with open_stream_group(client) as group:
        group.generate(request_a)          # from any task, at any time
        group.generate(request_b)
        async for batch in group:          # [(request_id, OutputDelta | error), ...]
            for request_id, item in batch:
                if isinstance(item, BaseException):
                    ...                    # that request failed (typed error); the others go on
                else:
                    ...                    # item.finish_reason set: that request is done

Semantics per request are those of ``RequestStream``: deltas in order, merged
when the reader lags (bounded by ``max_pending_tokens``), exactly one terminal
item (a delta with ``finish_reason``, or an error: ``EngineDeadError``,
``EngineRequestError``, ``SlowConsumerError``, ...), after which the request
leaves the group. :meth:`StreamGroup.abort` and leaving the group's block
(normally, on error or cancelled) abort every live request in one batched
ABORT, synchronously.

Wake-ups: each member's mailbox calls the group's hook once per put; the hook
queues the member and reschedules the group's reader if it is parked (no
closure or Event per delivery). Sans-IO state stays in the mailboxes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from .client import EngineClient
from .errors import DuplicateRequestIdError, LocalProtocolError
from .protocol.deadlines import Deadlines
from .protocol.mailbox import Mailbox, OutputDelta

__all__ = ["StreamGroup", "open_stream_group"]


class _Member:
    """One request of a group. ``hook`` (this member's bound ``_queue``, made
    once) is its mailbox's waiter. A bound method touches two objects per
    delivery; a closure would touch the function, its cells and the member,
    and the router visits a thousand members per step, none of them in cache."""

    __slots__ = ("request_id", "mailbox", "queued", "live", "group", "hook")

    def __init__(self, group: StreamGroup, request_id: str, mailbox: Mailbox) -> None:
        self.request_id = request_id
        self.mailbox = mailbox
        self.queued = False
        self.live = True  # False once aborted or its terminal item was taken
        self.group = group
        self.hook = self._queue

    def _queue(self) -> None:  # the mailbox's waiter: called by the router task
        if not self.queued:
            self.queued = True
            ready = self.group._ready
            if not ready:
                # Only the first member queued since the reader last took
                # needs to wake it: the reader parks only on an empty queue.
                self.group._wake()
            ready.append(self)


class StreamGroup:
    """Requests whose outputs one task receives in batches. Create with
    :func:`open_stream_group`.

    Attributes:
        client: the :class:`~zmqdispatch.EngineClient` the requests go to.
    """

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._members: dict[str, _Member] = {}
        self._ready: deque[_Member] = deque()
        self._task: Any = None
        self._closed = False
        self._receiving = False

    def __len__(self) -> int:
        """Requests in the group that have not delivered their terminal item."""
        return len(self._members)

    def _wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)

    def _abort_park(self, _: Any) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def generate(self, request: Any, *, deadlines: Deadlines | None = None) -> str:
        """Validate and submit *request* (synchronous, from any task); return its id.

        *deadlines* (:class:`~zmqdispatch.Deadlines`): past one, the request
        is aborted on the engine and its terminal item is ``DeadlineExceeded``.

        Raises: what :meth:`EngineClient.generate` raises (``RequestRejected``,
        ``RuntimeMismatchError``, ``DuplicateRequestIdError``, ``EngineDeadError``);
        ``DuplicateRequestIdError`` also while a request of that id is still in
        the group (until its terminal item was received); ``LocalProtocolError``
        after the group was closed.
        """
        if self._closed:
            raise LocalProtocolError("the stream group is closed")
        runtime = self.client.runtime
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
        mailbox, _add = self.client._submit(request, deadlines)
        member = _Member(self, mailbox.request_id, mailbox)
        self._members[member.request_id] = member
        mailbox.waiter = member.hook
        if mailbox.pending is not None or mailbox.finished:
            member.hook()
        return member.request_id

    def abort(self, request_ids: Any = None) -> None:
        """Abort these requests (default: every live one) in one batched ABORT.
        Synchronous, idempotent, never raises; they deliver nothing more."""
        ids = list(self._members) if request_ids is None else [r for r in request_ids if r in self._members]
        protocol = self.client._protocol
        for rid in ids:
            member = self._members.pop(rid)
            member.live = False  # if it is queued, the reader skips it
            member.mailbox.waiter = None
            # By mailbox, not by id: a member that already finished on the
            # engine may share its id with a newer request of another caller.
            # Pending aborts are batched: still one ABORT frame.
            protocol.abort_mailbox(member.mailbox)

    async def receive(self) -> list[tuple[str, OutputDelta | BaseException]]:
        """The next batch: ``(request_id, OutputDelta)`` for every request with
        new output, ``(request_id, error)`` for every request that failed.

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

    def _take_ready(self) -> list[tuple[str, OutputDelta | BaseException]]:
        batch: list[tuple[str, OutputDelta | BaseException]] = []
        ready = self._ready
        members = self._members
        while ready:
            member = ready.popleft()
            member.queued = False
            if not member.live:
                continue  # aborted meanwhile
            rid = member.request_id
            mb = member.mailbox
            delta = mb.pending
            if delta is not None:  # Mailbox.take(), inlined for the common case
                mb.pending = None
                mb.pending_tokens = 0
                batch.append((rid, delta))
                if delta.finish_reason is not None:
                    member.live = False
                    del members[rid]
                    continue
            if mb.finished:
                try:
                    mb.take()  # the stream's error, after the tokens it had
                except BaseException as exc:  # a typed error ending this request only
                    batch.append((rid, exc))
                    member.live = False
                    del members[rid]
                    continue
            mb.waiter = member.hook  # re-armed before any await: no lost wake-up
        return batch

    def __aiter__(self) -> StreamGroup:
        return self

    async def __anext__(self) -> list[tuple[str, OutputDelta | BaseException]]:
        while True:
            try:
                batch = await self.receive()
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
            if batch:
                return batch

    def close(self) -> None:
        """Abort every live request; iteration then ends."""
        self._closed = True
        self.abort()
        self._wake()


@asynccontextmanager
async def open_stream_group(client: EngineClient) -> AsyncIterator[StreamGroup]:
    """A :class:`StreamGroup` on *client*; leaving the block aborts what is still live.

    Cancellation: leaving (normally, on error, or cancelled) sends one batched
    ABORT for the live requests, synchronously.
    """
    group = StreamGroup(client)
    try:
        yield group
    finally:
        group.close()
