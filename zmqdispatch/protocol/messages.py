"""Sans-IO: what an engine link hands its I/O shell, shared by
:class:`~.engine.EngineProtocol` and its output routing (:mod:`.routing`):
the link's :class:`LinkState`, one queued multipart message
(:class:`Outgoing`) and where it is (:class:`SendState`), a pending utility
call (:class:`PendingUtilityCall`). The shell parks on their ``waiter`` hooks;
the link settles them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["LinkState", "Outgoing", "PendingUtilityCall", "SendState"]


class LinkState(enum.Enum):
    """Lifecycle of an engine link after the handshake."""

    READY = "READY"
    DEAD = "DEAD"


class SendState(enum.Enum):
    """Where an outgoing message is."""

    QUEUED = "queued"  # in the outbox
    SENDING = "sending"  # taken by the input pump, may be on the wire
    SENT = "sent"  # accepted by the socket
    CANCELLED = "cancelled"  # dropped before it was sent (aborted ADD)
    FAILED = "failed"  # the engine died first
    REJECTED = "rejected"  # an ADD whose request could not be encoded (``Outgoing.error``): never sent


@attrs.define(slots=True, eq=False)
class Outgoing:
    """One multipart message for the input ROUTER: ``[identity, type, payload, *aux]``.

    ``waiter`` (set by the shell) is called once when ``state`` leaves
    QUEUED/SENDING. An ADD is queued as ``[identity, type]`` with its
    ``request`` and completed by :meth:`.engine.EngineProtocol.pop_send` (which
    encodes it, or settles it REJECTED with ``error`` set).
    """

    frames: list[bytes]
    request_id: str | None = None
    state: SendState = SendState.QUEUED
    waiter: Callable[[], None] | None = None
    request: Any = None  # an ADD's request, until pop_send encodes it
    error: BaseException | None = None  # why a REJECTED ADD was not sent

    def settle(self, state: SendState) -> None:
        """:class:`~.engine.EngineProtocol`: the message reached its final *state*; wake its waiter."""
        self.state = state
        w = self.waiter
        if w is not None:
            self.waiter = None
            w()


@attrs.define(slots=True, eq=False)
class PendingUtilityCall:
    """A pending utility call; ``done`` flips once, then ``result`` or ``error`` is set."""

    call_id: int
    method: str
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    waiter: Callable[[], None] | None = None

    def settle(self) -> None:
        """:class:`~.engine.EngineProtocol`: the call is done (``result`` or ``error`` set); wake its waiter."""
        self.done = True
        w = self.waiter
        if w is not None:
            self.waiter = None
            w()
