"""One client, many engines: the trio shell around
:class:`~zmqdispatch.protocol.engines.EngineSet` and
:class:`~zmqdispatch.protocol.placement.Placement`.

:func:`connect_engines` (also ``connect(..., data_parallel_size=N)``) binds one
handshake ROUTER (on one or several addresses) and keeps it open: every
engine that dials it (the ranks of ``vllm serve --headless --data-parallel-size
N``, independent engines, TokenSpeed ranks, a restarted rank) is handshaken
on its own, gets its **own** input ROUTER / output PULL pair (INIT names them),
and is served by its own :class:`~zmqdispatch.client.EngineConnection`, so its
sentinel, its connections closing and its silence are its own::

    handshake ROUTER (bind, stays open) <- every engine: HELLO / INIT / READY
    per engine: input ROUTER <- its DEALER, output PULL <- its PUSH, their monitors

:class:`MultiEngineClient` places each request (``Placement``: least loaded,
random ties, ``data_parallel_rank`` pins, the samples of one request on one
engine), routes aborts to the engine holding the request, and fans control
calls out (:meth:`MultiEngineClient.call_all`). One engine's death fails only
its requests, each with ``EngineDeadError(engine_index=...)``, and takes it out
of placement at its first death sign. Rules: ``docs/many-engines.md``.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import zmq

from . import _ipc, limits
from ._zmq_trio import HANDSHAKE_FAILED_EVENTS, PeerUnreachable, TrioSocket, ZmqContext, parse_monitor_event
from .addresses import check_address
from ._engine_lifecycle import check_version, format_launch, terminate, unwrap
from ._engine_lifecycle import launch as launch_engine
from .client import ClientConfig, EngineClient, EngineConnection
from .errors import (
    AddressBindError,
    EngineDeadError,
    EngineHandshakeError,
    EngineHandshakeTimeout,
    LocalProtocolError,
    NoEngineAvailableError,
    RequestRejected,
)
from .metrics import EngineStats
from .protocol.deadlines import Deadlines, effective_deadlines
from .protocol.engine import EngineProtocol, LinkState
from .protocol.engines import EngineSet, EngineState, EngineStatus, Route, format_ranks
from .protocol.handshake import Handshake, check_not_lockstep, is_hello
from .protocol.link import EngineLink
from .protocol.mailbox import Mailbox
from .protocol.placement import EngineLoad, Placement
from .protocol.runtime import Runtime
from .streams import (
    EngineRequest,
    RequestStream,
    SampleStream,
    StreamGroup,
    open_samples,
)

__all__ = ["ADDRESS_INDEX_STRIDE", "MultiEngineClient", "connect_engines"]

#: The ``engine_index`` step between handshake addresses: an engine that dialed
#: the k-th address (0-based, in the order given) has ``engine_index`` ``k *
#: ADDRESS_INDEX_STRIDE + identity``. The identity is 2 bytes (vLLM: the DP rank;
#: TokenSpeed: ``zmq_engine_index + dp_rank``), so no two addresses can collide,
#: and the engines of the first (or only) address keep their identity as index.
ADDRESS_INDEX_STRIDE = 1 << 16

_log = logging.getLogger("zmqdispatch.client")


@attrs.frozen(eq=False)
class _Hosting:
    """What the stream hosts of a :class:`MultiEngineClient` may do to it: its
    engine set, its engines, and three of its checks (bound methods)."""

    engines: EngineSet
    members: Mapping[int, _Member]
    #: ``(request, deadlines, pin) -> deadlines in force``: quorum, the
    #: validation engine's checks, a new id, a pinned engine that can start it
    validate: Callable[[EngineRequest, Deadlines | None, Any], Deadlines | None]
    #: ``(request_id, pin) -> EngineClient``: place a request being entered
    place: Callable[[str, int | None], EngineClient]
    #: raises ``EngineDeadError`` (closed) / ``NoEngineAvailableError`` (below quorum)
    check_quorum: Callable[[], None]


class _PlacedHost:
    """The :class:`~zmqdispatch.streams.StreamHost` of one placement: a request,
    or the ``n`` samples of one request. The first ``open`` (entering the
    stream) picks the engine; the samples opened after it go to the same
    engine (its prefix cache). Nothing is placed for a stream never entered."""

    __slots__ = ("_engine", "_hosting", "_pin", "runtime")

    def __init__(self, hosting: _Hosting, pin: int | None, runtime: Runtime) -> None:
        self._hosting = hosting
        self._pin = pin
        self._engine: EngineClient | None = None
        self.runtime = runtime

    def validate(self, request: EngineRequest, deadlines: Deadlines | None) -> Deadlines | None:
        return self._hosting.validate(request, deadlines, self._pin)

    def is_live(self, request_id: str) -> bool:
        return self._hosting.engines.route(request_id) is not None

    def open(self, request: EngineRequest, deadlines: Deadlines | None) -> Mailbox:
        hosting = self._hosting
        rid = self.runtime.request_id(request)
        engine = self._engine
        if engine is None:
            engine = self._engine = hosting.place(rid, self._pin)
        else:
            hosting.engines.request_started(rid, engine.engine_index)  # a sibling sample: the same engine
        try:
            return engine.stream_host.open(request, deadlines)
        except BaseException:
            hosting.engines.request_finished(rid)
            raise

    def abort(self, mailbox: Mailbox) -> None:
        if self._engine is not None:
            self._engine.stream_host.abort(mailbox)

    def check_alive(self) -> None:
        if self._engine is not None:
            self._engine.stream_host.check_alive()
        else:
            self._hosting.check_quorum()


class _GroupHost:
    """The :class:`~zmqdispatch.streams.StreamHost` of a stream group over many
    engines: each member is placed on its own."""

    __slots__ = ("_hosting", "runtime")

    def __init__(self, hosting: _Hosting, runtime: Runtime) -> None:
        self._hosting = hosting
        self.runtime = runtime

    def validate(self, request: EngineRequest, deadlines: Deadlines | None) -> Deadlines | None:
        return self._hosting.validate(request, deadlines, getattr(request, "data_parallel_rank", None))

    def is_live(self, request_id: str) -> bool:
        return self._hosting.engines.route(request_id) is not None

    def open(self, request: EngineRequest, deadlines: Deadlines | None) -> Mailbox:
        pin = getattr(request, "data_parallel_rank", None)
        return _PlacedHost(self._hosting, pin, self.runtime).open(request, deadlines)

    def abort(self, mailbox: Mailbox) -> None:
        hosting = self._hosting
        route = hosting.engines.route(mailbox.request_id)
        if route is not None:
            hosting.members[route.engine_index].client.stream_host.abort(mailbox)
            return
        # Out of the table (its engine is dying): the owner is whichever engine
        # still holds this very mailbox (abort_mailbox checks identity).
        for m in hosting.members.values():
            m.client.stream_host.abort(mailbox)

    def check_alive(self) -> None:
        self._hosting.check_quorum()


@attrs.define
class _Member:
    """One engine incarnation served by the client."""

    client: EngineClient
    connection: EngineConnection
    route: Route
    sockets: list[TrioSocket]
    handshake_address: str = ""
    identity: bytes = b""


def _no_member(member: _Member) -> None:
    raise AssertionError("a MultiEngineClient sets this hook")  # pragma: no cover


def _nothing() -> None:
    raise AssertionError("a MultiEngineClient sets this hook")  # pragma: no cover


@attrs.define(eq=False)
class _Serving:
    """What :func:`connect_engines` (the shell) and the :class:`MultiEngineClient`
    it serves share: the engines served, the handshakes under way, whether the
    client is closed, and the client's two hooks the shell calls (set by the
    client)."""

    #: every engine's current incarnation, by ``engine_index`` (dead ones included)
    members: dict[int, _Member] = attrs.Factory(dict)
    #: the handshakes under way, by ``engine_index``
    pending: dict[int, _Pending] = attrs.Factory(dict)
    closed: bool = False
    #: an engine completed its handshake: serve it (a new engine, or a new incarnation)
    engine_joined: Callable[[_Member], None] = _no_member
    #: wake whoever waits for an engine state change
    state_changed: Callable[[], None] = _nothing


class MultiEngineClient:
    """Many engines behind one client. Create with :func:`connect_engines`
    (or ``connect(..., data_parallel_size=N)``).

    The request API is :class:`~zmqdispatch.client.EngineClient`'s
    (:meth:`generate`, :meth:`abort`, :meth:`check_request`); each request
    goes to one engine. One engine: ``client.engine(i)``, an ``EngineClient``
    (its control plane, its stats, its ``ready``).

    Attributes:
        config: the :class:`ClientConfig` in force (for every engine).
        quorum: the number of ``up`` engines below which :meth:`generate`
            refuses new requests (``NoEngineAvailableError``).
    """

    def __init__(self, *, config: ClientConfig, quorum: int, rng: Any = None, serving: _Serving | None = None) -> None:
        """*serving*: the state shared with the shell serving this client
        (:func:`connect_engines` passes its own)."""
        self.config = config
        self.quorum = quorum
        self._set = EngineSet()
        self._placement = Placement(self._set, rng=rng)
        self._serving = serving = serving if serving is not None else _Serving()
        self._members = serving.members
        self._drains: dict[int, trio.Event] = {}
        self._changed = trio.Event()  # set (and replaced) on every engine state change
        serving.engine_joined = self._engine_joined
        serving.state_changed = self._state_changed
        self._hosting = _Hosting(self._set, self._members, self._validate, self._place, self._check_quorum)

    def __repr__(self) -> str:
        states = ", ".join(f"{s.engine_index}:{s.state.value}" for s in self._set.snapshot())
        return f"<MultiEngineClient engines=[{states}] in_flight={self._set.total_in_flight}>"

    # ------------------------------------------------------------------ engines and states

    @property
    def engines(self) -> dict[int, EngineClient]:
        """Every known engine's current incarnation, by ``engine_index`` (dead ones included)."""
        return {i: m.client for i, m in sorted(self._members.items())}

    def engine(self, engine_index: int) -> EngineClient:
        """The :class:`EngineClient` of one engine (its control plane, stats, ``ready``).

        Raises:
            LocalProtocolError: no engine has that index (the message lists the known ones).
        """
        m = self._members.get(engine_index)
        if m is None:
            raise LocalProtocolError(
                f"engine {engine_index!r} is not known (known: {format_ranks(self._members)})"
            )
        return m.client

    def states(self) -> tuple[EngineStatus, ...]:
        """Every engine's :class:`~zmqdispatch.protocol.engines.EngineStatus`
        (``up`` / ``draining`` / ``dead`` with its reason, incarnation, in flight), by index."""
        return self._set.snapshot()

    def engine_of(self, request_id: str) -> int | None:
        """The ``engine_index`` a live request was placed on (None when it is
        not live: not entered yet, finished, or its engine died)."""
        route = self._set.route(request_id)
        return None if route is None else route.engine_index

    def origin(self, engine_index: int) -> tuple[str, int]:
        """Where an engine came from: ``(handshake address it dialed, its
        identity as an int)`` (vLLM: its DP rank). ``engine_index`` is
        ``position of that address * ADDRESS_INDEX_STRIDE + identity``.

        Raises:
            LocalProtocolError: no engine has that index.
        """
        self.engine(engine_index)
        m = self._members[engine_index]
        return m.handshake_address, int.from_bytes(m.identity, "little")

    def loads(self) -> tuple[EngineLoad, ...]:
        """What placement sees of each engine (own requests, reported load terms)."""
        return self._placement.loads()

    @property
    def pending_handshakes(self) -> tuple[int, ...]:
        """The ``engine_index`` of each engine whose handshake is under way (it
        said HELLO, not yet READY), at most ``limits.MAX_PENDING_HANDSHAKES``
        (or ``data_parallel_size``) at once."""
        return tuple(sorted(self._serving.pending))

    @property
    def up_count(self) -> int:
        return self._set.up_count

    @property
    def has_quorum(self) -> bool:
        """At least :attr:`quorum` engines are ``up``."""
        return self._set.has_quorum(self.quorum)

    @property
    def is_alive(self) -> bool:
        """The client takes new requests: not closed, and :attr:`has_quorum`."""
        return not self._serving.closed and self.has_quorum

    @property
    def runtime(self) -> Runtime:
        """The engines' runtime (all engines of one client speak the same one)."""
        return self._any().runtime

    @property
    def engine_index(self) -> None:
        """None: requests are placed per request (``EngineClient.engine_index``
        names the one engine of a single-engine client)."""
        return None

    @property
    def max_model_len(self) -> int:
        """The smallest ``max_model_len`` among the engines (a request that fits it fits any)."""
        return min(m.client.max_model_len for m in self._members.values())

    @property
    def ready(self) -> Any:
        """The ready response of the lowest-index engine (``client.engine(i).ready`` for one)."""
        return self._any().ready

    def _any(self) -> EngineClient:
        if not self._members:
            raise LocalProtocolError("no engine has completed its handshake")
        return self._members[min(self._members)].client

    async def wait_for_engines(self, n: int) -> None:
        """Wait until at least *n* engines are ``up`` (e.g. after a restart, or
        for engines that dial in later). No timeout of its own: wrap it in
        ``trio.move_on_after``."""
        while self._set.up_count < n:
            await self._changed.wait()

    def _state_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ drain

    def start_drain(self, engine_index: int) -> bool:
        """Stop placing new requests on the engine (pinned ones get
        ``EngineDrainingError``); its requests go on. Returns whether it is
        already drained. Synchronous, idempotent.

        Raises:
            LocalProtocolError: the engine is unknown or dead.
        """
        drained = self._set.drain(engine_index)
        _log.info("engine %d: draining (%d in flight)", engine_index, self._set.in_flight(engine_index))
        self._state_changed()
        return drained

    async def drain(self, engine_index: int) -> None:
        """:meth:`start_drain`, then wait until the engine has no request in
        flight (or died). The engine stays ``draining`` (connected, serving
        control calls) until :meth:`undrain`. Cancellation: the wait ends, the
        engine stays ``draining``."""
        if self.start_drain(engine_index):
            await trio.lowlevel.checkpoint()
            return
        event = self._drains.setdefault(engine_index, trio.Event())
        await event.wait()

    def undrain(self, engine_index: int) -> None:
        """Take the engine back into placement (``up``)."""
        self._set.undrain(engine_index)
        self._drains.pop(engine_index, None)
        self._state_changed()

    def _drain_check(self, engine_index: int) -> None:
        event = self._drains.get(engine_index)
        if event is not None and (
            self._set.is_drained(engine_index) or self._set.state(engine_index).state is EngineState.DEAD
        ):
            del self._drains[engine_index]
            event.set()

    # ------------------------------------------------------------------ requests

    def check_request(self, request: Any) -> None:
        """Validate *request* against the engine it is pinned to, or against
        the engine with the smallest ``max_model_len`` (nothing is sent).
        Raises what :meth:`EngineClient.check_request` raises."""
        pin = getattr(request, "data_parallel_rank", None)
        self._validation_engine(pin, "").check_request(request)

    def _validation_engine(self, pin: Any, request_id: str) -> EngineClient:
        if pin is not None:
            if type(pin) is not int or pin not in self._members:
                raise RequestRejected(
                    f"data_parallel_rank {pin!r} is not an engine of this client; valid ranks: "
                    f"{format_ranks(self._members)}",
                    request_id=request_id,
                    field="data_parallel_rank",
                )
            return self._members[pin].client
        # The smallest context window: a request valid there is valid on every engine.
        return min((m.client for m in self._members.values()), key=lambda c: c.max_model_len)

    def _check_quorum(self) -> None:
        if self._serving.closed:
            raise EngineDeadError("the engine client is closed", reason="closed")
        if not self._set.has_quorum(self.quorum):
            words = {s.engine_index: s.state.value if s.reason is None else f"{s.state.value}: {s.reason}"
                     for s in self._set.snapshot()}
            raise NoEngineAvailableError(
                f"{self._set.up_count} engine(s) up, below the quorum of {self.quorum}: "
                + ", ".join(f"engine {i} {w}" for i, w in words.items()),
                states=words,
            )

    def _validate(self, request: EngineRequest, deadlines: Deadlines | None, pin: Any) -> Deadlines | None:
        self._check_quorum()
        engine = self._validation_engine(pin, "")
        engine.check_request(request)  # first: refuses the other runtime's request type
        rid = engine.runtime.request_id(request)
        in_force = effective_deadlines(deadlines)
        self._set.check_new_ids((rid,))
        if pin is not None:
            self._set.check_can_start(pin, rid)
        return in_force

    def _place(self, request_id: str, pin: int | None) -> EngineClient:
        """Place one request (its stream is being entered) and return its engine."""
        self._check_quorum()
        route = self._placement.place(request_id, data_parallel_rank=pin)
        return self._members[route.engine_index].client

    def generate(self, request: EngineRequest, *, deadlines: Deadlines | None = None) -> RequestStream:
        """Validate *request*; return its stream (``async with``), as
        :meth:`EngineClient.generate`. The engine is picked when the stream is
        entered (least loaded; ``request.data_parallel_rank`` pins it), so a
        stream never entered is never placed.

        Raises (now, nothing sent):
            RequestRejected: validation failed (against the pinned engine, or
                the smallest ``max_model_len``); ``data_parallel_rank`` names no
                engine (``field="data_parallel_rank"``, the message lists the ranks).
            DuplicateRequestIdError: the id is live on some engine.
            NoEngineAvailableError: fewer than :attr:`quorum` engines are up.
            EngineDeadError / EngineDrainingError: the pinned engine is dead / draining.
        Entering raises the same when the engines changed meanwhile.
        """
        host = _PlacedHost(self._hosting, getattr(request, "data_parallel_rank", None), self.runtime)
        in_force = host.validate(request, deadlines)
        return RequestStream(host, host.runtime.request_id(request), request, in_force)

    def generate_samples(self, requests: Sequence[EngineRequest], *, deadlines: Deadlines | None = None
                         ) -> SampleStream:
        """:meth:`EngineClient.generate_samples`, every sample on one engine
        (the least loaded when entered, or the first sample's ``data_parallel_rank``)."""
        pin = getattr(requests[0], "data_parallel_rank", None) if requests else None
        return open_samples(_PlacedHost(self._hosting, pin, self.runtime), requests, deadlines)

    def stream_group(self) -> StreamGroup:
        """:meth:`EngineClient.stream_group` over every engine: each member is
        placed on its own (pins honoured)."""
        return StreamGroup(_GroupHost(self._hosting, self.runtime))

    def stats(self) -> dict[int, EngineStats]:
        """Each engine's :class:`~zmqdispatch.metrics.EngineStats`, by index."""
        return {i: m.client.stats() for i, m in sorted(self._members.items())}

    # ------------------------------------------------------------------ control plane

    async def call_all(self, method: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Call ``EngineClient.<method>(*args, **kwargs)`` (``is_sleeping``,
        ``reset_prefix_cache``, ``sleep``, ``call_utility``, ...) on every
        engine that is not dead, concurrently; one result per engine, by
        ``engine_index``. An engine's failure is its value (the exception
        instance), so one engine's error hides no other's result.

        Raises:
            AttributeError: no such ``EngineClient`` method (nothing is sent).
        """
        targets = {i: m.client for i, m in sorted(self._members.items())
                   if self._set.state(i).state is not EngineState.DEAD}
        calls = {i: getattr(c, method) for i, c in targets.items()}
        results: dict[int, Any] = {}

        async def one(i: int, fn: Callable[..., Any]) -> None:
            try:
                results[i] = await fn(*args, **kwargs)
            except Exception as exc:  # the engine's outcome, reported per engine
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i, fn in calls.items():
                nursery.start_soon(one, i, fn)
        return dict(sorted(results.items()))

    async def call_utility(self, method: str, *args: Any, engine_index: int,
                           timeout: float | None = None) -> Any:
        """``EngineClient.call_utility`` on one engine (see :meth:`call_all` for every engine)."""
        return await self.engine(engine_index).call_utility(method, *args, timeout=timeout)

    # ------------------------------------------------------------------ engine events (shell)

    def _engine_joined(self, member: _Member) -> None:
        index = member.route.engine_index
        if index in self._members:
            route = self._set.engine_returned(index)
        else:
            route = self._set.add_engine(index)
        member.route = route
        self._members[index] = member
        conn = member.connection
        protocol = conn.protocol
        engines = self._set
        placement = self._placement
        drains = self._drains
        finished = engines.request_finished

        def on_retired(mb: Mailbox) -> None:
            finished(mb.request_id, route)
            if drains:
                self._drain_check(index)

        def on_ending(exc: EngineDeadError) -> None:
            if self._serving.closed:
                return
            if self._members.get(index) is member and engines.state(index).state is not EngineState.DEAD:
                lost = engines.engine_died(index, exc.reason)
                _log.warning("engine %d out of placement (%s): %d request(s) on it fail with its death; %d of "
                             "%d engine(s) up", index, exc.reason, len(lost), engines.up_count,
                             len(self._members))
                self._drain_check(index)
                self._state_changed()

        if protocol.runtime is Runtime.VLLM:
            def on_load(stats: Any, timestamp: float | None) -> None:
                placement.report_scheduler_stats(index, route.incarnation, stats, timestamp)
        else:
            def on_load(stats: Any, timestamp: float | None) -> None:
                placement.report_load(index, route.incarnation, num_running=stats.num_running,
                                      num_waiting=stats.num_waiting,
                                      kv_cache_usage=stats.kv_usage if stats.kv_total_pages > 0 else None)

        protocol.on_retired = on_retired
        protocol.on_load = on_load
        conn.on_ending = on_ending
        self._state_changed()


@attrs.define
class _Pending:
    """An engine mid-handshake: its machine and its fresh socket pair."""

    identity: bytes
    engine_index: int
    handshake_address: str
    machine: Handshake
    inp: TrioSocket
    out: TrioSocket
    monitor: TrioSocket | None
    out_monitor: TrioSocket
    input_address: str
    output_address: str
    ready_status: trio.Event = attrs.Factory(trio.Event)
    #: the scope of its handshake task, cancelled when the engine restarts mid-handshake
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: its connection to the handshake ROUTER (the fd its HELLO came on; -1: unknown)
    handshake_fd: int = -1
    #: the wait of its handshake task, until the machine's next deadline (moved by :meth:`wake`)
    wait: trio.CancelScope | None = None

    def wake(self) -> None:
        """Its machine's deadline moved (its handshake connection closed): its
        task waits until the new one."""
        if self.wait is not None:
            self.wait.deadline = self.machine.next_deadline()

    def sockets(self) -> list[TrioSocket]:
        return [s for s in (self.monitor, self.out_monitor, self.out, self.inp) if s is not None]


def _any_port(host: str) -> str:
    """``tcp://`` *host* with port 0 (the bound address names the port picked)."""
    return "tcp://" + host + ":0"


def _close_sockets(sockets: Sequence[TrioSocket]) -> None:
    """Close one engine's sockets: monitors first, the input ROUTER last and
    lingering (queued ABORTs leave in the background)."""
    for s in sockets:
        if s.name in ("input", "output"):
            s.disable_monitor()
    for s in sockets:
        if s.name == "input":
            s.close(linger_ms=1000)
        else:
            s.close()


@asynccontextmanager
async def connect_engines(
    handshake_address: str | Sequence[str] | None = None,
    *,
    data_parallel_size: int = 1,
    quorum: int = 1,
    launch: str | Sequence[str] | None = None,
    config: ClientConfig | None = None,
    launch_stdout: int | None = None,
    runtime: Runtime | str | None = None,
    data_plane_host: str | None = None,
    rng: Any = None,
) -> AsyncIterator[MultiEngineClient]:
    """Bind the handshake ROUTER, wait for *data_parallel_size* engines, and serve them all.

    Args:
        handshake_address: where the engines dial (``tcp://HOST:PORT`` for
            ``vllm serve --headless --data-parallel-address HOST
            --data-parallel-rpc-port PORT``), or several addresses, one
            handshake ROUTER each (independent engines, e.g. two ``vllm
            serve``, each DP rank 0): an engine's ``engine_index`` is
            ``k * ADDRESS_INDEX_STRIDE + identity`` for the k-th address
            (0-based, in the order given), so engines of the first address
            keep their rank as index and ``data_parallel_rank`` pins that
            index (:meth:`MultiEngineClient.origin` maps it back). Default: a
            private ``ipc://`` path. The
            socket stays open: engines that dial later (scale out, a restarted
            rank) are handshaken and placed while the client runs.
        data_parallel_size: engines to wait for before yielding, over every
            address (vLLM's name; on the first address each engine's identity,
            its DP rank, is its ``engine_index``).
        quorum: below this many ``up`` engines :meth:`MultiEngineClient.generate`
            refuses new requests (``NoEngineAvailableError``); requests on
            live engines go on, and the client serves again once engines return.
        launch / launch_stdout / runtime / config: as :func:`zmqdispatch.connect`
            (one launched process may run every rank: ``zmqdispatch mock-engine
            --data-parallel-size N``).
        data_plane_host: bind each engine's socket pair on ``tcp://HOST:<free port>``
            (engines on other hosts) instead of private ``ipc://`` paths. Use an
            address of this host the engines can reach; nothing else is bound
            unless asked.
        rng: the placement's tie-break ``random.Random`` (tests seed it).

    Yields:
        a :class:`MultiEngineClient` with at least *data_parallel_size* engines up.

    Raises:
        EngineHandshakeTimeout: fewer than *data_parallel_size* engines completed
            their handshake within ``handshake_timeout``.
        EngineHandshakeError: an engine's handshake failed at startup (malformed,
            a lock-step MoE rank, a refused version), or the launched process exited.
        ValueError: ``data_parallel_size`` / ``quorum`` out of range, or a fixed
            ``config.input_address`` / ``output_address`` (each engine needs its own pair).
        InvalidAddressError / AddressBindError: as :func:`zmqdispatch.connect`.

    After startup a failed handshake (a lock-step rank, a refused version, a
    timeout) is logged at WARNING and that engine is not served; the others go on.
    An engine that says HELLO again before its READY (it restarted during its
    handshake) has its handshake started over, at startup too.

    Cancellation: as :func:`zmqdispatch.connect`, for every engine.
    """
    config = config or ClientConfig()
    if type(data_parallel_size) is not int or not 1 <= data_parallel_size <= 65536:
        raise ValueError(f"data_parallel_size: expected 1..65536 engines, got {data_parallel_size!r}")
    if type(quorum) is not int or not 1 <= quorum:
        raise ValueError(f"quorum: expected an int >= 1, got {quorum!r}")
    if config.input_address is not None or config.output_address is not None:
        raise ValueError("input_address / output_address: each engine gets a socket pair of its own; "
                         "use data_plane_host= to bind them on tcp")
    addresses = [handshake_address] if isinstance(handshake_address, str) else list(handshake_address or [])
    if launch is not None:
        format_launch(launch, "")
    for a in addresses:
        check_address(a, role="handshake_address", any_port=launch is not None)
    if data_plane_host is not None:
        check_address(_any_port(data_plane_host), role="data_plane_host", any_port=True)
    wanted_runtime = runtime
    ctx = ZmqContext()
    ipc_dir: str | None = None
    seq = itertools.count()

    def ipc(name: str) -> str:
        nonlocal ipc_dir
        if ipc_dir is None:
            ipc_dir = _ipc.private_ipc_dir()
        return f"ipc://{ipc_dir}/{name}"

    async def bind(sock: TrioSocket, address: str, role: str) -> str:
        try:
            prepared = await _ipc.prepare_bind(address)
        except OSError as exc:
            raise AddressBindError(f"{role}: cannot bind {address!r}: {exc.strerror or exc}",
                                   address=address, role=role, errno=exc.errno) from None
        return sock.bind(prepared, role=role)

    serving = _Serving()
    client = MultiEngineClient(config=config, quorum=quorum, rng=rng, serving=serving)
    # One handshake ROUTER per address: engines of different addresses may
    # share an identity (two independent engines, both DP rank 0), which one
    # ROUTER could not tell apart. Handover: a restarted engine dials with its
    # old identity, possibly before libzmq reaped the dead process's connection
    # (none at all when its host vanished without closing it); the newcomer
    # must get the identity.
    sockets = [ctx.socket(zmq.ROUTER, name="handshake", router_mandatory=True, router_handover=True)
               for _ in range(max(1, len(addresses)))]
    # Each handshake ROUTER's connections (created before bind: no event
    # missed): an engine whose handshake connection closes before its READY
    # (it exited or crashed) is dropped after the drop grace, not at the timeout.
    hs_monitors = ([hs.monitor(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED, name="handshake-monitor")
                    for hs in sockets] if config.death_on_disconnect else [])
    process: trio.Process | None = None
    pending = serving.pending  # by engine_index
    max_pending = max(limits.MAX_PENDING_HANDSHAKES, data_parallel_size)
    startup = True
    startup_error: list[BaseException] = []
    started = trio.Event()

    def fail_startup(exc: BaseException) -> None:
        if startup:
            startup_error.append(exc)
            started.set()

    async def new_pair(identity: bytes, index: int, address: str) -> _Pending:
        n = next(seq)
        inp = ctx.socket(zmq.ROUTER, name="input", router_mandatory=True, sndhwm=config.send_hwm)
        out = ctx.socket(zmq.PULL, name="output", rcvhwm=0, maxmsgsize=limits.MAX_FRAME_BYTES)
        out_monitor = out.monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS,
                                  name="output-monitor")
        monitor = None
        if config.death_on_disconnect:
            monitor = inp.monitor(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED,
                                  name="input-monitor")
        try:
            if data_plane_host is None:
                in_addr = await bind(inp, ipc(f"e{index}.{n}.in"), "input_address")
                out_addr = await bind(out, ipc(f"e{index}.{n}.out"), "output_address")
            else:
                in_addr = await bind(inp, _any_port(data_plane_host), "input_address")
                out_addr = await bind(out, _any_port(data_plane_host), "output_address")
        except BaseException:
            _close_sockets([s for s in (monitor, out_monitor, out, inp) if s is not None])
            raise
        machine = Handshake(now=trio.current_time(), timeout=config.handshake_timeout,
                            input_address=in_addr, output_address=out_addr)
        return _Pending(identity, index, address, machine, inp, out, monitor, out_monitor, in_addr, out_addr)

    async def engine_handshake(p: _Pending, nursery: trio.Nursery) -> None:
        """The rest of one engine's handshake (its ready response on its own
        input socket, its READY via the handshake task), then serve it."""
        with p.scope:
            await _engine_handshake(p, nursery)

    async def _engine_handshake(p: _Pending, nursery: trio.Nursery) -> None:
        index = p.engine_index
        try:
            # Until READY and the ready response, or the machine's next deadline
            # (the timeout; the grace after its handshake connection closed: p.wake).
            while True:
                with trio.move_on_at(p.machine.next_deadline()) as p.wait:
                    while p.machine.wants_ready_responses:
                        step = p.machine.input_received(await p.inp.recv_multipart(), trio.current_time())
                        _log.info("handshake: ready response from engine identity %s on its input socket",
                                  step.identity.hex())
                    await p.ready_status.wait()
                if not p.wait.cancelled_caught:
                    break
                p.machine.timer_fired(trio.current_time())  # raises past a deadline
            p.wait = None
            ((identity, ready),) = p.machine.results()
            check_version(ready, allow_unknown=config.allow_unknown_engine_version)
            resolved = Runtime.resolve(wanted_runtime, ready)
            check_not_lockstep(ready, identity, vllm=resolved is Runtime.VLLM)
            if serving.members and resolved is not client.runtime:
                raise EngineHandshakeError(
                    f"engine {index} is a {resolved.value} engine; this client's engines are {client.runtime.value}"
                )
        except BaseException as exc:
            if pending.get(index) is p:
                del pending[index]
            _close_sockets(p.sockets())
            if isinstance(exc, EngineHandshakeTimeout):
                exc = EngineHandshakeTimeout(
                    f"engine {index}: handshake timed out after {config.handshake_timeout} s waiting for "
                    f"{p.machine.stage()}", stage=p.machine.stage())
            if not isinstance(exc, Exception):
                raise
            _log.warning("engine %d (identity %s): handshake failed: %s", index, p.identity.hex(), exc)
            fail_startup(exc)
            serving.state_changed()
            return
        if pending.get(index) is p:
            del pending[index]
        link = EngineLink(now=trio.current_time(), silence_timeout=config.silence_timeout,
                          watch_input=config.death_on_disconnect, await_output_reconnect=config.death_on_disconnect)
        link.engine_index = index
        protocol = EngineProtocol(engine_index=index, identity=identity, max_pending_tokens=config.max_pending_tokens,
                                  max_decode_errors=config.max_decode_errors, runtime=resolved,
                                  timer=trio.current_time)
        conn = EngineConnection(protocol=protocol, link=link, input_sock=p.inp, output_sock=p.out, process=None,
                                monitor_sock=p.monitor, output_monitor_sock=p.out_monitor,
                                send_timeout=config.send_timeout,
                                pause_gc_while_routing=config.pause_gc_while_routing)
        engine = EngineClient(connection=conn, ready=ready, config=config, input_address=p.input_address,
                              output_address=p.output_address)
        member = _Member(engine, conn, Route(index, 0), p.sockets(), p.handshake_address, identity)
        serving.engine_joined(member)
        _log.info("engine %d ready (identity %s on %s, incarnation %d): %s, version %s, max_model_len %d; "
                  "input %s, output %s", index, identity.hex(), p.handshake_address, member.route.incarnation,
                  resolved.value, ready.vllm_version, ready.max_model_len, p.input_address, p.output_address)
        if startup and client.up_count >= data_parallel_size:
            started.set()
        nursery.start_soon(serve_engine, member)

    async def serve_engine(member: _Member) -> None:
        conn = member.connection
        try:
            async with trio.open_nursery() as tasks:
                conn.start(tasks)
                await conn.wait_dead()
                tasks.cancel_scope.cancel()
        finally:
            conn.close_link()
            _close_sockets(member.sockets)

    async def handshake_side(nursery: trio.Nursery, hs: TrioSocket, base: int, address: str) -> None:
        """The handshake ROUTER of one address: its engines' HELLO and READY."""
        while True:
            try:
                frames, fd = await hs.recv_multipart_from()
            except trio.ClosedResourceError:
                if serving.closed:
                    return  # closed first when the client closes (below)
                raise
            identity = frames[0] if frames else b""
            rank = int.from_bytes(identity, "little")
            if rank >= ADDRESS_INDEX_STRIDE:
                _log.warning("handshake on %s: identity %s refused: an engine identity is 2 bytes (its rank)",
                             address, identity.hex())
                continue
            index = base + rank
            p = pending.get(index)
            if p is not None and is_hello(frames):
                # HELLO again from an identity mid-handshake: that engine
                # restarted before READY (it crashed while loading, its
                # supervisor started it again); the INIT went to a process
                # that is gone. Drop that attempt (its task closes its sockets)
                # and start over.
                _log.warning("handshake on %s: engine identity %s said HELLO again during its handshake (it "
                             "restarted); starting its handshake over", address, identity.hex())
                del pending[index]
                p.scope.cancel()
                p = None
            if p is None and len(pending) >= max_pending:
                _log.warning("handshake on %s: HELLO from identity %s refused: %d handshakes are under way, the "
                             "most at once (limits.MAX_PENDING_HANDSHAKES); it may dial again", address,
                             identity.hex(), len(pending))
                continue
            try:
                if p is None:
                    old = serving.members.get(index)
                    if old is not None and old.connection.protocol.state is LinkState.READY:
                        # Same identity, a new HELLO: that rank restarted; its old
                        # incarnation is gone (its requests fail, its sockets close).
                        old.connection.protocol.engine_died(EngineDeadError(
                            f"engine {index} dialed the handshake again (it restarted)", engine_index=index,
                            reason="restarted"))
                    p = await new_pair(identity, index, address)
                    try:
                        step = p.machine.handshake_received(frames, trio.current_time())
                    except BaseException:
                        _close_sockets(p.sockets())
                        raise
                    pending[index] = p
                    p.handshake_fd = fd
                    p.machine.peer_connected(fd)
                    _log.info("handshake: HELLO from engine identity %s (%s); sending INIT (input %s, output %s)",
                              identity.hex(), "local" if step.local else "remote", p.input_address,
                              p.output_address)
                    try:
                        assert step.reply is not None
                        await hs.send(step.reply)
                    except PeerUnreachable:
                        raise p.machine.init_unreachable(identity) from None
                    nursery.start_soon(engine_handshake, p, nursery)
                else:
                    step = p.machine.handshake_received(frames, trio.current_time())
                    if step.event == "READY":
                        _log.info("handshake: READY from engine identity %s", identity.hex())
                        p.ready_status.set()
            except (EngineHandshakeError, AddressBindError) as exc:
                if p is not None and pending.get(index) is p:
                    del pending[index]
                    _close_sockets(p.sockets())
                _log.warning("handshake: identity %s refused: %s", identity.hex(), exc)
                fail_startup(exc)

    async def watch_handshake_link(monitor: TrioSocket, address: str) -> None:
        """One handshake ROUTER's connections closing: the handshake under way
        on that connection (its HELLO's) learns it (``Handshake.peer_disconnected``)."""
        try:
            while True:
                event, fd, _ = parse_monitor_event(await monitor.recv_multipart())
                if event != zmq.EVENT_DISCONNECTED:
                    continue
                for p in list(pending.values()):
                    if p.handshake_fd == fd and p.handshake_address == address:
                        p.machine.peer_disconnected(fd, trio.current_time())
                        p.wake()
        except trio.ClosedResourceError:
            return

    async def watch_process() -> None:
        assert process is not None
        code = await process.wait()
        _log.info("launched engine process %d exited with code %s", process.pid, code)
        fail_startup(EngineHandshakeError(f"engine process {process.pid} exited with code {code} during the "
                                          "handshake"))
        for m in list(serving.members.values()):
            m.connection.process_exited(process.pid, code)

    def close_handshake() -> None:
        for hs, monitor in zip(sockets, hs_monitors, strict=False):
            hs.disable_monitor()
            monitor.close()
        for hs in sockets:
            hs.close()

    try:
        bound = [await bind(hs, a, "handshake_address")
                 for hs, a in zip(sockets, addresses or [ipc("handshake.sock")], strict=True)]
        _log.info("bound handshake %s; waiting for %d engine(s), timeout %s s", ", ".join(bound),
                  data_parallel_size, config.handshake_timeout, extra={"zmqdispatch_wait": True})
        if launch is not None:
            process = await launch_engine(launch, bound[0], launch_stdout, config.terminate_grace)
        try:
            async with trio.open_nursery() as nursery:
                for k, (hs, address) in enumerate(zip(sockets, bound, strict=True)):
                    nursery.start_soon(handshake_side, nursery, hs, k * ADDRESS_INDEX_STRIDE, address)
                for monitor, address in zip(hs_monitors, bound, strict=False):
                    nursery.start_soon(watch_handshake_link, monitor, address)
                if process is not None:
                    nursery.start_soon(watch_process)
                with trio.move_on_after(config.handshake_timeout) as startup_scope:
                    await started.wait()
                startup = False
                if startup_error:
                    raise startup_error[0]
                if startup_scope.cancelled_caught:
                    stages = sorted({p.machine.stage() for p in pending.values()}) or ["HELLO"]
                    raise EngineHandshakeTimeout(
                        f"{client.up_count} of {data_parallel_size} engine(s) completed the handshake within "
                        f"{config.handshake_timeout} s (waiting for {', '.join(stages)})", stage=stages[0])
                try:
                    yield client
                finally:
                    serving.closed = True
                    # The handshake sockets close before any engine's data sockets: an
                    # engine that sees its input connection close may dial the handshake
                    # address again at once (the mock engine serving clients in turn, a
                    # restarted rank), and its HELLO must wait for the next client, not be
                    # read by this closing one.
                    close_handshake()
                    for m in serving.members.values():
                        m.connection.close_client()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
    finally:
        serving.closed = True
        for p in list(pending.values()):
            _close_sockets(p.sockets())
        close_handshake()
        try:
            if process is not None:
                await terminate(process, config.terminate_grace)
        finally:
            if ipc_dir is not None:
                shutil.rmtree(ipc_dir, ignore_errors=True)
