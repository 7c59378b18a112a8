"""The trio shell around :class:`~zmqdispatch.protocol.engine.EngineProtocol`.

:func:`connect` is an async context manager whose nursery owns one engine's
sockets (vLLM's topology, which TokenSpeed's direct wire shares: the client
binds, the engine dials in)::

    handshake ROUTER (bind) <- engine DEALER   HELLO / INIT / READY, then closed
    input     ROUTER (bind) <- engine DEALER   ready response, then ADD/ABORT/UTILITY
    output    PULL   (bind) <- engine PUSH     EngineCoreOutputs, ENGINE_CORE_DEAD

Task tree inside the nursery (one owner task per socket, ``docs/trio-and-zmq.md`` §8)::

    output pump   owns PULL: recv_batch -> EngineProtocol.frames_received (sync routing)
    input pump    owns ROUTER: EngineProtocol.pop_send -> bounded send
    watchdog      silence while requests are in flight -> engine death
    output watch  the PULL's monitor: the engine's output connection dropped ->
                  fail what may have been lost on it (``_output_link_dropped``)
    process watch (engines we spawned) exit -> engine death

Per-request streams are *not* tasks: :meth:`EngineClient.generate` returns a
:class:`RequestStream`, an ``async with`` context manager and async iterator
over :class:`~zmqdispatch.protocol.mailbox.OutputDelta`. Leaving it before the
final output aborts the request on the engine, synchronously, so it works even
when the exit is a cancellation (an ``await`` in a cancelled scope would raise
``Cancelled`` and lose the ABORT; ``docs/known-failures.md`` K7).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
from time import perf_counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import zmq

from . import _ipc, limits
from .addresses import check_address
from ._zmq_trio import PeerUnreachable, SendTimeout, TrioSocket, ZmqContext, parse_monitor_event
from .errors import (
    AddressBindError,
    EngineDeadError,
    LocalProtocolError,
    EngineHandshakeError,
    EngineHandshakeTimeout,
    RemoteProtocolError,
    RequestStreamClosed,
    UtilityCallTimeout,
)
from .protocol import control
from .metrics import EngineStats
from .protocol.deadlines import Deadlines, DeadlineScheduler, TimedMailbox, effective_deadlines
from .protocol.engine import EngineProtocol, LinkState, Outgoing, SendState
from .protocol.runtime import Runtime
from .protocol.versions import EngineVersion, check_engine_version
from .protocol.mailbox import Mailbox, OutputDelta
from .wire import vllm as wire

__all__ = ["ClientConfig", "EngineClient", "EngineSession", "LoRARequest", "RequestStream", "connect"]

LoRARequest = control.LoRARequest

_log = logging.getLogger("zmqdispatch.client")


def _check_bind_address(_: object, attribute: attrs.Attribute, value: str | None) -> None:
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


class RequestStream:
    """One request's outputs: ``async with`` it, then iterate.

    ::

        async with client.generate(request) as stream:
            async for delta in stream:       # OutputDelta, merged if you lag
                ...

    Nothing is sent before the stream is entered: entering registers the
    request, queues its ADD and waits until the socket accepted it (a stream
    that is never entered costs nothing on the engine). Iteration yields
    :class:`OutputDelta` objects and stops after the one whose
    ``finish_reason`` is set. Leaving the block before that (``break``, an
    exception, a cancellation) aborts the request on the engine: the ABORT is
    queued synchronously, batched with others, and sent by the input pump.

    Raises (from ``__aenter__`` or iteration):
        DuplicateRequestIdError: (entering) the ``request_id`` is live.
        RequestRejected: (entering) the request passed validation but could
            not be encoded for the wire (nothing was sent).
        DeadlineExceeded: the request went past one of its ``deadlines``
            (it was aborted on the engine).
        EngineDeadError: the engine died (every open stream gets one).
        EngineRequestError: the engine finished the request with an error.
        SlowConsumerError: the consumer fell behind ``max_pending_tokens``.
        RemoteProtocolError: this request's output did not decode, or the
            engine's output connection dropped (a frame above
            ``limits.MAX_FRAME_BYTES``) and its outputs may be lost.
        RequestStreamClosed: iterating a stream that was aborted.
    """

    __slots__ = (
        "_client", "request_id", "_request", "_mailbox", "_eof", "_closed", "_entered", "_receiving", "_task",
        "_waker", "_aborter", "_deadlines",
    )

    def __init__(self, client: EngineClient, request_id: str, request: Any, deadlines: Deadlines | None = None) -> None:
        self._client = client
        self.request_id = request_id
        self._request = request  # validated; submitted by __aenter__
        self._deadlines = deadlines
        self._mailbox: Mailbox | None = None
        self._eof = False  # the final delta was handed to the consumer
        self._closed = False  # aborted / exited before the final delta
        self._entered = False
        self._receiving = False
        # The parked consumer and its wake / abort hooks, bound once per stream
        # (a park per delivery is the hot path: no closures per park).
        self._task: Any = None
        self._waker = self._wake
        self._aborter = self._abort_park

    def __repr__(self) -> str:
        return f"<RequestStream {self.request_id!r} eof={self._eof} closed={self._closed} {self._mailbox!r}>"

    async def __aenter__(self) -> RequestStream:
        if self._entered:
            raise LocalProtocolError(f"request {self.request_id!r}: a stream can be entered once")
        self._entered = True
        if self._closed:
            raise RequestStreamClosed(
                f"request {self.request_id!r}: the stream was closed before it was entered (nothing was sent)",
                request_id=self.request_id,
            )
        if self._mailbox is None:
            await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sends nothing
            self._queue()  # raises DuplicateRequestIdError / EngineDeadError: nothing to undo
        add = self._mailbox.add
        try:
            while add.state is SendState.QUEUED or add.state is SendState.SENDING:
                await _park(add)
            if add.state is SendState.FAILED:
                self._closed = True
                self._client._protocol.check_alive()
                raise EngineDeadError("engine died before the request was sent", reason="closed")
            if add.state is SendState.REJECTED:
                self._closed = True
                raise add.error  # RequestRejected: the request could not be encoded, nothing was sent
            if add.state is SendState.CANCELLED:
                self._closed = True
                raise RequestStreamClosed(
                    f"request {self.request_id!r} was aborted before it was sent", request_id=self.request_id
                )
            # Inside the try: a cancellation landing on this last checkpoint
            # leaves without __aexit__, so it must abort here (no leak).
            await trio.lowlevel.checkpoint()
        except BaseException:
            self.abort()
            raise
        return self

    def _queue(self) -> None:
        """Register the request and queue its ADD now (``__aenter__`` does it;
        fan-out calls it for every sample first, so their ADDs go out in order
        and together). Idempotent."""
        if self._mailbox is None and not self._closed:
            self._mailbox = self._client._queue_request(self._request, self._deadlines)
            self._request = None

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def abort(self) -> None:
        """Abort the request now unless it already finished. Synchronous,
        idempotent, never raises; iteration afterwards raises
        :class:`RequestStreamClosed`."""
        if not self._eof and not self._closed:
            self._closed = True
            if self._mailbox is not None:
                self._client._protocol.abort_mailbox(self._mailbox)

    async def aclose(self) -> None:
        """Async alias of :meth:`abort` (a checkpoint)."""
        self.abort()
        await trio.lowlevel.checkpoint()

    @property
    def finished(self) -> bool:
        """True once the final output was received or the stream was aborted."""
        return self._eof or self._closed

    async def receive(self) -> OutputDelta:
        """The next :class:`OutputDelta` (merged ticks if the consumer lagged).

        Cancellation: atomic; a cancelled receive leaves the pending delta in
        the mailbox.

        Raises:
            trio.EndOfChannel: after the final delta was returned.
            LocalProtocolError: the stream was not entered with ``async with``
                (the request is aborted).
            trio.BusyResourceError: another task is receiving on this stream.
            plus the errors listed on the class.
        """
        if not self._entered:
            # Iterating without `async with` would leave nothing to abort the
            # request when the caller stops: refuse, and abort it now.
            self.abort()
            raise LocalProtocolError(
                f"request {self.request_id!r}: enter the stream first (`async with client.generate(...) as stream`)"
            )
        if self._receiving:
            raise trio.BusyResourceError(f"another task is already receiving on request {self.request_id!r}")
        self._receiving = True
        try:
            return await self._receive()
        finally:
            self._receiving = False

    def _wake(self) -> None:  # the mailbox's waiter: called once by the router task
        task = self._task
        self._task = None
        trio.lowlevel.reschedule(task)

    def _abort_park(self, _: Any) -> trio.lowlevel.Abort:
        self._mailbox.waiter = None
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _receive(self) -> OutputDelta:
        mb = self._mailbox
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self._eof:
                raise trio.EndOfChannel
            if self._closed:
                raise RequestStreamClosed(f"request {self.request_id!r}: stream was aborted", request_id=self.request_id)
            delta = mb.take()  # raises the stream's error once nothing is pending
            if delta is not None:
                if delta.finish_reason is not None:
                    self._eof = True
                if not parked:
                    # Nothing waited yet: give the scheduler its turn. After a
                    # park that turn was the park (one scheduler pass, not two).
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return delta
            self._task = trio.lowlevel.current_task()
            mb.waiter = self._waker
            await trio.lowlevel.wait_task_rescheduled(self._aborter)
            parked = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> OutputDelta:
        # receive() without its frame: the per-delivery path
        if not self._entered or self._receiving:
            try:
                return await self.receive()  # raises the misuse errors
            except trio.EndOfChannel:
                raise StopAsyncIteration from None
        self._receiving = True
        try:
            return await self._receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        finally:
            self._receiving = False


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
        protocol: EngineProtocol,
        ready: wire.EngineCoreReadyResponse,
        config: ClientConfig,
        input_sock: TrioSocket,
        output_sock: TrioSocket,
        process: trio.Process | None,
        monitor_sock: TrioSocket | None = None,
        output_monitor_sock: TrioSocket | None = None,
    ) -> None:
        self._protocol = protocol
        self.ready = ready
        self.runtime = protocol.runtime
        self.engine_index = protocol.engine_index
        self.config = config
        self._input = input_sock
        self._output = output_sock
        self._process = process
        self._monitor = monitor_sock
        #: fds of the connections accepted on the input socket (monitor events)
        self._peer_fds: set[int] = set()
        self._bound_input = ""
        self._bound_output = ""
        self._last_activity = trio.current_time()
        self._closing = False
        self._dead = trio.Event()
        self._ending = trio.Event()  # set by a death sign or a death

        def on_death(exc: EngineDeadError) -> None:
            self._dead.set()
            self._ending.set()
            self._wake_link_wait()

        protocol.on_death = on_death
        # the engine's output connection dropped (set by _output_monitor_watch)
        self._output_monitor = output_monitor_sock
        self._output_dropped = ""  # endpoint of the dropped connection, "" = none
        self._pump_wait: trio.CancelScope | None = None  # the output pump's wait
        # the engine's output connections past their ZMTP handshake (output watch)
        self._output_links = 0
        # _await_output_link's wait: cancelled by a new output link, a death sign or a death
        self._link_wait: trio.CancelScope | None = None
        self.stray_output_connections = 0  # closed before their ZMTP handshake
        # per-request deadlines: one heap, one task (_deadline_watch)
        self._deadlines = DeadlineScheduler()

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
        await self._dead.wait()
        assert self._protocol.death is not None
        return self._protocol.death

    def check_request(self, request: Any) -> None:
        """Validate *request* for this engine without sending anything.

        Raises:
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected / ContextLengthError: see
                :func:`zmqdispatch.protocol.checks.check_request` (vLLM) and
                :func:`~zmqdispatch.protocol.checks.check_tokenspeed_request`.
        """
        self.runtime.check_request(
            request,
            max_model_len=self.ready.max_model_len,
            vocab_size=self.config.vocab_size,
            max_logprobs=self.config.max_logprobs,
        )

    def generate(self, request: Any, *, deadlines: Deadlines | None = None) -> RequestStream:
        """Validate and submit *request*; return its stream (use ``async with``).

        Args:
            request: a ``wire.vllm.EngineCoreRequest`` for a vLLM engine, a
                ``wire.tokenspeed.TokenizedGenerateReqInput`` for TokenSpeed
                (see :attr:`runtime`; :mod:`zmqdispatch.translate` builds both).
            deadlines: optional time limits (:class:`~zmqdispatch.Deadlines`:
                first token, total, stall between tokens), counted from
                entering the stream; past one the request is aborted on the
                engine and the stream raises ``DeadlineExceeded``.

        Synchronous: validates now; entering the stream (``async with``)
        queues the ADD and waits until the socket accepted it, so a stream
        that is never entered sends nothing.

        Raises:
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected: the request fails validation, or ``deadlines`` is
                not a ``Deadlines`` (nothing is sent).
            DuplicateRequestIdError: the ``request_id`` is live (checked again
                on entering).
            EngineDeadError: the engine is dead or the client closed.
        """
        self.check_request(request)
        deadlines = effective_deadlines(deadlines)
        p = self._protocol
        p.check_alive()
        rid = self.runtime.request_id(request)
        p.check_request_id(rid)
        return RequestStream(self, rid, request, deadlines)

    def _submit(self, request: Any, deadlines: Deadlines | None = None) -> tuple[Mailbox, Outgoing]:
        """Validate and queue *request* now; its mailbox and ADD (StreamGroup, fan-out)."""
        self.check_request(request)
        mailbox = self._queue_request(request, effective_deadlines(deadlines))
        return mailbox, mailbox.add

    def _queue_request(self, request: Any, deadlines: Deadlines | None) -> Mailbox:
        """Register *request* (validated) and queue its ADD; start its
        *deadlines* (from :func:`effective_deadlines`)."""
        p = self._protocol
        if deadlines is None:
            mailbox, _add = p.submit(request)
        else:
            timed = TimedMailbox(self.runtime.request_id(request), p.max_pending_tokens, p, deadlines)
            mailbox, _add = p.submit(request, timed)
            self._deadlines.add(timed, trio.current_time(), p.inflight)
        self._note_submit()
        return mailbox

    def _note_submit(self) -> None:
        # The silence watchdog measures from the first request in flight.
        if self._protocol.inflight == 1:
            self._last_activity = trio.current_time()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id (synchronous, idempotent, batched into one ABORT)."""
        self._protocol.abort(request_ids)

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

    async def _control(self, call: control.ControlCall, timeout: float | None) -> Any:
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

    # ------------------------------------------------------------------ tasks

    def _died(self, reason: str, message: str) -> None:
        self._protocol.engine_died(EngineDeadError(message, engine_index=self.engine_index, reason=reason))

    def _death_sign(self, reason: str, message: str) -> None:
        """A sign that the engine is gone which may come before its last
        outputs (its final tokens, finishes, the ``ENGINE_CORE_DEAD``
        sentinel) are read: the input connection closed, the process exited,
        a send met EHOSTUNREACH. New requests are refused at once
        (``EngineProtocol.engine_gone``); the output pump routes those outputs
        first (:meth:`_outputs_then_death`), then declares the death, unless
        the outputs themselves did (a sentinel)."""
        p = self._protocol
        if p.state is LinkState.READY and p.gone is None:
            _log.info("engine %d gone (%s): %s; routing the outputs it sent before (drain, at most %s s)",
                      self.engine_index, reason, message, limits.OUTPUT_DROP_GRACE)
            p.engine_gone(EngineDeadError(message, engine_index=self.engine_index, reason=reason))
            self._ending.set()
            self._wake_link_wait()
            if self._pump_wait is not None:
                self._pump_wait.cancel()

    def _wake_link_wait(self) -> None:
        if self._link_wait is not None:
            self._link_wait.cancel()

    def _route(self, batch: list[list[bytes]]) -> None:
        p = self._protocol
        now = self._last_activity  # the batch's receipt time (set by the caller)
        if self.config.pause_gc_while_routing and gc.isenabled():
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
            self._last_activity = trio.current_time()
            self._route(batch)
            await trio.lowlevel.checkpoint()

    async def _outputs_then_death(self) -> None:
        """Declare the death :meth:`_death_sign` recorded, after the engine's
        last outputs. libzmq keeps what arrived on a connection readable after
        reporting it closed, and a dead engine's output connection closes
        within milliseconds of its input one, so: read on while an output
        connection is up (at most ``limits.OUTPUT_DROP_GRACE`` seconds), route
        what is queued, then fail what is left."""
        p = self._protocol
        assert p.gone is not None
        deadline = trio.current_time() + limits.OUTPUT_DROP_GRACE
        while p.state is LinkState.READY and self._output_links > 0 and trio.current_time() < deadline:
            batch = None
            with trio.CancelScope(deadline=deadline) as self._pump_wait:
                batch = await self._output.recv_batch()
            self._pump_wait = None
            if batch:
                self._last_activity = trio.current_time()
                self._route(batch)
        await self._route_queued()
        _log.info("engine %d: drain done (%d output messages received in all)", self.engine_index,
                  p.messages_received)
        if p.state is LinkState.READY:
            p.engine_died(p.gone)

    async def _output_pump(self) -> None:
        sock = self._output
        p = self._protocol
        try:
            while p.state is LinkState.READY:
                if p.gone is not None:
                    await self._outputs_then_death()
                    return
                if self._output_dropped:
                    await self._output_link_dropped()
                    continue
                batch = None
                with trio.CancelScope() as self._pump_wait:  # cancelled on a drop or a death sign
                    batch = await sock.recv_batch()  # atomic: a cancel loses nothing
                self._pump_wait = None
                if batch is None:
                    continue
                self._last_activity = trio.current_time()
                self._route(batch)
        except trio.ClosedResourceError:
            return

    async def _input_pump(self) -> None:
        sock = self._input
        p = self._protocol
        timeout = self.config.send_timeout
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
                self._death_sign(
                    "unreachable", f"engine {self.engine_index} is not connected to the input socket (EHOSTUNREACH)"
                )
                return
            except SendTimeout:
                self._died(
                    "send_timeout",
                    f"engine {self.engine_index} stopped reading its input: a send waited {timeout} s",
                )
                return
            except trio.ClosedResourceError:
                return
            p.send_done(out)

    async def _watchdog(self) -> None:
        p = self._protocol
        timeout = self.config.silence_timeout
        if not math.isfinite(timeout):
            return
        while p.state is LinkState.READY:
            deadline = self._last_activity + timeout
            if trio.current_time() >= deadline:
                if p.inflight > 0:
                    self._died(
                        "silence",
                        f"engine {self.engine_index} sent nothing for {timeout} s with {p.inflight} requests in flight",
                    )
                    return
                self._last_activity = trio.current_time()
                continue
            await trio.sleep_until(deadline)

    async def _monitor_watch(self) -> None:
        assert self._monitor is not None
        sock = self._monitor
        try:
            while self._protocol.state is LinkState.READY:
                event, value, endpoint = parse_monitor_event(await sock.recv_multipart())
                if _engine_gone(self._peer_fds, event, value) and not self._closing:
                    self._death_sign(
                        "disconnected",
                        f"engine {self.engine_index} closed its input connection ({endpoint})",
                    )
                    return
        except trio.ClosedResourceError:
            return

    async def _output_monitor_watch(self) -> None:
        """Watch the output PULL's connections (zmq monitor). A connection that
        closes after its ZMTP handshake is an engine output link lost: libzmq
        closes it itself when a frame exceeds ``MAXMSGSIZE``, and the outputs
        still on it are gone. One that failed its handshake first (libzmq
        emits ``HANDSHAKE_FAILED_*`` right before its ``DISCONNECTED``: a
        probe, a port scan) is counted and ignored."""
        assert self._output_monitor is not None
        sock = self._output_monitor
        stray = False
        try:
            while self._protocol.state is LinkState.READY:
                event, _, endpoint = parse_monitor_event(await sock.recv_multipart())
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._output_links += 1
                    self._wake_link_wait()
                elif event & _HANDSHAKE_FAILED:
                    stray = True
                elif event == zmq.EVENT_DISCONNECTED:
                    if stray:
                        self.stray_output_connections += 1
                        _log.info("engine %d: a connection to the output socket (%s) failed its ZMTP handshake "
                                  "and was ignored", self.engine_index, endpoint)
                    elif not self._closing:
                        self._output_links = max(0, self._output_links - 1)
                        self._output_dropped = endpoint or "?"
                        if self._pump_wait is not None:
                            self._pump_wait.cancel()
                    stray = False
        except trio.ClosedResourceError:
            return

    async def _output_link_dropped(self) -> None:
        """The engine's output connection dropped. Route what arrived before
        the drop (final outputs, a sentinel), then stop reading for
        ``limits.OUTPUT_DROP_GRACE`` seconds: a dying engine's other signals
        (input disconnect, process exit) make it a death as usual. Otherwise
        the engine lives on (its PUSH reconnects) and everything whose outputs
        may have been on the lost connection fails with ``RemoteProtocolError``
        and is aborted (``EngineProtocol.output_lost``)."""
        endpoint, self._output_dropped = self._output_dropped, ""
        p = self._protocol
        await self._route_queued()
        if p.inflight or p.pending_utility_calls:
            with trio.move_on_after(limits.OUTPUT_DROP_GRACE):
                await self._ending.wait()
        if p.state is not LinkState.READY or p.gone is not None:
            return  # dead, or a death sign: the pump's loop declares it (_outputs_then_death)
        p.output_lost(
            f"engine {self.engine_index}'s output connection ({endpoint}) was dropped, by libzmq for a frame above "
            f"MAX_FRAME_BYTES ({limits.MAX_FRAME_BYTES} bytes, ZMQ_MAXMSGSIZE) or by a broken link: outputs on it "
            "may be lost"
        )
        if self.config.death_on_disconnect and self._output_links == 0:
            await self._await_output_link()

    async def _await_output_link(self) -> None:
        """No output connection is left: wait ``limits.OUTPUT_RECONNECT_GRACE``
        for the engine's PUSH to reconnect, else declare the engine dead (it
        can send nothing; new requests would wait for ``silence_timeout``)."""
        p = self._protocol
        # Its own scope: further drops (a reconnected link dropped again before
        # this task ran) do not end the wait; only the deadline, a new link, a
        # death sign or a death do.
        with trio.move_on_after(limits.OUTPUT_RECONNECT_GRACE):
            while self._output_links == 0 and p.state is LinkState.READY and p.gone is None:
                with trio.CancelScope() as self._link_wait:
                    await trio.sleep_forever()
        self._link_wait = None
        if self._output_links == 0 and p.state is LinkState.READY and p.gone is None:
            self._died(
                "output_disconnected",
                f"engine {self.engine_index}'s output connection closed and did not come back within "
                f"{limits.OUTPUT_RECONNECT_GRACE} s (limits.OUTPUT_RECONNECT_GRACE)",
            )

    async def _process_watch(self) -> None:
        assert self._process is not None
        code = await self._process.wait()
        _log.info("engine %d: launched engine process %d exited with code %s", self.engine_index,
                  self._process.pid, code)
        if not self._closing:
            self._death_sign("process_exit", f"engine process {self._process.pid} exited with code {code}")

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
    await _park(p, "send_waiter")


# ---------------------------------------------------------------------- connect


def _private_ipc_dir() -> str:
    # mkdtemp creates the directory with mode 0700 atomically: no window in
    # which another user could plant a socket file (checked in _ipc).
    return _ipc.private_ipc_dir(prefix="zmqd-")


def _format_launch(launch: str | Sequence[str], handshake_address: str) -> list[str]:
    """*launch* as an argv with ``{handshake_address}`` substituted.

    Raises:
        ValueError: an empty command, or a string that shell quoting rules
            cannot split (an unclosed quote); the message names ``launch``.
    """
    try:
        argv = shlex.split(launch) if isinstance(launch, str) else [str(a) for a in launch]
    except ValueError as exc:
        raise ValueError(f"launch: {launch!r} is not a command line: {exc}") from None
    if not argv or not argv[0]:
        raise ValueError("launch: the engine command is empty")
    return [a.replace("{handshake_address}", handshake_address) for a in argv]


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def _unwrap(eg: BaseExceptionGroup) -> BaseException:
    """The one meaningful exception of a nursery failure.

    Cancellations are dropped when something else failed; a group of nothing
    but cancellations becomes one bare ``Cancelled``, so the enclosing scope
    (and any ``except trio.Cancelled``) sees what it expects. Several real
    errors stay a group.
    """
    leaves = _leaves(eg)
    errors = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    if len(errors) == 1:
        return errors[0]
    if not errors and leaves:
        return leaves[0]
    return eg


def _kill_group(proc: trio.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _terminate(proc: trio.Process, grace: float) -> None:
    """SIGTERM the engine process, then SIGKILL its whole process group once it
    exited or after *grace* seconds. Shielded
    from cancellation; a KeyboardInterrupt (a second Ctrl-C) while waiting
    SIGKILLs the group at once, so no engine is orphaned."""
    try:
        await _terminate_gracefully(proc, grace)
    except BaseException:
        _kill_group(proc)
        raise


async def _terminate_gracefully(proc: trio.Process, grace: float) -> None:
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            _log.info("stopping launched engine process %d (SIGTERM, SIGKILL after %s s)", proc.pid, grace)
            # SIGTERM to the engine process alone: it stops its own workers (a
            # vLLM EngineCore whose worker was signalled too fails instead of
            # stopping, and waits out the grace). What is left of the group is
            # SIGKILLed below, as systemd's KillMode=mixed does.
            try:
                proc.send_signal(signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) engine acts on it only once resumed
            except ProcessLookupError:
                pass
            with trio.move_on_after(grace):
                await proc.wait()
        # Kill the whole group: vllm serve / EngineCore spawn workers.
        _kill_group(proc)
        with trio.move_on_after(2):
            await proc.wait()
        _log.info("launched engine process %d exited with code %s", proc.pid, proc.returncode)


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
    """HELLO -> INIT -> (READY on the handshake socket, ready response on the
    input socket, in either order). vLLM 0.32, ``docs/vllm-wire.md`` §5.1.

    *monitor* (``EVENT_ACCEPTED | EVENT_DISCONNECTED`` of *hs*): the engine
    keeps its handshake connection open from HELLO until it has sent both
    READY and its ready response (model loading included; vLLM sends the
    ready response first, TokenSpeed READY first); when it closes in between
    and the handshake does not complete within ``limits.OUTPUT_DROP_GRACE``
    (what was sent before the close is still read), the engine is gone:
    ``EngineHandshakeError`` at once instead of after *timeout*."""
    result: dict[str, Any] = {}
    complete = trio.Event()  # READY and the ready response both received

    def stage() -> str:
        if "identity" not in result:
            return "HELLO"
        if "ready_status" not in result:
            return "READY"
        return "input_registration"

    async def handshake_side() -> None:
        while True:
            msg = await hs.recv_multipart()
            if len(msg) != 2:
                raise EngineHandshakeError(f"handshake message has {len(msg)} frames, expected 2")
            identity, payload = msg
            try:
                status = wire.decode_handshake_status(payload)
            except RemoteProtocolError as exc:
                raise EngineHandshakeError(f"undecodable handshake message: {exc}") from exc
            if status.status == "HELLO":
                if "identity" in result:
                    raise EngineHandshakeError(f"second HELLO (identity {identity.hex()}) during the handshake")
                result["identity"] = identity
                _log.info("handshake: HELLO from engine identity %s (%s); sending INIT (input %s, output %s)",
                          identity.hex(), "local" if status.local else "remote", input_address, output_address)
                try:
                    await hs.send([identity, wire.encode_init(inputs=[input_address], outputs=[output_address])])
                except PeerUnreachable:
                    raise EngineHandshakeError(
                        "the engine closed its handshake connection right after HELLO (it exited or crashed)"
                    ) from None
                inp_ready_started.set()
            elif status.status == "READY":
                if result.get("identity") != identity:
                    raise EngineHandshakeError(f"READY from identity {identity.hex()} before its HELLO")
                result["ready_status"] = status
                _log.info("handshake: READY from engine identity %s", identity.hex())
                if "ready" in result:
                    complete.set()
                return
            else:
                raise EngineHandshakeError(f"unexpected handshake status {status.status!r}")

    async def input_side() -> None:
        msg = await inp.recv_multipart()
        if len(msg) != 2:
            raise EngineHandshakeError(f"input registration has {len(msg)} frames, expected 2")
        identity, payload = msg
        await inp_ready_started.wait()
        if identity != result.get("identity"):
            raise EngineHandshakeError(f"ready response from unknown identity {identity.hex()}")
        try:
            result["ready"] = wire.decode_ready_response(payload)
        except RemoteProtocolError as exc:
            raise EngineHandshakeError(f"bad EngineCoreReadyResponse: {exc}") from exc
        _log.info("handshake: ready response from engine identity %s on the input socket", identity.hex())
        if "ready_status" in result:
            complete.set()

    async def watch_process() -> None:
        assert process is not None
        code = await process.wait()
        raise EngineHandshakeError(f"engine process {process.pid} exited with code {code} during the handshake")

    async def watch_handshake_link() -> None:
        assert monitor is not None
        fds: set[int] = set()
        while True:
            event, value, _ = parse_monitor_event(await monitor.recv_multipart())
            if _engine_gone(fds, event, value):
                # What was sent right before the close (a HELLO, READY) is
                # still readable: give it the grace.
                with trio.move_on_after(limits.OUTPUT_DROP_GRACE):
                    await complete.wait()
                if complete.is_set():
                    return
                if "identity" in result:
                    raise EngineHandshakeError(
                        f"the engine closed its handshake connection while the handshake waited for {stage()}"
                        " (it exited or crashed)"
                    )
                # no HELLO came on it: a probe, or an engine not yet started; watch on

    inp_ready_started = trio.Event()
    try:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                if process is not None:
                    nursery.start_soon(watch_process)
                if monitor is not None:
                    nursery.start_soon(watch_handshake_link)

                async def both() -> None:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(handshake_side)
                        inner.start_soon(input_side)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(both)
    except trio.TooSlowError:
        _log.warning("handshake: timed out after %s s waiting for %s", timeout, stage())
        raise EngineHandshakeTimeout(
            f"engine handshake timed out after {timeout} s waiting for {stage()}", stage=stage()
        ) from None
    except BaseExceptionGroup as eg:
        raise _unwrap(eg) from None
    return result["identity"], result["ready"]


def _check_version(ready: wire.EngineCoreReadyResponse, config: ClientConfig) -> EngineVersion:
    """The version guard (:mod:`zmqdispatch.protocol.versions`): refuse an
    engine version the codec was not checked against, or warn when the caller
    allowed it."""
    try:
        version = check_engine_version(ready.vllm_version, allow_unknown=config.allow_unknown_engine_version)
    except ValueError as exc:
        raise EngineHandshakeError(str(exc)) from None
    if not version.known:
        _log.warning("%s; connecting anyway (allow_unknown_engine_version)", version.unknown_message())
    return version


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _engine_gone(peer_fds: set[int], event: int, value: int) -> bool:
    """Track a socket's connections (its monitor's ACCEPTED / DISCONNECTED);
    True when the last one closed.

    A stray connection (a port scan on a tcp input address, a probe on an ipc
    path) connects and closes without touching the engine's own connection,
    so only "no connection left" means the engine went away.
    """
    if event == zmq.EVENT_ACCEPTED:
        peer_fds.add(value)
        return False
    if event == zmq.EVENT_DISCONNECTED:
        peer_fds.discard(value)
        return not peer_fds
    return False


async def _await_reconnect(monitor: TrioSocket | None, timeout: float, peer_fds: set[int]) -> None:
    assert monitor is not None
    try:
        with trio.fail_after(timeout):
            while True:
                event, value, _ = parse_monitor_event(await monitor.recv_multipart())
                _engine_gone(peer_fds, event, value)
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
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
) -> AsyncIterator[EngineClient]:
    """Bind the three sockets, handshake one engine, and serve it.

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
    config = config or ClientConfig()
    if launch is not None:
        _format_launch(launch, "")  # refuse a malformed command before anything is bound
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
            ipc_dir = _private_ipc_dir()
        return f"ipc://{ipc_dir}/{name}"

    inp = ctx.socket(zmq.ROUTER, name="input", router_mandatory=True, sndhwm=config.send_hwm)
    out = ctx.socket(zmq.PULL, name="output", rcvhwm=0, maxmsgsize=limits.MAX_FRAME_BYTES)
    hs = ctx.socket(zmq.ROUTER, name="handshake", router_mandatory=True)
    process: trio.Process | None = None
    client: EngineClient | None = None
    monitor: TrioSocket | None = None
    peer_fds: set[int] = set()
    out_monitor: TrioSocket | None = None
    hs_monitor: TrioSocket | None = None
    try:
        # Created before bind: the output watch sees the engine's output connection drop.
        out_monitor = out.monitor(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED, name="output-monitor"
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
            await _await_reconnect(monitor, config.handshake_timeout, peer_fds)
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
                argv = _format_launch(launch, hs_address)
                try:
                    process = await trio.lowlevel.open_process(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=launch_stdout if launch_stdout is not None else sys.stderr.fileno(),
                        # A process group of its own (so a stop reaches its workers too), but
                        # inside the caller's session: a new session is a new scheduling
                        # autogroup, and a busy-polling engine there starves the client
                        # (docs/deployment.md).
                        process_group=0,
                    )
                except OSError as exc:
                    raise EngineHandshakeError(f"cannot start engine command {argv[0]!r}: {exc}") from exc
                _log.info("launched engine process %d: %s", process.pid, shlex.join(argv))
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
        _check_version(ready, config)
        engine_index = int.from_bytes(identity, "little") if len(identity) == 2 else 0
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
        client = EngineClient(
            protocol=protocol,
            ready=ready,
            config=config,
            input_sock=inp,
            output_sock=out,
            process=process,
            monitor_sock=monitor,
            output_monitor_sock=out_monitor,
        )
        client._bound_input, client._bound_output = input_address, output_address
        client._peer_fds = peer_fds
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._output_pump)
                nursery.start_soon(client._input_pump)
                nursery.start_soon(client._watchdog)
                if process is not None:
                    nursery.start_soon(client._process_watch)
                if monitor is not None:
                    nursery.start_soon(client._monitor_watch)
                nursery.start_soon(client._output_monitor_watch)
                nursery.start_soon(client._deadline_watch)
                try:
                    yield client
                finally:
                    client._closing = True
                    if protocol.state is LinkState.READY:
                        _log.info("closing the client of engine %d (%d live requests aborted)", engine_index,
                                  protocol.inflight)
                    # Streams still open (held by other tasks) would otherwise
                    # keep decoding on an engine we did not start
                    # (docs/known-failures.md K7).
                    closed = EngineDeadError("the engine client is closed", engine_index=engine_index, reason="closed")
                    protocol.abort(protocol.live_request_ids(), error=closed)
                    client._flush_aborts_nowait()
                    protocol.engine_died(closed)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise _unwrap(eg) from None
    finally:
        if client is not None:
            client._closing = True
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
                await _terminate(process, config.terminate_grace)
        finally:
            if ipc_dir is not None:
                shutil.rmtree(ipc_dir, ignore_errors=True)
