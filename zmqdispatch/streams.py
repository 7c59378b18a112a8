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

Where they live (every name stays importable from here):
:mod:`.request_stream` (``RequestStream``, ``StreamHost``, ``EngineRequest``),
:mod:`.sample_stream` (``SampleStream``, ``open_samples``),
:mod:`.stream_group` (``StreamGroup``, ``GroupMember``, ``GroupItem``).
"""

from __future__ import annotations

from .request_stream import EngineRequest, RequestStream, StreamHost
from .request_stream import _wait_sent as _wait_sent
from .sample_stream import SampleStream
from .sample_stream import open_samples as open_samples  # the client opens samples with it
from .sample_stream import _leaves as _leaves
from .sample_stream import _unwrap as _unwrap
from .stream_group import GroupItem, GroupMember, StreamGroup

__all__ = [
    "EngineRequest",
    "GroupItem",
    "GroupMember",
    "RequestStream",
    "SampleStream",
    "StreamGroup",
    "StreamHost",
]
