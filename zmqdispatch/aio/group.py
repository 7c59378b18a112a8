"""Many requests, one asyncio reader: :class:`AsyncStreamGroup`.

:class:`zmqdispatch.StreamGroup` with asyncio parking: the members, their
mailbox hooks, batching, merging and aborts are the trio group's own code;
only the reader's wait is an asyncio future (resolved by the first member
queued since the reader last took, from the trio output router).
"""

from __future__ import annotations

import asyncio

import trio

from ..stream_group import GroupItem, GroupMember, StreamGroup

__all__ = ["AsyncStreamGroup", "GroupItem", "GroupMember", "adopt"]


class AsyncStreamGroup(StreamGroup):
    """Requests whose outputs one asyncio task receives in batches. Open with
    ``client.stream_group()``; the items, rules and errors of
    :class:`zmqdispatch.StreamGroup`::

        async with client.stream_group() as group:
            member = group.generate(request)       # from any task, at any time
            async for batch in group:              # [(GroupMember, OutputDelta | error), ...]
                ...

    ``receive()`` raises ``StopAsyncIteration`` once the group is closed;
    cancelling it takes nothing. Leaving the block (normally, on error,
    cancelled) aborts every live member in one batched ABORT.
    """

    _fut: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        fut = self._fut
        if fut is not None:
            self._fut = None
            if not fut.done():
                fut.set_result(None)

    async def receive(self) -> list[GroupItem]:  # asyncio: StopAsyncIteration ends it
        """The next batch (see :class:`zmqdispatch.StreamGroup.receive`);
        waits while nothing is ready. Raises ``StopAsyncIteration`` once the
        group was closed, ``trio.BusyResourceError`` if another task receives."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream group")
        self._receiving = True
        try:
            while not self._ready:
                if self._closed:
                    raise StopAsyncIteration
                fut = self._fut = asyncio.get_running_loop().create_future()
                try:
                    await fut
                finally:
                    self._fut = None
            return self._take_ready()
        finally:
            self._receiving = False

    async def __anext__(self) -> list[GroupItem]:
        while True:
            batch = await self.receive()
            if batch:
                return batch

    async def aclose(self) -> None:
        """:meth:`close` (awaitable, for ``contextlib.aclosing``)."""
        self.close()


def adopt(group: StreamGroup) -> AsyncStreamGroup:
    """The asyncio group over the host of a trio group never used."""
    return AsyncStreamGroup(group.host)

