"""The only module that calls pyzmq: single-owner sockets driven under trio.

Rules (``docs/trio-and-zmq.md`` §1, measured on this machine kind):

1. **One owner task per socket, one direction per socket** after startup. The
   ``zmq.FD`` is edge-triggered and *any* zmq call on the socket may consume the
   edge another waiter depends on (pyzmq#1203), and trio allows one waiter per
   fd. :class:`TrioSocket` enforces single use with a conflict detector instead
   of a lock: a second concurrent user is a bug and raises
   :class:`trio.BusyResourceError`.
2. **Try before wait.** The FD is a hint that ``EVENTS`` changed, not that a
   message is ready. We always try the non-blocking call first and wait on the
   FD only right after a fresh ``zmq.Again`` with no other call in between.
3. **Drain until EAGAIN** (bounded by a limit), because after a successful
   receive no new edge will come for messages already queued.
4. **Checkpoint discipline** (the shape of trio's ``MemorySendChannel.send``):
   ``checkpoint_if_cancelled()`` before the dequeue and
   ``cancel_shielded_checkpoint()`` after it, so a cancelled receive never
   loses a message that was already taken off the socket (a plain checkpoint
   after the dequeue lost 11,902 of 20,000 messages in the cancel storm).
5. **notify_closing before close**, so a parked waiter gets
   ``ClosedResourceError`` rather than waiting on a reused fd number.

zmq errors are translated here: a failed bind or connect becomes
:class:`~zmqdispatch.errors.AddressBindError` / ``InvalidAddressError``;
``EHOSTUNREACH`` (``ROUTER_MANDATORY`` on an
unroutable identity) becomes :class:`PeerUnreachable`; a send that cannot make
progress before its deadline becomes :class:`SendTimeout`.
"""

from __future__ import annotations

import enum
import errno
import math
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import trio
import zmq

from . import limits
from .errors import AddressBindError, InvalidAddressError

_T = TypeVar("_T")

__all__ = [
    "PeerUnreachable",
    "SendTimeout",
    "SocketKind",
    "MonitorEvent",
    "TrioSocket",
    "ZmqContext",
    "HANDSHAKE_FAILED_EVENTS",
    "parse_monitor_event",
]

_NOBLOCK = zmq.NOBLOCK
_POLLOUT = zmq.POLLOUT


class SocketKind(enum.IntEnum):
    """The socket types the wire uses (libzmq's numbers), for :meth:`ZmqContext.socket`."""

    ROUTER = zmq.ROUTER
    DEALER = zmq.DEALER
    PULL = zmq.PULL
    PUSH = zmq.PUSH


class MonitorEvent(enum.IntFlag):
    """The monitor events the shells watch (libzmq's ``ZMQ_EVENT_*`` bits), for
    :meth:`TrioSocket.monitor` and what :func:`parse_monitor_event` returns."""

    ACCEPTED = zmq.EVENT_ACCEPTED
    DISCONNECTED = zmq.EVENT_DISCONNECTED
    HANDSHAKE_SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
    HANDSHAKE_FAILED_NO_DETAIL = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    HANDSHAKE_FAILED_PROTOCOL = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    HANDSHAKE_FAILED_AUTH = zmq.EVENT_HANDSHAKE_FAILED_AUTH


class PeerUnreachable(Exception):
    """A ROUTER send named an identity that is not connected (EHOSTUNREACH)."""


class SendTimeout(Exception):
    """A send could not be queued before its deadline (the peer stopped reading)."""


class _ConflictDetector:
    """Raise ``BusyResourceError`` when two tasks use one socket at once."""

    __slots__ = ("_held", "_msg")

    def __init__(self, msg: str) -> None:
        self._held = False
        self._msg = msg

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(self._msg)
        self._held = True

    def __exit__(self, *exc: object) -> None:
        self._held = False


class ZmqContext:
    """Creates the project's sockets with the options the wire needs.

    One process-wide ``zmq.Context`` (thread-safe) is shared; it is never
    terminated here, because termination blocks while any socket lingers.
    """

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()

    def socket(
        self,
        kind: int,
        *,
        name: str,
        identity: bytes | None = None,
        router_mandatory: bool = False,
        router_handover: bool = False,
        sndhwm: int | None = None,
        rcvhwm: int | None = None,
        maxmsgsize: int | None = None,
    ) -> TrioSocket:
        """Create a socket (not yet bound or connected), wrapped for trio.

        Args:
            kind: a :class:`SocketKind` (or the same libzmq number, ``zmq.ROUTER`` ...).
            name: shown in errors and ``repr``.
            identity: routing identity for a DEALER (vLLM: engine index, 2 bytes LE).
            router_mandatory: raise EHOSTUNREACH instead of silently dropping.
            router_handover: a peer connecting with an identity a live
                connection holds takes it over (libzmq otherwise ignores the
                newcomer: a restarted engine's HELLO would be dropped until
                its old connection is reaped).
            sndhwm / rcvhwm: high-water marks in messages (0 = unbounded).
            maxmsgsize: largest inbound message in bytes; libzmq disconnects a
                peer that sends a bigger one.
        """
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if router_mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if router_handover:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if rcvhwm is not None:
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if maxmsgsize is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
        return TrioSocket(sock, name)


class TrioSocket:
    """A pyzmq socket used by exactly one trio task at a time.

    Every method that touches the socket is guarded: concurrent use raises
    ``trio.BusyResourceError`` (a design bug, never a race to paper over).
    """

    __slots__ = ("_sock", "name", "_guard", "_fd", "_closed")

    def __init__(self, sock: zmq.Socket[bytes], name: str) -> None:
        self._sock = sock
        self.name = name
        self._guard = _ConflictDetector(f"another task is using zmq socket {name!r}")
        self._fd = cast(int, sock.getsockopt(zmq.FD))  # pyzmq types every option int | bytes
        self._closed = False

    def __repr__(self) -> str:
        return f"<TrioSocket {self.name} closed={self._closed}>"

    # ------------------------------------------------------------- setup

    def bind(self, address: str, *, role: str = "") -> str:
        """Bind and return the resolved endpoint (``tcp://...:0`` gets its port).

        Check the address first (:func:`zmqdispatch.addresses.check_address`):
        libzmq wraps out-of-range ports.

        Raises:
            AddressBindError: it cannot be bound (in use, not an address of
                this host, no permission, missing ipc directory), with the errno.
            InvalidAddressError: libzmq refused its form.
        """
        self._endpoint(self._sock.bind, address, role, "bind")
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, address: str, *, role: str = "") -> None:
        """Connect (asynchronous in libzmq; never blocks).

        Raises:
            InvalidAddressError: libzmq refused the address's form.
        """
        self._endpoint(self._sock.connect, address, role, "connect to")

    def _endpoint(self, op: Callable[[str], object], address: str, role: str, verb: str) -> None:
        """Run ``bind`` / ``connect`` (*op*) on *address*, IPv6 enabled for a
        bracketed host; a ZMQError becomes the typed address error."""
        if address.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            op(address)
        except zmq.ZMQError as exc:
            raise _address_error(exc, address, role or self.name, verb) from None

    # ------------------------------------------------------------- receive

    async def recv_batch(self, limit: int = limits.RECV_BATCH_LIMIT) -> list[list[bytes]]:
        """Receive between 1 and *limit* complete multipart messages.

        Returns a list of messages, each a list of frames (``bytes``), in
        arrival order.

        Cancellation: atomic. Either messages are returned, or ``Cancelled`` is
        raised and no message has been taken off the socket (the only awaits
        are before the first dequeue and a cancel-shielded yield after it).
        Always a checkpoint, even when data is already queued: a call that
        waited yielded in that wait, one that found data queued yields once
        after taking it (a second yield after a wait would cost a scheduler
        pass, an epoll round, per engine step before anything is routed).

        Raises:
            trio.ClosedResourceError: the socket was closed while waiting.
        """
        with self._guard:
            await trio.lowlevel.checkpoint_if_cancelled()
            recv = self._sock.recv_multipart
            first, waited = await self._first_message(recv)
            batch = [first]
            # An edge was consumed: keep going until EAGAIN (or the limit; the
            # next call starts with a try, never with a wait).
            while len(batch) < limit:
                try:
                    batch.append(recv(_NOBLOCK))
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    raise _translate(exc, self.name) from exc
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return batch

    async def _first_message(self, recv: Callable[[int], _T]) -> tuple[_T, bool]:
        """``recv(NOBLOCK)``, waiting for the fd between tries; returns the
        message and whether it waited. The caller holds the guard and checked
        for cancellation; once ``recv`` returned nothing awaits, so a cancel
        never loses a taken message."""
        waited = False
        while True:
            try:
                return recv(_NOBLOCK), waited
            except zmq.Again:
                # Safe to wait: a fresh EAGAIN drained libzmq's command
                # mailbox, so the next state change will ring the fd.
                await trio.lowlevel.wait_readable(self._fd)
                waited = True
            except zmq.ZMQError as exc:
                raise _translate(exc, self.name) from exc

    def recv_nowait(self, limit: int = limits.RECV_BATCH_LIMIT) -> list[list[bytes]]:
        """Up to *limit* messages already queued, without waiting (maybe none).

        Not a checkpoint. The next :meth:`recv_batch` starts with a try, so
        stopping here at EAGAIN or at the limit loses no wake-up.
        """
        with self._guard:
            recv = self._sock.recv_multipart
            batch: list[list[bytes]] = []
            while len(batch) < limit:
                try:
                    batch.append(recv(_NOBLOCK))
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    raise _translate(exc, self.name) from exc
            return batch

    async def recv_multipart(self) -> list[bytes]:
        """Receive one multipart message. Cancellation: atomic, as :meth:`recv_batch`."""
        (msg,) = await self.recv_batch(1)
        return msg

    async def recv_multipart_from(self) -> tuple[list[bytes], int]:
        """Receive one multipart message and the file descriptor of the
        connection it came on (libzmq's ``ZMQ_SRCFD``, -1 when unknown): the
        ``value`` of that connection's monitor ``ACCEPTED`` / ``DISCONNECTED``
        events, so a ROUTER can tell which peer a closed connection was. For
        the handshake, not the hot path (it copies each frame once more).
        Cancellation: atomic, as :meth:`recv_batch`.

        Raises:
            trio.ClosedResourceError: the socket was closed while waiting.
        """
        with self._guard:
            await trio.lowlevel.checkpoint_if_cancelled()
            sock = self._sock
            parts, waited = await self._first_message(lambda flags: sock.recv_multipart(flags, copy=False))
            try:
                fd = int(parts[0].get(zmq.SRCFD))
            except zmq.ZMQError:
                fd = -1
            frames = [part.bytes for part in parts]
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return frames, fd

    # ------------------------------------------------------------- send

    def try_send(self, frames: Sequence[bytes]) -> bool:
        """Queue one multipart message without waiting.

        Returns ``False`` when the pipe is full (the message was not queued).
        libzmq queues multipart messages atomically, and only the first frame
        can return EAGAIN.

        Raises:
            PeerUnreachable: ROUTER_MANDATORY and the identity is not connected.
        """
        with self._guard:
            return self._try_send(frames)

    def _try_send(self, frames: Sequence[bytes]) -> bool:
        try:
            self._sock.send_multipart(frames, _NOBLOCK, copy=True)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise _translate(exc, self.name) from exc
        return True

    async def send(self, frames: Sequence[bytes], *, timeout: float = math.inf) -> None:
        """Queue one multipart message, waiting at most *timeout* seconds for room.

        Cancellation: if ``Cancelled`` is raised the message was not queued.
        Always a checkpoint.

        Raises:
            PeerUnreachable: see :meth:`try_send`.
            SendTimeout: no room before the deadline (the peer stopped reading).
        """
        with self._guard:
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._try_send(frames):
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            with trio.move_on_after(timeout):
                while True:
                    # Read EVENTS before waiting: it processes libzmq's commands
                    # unthrottled (a send does so at most once per ~1 ms), and
                    # once it reports "no room" the next change rings the fd
                    # (docs/trio-and-zmq.md §2.2).
                    if cast(int, self._sock.getsockopt(zmq.EVENTS)) & _POLLOUT:
                        if self._try_send(frames):
                            return
                        # POLLOUT on a ROUTER means "some pipe has room", not
                        # necessarily ours: back off instead of spinning.
                        await trio.sleep(0.001)
                        continue
                    await trio.lowlevel.wait_readable(self._fd)
            raise SendTimeout(f"{self.name}: send not accepted within {timeout} s")

    # ------------------------------------------------------------- close

    def close(self, linger_ms: int = 0) -> None:
        """Wake any waiter with ``ClosedResourceError``, then close. Idempotent.

        ``linger_ms`` > 0 lets libzmq's I/O thread keep flushing queued
        messages in the background for that long (close itself never blocks:
        the shared context is never terminated).
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=linger_ms)

    def detach(self) -> zmq.Socket[bytes]:
        """Hand the pyzmq socket over to blocking code, which owns it from now on
        (this wrapper is then closed; the socket is not). For a program that
        dials with trio and then runs a plain pyzmq loop (the benchmark engine)."""
        if self._closed:
            raise trio.ClosedResourceError(f"zmq socket {self.name!r} is closed")
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        return self._sock

    def monitor(self, events: int, *, name: str) -> TrioSocket:
        """A PAIR socket receiving this socket's monitor events (a
        :class:`MonitorEvent` mask, or ``zmq.EVENT_*`` bits). Call before any task waits on this socket. Decode messages
        with :func:`parse_monitor_event`."""
        # A unique inproc address: pyzmq's default is derived from the fd
        # number, which the next socket reuses while a lingering closed socket
        # still owns the old monitor endpoint (events then go nowhere).
        addr = f"inproc://zmqdispatch-monitor-{uuid.uuid4().hex}"
        return TrioSocket(self._sock.get_monitor_socket(events, addr), name)

    def disable_monitor(self) -> None:
        """Stop the monitor started by :meth:`monitor` (before closing it)."""
        if not self._closed:
            self._sock.disable_monitor()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed


#: Every monitor event of a connection that failed its ZMTP handshake (libzmq
#: emits one right before that connection's ``EVENT_DISCONNECTED``).
HANDSHAKE_FAILED_EVENTS = (
    MonitorEvent.HANDSHAKE_FAILED_NO_DETAIL | MonitorEvent.HANDSHAKE_FAILED_PROTOCOL
    | MonitorEvent.HANDSHAKE_FAILED_AUTH
)


def parse_monitor_event(frames: list[bytes]) -> tuple[int, int, str]:
    """``(event, value, endpoint)`` of one monitor message (libzmq 4 layout:
    frame 0 = 16-bit event id + 32-bit value, frame 1 = endpoint). For
    ``EVENT_ACCEPTED`` / ``EVENT_DISCONNECTED`` the value is the connection's fd."""
    if len(frames) != 2 or len(frames[0]) != 6:
        return 0, 0, ""
    head = frames[0]
    return (
        int.from_bytes(head[:2], "little"),
        int.from_bytes(head[2:], "little"),
        frames[1].decode("utf-8", "replace"),
    )


#: errnos of a well-formed address that cannot be used here (the rest: a bad form)
_BIND_ERRNOS = frozenset({
    errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, errno.EPERM, errno.ENODEV,
    errno.ENOENT, errno.ENOTDIR, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP,
})


def _address_error(exc: zmq.ZMQError, address: str, role: str, verb: str) -> Exception:
    message = f"{role}: cannot {verb} {address!r}: {zmq.strerror(exc.errno) if exc.errno is not None else exc}"
    if exc.errno in _BIND_ERRNOS:
        return AddressBindError(message, address=address, role=role, errno=exc.errno)
    return InvalidAddressError(message, address=address, role=role)


def _translate(exc: zmq.ZMQError, name: str) -> Exception:
    if exc.errno == errno.EHOSTUNREACH:
        return PeerUnreachable(f"{name}: peer identity not connected (EHOSTUNREACH)")
    if exc.errno == zmq.ENOTSOCK or exc.errno == zmq.ETERM:
        return trio.ClosedResourceError(f"{name}: socket closed")
    return exc
