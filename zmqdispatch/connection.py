"""One engine's data plane under trio: :class:`EngineConnection`.

It owns the engine's input ROUTER / output PULL pair and their monitors and runs
one task per socket or timer (``docs/trio-and-zmq.md`` §8)::

    output pump   owns PULL: recv_batch -> EngineProtocol.frames_received (sync routing);
                  at the link's pump_deadline, the link's turn (drain, hold, reconnect wait)
    input pump    owns ROUTER: EngineProtocol.pop_send -> bounded send
    silence watch sleeps until the link's next_deadline (silence with requests in flight)
    monitor       the input ROUTER's monitor: its last connection closed -> a death sign
    output watch  the PULL's monitor: the engine's output connection dropped ->
                  fail what may have been lost on it
    process watch (an engine this connection launched) exit -> a death sign
    deadlines     the per-request deadlines (one heap, one task)

Every decision is the sans-IO core's: requests and routing are
:class:`~zmqdispatch.protocol.engine.EngineProtocol`'s, liveness is
:class:`~zmqdispatch.protocol.link.EngineLink`'s; these tasks feed them events
with ``trio.current_time()`` and carry out what they decide
(:meth:`EngineConnection._act`). Sockets come from :mod:`zmqdispatch._zmq_trio`,
the only module that calls pyzmq.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable
from time import perf_counter
from typing import Any

import trio

from . import limits
from ._zmq_trio import (
    HANDSHAKE_FAILED_EVENTS,
    MonitorEvent,
    PeerUnreachable,
    SendTimeout,
    TrioSocket,
    parse_monitor_event,
)
from .errors import EngineDeadError
from .protocol.deadlines import Deadlines, DeadlineScheduler, TimedMailbox
from .protocol.engine import EngineProtocol, LinkState
from .protocol.link import EngineLink, LinkAction, LinkDecision
from .protocol.mailbox import Mailbox
from .streams import EngineRequest

__all__ = ["EngineConnection", "park", "send_slice"]

_log = logging.getLogger("zmqdispatch.client")


async def park(obj: Any, attr: str = "waiter") -> None:
    """Sleep until the sans-IO core calls ``getattr(obj, attr)()``.

    The core (mailbox, outgoing message, utility call, protocol) calls and
    clears that hook from the router or pump task; ``reschedule`` is the
    cheapest wake-up trio has (no Event per delivery).

    Cancellation: a cancel point; on cancel the hook is cleared and nothing
    else changes.
    """
    task = trio.lowlevel.current_task()
    setattr(obj, attr, lambda: trio.lowlevel.reschedule(task))

    def abort_fn(_: Any) -> trio.lowlevel.Abort:
        setattr(obj, attr, None)
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort_fn)


class EngineConnection:
    """The trio shell of one engine's data plane: its input ROUTER / output
    PULL pair and their monitors, the :class:`EngineProtocol` (requests,
    routing), the :class:`~zmqdispatch.protocol.link.EngineLink` (liveness),
    the per-request deadlines, and the tasks that run them (:meth:`start`).
    :class:`~zmqdispatch.engine.Engine` is the user-facing side of one of
    these; a client has one per engine it serves.

    Every task here owns one socket or one timer, feeds the link its events
    with ``trio.current_time()`` and acts on its decisions (:meth:`_act`).

    What the shell (:mod:`zmqdispatch.shell`) and
    :class:`~zmqdispatch.engine.Engine` use, and nothing else: :attr:`protocol`,
    :attr:`process`, :attr:`ending`, :meth:`start`, :meth:`queue_request`,
    :meth:`wait_dead`, :meth:`process_exited`, :meth:`close_link`,
    :meth:`close_client`, :attr:`on_ending`, and the link's counters
    :attr:`output_links` / :attr:`stray_output_connections`.
    """

    def __init__(
        self,
        *,
        protocol: EngineProtocol,
        link: EngineLink,
        input_sock: TrioSocket,
        output_sock: TrioSocket,
        process: trio.Process | None,
        monitor_sock: TrioSocket | None,
        output_monitor_sock: TrioSocket | None,
        send_timeout: float,
        pause_gc_while_routing: bool,
    ) -> None:
        self._protocol = protocol
        self._link = link
        self.engine_index = protocol.engine_index
        self._input = input_sock
        self._output = output_sock
        self._process = process
        self._monitor = monitor_sock
        self._output_monitor = output_monitor_sock
        self._send_timeout = send_timeout
        self._pause_gc = pause_gc_while_routing
        # The output pump's wait, bounded by the link's pump_deadline (moved
        # there by _act when an event changes it).
        self._pump_scope: trio.CancelScope | None = None
        self._dead = trio.Event()
        self._ending = trio.Event()  # set by a death sign or a death (for observers)
        #: called with the cause at the first death sign or death (a
        #: many-engine client takes the engine out of placement at once).
        self.on_ending: Callable[[EngineDeadError], None] | None = None
        # per-request deadlines: one heap, one task (_deadline_watch)
        self._deadlines = DeadlineScheduler()
        link.start(trio.current_time())

        def on_death(exc: EngineDeadError) -> None:
            self._dead.set()
            self._ending.set()
            if self.on_ending is not None:
                self.on_ending(exc)
            link.died(exc.reason)
            self._sync_pump()

        protocol.on_death = on_death

    @property
    def protocol(self) -> EngineProtocol:
        """The engine's sans-IO state (requests, routing, death)."""
        return self._protocol

    @property
    def process(self) -> trio.Process | None:
        """The engine process this connection watches (launched for this
        engine alone), or None."""
        return self._process

    @property
    def ending(self) -> trio.Event:
        """Set at the engine's first death sign or its death (wait on it; never set it)."""
        return self._ending

    @property
    def output_links(self) -> int:
        """The engine's output connections open now (ZMTP handshake done)."""
        return self._link.output_links

    @property
    def stray_output_connections(self) -> int:
        """Connections to the output socket that closed before their ZMTP
        handshake (probes, port scans): counted and ignored."""
        return self._link.stray_output_connections

    async def wait_dead(self) -> None:
        """Block until the engine is declared dead (``protocol.death`` is then set)."""
        await self._dead.wait()

    def process_exited(self, pid: int, code: int | None) -> None:
        """The engine's process exited (a process watched elsewhere: one
        launched process serving many engines): feed the link and act on its
        decision (a death sign unless the client is closing)."""
        self._act(self._link.process_exited(pid, code, trio.current_time()))

    def close_link(self) -> None:
        """Connection and process events decide nothing from now (the client
        is closing, or the engine's tasks ended). Idempotent."""
        self._link.close()

    def queue_request(self, request: EngineRequest, deadlines: Deadlines | None) -> Mailbox:
        """Register *request* (validated by the caller) and queue its ADD;
        start its *deadlines* (from :func:`effective_deadlines`). Returns its
        mailbox. Synchronous; the input pump sends the ADD.

        Raises:
            DuplicateRequestIdError / EngineDeadError: as ``EngineProtocol.submit``.
        """
        p = self._protocol
        if deadlines is None:
            mailbox, _add = p.submit(request)
        else:
            timed = TimedMailbox(self._protocol.runtime.request_id(request), p.max_pending_tokens, p, deadlines)
            mailbox, _add = p.submit(request, timed)
            self._deadlines.add(timed, trio.current_time(), p.inflight)
        # The silence watchdog measures from the first request in flight.
        inflight = p.inflight
        if inflight == 1:
            self._link.submitted(trio.current_time(), inflight)
        return mailbox

    def start(self, nursery: trio.Nursery) -> None:
        """Start the tasks (pumps, watches, deadlines) in *nursery*; they end
        when the engine is declared dead or the nursery is cancelled."""
        nursery.start_soon(self._output_pump)
        nursery.start_soon(self._input_pump)
        nursery.start_soon(self._silence_watch)
        if self._process is not None:
            nursery.start_soon(self._process_watch)
        if self._monitor is not None:
            nursery.start_soon(self._monitor_watch)
        if self._output_monitor is not None:
            nursery.start_soon(self._output_monitor_watch)
        nursery.start_soon(self._deadline_watch)

    def _act(self, decision: LinkDecision | None) -> None:
        """Carry out what the link decided (:mod:`zmqdispatch.protocol.link`),
        then move the output pump's wait to the link's new deadline."""
        if decision is not None:
            p = self._protocol
            action = decision.action
            if action is LinkAction.GONE:
                if p.state is LinkState.READY and p.gone is None:
                    _log.info("engine %d gone (%s): %s; routing the outputs it sent before (drain, at most %s s)",
                              self.engine_index, decision.reason, decision.message, self._link.drop_grace)
                    gone = EngineDeadError(decision.message, engine_index=self.engine_index, reason=decision.reason)
                    p.engine_gone(gone)
                    self._ending.set()
                    if self.on_ending is not None:
                        self.on_ending(gone)
            elif action is LinkAction.DIE:
                if p.gone is not None and decision.reason == p.gone.reason:
                    _log.info("engine %d: drain done (%d output messages received in all)", self.engine_index,
                              p.messages_received)
                p.engine_died(EngineDeadError(decision.message, engine_index=self.engine_index,
                                              reason=decision.reason))
            elif action is LinkAction.FAIL_SENT:
                p.output_lost(decision.message)
            else:  # STRAY
                _log.info("engine %d: %s", self.engine_index, decision.message)
        self._sync_pump()

    def _sync_pump(self) -> None:
        scope = self._pump_scope
        if scope is not None:
            scope.deadline = self._link.pump_deadline

    def _route(self, batch: list[list[bytes]], now: float) -> None:
        p = self._protocol
        if self._pause_gc and gc.isenabled():
            gc.disable()
            try:
                for frames in batch:
                    p.frames_received(frames, now)
            finally:
                gc.enable()
        else:
            for frames in batch:
                p.frames_received(frames, now)

    async def _route_queued(self) -> None:
        """Route every output message already queued on the socket."""
        p = self._protocol
        while p.state is LinkState.READY and (batch := self._output.recv_nowait()):
            now = trio.current_time()
            self._link.output_received(now)
            self._route(batch, now)
            await trio.lowlevel.checkpoint()

    async def _output_pump(self) -> None:
        """Own the output PULL: read and route batches until the link's
        ``pump_deadline`` (``inf`` while nothing is pending), then take the
        link's turn (``EngineLink.pump_turn``: drain after a death sign, hold
        after an output drop, wait for an output connection to come back)."""
        sock = self._output
        p = self._protocol
        link = self._link
        try:
            while p.state is LinkState.READY:
                batch = None
                with trio.CancelScope(deadline=link.pump_deadline) as self._pump_scope:
                    if link.pump_reads:
                        batch = await sock.recv_batch()  # atomic: a cancel loses nothing
                    else:
                        await trio.sleep_forever()
                self._pump_scope = None
                now = trio.current_time()
                if batch:
                    link.output_received(now)
                    self._route(batch, now)
                if link.pump_deadline <= now and p.state is LinkState.READY:
                    if link.pump_reads:
                        await self._route_queued()
                    self._act(link.pump_turn(trio.current_time(), bool(p.inflight or p.pending_utility_calls)))
        except trio.ClosedResourceError:
            return

    async def _input_pump(self) -> None:
        sock = self._input
        p = self._protocol
        timeout = self._send_timeout
        others = 0.0  # how long the rest of the loop ran while this pump last yielded mid-burst
        while p.state is LinkState.READY:
            slice_end = perf_counter() + send_slice(others)
            others = 0.0
            out = p.pop_send()
            if out is None:
                await _park_sender(p)
                continue
            try:
                # Drain what the socket takes at once (one scheduler pass per
                # burst, not per message: under heavy output an ADD per pass
                # starved admission), then the awaited send for the rest. A
                # burst also ends after its slice (send_slice): pop_send
                # encodes ADDs (tens of µs each), and a thousand of them in
                # one pass would hold the output pump (every running stream) back.
                burst = limits.SEND_BURST_LIMIT
                while sock.try_send(out.frames):
                    p.send_done(out)
                    burst -= 1
                    if not burst or perf_counter() >= slice_end:
                        out = None  # the burst is over: yield, the next pass pops on
                        break
                    out = p.pop_send()
                    if out is None:
                        break
                if out is None:
                    yielded = perf_counter()
                    await trio.lowlevel.checkpoint()
                    others = perf_counter() - yielded
                    continue
                # The socket is full: the awaited send yields and waits for
                # room (bounded by send_timeout).
                await sock.send(out.frames, timeout=timeout)
            except PeerUnreachable:
                self._act(self._link.unreachable(trio.current_time()))
                return
            except SendTimeout:
                self._act(self._link.send_timed_out(timeout))
                return
            except trio.ClosedResourceError:
                return
            p.send_done(out)

    async def _silence_watch(self) -> None:
        """Sleep until the link's next deadline (the silence watchdog), then
        let it decide."""
        p = self._protocol
        link = self._link
        while p.state is LinkState.READY:
            when = link.next_deadline()
            if when == math.inf:
                return
            now = trio.current_time()
            if now < when:
                await trio.sleep_until(when)
                continue
            self._act(link.timer_fired(now, p.inflight))

    async def _monitor_watch(self) -> None:
        """Feed the input ROUTER's connection events (zmq monitor) to the link."""
        assert self._monitor is not None
        sock = self._monitor
        link = self._link
        try:
            while self._protocol.state is LinkState.READY:
                event, value, endpoint = parse_monitor_event(await sock.recv_multipart())
                if event == MonitorEvent.ACCEPTED:
                    link.input_connected(value)
                elif event == MonitorEvent.DISCONNECTED:
                    self._act(link.input_disconnected(value, endpoint, trio.current_time()))
        except trio.ClosedResourceError:
            return

    async def _output_monitor_watch(self) -> None:
        """Feed the output PULL's connection events (zmq monitor) to the link.
        A connection that closes after its ZMTP handshake is an engine output
        link lost: libzmq closes it itself when a frame exceeds
        ``MAXMSGSIZE``, and the outputs still on it are gone. One that failed
        its handshake first (libzmq emits ``HANDSHAKE_FAILED_*`` right before
        its ``DISCONNECTED``: a probe, a port scan) is counted and ignored."""
        assert self._output_monitor is not None
        sock = self._output_monitor
        link = self._link
        try:
            while self._protocol.state is LinkState.READY:
                event, _, endpoint = parse_monitor_event(await sock.recv_multipart())
                if event == MonitorEvent.HANDSHAKE_SUCCEEDED:
                    link.output_connected()
                    self._sync_pump()
                elif event & HANDSHAKE_FAILED_EVENTS:
                    link.output_handshake_failed()
                elif event == MonitorEvent.DISCONNECTED:
                    self._act(link.output_disconnected(endpoint))
        except trio.ClosedResourceError:
            return

    async def _process_watch(self) -> None:
        assert self._process is not None
        code = await self._process.wait()
        _log.info("engine %d: launched engine process %d exited with code %s", self.engine_index,
                  self._process.pid, code)
        self.process_exited(self._process.pid, code)

    async def _deadline_watch(self) -> None:
        """The one task that enforces every request's deadlines: sleeps until
        the earliest one (``DeadlineScheduler``), fails and aborts the requests
        past theirs."""
        d = self._deadlines
        p = self._protocol
        while p.state is LinkState.READY:
            when = d.next_deadline()
            if when is None or when > trio.current_time():
                # Woken by an earlier deadline (DeadlineScheduler.waiter), or at `when`.
                with trio.move_on_at(math.inf if when is None else when):
                    await park(d)
                continue
            expired = d.pop_expired(trio.current_time())
            for mailbox, exc in expired:
                _log.warning("engine %d: %s", self.engine_index, exc)
                p.stats.deadlines_exceeded[exc.limit] = p.stats.deadlines_exceeded.get(exc.limit, 0) + 1
                p.abort_mailbox(mailbox, exc)
            await trio.lowlevel.checkpoint()

    def close_client(self) -> int:
        """The client is closing: stop the link, fail every live request of this
        engine with ``EngineDeadError(reason="closed")`` (streams still held by
        other tasks would otherwise keep decoding, docs/known-failures.md K7),
        hand their ABORT to the socket without waiting, and mark the engine
        dead. Returns how many requests were live. Never blocks."""
        p = self._protocol
        self._link.close()
        live = p.live_request_ids()
        closed = EngineDeadError("the engine client is closed", engine_index=p.engine_index, reason="closed")
        p.abort(live, error=closed)
        self._flush_aborts_nowait()
        p.engine_died(closed)
        return len(live)

    def _flush_aborts_nowait(self) -> None:
        """At shutdown: hand the pending ABORT frame to the socket without
        waiting (the input socket then lingers briefly to deliver it). Queued
        ADDs are not sent: nobody would read their outputs."""
        p = self._protocol
        if p.state is not LinkState.READY or not p.pending_abort_ids:
            return
        out = p.pop_send()  # pending aborts always come first
        if out is None:
            return
        try:
            if self._input.try_send(out.frames):
                p.send_done(out)
        except (PeerUnreachable, trio.ClosedResourceError, trio.BusyResourceError):
            pass


def send_slice(others: float) -> float:
    """Seconds the input pump may work in its next scheduler pass.

    ``limits.SEND_SLICE_SECONDS``, or ``limits.SEND_SLICE_SHARE`` of *others*
    (how long the rest of the event loop ran while the pump last yielded in
    the middle of a burst) when that is more: when passes are long anyway (the
    output pump routing a saturated engine's batches), admission keeps pace
    with them instead of sending a millisecond's worth per long pass, and
    still holds every other task back by at most that share.
    """
    return max(limits.SEND_SLICE_SECONDS, limits.SEND_SLICE_SHARE * others)


async def _park_sender(p: EngineProtocol) -> None:
    """Sleep until the protocol has something to send (or died)."""
    if p.wants_send or p.state is not LinkState.READY:
        await trio.lowlevel.checkpoint()
        return
    await park(p, "send_waiter")
