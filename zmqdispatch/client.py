"""The trio shell around :class:`~zmqdispatch.protocol.engine.EngineProtocol`.

:func:`connect` is an async context manager whose nursery owns one engine's
sockets (vLLM's topology, which TokenSpeed's direct wire shares: the client
binds, the engine dials in)::

    handshake ROUTER (bind) <- engine DEALER   HELLO / INIT / READY, then closed
    input     ROUTER (bind) <- engine DEALER   ready response, then ADD/ABORT/UTILITY
    output    PULL   (bind) <- engine PUSH     EngineCoreOutputs, ENGINE_CORE_DEAD

Task tree inside the nursery (one owner task per socket, ``docs/trio-and-zmq.md`` §8)::

    output pump   owns PULL: recv_batch -> EngineProtocol.frames_received (sync routing);
                  at the link's pump_deadline, the link's turn (drain, hold, reconnect wait)
    input pump    owns ROUTER: EngineProtocol.pop_send -> bounded send
    silence watch sleeps until the link's next_deadline (silence with requests in flight)
    monitor       the input ROUTER's monitor: its last connection closed -> a death sign
    output watch  the PULL's monitor: the engine's output connection dropped ->
                  fail what may have been lost on it
    process watch (engines we spawned) exit -> a death sign

When the engine is gone, dead or only its output connection lost is decided by
the sans-IO :class:`~zmqdispatch.protocol.link.EngineLink`: these tasks feed it
their events and act on its decisions (``EngineConnection._act``); the startup
handshake is :class:`~zmqdispatch.protocol.handshake.Handshake`, driven by
``_handshake``. :class:`EngineConnection` is one engine's data plane (socket
pair, pumps, ``EngineProtocol``, ``EngineLink``); :class:`EngineClient` the
user-facing side of it.

Per-request streams are *not* tasks: :meth:`EngineClient.generate` returns a
:class:`~zmqdispatch.streams.RequestStream` (``generate_samples`` and
``stream_group`` the other two shapes, all in ``streams.py``, which reach the
client only through its :class:`_StreamHost`), an ``async with`` context manager and async iterator
over :class:`~zmqdispatch.protocol.mailbox.OutputDelta`. Leaving it before the
final output aborts the request on the engine, synchronously, so it works even
when the exit is a cancellation (an ``await`` in a cancelled scope would raise
``Cancelled`` and lose the ABORT; ``docs/known-failures.md`` K7).
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from time import perf_counter
from typing import Any

import attrs
import trio
import zmq

from . import _ipc, limits
from ._engine_lifecycle import check_version, format_launch, terminate, unwrap
from ._engine_lifecycle import launch as launch_engine
from ._zmq_trio import (
    HANDSHAKE_FAILED_EVENTS,
    PeerUnreachable,
    SendTimeout,
    TrioSocket,
    ZmqContext,
    parse_monitor_event,
)
from .addresses import check_address
from .errors import (
    AddressBindError,
    EngineDeadError,
    EngineHandshakeTimeout,
    RequestRejected,
    UtilityCallTimeout,
)
from .metrics import EngineStats
from .protocol import control
from .protocol.deadlines import Deadlines, DeadlineScheduler, TimedMailbox, effective_deadlines
from .protocol.engine import EngineProtocol, LinkState
from .protocol.engines import format_ranks
from .protocol.handshake import Handshake
from .protocol.link import EngineLink, LinkAction, LinkDecision
from .protocol.mailbox import Mailbox
from .protocol.runtime import Runtime
from .protocol.versions import EngineVersion
from .streams import EngineRequest, RequestStream, SampleStream, StreamGroup, StreamHost, open_samples
from .wire import vllm_handshake as wire  # the handshake: the only wire client.py speaks itself

__all__ = ["ClientConfig", "EngineClient", "EngineSession", "LoRARequest", "connect"]

LoRARequest = control.LoRARequest

_log = logging.getLogger("zmqdispatch.client")


def _check_bind_address(_: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        check_address(value, role=attribute.name)


@attrs.frozen(kw_only=True)
class ClientConfig:
    """Per-connection settings. Defaults and their reasons: :mod:`zmqdispatch.limits`.

    Attributes:
        handshake_timeout: seconds for the whole startup handshake.
        send_timeout: seconds one input send may wait for room before the
            engine is declared dead (``reason="send_timeout"``).
        send_hwm: messages queued towards the engine before sends wait.
        silence_timeout: seconds without output while requests are in flight
            before the engine is declared dead (``reason="silence"``).
        max_decode_errors: consecutive undecodable messages that mean death.
        max_pending_tokens: per-stream backlog before ``SlowConsumerError``.
        utility_timeout: default seconds a utility call waits.
        vocab_size: when set, prompt, stop, logit-bias and allowed token ids
            are checked against it (an out-of-range id crashes a vLLM engine;
            the engine does not report its vocabulary size).
        max_logprobs: the engine's ``max_logprobs`` (vLLM's default 20); larger
            logprob requests crash the engine, so they are refused.
        input_address / output_address: data-plane endpoints to bind (default:
            ``ipc://`` in a private 0700 temporary directory). Fixed addresses
            let headless engines reconnect to a restarted client. Checked at
            construction (``InvalidAddressError``, see
            :func:`zmqdispatch.addresses.check_address`).
        terminate_grace: seconds a spawned engine gets after SIGTERM.
        death_on_disconnect: treat the engine's input connection closing (a
            zmq monitor ``EVENT_DISCONNECTED`` on the input ROUTER) as death
            (``reason="disconnected"``), and its handshake connection closing
            before READY as a failed handshake (``EngineHandshakeError`` at
            once, not after ``handshake_timeout``). Right for same-host engines, where it
            catches a SIGKILLed engine we did not spawn at once; turn it off
            for tcp links that may drop and reconnect.
        pause_gc_while_routing: hold off Python's cyclic garbage collector
            while one received batch is decoded and routed (synchronous: no
            other task runs meanwhile, and no user code), then restore it. A
            step of C requests allocates about 2 x C tuples that die right after
            routing; collections in the middle of it promote them to the older
            generations, and those then cost full collections of tens of
            milliseconds (``benchmarks/README.md``). It is msgpack's own advice
            for large messages. Nothing happens when the collector is already
            disabled. Process-wide, like every ``gc`` switch: another thread
            allocating in that window (at most one batch's routing) is not
            collected until it ends.
        allow_unknown_engine_version: connect to an engine whose reported
            version the wire codec was not checked against (known: vLLM 0.32.x
            and 0.33.x, TokenSpeed 0.1.1; :mod:`zmqdispatch.protocol.versions`),
            logging a WARNING on the ``zmqdispatch.client`` logger. Off by
            default: such an engine fails the handshake with
            ``EngineHandshakeError``, since a changed positional layout would
            be misread without any decode error.
    """

    handshake_timeout: float = limits.DEFAULT_HANDSHAKE_TIMEOUT
    send_timeout: float = limits.DEFAULT_SEND_TIMEOUT
    send_hwm: int = limits.DEFAULT_SEND_HWM
    silence_timeout: float = limits.DEFAULT_SILENCE_TIMEOUT
    max_decode_errors: int = limits.DEFAULT_MAX_DECODE_ERRORS
    max_pending_tokens: int = limits.DEFAULT_MAX_PENDING_TOKENS
    utility_timeout: float = limits.DEFAULT_UTILITY_TIMEOUT
    vocab_size: int | None = None
    max_logprobs: int = limits.DEFAULT_MAX_LOGPROBS
    input_address: str | None = attrs.field(default=None, validator=_check_bind_address)
    output_address: str | None = attrs.field(default=None, validator=_check_bind_address)
    terminate_grace: float = limits.DEFAULT_TERMINATE_GRACE
    death_on_disconnect: bool = True
    pause_gc_while_routing: bool = True
    allow_unknown_engine_version: bool = False


@attrs.frozen(kw_only=True)
class EngineSession:
    """What a client needs to re-attach to an engine without a new handshake.

    vLLM's engine handshakes once, then keeps dialing the input/output
    addresses it was given: a client that re-binds the same addresses gets the
    engine back (its DEALER and PUSH reconnect on their own; outputs queued
    meanwhile are delivered and dropped as unknown ids). ``docs/vllm-wire.md``
    §6. Only sessions with explicitly configured
    ``input_address`` / ``output_address`` can be resumed.

    ``orphan_ids`` are requests the engine may still be running for nobody
    (their ADD reached it, their ABORT did not: e.g. a ``send_timeout`` death
    of a frozen engine); a resumed client ABORTs them before sending anything
    else. Take the session after the client died or closed; at most
    ``limits.MAX_ORPHAN_IDS``.
    """

    identity: bytes
    ready: wire.EngineCoreReadyResponse
    input_address: str
    output_address: str
    orphan_ids: tuple[str, ...] = ()


async def _park(obj: Any, attr: str = "waiter") -> None:
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


class _StreamHost:
    """The client's side of :class:`zmqdispatch.streams.StreamHost`: what the
    streams (``streams.py``) may do to the engine link, and nothing else."""

    __slots__ = ("_client", "_connection", "_protocol", "runtime")

    def __init__(self, client: EngineClient, connection: EngineConnection) -> None:
        self._client = client
        self._connection = connection
        self._protocol = connection.protocol
        self.runtime: Runtime = client.runtime

    def validate(self, request: EngineRequest, deadlines: Deadlines | None) -> Deadlines | None:
        client = self._client
        client.check_request(request)
        in_force = effective_deadlines(deadlines)
        p = self._protocol
        p.check_alive()
        p.check_request_id(self.runtime.request_id(request))
        return in_force

    def is_live(self, request_id: str) -> bool:
        return self._protocol.is_live(request_id)

    def open(self, request: EngineRequest, deadlines: Deadlines | None) -> Mailbox:
        return self._connection.queue_request(request, deadlines)

    def abort(self, mailbox: Mailbox) -> None:
        self._protocol.abort_mailbox(mailbox)

    def check_alive(self) -> None:
        self._protocol.check_alive()


class EngineConnection:
    """The trio shell of one engine's data plane: its input ROUTER / output
    PULL pair and their monitors, the :class:`EngineProtocol` (requests,
    routing), the :class:`~zmqdispatch.protocol.link.EngineLink` (liveness),
    the per-request deadlines, and the tasks that run them (:meth:`start`).
    :class:`EngineClient` is the user-facing side of one of these; several
    engines behind one handshake (vLLM data parallel) would be one each.

    Every task here owns one socket or one timer, feeds the link its events
    with ``trio.current_time()`` and acts on its decisions (:meth:`_act`).

    What the shells (:func:`connect`, :func:`zmqdispatch.multi.connect_engines`)
    and :class:`EngineClient` use, and nothing else: :attr:`protocol`,
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
        """The engine process this connection watches (one :func:`connect`
        launched), or None."""
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
                if event == zmq.EVENT_ACCEPTED:
                    link.input_connected(value)
                elif event == zmq.EVENT_DISCONNECTED:
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
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.output_connected()
                    self._sync_pump()
                elif event & HANDSHAKE_FAILED_EVENTS:
                    link.output_handshake_failed()
                elif event == zmq.EVENT_DISCONNECTED:
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
                    await _park(d)
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


class EngineClient:
    """A handshaken connection to one engine. Create with :func:`connect`.

    Attributes:
        ready: the engine's ``EngineCoreReadyResponse`` (``max_model_len`` etc.;
            TokenSpeed's ``prefix_granularity`` is in ``block_size``).
        runtime: the engine's :class:`~zmqdispatch.protocol.runtime.Runtime`
            (vLLM EngineCore or TokenSpeed scheduler), from its ready response.
        engine_index: the engine's DP rank, from its 2-byte identity.
        config: the :class:`ClientConfig` in force.
    """

    def __init__(
        self,
        *,
        connection: EngineConnection,
        ready: wire.EngineCoreReadyResponse,
        config: ClientConfig,
        input_address: str = "",
        output_address: str = "",
    ) -> None:
        """*input_address* / *output_address*: where the engine's socket pair
        is bound (the session's addresses)."""
        self._conn = connection
        self._protocol = protocol = connection.protocol
        self._process = connection.process
        self._ending = connection.ending
        self.ready = ready
        self.runtime = protocol.runtime
        self.engine_index = protocol.engine_index
        self.config = config
        self._bound_input = input_address
        self._bound_output = output_address

    def __repr__(self) -> str:
        p = self._protocol
        return f"<EngineClient engine={p.engine_index} {p.state.value} inflight={p.inflight}>"

    # ------------------------------------------------------------------ public API

    @property
    def protocol(self) -> EngineProtocol:
        """The sans-IO state (counters, inflight); read-only use."""
        return self._protocol

    @property
    def engine_version(self) -> EngineVersion:
        """The engine's version from its ready response (``vllm_version``):
        release, runtime, and whether the codec was checked against it
        (:class:`~zmqdispatch.protocol.versions.EngineVersion`)."""
        return EngineVersion.parse(self.ready.vllm_version)

    @property
    def max_model_len(self) -> int:
        """The engine's context length in tokens (post KV-fit, from its ready response)."""
        return self.ready.max_model_len

    @property
    def load(self) -> Any:
        """TokenSpeed: the newest load snapshot piggybacked on its outputs
        (``wire.tokenspeed.LoadSnapshot``: running, waiting, KV pages), ``None``
        before the first one and always on vLLM. Stale while the engine is idle
        (it sends nothing then)."""
        return self._protocol.load

    @property
    def is_alive(self) -> bool:
        """False once the engine is known dead or gone (its death being
        declared after its last outputs), or the client closed (latched)."""
        return self._protocol.accepts_requests

    @property
    def session(self) -> EngineSession | None:
        """An :class:`EngineSession` for :func:`connect` ``resume=``, or ``None``
        when the data-plane addresses were private (removed on close)."""
        c = self.config
        if c.input_address is None or c.output_address is None:
            return None
        return EngineSession(
            identity=self._protocol.identity,
            ready=self.ready,
            input_address=self._bound_input,
            output_address=self._bound_output,
            orphan_ids=tuple(self._protocol.possibly_live_ids()),
        )

    @property
    def death(self) -> EngineDeadError | None:
        """Why the engine is considered dead (``None`` while alive). While a
        death sign's last outputs are being routed (at most
        ``limits.OUTPUT_DROP_GRACE``), that sign; then the declared cause,
        which is the engine's sentinel when one came among those outputs."""
        p = self._protocol
        return p.death or p.gone

    async def wait_dead(self) -> EngineDeadError:
        """Block until the engine is declared dead; return the cause."""
        await self._conn.wait_dead()
        assert self._protocol.death is not None
        return self._protocol.death

    def check_request(self, request: Any) -> None:
        """Validate *request* for this engine without sending anything.

        Raises:
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected / ContextLengthError: see
                :func:`zmqdispatch.protocol.checks.check_request` (vLLM) and
                :func:`~zmqdispatch.protocol.checks.check_tokenspeed_request`;
                also ``field="data_parallel_rank"`` when the request pins an
                engine other than this one (its ``engine_index``).
        """
        self.runtime.check_request(
            request,
            max_model_len=self.ready.max_model_len,
            vocab_size=self.config.vocab_size,
            max_logprobs=self.config.max_logprobs,
        )
        pin = getattr(request, "data_parallel_rank", None)
        if pin is not None and (type(pin) is not int or pin != self.engine_index):
            raise RequestRejected(
                f"data_parallel_rank {pin!r} is not an engine of this client; valid ranks: "
                f"{format_ranks([self.engine_index])}",
                request_id=self.runtime.request_id(request),
                field="data_parallel_rank",
            )

    def generate(self, request: EngineRequest, *, deadlines: Deadlines | None = None) -> RequestStream:
        """Validate *request*; return its stream (use ``async with``).

        Args:
            request: an :data:`~zmqdispatch.EngineRequest`: a
                ``wire.vllm.EngineCoreRequest`` for a vLLM engine, a
                ``wire.tokenspeed.TokenizedGenerateReqInput`` for TokenSpeed
                (see :attr:`runtime`; ``translate_vllm_request`` /
                ``translate_tokenspeed_request`` build them). Its
                ``sampling_params.n`` must be 1: ``n > 1`` is :meth:`generate_samples`.
            deadlines: optional time limits (:class:`~zmqdispatch.Deadlines`:
                first token, total, stall between tokens), counted from
                entering the stream; past one the request is aborted on the
                engine and the stream raises ``DeadlineExceeded``.

        Synchronous: validates now; entering the stream (``async with``)
        queues the ADD and waits until the socket accepted it, so a stream
        that is never entered sends nothing. Errors after that are raised
        from the stream's ``receive()`` / iteration
        (:class:`~zmqdispatch.RequestStream`).

        Raises:
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected: the request fails validation, or ``deadlines`` is
                not a ``Deadlines`` (nothing is sent).
            DuplicateRequestIdError: the ``request_id`` is live (checked again
                on entering).
            EngineDeadError: the engine is dead or the client closed.
        """
        host = self.stream_host
        in_force = host.validate(request, deadlines)  # first: refuses the other runtime's request type
        return RequestStream(host, self.runtime.request_id(request), request, in_force)

    def generate_samples(self, requests: Sequence[EngineRequest], *, deadlines: Deadlines | None = None
                         ) -> SampleStream:
        """Validate the ``n`` samples of one parent request; return their merged
        stream (use ``async with``), which yields ``(index, OutputDelta)``.

        Args:
            requests: the single-sample requests in index order, from
                ``translate_vllm_samples`` / ``translate_tokenspeed_samples``
                (ids ``<request_id>-<i>``, seeds ``seed + i``).
            deadlines: applied to every sample; a sample past one fails the
                parent with ``DeadlineExceeded`` like any failing sample.

        Entering queues every sample's ADD in index order; leaving the block
        (normally, on error, cancelled) aborts the live samples in one ABORT.
        Errors are raised from the stream's ``receive()`` / iteration
        (:class:`~zmqdispatch.SampleStream`).

        Raises (nothing is sent for any sample):
            RequestRejected: ``requests`` is empty (n = 0), or one fails validation.
            RuntimeMismatchError: a request is for the other runtime.
            DuplicateRequestIdError: two samples share an id, or one is live.
            EngineDeadError: the engine is dead or the client closed.
        """
        return open_samples(self.stream_host, requests, deadlines)

    def stream_group(self) -> StreamGroup:
        """A new :class:`~zmqdispatch.StreamGroup` on this engine (use ``async
        with``): many requests read by one task, one batch per wake-up;
        ``group.generate(request)`` adds one and returns its member handle.
        Leaving the block aborts the live members in one ABORT."""
        return StreamGroup(self.stream_host)

    @functools.cached_property
    def stream_host(self) -> StreamHost:
        """What the streams may do to this engine (:class:`zmqdispatch.streams.StreamHost`):
        validate, queue (``open``), abort, check alive. In-package: a many-engine
        client's streams reach the engine a request was placed on through it."""
        return _StreamHost(self, self._conn)

    @property
    def stray_output_connections(self) -> int:
        """Connections to the output socket that closed before their ZMTP
        handshake (probes, port scans): counted and ignored."""
        return self._conn.stray_output_connections

    @property
    def _output_links(self) -> int:
        return self._conn.output_links

    def stats(self) -> EngineStats:
        """A snapshot of this engine link's counters and latency histograms
        (:class:`zmqdispatch.metrics.EngineStats`; names and meaning in
        ``docs/operations.md``). Cheap (copies a few dicts and two lists)."""
        return EngineStats.of(self)

    async def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``EngineCore.<method>(*args)`` on the engine and return its result.

        Wire: UTILITY ``[client_index, call_id, method, args]``; the reply is an
        ``EngineCoreOutputs`` carrying ``utility_output`` (``docs/vllm-wire.md`` §5.7).

        Raises:
            UtilityCallTimeout: no reply within *timeout* (default
                ``config.utility_timeout``) seconds.
            UtilityCallError: the engine reported a failure.
            EngineDeadError: the engine died.
            UnsupportedByRuntimeError: a TokenSpeed engine (no utility calls).
            RemoteProtocolError: the engine's output connection dropped (the
                reply may be lost).
            ValueError: *timeout* is not a number of seconds >= 0 (nothing is sent).
        """
        timeout = self.config.utility_timeout if timeout is None else timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout: expected seconds >= 0 (or None for utility_timeout), got {timeout!r}")
        p = self._protocol
        call = p.start_utility(method, args)
        try:
            with trio.move_on_after(timeout):
                while not call.done:
                    await _park(call)
        finally:
            if not call.done:
                p.forget_utility(call)
        if not call.done:
            raise UtilityCallTimeout(
                f"utility call {method!r} got no reply within {timeout} s", engine_index=self.engine_index
            )
        if call.error is not None:
            raise call.error
        return call.result

    async def get_supported_tasks(self, *, timeout: float | None = None) -> tuple[str, ...]:
        """The engine's supported tasks, e.g. ``("generate",)``."""
        return tuple(await self.call_utility("get_supported_tasks", timeout=timeout))

    async def is_sleeping(self, *, timeout: float | None = None) -> bool:
        """Whether the engine is in sleep mode."""
        return bool(await self.call_utility("is_sleeping", timeout=timeout))

    # ------------------------------------------------------------------ control plane
    #
    # Typed vLLM utility calls (zmqdispatch.protocol.control; docs/control-plane.md).
    # Each raises, besides what call_utility raises: UnsupportedByRuntimeError
    # before sending anything on TokenSpeed or on a vLLM version without the
    # method (the message names the version); ValueError / TypeError for an
    # argument vLLM would refuse; RemoteProtocolError for a reply of the wrong
    # type. A call that times out (UtilityCallTimeout) may still take effect on
    # the engine: a pause with mode="wait" or a sleep answers only once running
    # requests are done, so give those a timeout that covers them.

    async def _control(self, call: control.ControlCall[control.R], timeout: float | None) -> control.R:
        return call.parse(await self.call_utility(call.method, *call.args, timeout=timeout))

    async def sleep(self, level: int = 1, mode: control.PauseMode = "abort", *,
                    timeout: float | None = None) -> None:
        """Put the engine to sleep: pause scheduling (running requests: *mode*,
        ``"abort"`` / ``"wait"`` / ``"keep"``) and, at *level* 1 or 2, release
        device memory (needs an engine started with sleep mode enabled; level 0
        needs nothing). Wake it with :meth:`wake_up`."""
        await self._control(control.sleep(self.engine_version, level, mode), timeout)

    async def wake_up(self, tags: Sequence[str] | None = None, *, timeout: float | None = None) -> bool:
        """Undo :meth:`sleep` (*tags*: ``None`` = everything; ``["weights"]``,
        ``["kv_cache"]``; ``["scheduling"]`` after level 0). Returns whether the
        engine is fully awake (scheduling resumes only then)."""
        return await self._control(control.wake_up(self.engine_version, tags), timeout)

    async def pause_scheduler(self, mode: control.PauseMode = "abort", clear_cache: bool = True, *,
                              timeout: float | None = None) -> None:
        """Stop scheduling; new requests are queued until :meth:`resume_scheduler`.
        *mode*: running requests are aborted (each stream ends with an ABORT
        finish), waited for, or kept frozen."""
        await self._control(control.pause_scheduler(self.engine_version, mode, clear_cache), timeout)

    async def resume_scheduler(self, *, timeout: float | None = None) -> None:
        """Schedule again after :meth:`pause_scheduler` / a level-0 sleep."""
        await self._control(control.resume_scheduler(self.engine_version), timeout)

    async def is_scheduler_paused(self, *, timeout: float | None = None) -> bool:
        """Whether scheduling is paused (by a pause or a sleep)."""
        return await self._control(control.is_scheduler_paused(self.engine_version), timeout)

    async def pause_generation(self, mode: control.PauseMode = "abort", clear_cache: bool = True, *,
                               timeout: float | None = None) -> None:
        """vLLM >= 0.33: pause for a user (e.g. a weight update): like
        :meth:`pause_scheduler`, but with ``"abort"`` / ``"wait"`` new requests are
        refused by the engine (a retryable error) until :meth:`resume_generation`.
        ``UnsupportedByRuntimeError`` on 0.32."""
        await self._control(control.pause_generation(self.engine_version, mode, clear_cache), timeout)

    async def resume_generation(self, *, timeout: float | None = None) -> None:
        """vLLM >= 0.33: end :meth:`pause_generation`. ``UnsupportedByRuntimeError`` on 0.32."""
        await self._control(control.resume_generation(self.engine_version), timeout)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False, *,
                                 timeout: float | None = None) -> bool:
        """Drop the engine's cached prefix blocks; returns whether it did (False
        while running requests hold blocks, unless *reset_running_requests*)."""
        return await self._control(
            control.reset_prefix_cache(self.engine_version, reset_running_requests, reset_connector), timeout
        )

    async def add_lora(self, lora: control.LoRARequest, *, timeout: float | None = None) -> bool:
        """Load a LoRA adapter (:class:`~zmqdispatch.protocol.control.LoRARequest`;
        the engine must run with LoRA enabled). Returns whether it was loaded."""
        return await self._control(control.add_lora(self.engine_version, lora), timeout)

    async def remove_lora(self, lora_id: int, *, timeout: float | None = None) -> bool:
        """Unload the adapter ``lora_int_id == lora_id``; returns whether it was loaded."""
        return await self._control(control.remove_lora(self.engine_version, lora_id), timeout)

    async def pin_lora(self, lora_id: int, *, timeout: float | None = None) -> bool:
        """Keep the adapter ``lora_id`` loaded (never evicted)."""
        return await self._control(control.pin_lora(self.engine_version, lora_id), timeout)

    async def list_loras(self, *, timeout: float | None = None) -> frozenset[int]:
        """The ``lora_int_id`` s of the loaded adapters."""
        return await self._control(control.list_loras(self.engine_version), timeout)

    async def collective_rpc(self, method: str, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                             rpc_timeout: float | None = None, timeout: float | None = None) -> list[Any]:
        """Run the worker method *method* on every worker; one result per worker.
        *rpc_timeout*: the engine's own wait for its workers (seconds); *timeout*:
        ours for the reply."""
        return await self._control(
            control.collective_rpc(self.engine_version, method, timeout=rpc_timeout, args=args, kwargs=kwargs),
            timeout,
        )

    async def profile(self, is_start: bool = True, *, profile_prefix: str | None = None,
                      delay_iterations: int | None = None, max_iterations: int | None = None,
                      profiler_kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> None:
        """Start (``is_start=True``) or stop the workers' profiler; the engine
        must run with a profiler configured (else ``UtilityCallError``).
        ``profiler_kwargs`` needs vLLM >= 0.33."""
        await self._control(
            control.profile(self.engine_version, is_start, profile_prefix=profile_prefix,
                            delay_iterations=delay_iterations, max_iterations=max_iterations,
                            profiler_kwargs=profiler_kwargs),
            timeout,
        )

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
    await _park(p, "send_waiter")


# ---------------------------------------------------------------------- connect


async def _handshake(
    hs: TrioSocket,
    inp: TrioSocket,
    *,
    input_address: str,
    output_address: str,
    timeout: float,
    process: trio.Process | None,
    monitor: TrioSocket | None = None,
) -> tuple[bytes, wire.EngineCoreReadyResponse]:
    """Run the handshake (:class:`~zmqdispatch.protocol.handshake.Handshake`,
    ``docs/vllm-wire.md`` §5.1) for one engine: one task per socket feeds the
    machine what it receives, sends the INIT it is handed, and one sleeps
    until the machine's deadline (the timeout; after the handshake connection
    closed, the grace for what was sent before the close).

    *monitor* (``EVENT_ACCEPTED | EVENT_DISCONNECTED`` of *hs*): the engine
    keeps its handshake connection open from HELLO until it has sent both
    READY and its ready response (model loading included); when it closes in
    between, ``EngineHandshakeError`` at once instead of after *timeout*."""
    machine = Handshake(
        now=trio.current_time(), timeout=timeout, input_address=input_address, output_address=output_address
    )
    timer_scope: trio.CancelScope | None = None

    def fed() -> None:
        # Move the timer to the machine's (possibly earlier) deadline; end the
        # handshake once complete.
        if machine.complete:
            nursery.cancel_scope.cancel()
        elif timer_scope is not None:
            timer_scope.deadline = machine.next_deadline()

    async def handshake_side() -> None:
        while machine.wants_handshake_messages:
            step = machine.handshake_received(await hs.recv_multipart(), trio.current_time())
            if step.reply is not None:
                _log.info("handshake: HELLO from engine identity %s (%s); sending INIT (input %s, output %s)",
                          step.identity.hex(), "local" if step.local else "remote", input_address, output_address)
                try:
                    await hs.send(step.reply)
                except PeerUnreachable:
                    raise machine.init_unreachable(step.identity) from None
            else:
                _log.info("handshake: READY from engine identity %s", step.identity.hex())
            fed()

    async def input_side() -> None:
        while machine.wants_ready_responses:
            step = machine.input_received(await inp.recv_multipart(), trio.current_time())
            _log.info("handshake: ready response from engine identity %s on the input socket", step.identity.hex())
            fed()

    async def watch_process() -> None:
        assert process is not None
        code = await process.wait()
        raise machine.process_exited(process.pid, code)

    async def watch_handshake_link() -> None:
        assert monitor is not None
        while True:
            event, value, _ = parse_monitor_event(await monitor.recv_multipart())
            if event == zmq.EVENT_ACCEPTED:
                machine.peer_connected(value)
            elif event == zmq.EVENT_DISCONNECTED:
                machine.peer_disconnected(value, trio.current_time())
                fed()

    async def timer() -> None:
        nonlocal timer_scope
        while True:
            with trio.CancelScope(deadline=machine.next_deadline()) as timer_scope:
                await trio.sleep_forever()
            timer_scope = None
            machine.timer_fired(trio.current_time())  # raises past a deadline

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer)
            if process is not None:
                nursery.start_soon(watch_process)
            if monitor is not None:
                nursery.start_soon(watch_handshake_link)
            nursery.start_soon(handshake_side)
            nursery.start_soon(input_side)
    except BaseExceptionGroup as eg:
        error = unwrap(eg)
        if isinstance(error, EngineHandshakeTimeout):
            _log.warning("handshake: timed out after %s s waiting for %s", timeout, error.stage)
        raise error from None
    ((identity, ready),) = machine.results()
    return identity, ready


async def _await_reconnect(monitor: TrioSocket | None, timeout: float, link: EngineLink) -> None:
    """Resume: wait until the engine's DEALER has reconnected to the input
    socket (its ZMTP handshake done), feeding the input connections to *link*."""
    assert monitor is not None
    try:
        with trio.fail_after(timeout):
            while True:
                event, value, endpoint = parse_monitor_event(await monitor.recv_multipart())
                if event == zmq.EVENT_ACCEPTED:
                    link.input_connected(value)
                elif event == zmq.EVENT_DISCONNECTED:
                    link.input_disconnected(value, endpoint, trio.current_time())  # not serving yet: counts only
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
    except trio.TooSlowError:
        raise EngineHandshakeTimeout(
            f"the engine did not reconnect to the input socket within {timeout} s", stage="reconnect"
        ) from None


@asynccontextmanager
async def connect(
    handshake_address: str | None = None,
    *,
    launch: str | Sequence[str] | None = None,
    config: ClientConfig | None = None,
    launch_stdout: int | None = None,
    resume: EngineSession | None = None,
    runtime: Runtime | str | None = None,
    data_parallel_size: int | None = None,
    quorum: int = 1,
    data_plane_host: str | None = None,
) -> AsyncIterator[EngineClient]:
    """Bind the three sockets, handshake one engine, and serve it.

    With ``data_parallel_size=N`` (N >= 1), serve many engines instead: yields
    a :class:`zmqdispatch.multi.MultiEngineClient` once N engines completed
    their handshake, each with its own socket pair; the handshake socket stays
    open for engines that dial later or restart. ``quorum`` and
    ``data_plane_host`` (and a list of handshake addresses) apply to that mode
    only: :func:`zmqdispatch.multi.connect_engines`, ``docs/many-engines.md``.

    The engine is a vLLM EngineCore or a TokenSpeed scheduler in direct-ZMQ
    mode (``ts serve --headless``); which one is read from its ready response
    (:class:`~zmqdispatch.protocol.runtime.Runtime`).

    Args:
        handshake_address: where to bind the handshake ROUTER (``tcp://HOST:PORT``
            for ``vllm serve --headless --data-parallel-address HOST
            --data-parallel-rpc-port PORT``; ``ipc://PATH``). Default: an
            ``ipc://`` path in a private 0700 temporary directory. A ``tcp://``
            address is bound exactly as given (use ``127.0.0.1`` unless the
            engine is remote); ``ipc://`` paths are checked first (see
            :mod:`zmqdispatch._ipc`: stale sockets unlinked, anything else refused).
        launch: an engine command (string or argv) to start after binding;
            ``{handshake_address}`` in it is replaced by the bound address. The
            process runs in its own process group with stdout sent to our
            stderr; it is terminated (SIGTERM, then SIGKILL after
            ``terminate_grace``) when the block exits or the handshake fails.
        config: :class:`ClientConfig`.
        launch_stdout: fd for the launched engine's stdout (default: our stderr).
        resume: re-attach to an already handshaken engine (see
            :class:`EngineSession`): bind its input/output addresses, skip the
            handshake, and wait (up to ``handshake_timeout``) until the engine
            has reconnected.
        runtime: ``"vllm"`` / ``"tokenspeed"`` (or a :class:`Runtime`) to
            require that engine; ``None`` accepts either.

    Yields:
        a ready :class:`EngineClient`.

    Raises:
        EngineHandshakeTimeout: no complete handshake within
            ``config.handshake_timeout`` (the spawned engine is killed).
        EngineHandshakeError: a malformed handshake, the spawned engine exited,
            or the engine is not the required ``runtime``.
        InvalidAddressError: a malformed handshake, input or output address
            (:func:`zmqdispatch.addresses.check_address`; a handshake port 0
            only with ``launch``, which is told the port picked), before any
            socket is created.
        AddressBindError: an address could not be bound (in use, not an
            address of this host, permission, an ipc path refused).
        ValueError: ``launch`` is empty or not a command line (an unclosed
            quote), before any socket is created.

    Cancellation: cancelling the block cancels the handshake or the pumps,
    sends queued ABORTs best-effort, closes the sockets, removes the private
    ipc directory and terminates a spawned engine.
    """
    if data_parallel_size is not None:
        if resume is not None:
            raise ValueError("resume= re-attaches one engine; it does not combine with data_parallel_size")
        from .multi import connect_engines  # the many-engine shell is built on this module

        async with connect_engines(handshake_address, data_parallel_size=data_parallel_size, quorum=quorum,
                                   launch=launch, config=config, launch_stdout=launch_stdout, runtime=runtime,
                                   data_plane_host=data_plane_host) as many:
            yield many  # type: ignore[misc]  # a MultiEngineClient: the EngineClient request API, per engine
        return
    if quorum != 1 or data_plane_host is not None:
        raise ValueError("quorum / data_plane_host apply to many engines: pass data_parallel_size")
    config = config or ClientConfig()
    if launch is not None:
        format_launch(launch, "")  # refuse a malformed command before anything is bound
    # Every address is checked before a socket exists (nothing to undo).
    if handshake_address is not None:
        check_address(handshake_address, role="handshake_address", any_port=launch is not None)
    if resume is not None:
        check_address(resume.input_address, role="resume.input_address", any_port=False)
        check_address(resume.output_address, role="resume.output_address", any_port=False)
    ctx = ZmqContext()
    ipc_dir: str | None = None

    async def bind(sock: TrioSocket, address: str, role: str) -> str:
        try:
            # ipc paths: stale socket files unlinked, anything else refused (_ipc)
            prepared = await _ipc.prepare_bind(address)
        except OSError as exc:
            error = AddressBindError(f"{role}: cannot bind {address!r}: {exc.strerror or exc}",
                                     address=address, role=role, errno=exc.errno)
            error.filename = exc.filename
            raise error from None
        return sock.bind(prepared, role=role)

    def ipc(name: str) -> str:
        nonlocal ipc_dir
        if ipc_dir is None:
            ipc_dir = _ipc.private_ipc_dir()
        return f"ipc://{ipc_dir}/{name}"

    inp = ctx.socket(zmq.ROUTER, name="input", router_mandatory=True, sndhwm=config.send_hwm)
    out = ctx.socket(zmq.PULL, name="output", rcvhwm=0, maxmsgsize=limits.MAX_FRAME_BYTES)
    hs = ctx.socket(zmq.ROUTER, name="handshake", router_mandatory=True)
    process: trio.Process | None = None
    client: EngineClient | None = None
    monitor: TrioSocket | None = None
    # The link's liveness state (protocol/link.py), made before the resume
    # wait so the input connections it sees are counted.
    link = EngineLink(
        now=trio.current_time(),
        silence_timeout=config.silence_timeout,
        watch_input=config.death_on_disconnect,
        await_output_reconnect=config.death_on_disconnect,
    )
    out_monitor: TrioSocket | None = None
    hs_monitor: TrioSocket | None = None
    try:
        # Created before bind: the output watch sees the engine's output connection drop.
        out_monitor = out.monitor(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS, name="output-monitor"
        )
        if config.death_on_disconnect or resume is not None:
            # Created before bind so no event is missed: the watch task counts
            # the input socket's connections (ACCEPTED / DISCONNECTED).
            monitor = inp.monitor(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED, name="input-monitor"
            )
        if resume is not None:
            if launch is not None or handshake_address is not None:
                raise ValueError("resume= re-attaches to a running engine: no launch or handshake address")
            input_address = await bind(inp, resume.input_address, "resume.input_address")
            output_address = await bind(out, resume.output_address, "resume.output_address")
            _log.info(
                "resuming engine identity %s: bound input %s, output %s; waiting for it to reconnect, timeout %s s "
                "(%d orphan ids to abort)", resume.identity.hex(), input_address, output_address,
                config.handshake_timeout, len(resume.orphan_ids), extra={"zmqdispatch_wait": True},
            )
            await _await_reconnect(monitor, config.handshake_timeout, link)
            identity, ready = resume.identity, resume.ready
        else:
            input_address = await bind(inp, config.input_address or ipc("input.sock"), "input_address")
            output_address = await bind(out, config.output_address or ipc("output.sock"), "output_address")
            if config.death_on_disconnect:
                # Created before bind: the handshake sees the engine's handshake connection close.
                hs_monitor = hs.monitor(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED, name="handshake-monitor")
            hs_address = await bind(hs, handshake_address or ipc("handshake.sock"), "handshake_address")
            _log.info("bound handshake %s, input %s, output %s", hs_address, input_address, output_address)
            if launch is not None:
                process = await launch_engine(launch, hs_address, launch_stdout, config.terminate_grace)
            _log.info("waiting for an engine at %s, timeout %s s", hs_address, config.handshake_timeout,
                      extra={"zmqdispatch_wait": True})
            identity, ready = await _handshake(
                hs,
                inp,
                input_address=input_address,
                output_address=output_address,
                timeout=config.handshake_timeout,
                process=process,
                monitor=hs_monitor,
            )
            if hs_monitor is not None:
                hs.disable_monitor()
                hs_monitor.close()
                hs_monitor = None
        hs.close()
        check_version(ready, allow_unknown=config.allow_unknown_engine_version)
        engine_index = int.from_bytes(identity, "little") if len(identity) == 2 else 0
        link.engine_index = engine_index
        protocol = EngineProtocol(
            engine_index=engine_index,
            identity=identity,
            max_pending_tokens=config.max_pending_tokens,
            max_decode_errors=config.max_decode_errors,
            runtime=Runtime.resolve(runtime, ready),
            timer=trio.current_time,
        )
        _log.info(
            "engine %d %s (identity %s): %s, version %s, max_model_len %d, data_parallel_rank %s",
            engine_index, "resumed" if resume is not None else "ready", identity.hex(), protocol.runtime.value,
            ready.vllm_version, ready.max_model_len, ready.data_parallel_rank,
        )
        if resume is not None:
            protocol.abort_stale(resume.orphan_ids)  # before any ADD of ours
        if not config.death_on_disconnect and monitor is not None:
            inp.disable_monitor()
            monitor.close()
            monitor = None
        connection = EngineConnection(
            protocol=protocol,
            link=link,
            input_sock=inp,
            output_sock=out,
            process=process,
            monitor_sock=monitor,
            output_monitor_sock=out_monitor,
            send_timeout=config.send_timeout,
            pause_gc_while_routing=config.pause_gc_while_routing,
        )
        client = EngineClient(connection=connection, ready=ready, config=config, input_address=input_address,
                              output_address=output_address)
        try:
            async with trio.open_nursery() as nursery:
                connection.start(nursery)
                try:
                    yield client
                finally:
                    was_ready = protocol.state is LinkState.READY
                    aborted = connection.close_client()
                    if was_ready:
                        _log.info("closing the client of engine %d (%d live requests aborted)", engine_index, aborted)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
    finally:
        link.close()
        if monitor is not None:
            inp.disable_monitor()
            monitor.close()
        if out_monitor is not None:
            out.disable_monitor()
            out_monitor.close()
        if hs_monitor is not None:
            hs.disable_monitor()
            hs_monitor.close()
        hs.close()
        out.close()
        # Give queued ABORTs a moment to leave in the background.
        inp.close(linger_ms=1000)
        try:
            if process is not None:
                await terminate(process, config.terminate_grace)
        finally:
            if ipc_dir is not None:
                shutil.rmtree(ipc_dir, ignore_errors=True)
