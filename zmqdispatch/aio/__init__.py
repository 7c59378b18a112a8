"""zmqdispatch for asyncio: the same client, streams, rules and errors as the
trio API, for asyncio programs (FastAPI / uvicorn, ``grpc.aio``), under
asyncio's default loop and uvloop.

::

    from zmqdispatch import aio

    async with aio.connect(launch=...) as client:
        async with client.generate(request) as stream:
            async for delta in stream:
                ...

The unchanged trio core runs as a guest of the running asyncio loop
(:mod:`._guest`: one trio run per loop, shared by every client in it); the
asyncio streams read the same sans-IO mailboxes the trio streams read
(``docs/asyncio.md``).
"""

from ._guest import GuestRunError, run_in_trio
from .client import AsyncEngineClient, connect
from .group import AsyncStreamGroup, GroupItem, GroupMember
from .samples import AsyncSampleStream
from .streams import AsyncRequestStream

__all__ = [
    "AsyncEngineClient",
    "AsyncRequestStream",
    "AsyncSampleStream",
    "AsyncStreamGroup",
    "GroupItem",
    "GroupMember",
    "GuestRunError",
    "connect",
    "run_in_trio",
]
