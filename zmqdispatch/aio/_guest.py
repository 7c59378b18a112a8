"""The trio run behind :mod:`zmqdispatch.aio`: trio as a guest of the running
asyncio loop (``trio.lowlevel.start_guest_run``), one run per event loop,
shared by every client and call of that loop.

trio's tasks run in the loop's own thread, between the loop's callbacks; only
trio's I/O wait (epoll) runs in a helper thread, which hands its events back
with ``loop.call_soon_threadsafe``. So asyncio code may call trio's
synchronous API directly (``trio.Event.set``, ``CancelScope.cancel``,
``trio.lowlevel.reschedule``, ``Nursery.start_soon``, ``trio.current_time``):
trio's run state is the thread's, and in guest mode every reschedule or moved
deadline wakes the I/O wait (``Runner.force_guest_tick_asap``). trio code may
resolve asyncio futures the same way. Nothing here needs a lock.

The run starts with the loop's first user (:func:`acquire`) and stops when its
last one is gone (:func:`release`), so it has finished before the loop closes
as long as every user leaves (``async with`` does, also when ``asyncio.run``
cancels the tasks it left pending). A loop closed from outside with a client
still open (``loop.close()`` with the block pending) cannot run trio any more:
once nothing can tick the run any more, the run's launched engines get
SIGTERM on their process groups (:meth:`TrioGuest.host_closed`) and the run
is left as it is. That moment is seen one of two ways: trio's I/O thread
hands back an event and the closed loop refuses it, or the loop's close drops
a callback of the run that had not run (:class:`_Callback`). trio's guest
state is held by the :class:`TrioGuest` for as long as it lives, so an
abandoned run is never finalized by the garbage collector in trio's I/O
thread, where trio's clean-up cannot restore the SIGINT handler.
``host_uses_signal_set_wakeup_fd=True``:
asyncio owns the signal wakeup fd; Ctrl-C is asyncio's (``asyncio.run``
cancels its main task), not trio's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import outcome
import trio

from ..errors import ZmqDispatchError

__all__ = ["GuestRunError", "TrioGuest", "acquire", "release", "run_in_trio", "wait_uncancelled"]

_log = logging.getLogger("zmqdispatch.aio")

T = TypeVar("T")


class GuestRunError(ZmqDispatchError, RuntimeError):
    """trio cannot run as a guest of this event loop: a trio run (``trio.run``,
    trio-asyncio, another guest run) already owns this thread, or the run
    stopped."""


async def wait_uncancelled(fut: asyncio.Future[Any]) -> None:
    """Wait until *fut* is done even if the calling task is cancelled meanwhile
    (clean-up that must finish: a launched engine stopped, the guest run
    ended); a cancellation that arrived is raised afterwards."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class TrioGuest:
    """The guest run of one event loop: its root nursery, where clients and
    calls run as trio tasks. Made by :func:`acquire`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.users = 0
        self.stopping = False
        self.nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self.started: asyncio.Future[None] = loop.create_future()
        #: the run's outcome once it ended
        self.done: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
        #: process group ids of the engines the run's clients launched (:meth:`host_closed`)
        self.engine_groups: set[int] = set()
        self._host_gone = False
        #: trio's guest state (the run's generator), kept: see the module docstring
        self._state: object = None

    def __repr__(self) -> str:
        return f"<TrioGuest users={self.users} stopping={self.stopping} running={self.nursery is not None}>"

    def start(self) -> None:
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                self.started.set_result(None)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

        def on_done(result: outcome.Outcome[None]) -> None:
            self.nursery = None
            error = result.error if isinstance(result, outcome.Error) else None
            interrupted = isinstance(error, KeyboardInterrupt) or (
                isinstance(error, BaseExceptionGroup) and error.subgroup(KeyboardInterrupt) is not None)
            if error is not None and not interrupted:
                _log.error("the trio guest run ended with an error", exc_info=error)
            if not self.started.done():
                self.started.set_exception(error or GuestRunError("the trio run ended"))
                self.started.exception()
            if not self.done.done():
                self.done.set_result(result)
            if interrupted:
                # Ctrl-C went to trio (a loop run without asyncio.run, which
                # would have taken SIGINT itself): the clients closed as the
                # run ended; the interrupt goes on to the loop's caller.
                raise KeyboardInterrupt

        try:
            trio.lowlevel.start_guest_run(
                main,
                run_sync_soon_threadsafe=self._to_host,
                run_sync_soon_not_threadsafe=self._tick_soon,
                done_callback=on_done,
                host_uses_signal_set_wakeup_fd=True,
            )
        except RuntimeError as exc:
            raise GuestRunError(
                "zmqdispatch.aio runs trio as a guest of the asyncio loop, but a trio run already owns this "
                f"thread ({exc}); from trio code use zmqdispatch.connect directly"
            ) from None

    def _tick_soon(self, fn: Callable[[], object]) -> None:
        # trio's first call passes its guest state's bound ``guest_tick``
        if self._state is None:
            self._state = getattr(fn, "__self__", fn)
        self.loop.call_soon(_Callback(fn, self))

    def callback_dropped(self) -> None:
        """A callback of the run was freed unrun (:class:`_Callback`): if the loop
        is closed, nothing will run trio again (:meth:`host_closed`)."""
        if self.loop.is_closed() and not self.done.done():
            self.host_closed()

    def _to_host(self, fn: Callable[[], object]) -> None:
        # trio's I/O thread hands its events to the loop; a loop closed under
        # the run refuses them (RuntimeError), and nothing will run trio again
        try:
            self.loop.call_soon_threadsafe(_Callback(fn, self))
        except RuntimeError:
            if not self.loop.is_closed():
                raise
            # *fn* holds the run: kept, so that it is not finalized in this thread
            _abandoned.append(fn)
            self.host_closed()

    def host_closed(self) -> None:
        """The loop closed with the run unfinished (a client left open): stop the
        launched engines (SIGTERM to each process group), once; called from
        trio's I/O thread or from the loop's ``close``. The clients' other state is left to the process's end."""
        if self._host_gone:
            return
        self._host_gone = True
        groups = sorted(self.engine_groups)
        _log.warning("the event loop closed with zmqdispatch.aio clients still open; stopping the engines they "
                     "launched (process groups %s)", groups)
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            # the engine (its group's leader) is this process's child, and the
            # run that would have waited for it is gone: reaped here
            threading.Thread(target=_reap, args=(pgid,), name=f"zmqdispatch-reap-{pgid}", daemon=True).start()

    def stop(self) -> None:
        """End the run: its nursery is cancelled (what still runs in it ends)."""
        self.stopping = True
        self._stop.set()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``fn(*args)`` as a trio task of the run (from the loop's thread)."""
        if self.nursery is None or self.stopping:
            raise GuestRunError("the trio guest run of this event loop has stopped")
        self.nursery.start_soon(fn, *args)

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await the trio function ``fn(*args)`` from asyncio: it runs as a trio
        task; its result or exception comes back. Cancelling the caller
        cancels the trio task and waits until it ended (its clean-up done,
        e.g. a utility call forgotten), then raises ``CancelledError``."""
        fut: asyncio.Future[T] = self.loop.create_future()
        ended: asyncio.Future[None] = self.loop.create_future()
        scope = trio.CancelScope()
        self.spawn(_job, fn, args, fut, scope, ended)
        try:
            return await fut
        except asyncio.CancelledError:
            scope.cancel()
            if fut.done() and not fut.cancelled():
                fut.exception()  # an outcome that raced the cancellation: dropped, as asked
            await wait_uncancelled(ended)
            raise


async def _job(fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], fut: asyncio.Future[Any],
               scope: trio.CancelScope, ended: asyncio.Future[None]) -> None:
    try:
        with scope:
            result = await fn(*args)
    except trio.Cancelled:
        if not fut.done():
            fut.set_exception(GuestRunError("the trio guest run stopped before the call returned"))
            fut.exception()  # its caller may be gone: no "never retrieved" log
        raise
    except BaseException as exc:  # the call's outcome goes to the asyncio caller
        if not fut.done():
            fut.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
        return
    else:
        if not fut.done():
            if scope.cancelled_caught:
                fut.cancel()
            else:
                fut.set_result(result)
    finally:
        if not ended.done():
            ended.set_result(None)


class _Callback:
    """A callback of the guest run on the loop; one that is freed without
    having run was dropped by the loop's ``close`` (:meth:`TrioGuest.callback_dropped`)."""

    __slots__ = ("fn", "guest", "ran")

    def __init__(self, fn: Callable[[], object], guest: TrioGuest) -> None:
        self.fn = fn
        self.guest = guest
        self.ran = False

    def __call__(self) -> None:
        self.ran = True
        self.fn()

    def __del__(self) -> None:
        if not self.ran:
            self.guest.callback_dropped()


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped already, or not a child
        pass


#: callbacks of runs whose loop closed under them (:meth:`TrioGuest._to_host`)
_abandoned: list[Callable[[], object]] = []

_guests: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TrioGuest] = weakref.WeakKeyDictionary()


async def acquire() -> TrioGuest:
    """The running loop's guest run, started on first use; one more user.
    Pair with :func:`release`.

    Raises:
        GuestRunError: trio already runs in this thread.
    """
    loop = asyncio.get_running_loop()
    while True:
        guest = _guests.get(loop)
        if guest is None:
            guest = _guests[loop] = TrioGuest(loop)
            try:
                guest.start()
            except BaseException:
                del _guests[loop]
                raise
        if guest.stopping:
            await wait_uncancelled(guest.done)
            if _guests.get(loop) is guest:
                del _guests[loop]
            continue
        guest.users += 1
        try:
            await asyncio.shield(guest.started)
        except BaseException:
            await release(guest)
            raise
        return guest


async def release(guest: TrioGuest) -> None:
    """One user fewer; the last one stops the run and waits until it ended
    (also when cancelled meanwhile: the cancellation is raised afterwards)."""
    guest.users -= 1
    if guest.users > 0:
        return
    guest.stop()
    try:
        await wait_uncancelled(guest.done)
    finally:
        if _guests.get(guest.loop) is guest:
            del _guests[guest.loop]


async def run_in_trio(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Await the trio async function ``fn(*args)`` from asyncio code, in the
    running loop's guest run (started for the call if no client holds it).

    Its result or exception is returned or raised as is. Cancelling the caller
    cancels the trio task.

    Raises:
        GuestRunError: trio already runs in this thread, or the run stopped.
    """
    guest = await acquire()
    try:
        return await guest.run(fn, *args)
    finally:
        await release(guest)
