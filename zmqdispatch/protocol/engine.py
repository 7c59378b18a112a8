"""Sans-IO state of one engine link: request table, outbox, aborts, death
(the messages it queues and their states: :mod:`.messages`; how received
outputs are routed: :mod:`.routing`).

:class:`EngineProtocol` never touches zmq or trio. The I/O shell
(:mod:`zmqdispatch.client`) feeds it received frames and carries out what it
queues; every state transition is a synchronous method call, so the rules
below are testable in microseconds without sockets:

- **Admission.** :meth:`submit` refuses a live duplicate ``request_id`` (the
  real engine asserts and dies on one) and anything after death. It registers
  the request and queues its ADD without encoding it: the ADD is encoded when
  :meth:`pop_send` hands it to the input pump (tens of microseconds per
  request, so a thousand requests entering at once would otherwise hold the
  event loop, and the output routing, for tens of milliseconds). A request
  that cannot be encoded (rare: validation runs first) is never sent: its
  stream fails with :class:`~zmqdispatch.errors.RequestRejected`.
- **Engine-side ids.** A request travels under its own ``request_id`` unless
  the engine may still hold something under that id: outputs of an aborted
  predecessor still in flight (nothing on the wire marks their end), a
  TokenSpeed parked ABORT, or another live request's engine-side id (SGLang:
  also a live id that is a prefix of it, or that it is a prefix of). Then it
  gets a fresh engine-side id ``<request_id>~<n>`` (SGLang ``~<n>~<request_id>``,
  which no live id prefixes; vLLM: the caller's id in
  ``external_req_id``, as vLLM's own front end suffixes ids); its stream still
  reports ``request_id``, and late outputs of the old one are dropped as
  unknown instead of reaching it.
- **Routing** (:mod:`.routing`, the base class :class:`~.routing.OutputRouting`).
  :meth:`frames_received` decodes one output message and routes
  each ``EngineCoreOutput`` to its :class:`~.mailbox.Mailbox` without waiting;
  terminal outputs, ids in ``finished_requests`` and slow consumers retire
  their entry. Outputs for unknown ids (normal after an abort) are counted and
  dropped.
- **Aborts** are synchronous and idempotent (:meth:`abort`): an ADD still in
  the outbox is simply never sent; an ADD already handed to the socket gets
  its id added to one batched ABORT frame, which is sent before anything
  queued later (so a resubmitted id is never killed by its old ABORT).
  vLLM sends no final output after a client ABORT, so the entry is retired
  locally at once.
- **Death** (:meth:`engine_died`): the ``ENGINE_CORE_DEAD`` sentinel, a streak
  of undecodable messages, or a fact the shell observed (process exit,
  EHOSTUNREACH, send timeout, silence). Every open stream and utility call
  fails with one typed :class:`~zmqdispatch.errors.EngineDeadError`; new
  requests are refused with it; pending aborts are dropped (the engine is gone),
  their ids kept in :meth:`possibly_live_ids` for a resumed link to ABORT.

- **Runtime.** The link speaks one engine dialect (:class:`~.runtime.Runtime`):
  vLLM 0.32.0 / 0.33.0 EngineCore (``docs/vllm-wire.md`` §5) or TokenSpeed
  0.1.1's scheduler (``docs/tokenspeed-wire.md`` §1). A request of the other
  dialect is refused (:class:`~zmqdispatch.errors.RuntimeMismatchError`).
  TokenSpeed specifics absorbed here: an unrequested terminal ``"abort"`` fails
  the stream with :class:`~zmqdispatch.errors.EngineAbortedRequest`; no utility
  calls; an ABORT that reached the engine after the request finished is parked
  there for 300 s and would silently kill a reuse of the id, so a reuse within
  that time travels under a fresh engine-side id
  (:data:`zmqdispatch.limits.TOKENSPEED_ABORT_PARK_SECONDS`);
  the latest piggybacked load snapshot is kept in :attr:`EngineProtocol.load`.
  SGLang specifics (``docs/sglang.md``): utility calls travel as CONTROL
  ``[call_id, method, args]`` and are answered by a ``ControlReplySlim``; an
  unrequested terminal ``"abort"`` fails the stream with its reason; the
  scheduler aborts by rid *prefix*, so an ABORT of ``X`` would also stop a
  live ``X...``: a link keeps its live engine-side ids prefix-free (no live id
  is a prefix of another), and a request whose id would break that travels
  under a fresh id ``~<n>~<request_id>`` ("Engine-side ids"; another first
  character than ``~`` if ``"~"`` itself is live), so an ABORT
  stops exactly the request it names.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from .. import limits
from ..errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    RemoteProtocolError,
    RequestRejected,
    RequestStreamClosed,
    UnsupportedByRuntimeError,
)
from ..wire import sglang as sg
from ..wire import tokenspeed as ts
from ..wire import vllm as wire
from .mailbox import Mailbox
from .messages import LinkState, Outgoing, PendingUtilityCall, SendState
from .routing import OutputRouting
from .routing import _preview as _preview  # importable from here as well
from .runtime import Runtime
from .stats import LinkStats

__all__ = ["EngineProtocol", "Outgoing", "SendState", "PendingUtilityCall", "LinkState", "Runtime"]

_ADD = bytes([wire.RequestType.ADD])
_ABORT = bytes([wire.RequestType.ABORT])
_UTILITY = bytes([wire.RequestType.UTILITY])
_CONTROL = sg.RequestType.CONTROL.frame

_log = logging.getLogger("zmqdispatch.protocol")
_DEBUG = logging.DEBUG


class EngineProtocol(OutputRouting):
    """Pure per-engine state. One instance per handshaken engine.

    Args:
        engine_index: the engine's DP rank (its identity's integer value).
        identity: the engine's ZMQ routing identity (2 bytes little-endian).
        max_pending_tokens: per-stream backlog bound (see :class:`Mailbox`).
        max_decode_errors: consecutive undecodable messages that mean death.
        runtime: the engine dialect (:class:`Runtime`); requests must match it.
        clock: monotonic seconds (TokenSpeed's parked-abort window); injectable
            for tests.
        timer: seconds, for submit times (statistics, deadlines); the shell
            passes its event loop's clock. Receipt times of outputs are the
            ``now`` argument of :meth:`frames_received`.
    """

    def __init__(
        self,
        *,
        engine_index: int = 0,
        identity: bytes = b"\x00\x00",
        max_pending_tokens: int = limits.DEFAULT_MAX_PENDING_TOKENS,
        max_decode_errors: int = limits.DEFAULT_MAX_DECODE_ERRORS,
        runtime: Runtime = Runtime.VLLM,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self._clock = clock
        self.timer = timer
        #: receipt time of the output message being routed (``frames_received``)
        self.now = 0.0
        #: counters and latency histograms (``zmqdispatch.metrics.EngineStats``)
        self.stats = LinkStats()
        self.engine_index = engine_index
        self.identity = identity
        self.max_pending_tokens = max_pending_tokens
        self.max_decode_errors = max_decode_errors
        self.state = LinkState.READY
        self.death: EngineDeadError | None = None
        # a death sign seen, the death not yet declared (engine_gone)
        self.gone: EngineDeadError | None = None
        # engine-side id -> mailbox (its ADD in .add, the caller's id in .request_id)
        self._requests: dict[str, Mailbox] = {}
        # caller's id -> engine-side id, for live requests sent under a fresh id
        # (entries of retired ones are dropped when next looked at: _live)
        self._renamed: dict[str, str] = {}
        # engine-side ids this link aborted, most recent last (MAX_ABORTED_IDS)
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._wire_seq = itertools.count(1)
        # SGLang: the engine-side ids submitted, sorted (retired ones are dropped
        # when next met, or in a sweep): finds the live ids a new one prefixes
        self._wire_sorted: list[str] = []
        self._outbox: deque[Outgoing] = deque()
        self._pending_aborts: dict[str, None] = {}
        self._utility: dict[int, PendingUtilityCall] = {}
        self._call_ids = itertools.count(1)
        #: called (by us) whenever there is something new to send; set by the shell.
        self.send_waiter: Callable[[], None] | None = None
        #: called once when the link dies; set by the shell.
        self.on_death: Callable[[EngineDeadError], None] | None = None
        #: called with a request's mailbox as it leaves the request table
        #: (finished, failed, aborted; not at death: the death is one event);
        #: set by a many-engine shell (placement counts). Once per request.
        self.on_retired: Callable[[Mailbox], None] | None = None
        #: called with a load report before the rows of the message carrying it:
        #: ``(scheduler_stats map, EngineCoreOutputs.timestamp)`` (vLLM, with
        #: log_stats) or ``(LoadSnapshot, None)`` (TokenSpeed); set by a
        #: many-engine shell (placement).
        self.on_load: Callable[[Any, float | None], None] | None = None
        # counters (observability; read-only for callers)
        self.unknown_outputs = 0
        self.decode_errors = 0
        self.decode_error_streak = 0
        self.messages_received = 0
        self.aborts_sent = 0
        self.bad_rows = 0
        self.unknown_finish_reasons = 0
        self.renamed_requests = 0  # requests sent under a fresh engine-side id
        self.last_decode_error: RemoteProtocolError | None = None
        #: TokenSpeed: the newest load snapshot piggybacked on an output batch.
        self.load: ts.LoadSnapshot | sg.SGLangLoad | None = None
        # TokenSpeed: request id -> monotonic time until which the engine holds a
        # parked ABORT for it (oldest first; bounded by MAX_PARKED_ABORT_IDS).
        self._parked: OrderedDict[str, float] = OrderedDict()
        # Ids the engine may still run once this link is gone (EngineSession.orphan_ids).
        self.output_drops = 0  # output connections lost (output_lost)
        self._abort_in_flight: tuple[Outgoing, list[str]] | None = None  # popped ABORT, not yet accepted
        self._orphans: list[str] = []  # snapshot of possibly_live_ids() at death

    def __repr__(self) -> str:
        return (
            f"<EngineProtocol engine={self.engine_index} {self.state.value}"
            f" inflight={len(self._requests)} dead={self.state is LinkState.DEAD}>"
        )

    # ------------------------------------------------------------------ queries

    @property
    def inflight(self) -> int:
        """Number of live requests (ADD queued or sent, no terminal output yet)."""
        return len(self._requests)

    @property
    def pending_utility_calls(self) -> int:
        """Utility calls awaiting a reply."""
        return len(self._utility)

    def live_request_ids(self) -> list[str]:
        """Ids (``request_id``) of every live request, in submission order."""
        return [mb.request_id for mb in self._requests.values()]

    def is_live(self, request_id: str) -> bool:
        """True while *request_id* is registered on this link."""
        return self._live(request_id) is not None

    def wire_id(self, request_id: str) -> str | None:
        """The id the engine knows live request *request_id* by (usually the
        same; see "Engine-side ids" in the module doc), or ``None``."""
        mb = self._live(request_id)
        return None if mb is None else mb.wire_id

    def _live(self, request_id: str) -> Mailbox | None:
        """The live mailbox of the caller's *request_id*, or ``None``."""
        renamed = self._renamed
        if renamed:
            wire_id = renamed.get(request_id)
            if wire_id is not None:
                mb = self._requests.get(wire_id)
                if mb is not None and mb.request_id == request_id:
                    return mb
                del renamed[request_id]  # that request retired
        mb = self._requests.get(request_id)
        return mb if mb is not None and mb.request_id == request_id else None

    @property
    def wants_send(self) -> bool:
        """True when :meth:`pop_send` would return a message."""
        return bool(self._outbox) or bool(self._pending_aborts)

    # ------------------------------------------------------------------ submit / abort

    @property
    def accepts_requests(self) -> bool:
        """True while the link is READY and no death sign was seen."""
        return self.state is LinkState.READY and self.gone is None

    def check_alive(self) -> None:
        """Raise a fresh :class:`EngineDeadError` if the engine is dead, or
        gone (:meth:`engine_gone`) with its death not yet declared."""
        d = self.death or self.gone
        if d is not None:
            raise EngineDeadError(str(d), engine_index=d.engine_index, reason=d.reason)

    def submit(self, request: Any, mailbox: Mailbox | None = None) -> tuple[Mailbox, Outgoing]:
        """Register *request* and queue its ADD.

        The caller must have validated the request (:mod:`.checks`, or
        :meth:`Runtime.check_request`).

        Args:
            request: a ``wire.vllm.EngineCoreRequest`` on a vLLM link, a
                ``wire.tokenspeed.TokenizedGenerateReqInput`` on a TokenSpeed link.

        Returns:
            the request's mailbox and its queued ADD message.

        The request goes out under its own id unless the engine may still hold
        something under it (module doc, "Engine-side ids"); then under a fresh
        one, ``Mailbox.wire_id``. Either way the mailbox and its deltas carry
        the caller's ``request_id``.

        The ADD is encoded later, by :meth:`pop_send`. If the request cannot be
        encoded then (e.g. an int beyond 64 bits, a schema nested too deep for
        the encoder), it is retired, its mailbox fails with
        :class:`~zmqdispatch.errors.RequestRejected`, and the ADD settles
        ``REJECTED`` with that error in ``Outgoing.error``; nothing is sent.

        Raises:
            EngineDeadError: the engine is dead.
            RuntimeMismatchError: the request is for the other runtime.
            DuplicateRequestIdError: the id is live on this link.
        """
        self.check_alive()
        runtime = self.runtime
        runtime.check_type(request)
        rid = runtime.request_id(request)
        self.check_request_id(rid)
        wire_id = rid
        sglang = runtime is Runtime.SGLANG
        held = self._held_by_engine(rid)
        if held or (sglang and self._prefix_clash(rid)):
            wire_id = self._fresh_wire_id(rid)
            request = runtime.with_request_id(request, wire_id)
        out = Outgoing([self.identity, _ADD], wire_id, request=request)
        mb = mailbox if mailbox is not None else Mailbox(rid, self.max_pending_tokens)
        mb.add = out
        mb.wire_id = wire_id
        if wire_id is not rid:
            self._add_renamed(rid, wire_id, held)
        self._requests[wire_id] = mb
        if sglang:
            self._add_sorted(wire_id)
        self._outbox.append(out)
        self.stats.submitted(wire_id, mb, self.timer(), len(self._requests))
        if _log.isEnabledFor(_DEBUG):
            _log.debug("request %r: submitted to engine %d%s", rid, self.engine_index,
                       "" if wire_id is rid else f" as {wire_id!r}")
        self._wake_sender()
        return mb, out

    def check_request_id(self, request_id: str) -> None:
        """Refuse an id that is live on this link.

        Raises:
            DuplicateRequestIdError: it is (the engine would die, or mix streams).
        """
        if self._live(request_id) is not None:
            raise DuplicateRequestIdError(
                f"request_id {request_id!r} is already live on engine {self.engine_index}; "
                + ("vLLM's scheduler would abort the whole engine on a duplicate" if self.runtime is Runtime.VLLM
                   else f"the {self.runtime.engine_name} does not check ids: both streams would mix"),
                request_id=request_id,
                field="request_id",
            )

    def _add_renamed(self, request_id: str, wire_id: str, held: bool) -> None:
        renamed = self._renamed
        if len(renamed) >= 2 * len(self._requests) + 64:
            # Entries of retired requests are dropped lazily (_live); sweep them
            # here too, so the map stays O(live requests), amortized O(1).
            requests = self._requests
            self._renamed = renamed = {
                u: w for u, w in renamed.items() if (mb := requests.get(w)) is not None and mb.request_id == u
            }
        renamed[request_id] = wire_id
        self.renamed_requests += 1
        if held:
            _log.warning(
                "request %r: sent to engine %d as %r (the engine may still hold outputs or an ABORT under its id)",
                request_id, self.engine_index, wire_id,
            )
        else:  # routine with ids such as "1" and "10"
            _log.info("request %r: sent to engine %d as %r (SGLang aborts by rid prefix, and a live rid and this "
                      "one prefix each other)", request_id, self.engine_index, wire_id)

    def _held_by_engine(self, wire_id: str) -> bool:
        """May the engine still hold something under *wire_id*: a live request
        (another caller id's engine-side id), outputs of an aborted request
        still in flight, or a TokenSpeed parked ABORT?"""
        if wire_id in self._requests or wire_id in self._aborted:
            return True
        return bool(self._parked) and self._is_parked(wire_id)

    def _fresh_wire_id(self, request_id: str) -> str:
        if self.runtime is Runtime.SGLANG:
            # Not under the caller's id: a live id that prefixes it would prefix this
            # one too. ``~<n>~`` heads differ before their second ``~``: prefix-free.
            # Only a live id of the head alone prefixes every candidate: then another head.
            head = next(c for c in itertools.chain("~#%", map(chr, itertools.count(0x100)))
                        if c not in self._requests)
            while True:
                wire_id = f"{head}{next(self._wire_seq)}~{request_id}"
                if not self._held_by_engine(wire_id) and not self._prefix_clash(wire_id):
                    return wire_id
        while True:
            wire_id = f"{request_id}~{next(self._wire_seq)}"
            if not self._held_by_engine(wire_id):
                return wire_id

    def _prefix_clash(self, wire_id: str) -> bool:
        """SGLang: would *wire_id* prefix a live engine-side id, or a live one
        prefix it (an ABORT of the one would stop the other)?

        The live ids starting with *wire_id* follow it in sorted order. As the
        live ids are prefix-free, one that prefixes it is its nearest live
        predecessor: any id sorted between a prefix and *wire_id* starts with
        that prefix. O(log(live)) plus the retired entries met (dropped)."""
        requests = self._requests
        ids = self._wire_sorted
        i = bisect.bisect_left(ids, wire_id)
        while i < len(ids) and ids[i].startswith(wire_id):
            if ids[i] in requests:
                return True
            del ids[i]  # retired
        while i > 0:
            i -= 1
            before = ids[i]
            if before in requests:
                return wire_id.startswith(before)
            del ids[i]
        return False

    def _add_sorted(self, wire_id: str) -> None:
        ids = self._wire_sorted
        if len(ids) >= 2 * len(self._requests) + 64:
            ids[:] = sorted(self._requests)  # drop the retired ones; includes wire_id
            return
        bisect.insort(ids, wire_id)

    def _queue_abort(self, wire_id: str) -> None:
        """Put *wire_id* in the next ABORT frame and remember it as aborted
        (its late outputs may still come: a reuse gets a fresh id)."""
        self._pending_aborts[wire_id] = None
        aborted = self._aborted
        aborted.pop(wire_id, None)
        aborted[wire_id] = None
        if len(aborted) > limits.MAX_ABORTED_IDS:
            aborted.popitem(last=False)

    def abort(self, request_ids: Iterable[str], error: BaseException | None = None) -> None:
        """Retire live requests and make sure the engine stops them.

        A consumer still reading one of them gets *error* (default
        :class:`~zmqdispatch.errors.RequestStreamClosed`) after any tokens
        already delivered, so nobody waits on a request that will never
        finish. Synchronous, idempotent, never raises: unknown or finished ids
        are ignored. Safe to call from a cancelled task's cleanup.
        """
        woke = False
        for rid in request_ids:
            mb = self._live(rid)
            if mb is None:
                continue
            del self._requests[mb.wire_id]
            if self.on_retired is not None:
                self.on_retired(mb)
            mb.fail(
                error if error is not None else RequestStreamClosed(f"request {rid!r} was aborted", request_id=rid)
            )
            self.stats.aborted(mb.wire_id)
            if _log.isEnabledFor(_DEBUG):
                _log.debug("request %r: aborted%s", rid, "" if error is None else f" ({error})")
            if mb.add.state is SendState.QUEUED:
                mb.add.request = None
                mb.add.settle(SendState.CANCELLED)  # never reaches the engine
            elif self.state is LinkState.READY:
                self._queue_abort(mb.wire_id)
                woke = True
        if woke:
            self._wake_sender()

    def _is_parked(self, wire_id: str) -> bool:
        """Does TokenSpeed hold a parked ABORT for *wire_id* (expired ones dropped)?"""
        now = self._clock()
        parked = self._parked
        while parked:
            oldest, until = next(iter(parked.items()))
            if until > now:
                break
            del parked[oldest]
        return wire_id in parked

    def _note_parked(self, rid: str) -> None:
        parked = self._parked
        parked.pop(rid, None)
        parked[rid] = self._clock() + limits.TOKENSPEED_ABORT_PARK_SECONDS
        if len(parked) > limits.MAX_PARKED_ABORT_IDS:
            parked.popitem(last=False)

    def abort_mailbox(self, mailbox: Mailbox, error: BaseException | None = None) -> None:
        """Abort the request that owns *mailbox*, if it is still live (its
        consumer gets *error*, as with :meth:`abort`).

        Unlike :meth:`abort` by id, a stream that outlived its request can
        never abort a newer request that reuses the id.
        """
        if self._requests.get(mailbox.wire_id) is mailbox:
            self.abort((mailbox.request_id,), error)

    def _wake_sender(self) -> None:
        w = self.send_waiter
        if w is not None:
            self.send_waiter = None
            w()

    # ------------------------------------------------------------------ outbound

    def pop_send(self) -> Outgoing | None:
        """Next message for the input ROUTER, or ``None``.

        Pending aborts go first, as one batched ABORT frame; then the outbox
        (ADDs and utility calls) in submission order. An ADD is encoded here
        (see :meth:`submit`); one that cannot be is settled ``REJECTED`` and
        skipped. Aborts first is always
        safe and sometimes required: an id is only in the pending set once
        its ADD was handed to the socket (the pump sends one message at a
        time, so that send has completed), and a request resubmitted with the
        same id after an abort must reach the engine *after* that ABORT, or
        the ABORT would kill the new request.
        The returned message is in state SENDING until :meth:`send_done` /
        :meth:`engine_died`.
        """
        if self._pending_aborts:
            ids = list(self._pending_aborts)
            self._pending_aborts.clear()
            self.aborts_sent += len(ids)
            abort = Outgoing([self.identity, _ABORT, wire.encode_abort(ids)], state=SendState.SENDING)
            self._abort_in_flight = (abort, ids)
            return abort
        while self._outbox:
            out = self._outbox.popleft()
            if out.state is SendState.QUEUED:
                if out.request is not None and not self._encode_add(out):
                    continue
                out.state = SendState.SENDING
                return out
        return None

    def _encode_add(self, out: Outgoing) -> bool:
        """Complete a queued ADD's frames; False (and the request retired,
        its stream failed) when its request cannot be encoded."""
        request, out.request = out.request, None
        runtime = self.runtime
        try:
            out.frames += runtime.encode_add(request)
        except Exception as exc:  # never out of the input pump: this request fails alone
            mb = self._requests.get(out.request_id) if out.request_id is not None else None
            if mb is None or mb.add is not out:
                mb = None
            rid = mb.request_id if mb is not None else runtime.request_id(request)
            error = RequestRejected(
                str(exc) if isinstance(exc, RequestRejected)
                else f"request cannot be encoded for the {runtime.engine_name}: {exc!r}",
                request_id=rid,
            )
            error.__cause__ = exc
            if mb is not None:
                del self._requests[mb.wire_id]
                if self.on_retired is not None:
                    self.on_retired(mb)
                mb.fail(error)
            out.error = error
            out.settle(SendState.REJECTED)
            return False
        return True

    def send_done(self, out: Outgoing) -> None:
        """The socket accepted *out*."""
        if self._abort_in_flight is not None and self._abort_in_flight[0] is out:
            self._abort_in_flight = None
        out.settle(SendState.SENT)

    @property
    def pending_abort_ids(self) -> list[str]:
        """Ids waiting to be sent in the next ABORT frame."""
        return list(self._pending_aborts)

    def possibly_live_ids(self) -> list[str]:
        """Ids the engine may still be running although nobody will read them
        once this link is gone: requests whose ADD reached the socket and that
        got no final output, plus ids whose ABORT was not accepted by the
        socket yet. After death: the snapshot taken when the link died (its
        pending ABORTs were dropped). At most ``limits.MAX_ORPHAN_IDS``, the
        most recent kept. :class:`~zmqdispatch.client.EngineSession` carries
        them, and a resumed link ABORTs them first (:meth:`abort_stale`)."""
        if self.state is LinkState.DEAD:
            return list(self._orphans)
        ids: dict[str, None] = dict.fromkeys(self._abort_in_flight[1] if self._abort_in_flight else ())
        ids.update(self._pending_aborts)
        for rid, entry in self._requests.items():
            if entry.add.state is SendState.SENT or entry.add.state is SendState.SENDING:
                ids[rid] = None
        return list(ids)[-limits.MAX_ORPHAN_IDS:]

    def abort_stale(self, request_ids: Iterable[str]) -> None:
        """Queue an ABORT for ids a previous link left possibly running on this
        engine (a resumed session's ``orphan_ids``). Like every pending ABORT it
        goes out before any ADD or utility call queued later, and a new request
        reusing one of the ids travels under a fresh engine-side id, so neither
        the ABORT (which TokenSpeed parks for an id it no longer runs) nor late
        outputs can touch it. Ids live on this link are skipped. At most
        ``limits.MAX_ORPHAN_IDS`` (the most recent) are kept."""
        if self.state is not LinkState.READY:
            return
        stale = [rid for rid in request_ids if rid not in self._requests]
        tokenspeed = self.runtime is Runtime.TOKENSPEED
        for rid in stale[-limits.MAX_ORPHAN_IDS:]:
            self._queue_abort(rid)
            if tokenspeed:
                # If the request already finished there, TokenSpeed parks this
                # ABORT and would silently kill a request sent under this id.
                self._note_parked(rid)
        if stale:
            self._wake_sender()

    def output_lost(self, message: str) -> None:
        """The engine's output connection dropped (libzmq closes it for a frame
        above ``MAXMSGSIZE``, or it broke): whatever was on it is lost. Fail
        every request whose ADD may have reached the engine and every pending
        utility call with :class:`RemoteProtocolError` (*message* says why)
        and abort the requests on the engine. The link stays up (the engine's
        PUSH reconnects); requests still queued are unaffected."""
        if self.state is not LinkState.READY:
            return
        self.output_drops += 1
        _log.warning("engine %d: %s; failing %d requests and %d utility calls", self.engine_index, message,
                     sum(1 for e in self._requests.values() if e.add.state is not SendState.QUEUED),
                     len(self._utility))
        woke = False
        for rid, entry in list(self._requests.items()):
            if entry.add.state is SendState.QUEUED:
                continue
            del self._requests[rid]
            if self.on_retired is not None:
                self.on_retired(entry)
            entry.fail(RemoteProtocolError(f"request {entry.request_id!r}: {message}"))
            self._queue_abort(rid)
            woke = True
        calls = self._utility
        self._utility = {}
        for call in calls.values():
            call.error = RemoteProtocolError(f"utility call {call.method!r}: {message}")
            call.settle()
        if woke:
            self._wake_sender()

    # ------------------------------------------------------------------ utility calls

    def start_utility(self, method: str, args: Iterable[Any] = (), *, client_index: int = 0) -> PendingUtilityCall:
        """Queue a UTILITY call ``[client_index, call_id, method, args]`` (SGLang: a
        CONTROL ``[call_id, method, args]``; *client_index* is not sent).

        Raises:
            EngineDeadError: the engine is dead.
            UnsupportedByRuntimeError: the runtime has no utility calls (TokenSpeed).
        """
        if not self.runtime.supports_utility_calls:
            raise UnsupportedByRuntimeError(
                f"utility call {method!r}: the {self.runtime.engine_name}'s wire has no utility calls "
                "(only ADD and ABORT)",
                runtime=self.runtime.value,
            )
        self.check_alive()
        call = PendingUtilityCall(next(self._call_ids), method)
        if self.runtime is Runtime.SGLANG:
            frames = [self.identity, _CONTROL, sg.encode_control(call.call_id, method, list(args))]
        else:
            frames = [self.identity, _UTILITY, wire.encode_utility_call(client_index, call.call_id, method, list(args))]
        self._utility[call.call_id] = call
        self._outbox.append(Outgoing(frames))
        self._wake_sender()
        return call

    def forget_utility(self, call: PendingUtilityCall) -> None:
        """Stop waiting for *call* (timeout or cancellation); a late reply is dropped."""
        self._utility.pop(call.call_id, None)

    # ------------------------------------------------------------------ death

    def engine_gone(self, exc: EngineDeadError) -> None:
        """A sign that the engine is gone which may come before its last
        outputs are read (its input connection closed, its process exited).
        From now on new requests and utility calls are refused with *exc*
        (:meth:`check_alive`); open requests keep receiving what the engine
        sent until :meth:`engine_died` (the caller's to call, with *exc* or a
        cause found in those outputs). Idempotent: the first sign wins."""
        if self.state is LinkState.READY and self.gone is None:
            self.gone = exc

    def engine_died(self, exc: EngineDeadError) -> None:
        """Mark the link dead and fail everything open with *exc*. Idempotent:
        the first cause wins."""
        if self.state is LinkState.DEAD:
            return
        self._orphans = self.possibly_live_ids()  # before the tables are cleared
        self.state = LinkState.DEAD
        self.death = exc
        deaths = self.stats.deaths
        deaths[exc.reason] = deaths.get(exc.reason, 0) + 1
        self.stats.forget_all()
        lost = len(self._requests), len(self._utility)
        if exc.reason == "closed":
            _log.info("engine %d: link closed (%d requests and %d utility calls failed, %d possibly left running)",
                      self.engine_index, *lost, len(self._orphans))
        else:
            _log.log(
                logging.WARNING if any(lost) else logging.INFO,
                "engine %d dead (reason %s): %s; %d requests and %d utility calls failed, %d possibly left running",
                self.engine_index, exc.reason, exc, *lost, len(self._orphans),
            )
        requests = self._requests
        self._requests = {}
        for entry in requests.values():
            entry.fail(EngineDeadError(str(exc), engine_index=exc.engine_index, reason=exc.reason))
            if entry.add.state in (SendState.QUEUED, SendState.SENDING):
                entry.add.settle(SendState.FAILED)
        for out in self._outbox:
            if out.state is SendState.QUEUED:
                out.settle(SendState.FAILED)
        self._outbox.clear()
        self._pending_aborts.clear()
        calls = self._utility
        self._utility = {}
        for call in calls.values():
            call.error = EngineDeadError(str(exc), engine_index=exc.engine_index, reason=exc.reason)
            call.settle()
        self._wake_sender()
        if self.on_death is not None:
            self.on_death(exc)
