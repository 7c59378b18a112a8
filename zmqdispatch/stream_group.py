"""Many requests, one reader: :class:`StreamGroup`, what
``client.stream_group()`` opens, and :class:`GroupMember`, the handle of one
of its requests. A member's mailbox ``waiter`` queues the member on the
group; the group wakes its one reader once per batch (not once per delivery,
as a :class:`~.request_stream.RequestStream` does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Self, TypeAlias

import trio

from .errors import (
    DuplicateRequestIdError,
    LocalProtocolError,
    ZmqDispatchError,
)
from .protocol.deadlines import Deadlines
from .protocol.mailbox import Mailbox, OutputDelta
from .request_stream import EngineRequest, StreamHost

__all__ = ["GroupItem", "GroupMember", "StreamGroup"]


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

    @property
    def host(self) -> StreamHost:
        """The :class:`StreamHost` members are opened through (the asyncio
        group of :mod:`zmqdispatch.aio` is built on the same one)."""
        return self._host

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
