"""The client: :class:`EngineClient`, one type for one engine and for many.

:func:`zmqdispatch.connect` (the trio shell, :mod:`zmqdispatch.shell`) serves
every engine that completes its handshake and hands them to one
:class:`EngineClient`; one engine is a group of one. The client places each
request on an engine (:class:`~zmqdispatch.protocol.placement.Placement`:
least loaded, random ties, ``data_parallel_rank`` pins, the samples of one
request on one engine), routes aborts to the engine holding the request, and
reaches each engine's control plane (:meth:`EngineClient.engine`,
:meth:`EngineClient.call_all`). One engine's death fails only its requests,
each with ``EngineDeadError(engine_index=...)``, and takes it out of
placement at its first death sign. Rules: ``docs/many-engines.md``.

Per-request streams are *not* tasks: :meth:`EngineClient.generate` returns a
:class:`~zmqdispatch.streams.RequestStream` (``generate_samples`` and
``stream_group`` the other two shapes, all in ``streams.py``, which reach the
client only through its stream hosts), an ``async with`` context manager and
async iterator over :class:`~zmqdispatch.protocol.mailbox.OutputDelta`.
Leaving it before the final output aborts the request on the engine,
synchronously, so it works even when the exit is a cancellation
(``docs/known-failures.md`` K7).

No socket is touched here: each engine's sockets and tasks are its
:class:`~zmqdispatch.connection.EngineConnection`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from ._zmq_trio import TrioSocket
from .config import ClientConfig, EngineSession
from .connection import EngineConnection
from .engine import Engine
from .errors import (
    EngineDeadError,
    LocalProtocolError,
    NoEngineAvailableError,
    RequestRejected,
)
from .metrics import EngineStats
from .protocol import control
from .protocol.deadlines import Deadlines, effective_deadlines
from .protocol.engine import EngineProtocol
from .protocol.engines import EngineSet, EngineState, EngineStatus, Route, format_ranks
from .protocol.mailbox import Mailbox
from .protocol.placement import EngineLoad, Placement
from .protocol.runtime import Runtime
from .protocol.versions import EngineVersion
from .streams import (
    EngineRequest,
    RequestStream,
    SampleStream,
    StreamGroup,
    open_samples,
)

__all__ = ["ClientConfig", "EngineClient", "EngineSession", "LoRARequest"]

LoRARequest = control.LoRARequest

_log = logging.getLogger("zmqdispatch.client")


@attrs.frozen(eq=False)
class _Hosting:
    """What the stream hosts of an :class:`EngineClient` may do to it: its
    engine set, its engines, and three of its checks (bound methods)."""

    engines: EngineSet
    members: Mapping[int, _Member]
    #: ``(request, deadlines, pin) -> deadlines in force``: quorum, the
    #: validation engine's checks, a new id, a pinned engine that can start it
    validate: Callable[[EngineRequest, Deadlines | None, Any], Deadlines | None]
    #: ``(request_id, pin) -> Engine``: place a request being entered
    place: Callable[[str, int | None], Engine]
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
        self._engine: Engine | None = None
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
            return engine.queue_request(request, deadlines)
        except BaseException:
            hosting.engines.request_finished(rid)
            raise

    def abort(self, mailbox: Mailbox) -> None:
        if self._engine is not None:
            self._engine.abort_mailbox(mailbox)

    def check_alive(self) -> None:
        if self._engine is not None:
            self._engine.check_alive()
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
            hosting.members[route.engine_index].engine.abort_mailbox(mailbox)
            return
        # Out of the table (its engine is dying): the owner is whichever engine
        # still holds this very mailbox (abort_mailbox checks identity).
        for m in hosting.members.values():
            m.engine.abort_mailbox(mailbox)

    def check_alive(self) -> None:
        self._hosting.check_quorum()


@attrs.define
class _Member:
    """One engine incarnation served by the client."""

    engine: Engine
    connection: EngineConnection
    route: Route
    sockets: list[TrioSocket]
    handshake_address: str = ""
    identity: bytes = b""
    #: set once its tasks ended and its sockets are closed
    closed: trio.Event = attrs.Factory(trio.Event)


def _no_member(member: _Member) -> None:
    raise AssertionError("an EngineClient sets this hook")  # pragma: no cover


def _nothing() -> None:
    raise AssertionError("an EngineClient sets this hook")  # pragma: no cover


@attrs.define(eq=False)
class _Serving:
    """What :func:`zmqdispatch.connect` (the shell) and the :class:`EngineClient`
    it serves share: the engines served, the handshakes under way, whether the
    client is closed, and the client's two hooks the shell calls (set by the
    client)."""

    #: every engine's current incarnation, by ``engine_index`` (dead ones included)
    members: dict[int, _Member] = attrs.Factory(dict)
    #: the handshakes under way, by ``engine_index``
    pending: dict[int, Any] = attrs.Factory(dict)
    closed: bool = False
    #: the engine process the shell launched (``connect(launch=...)``), or None
    process: trio.Process | None = None
    #: an engine completed its handshake: serve it (a new engine, or a new incarnation)
    engine_joined: Callable[[_Member], None] = _no_member
    #: wake whoever waits for an engine state change
    state_changed: Callable[[], None] = _nothing


class EngineClient:
    """The client of one engine or many. Create with :func:`zmqdispatch.connect`.

    Requests: :meth:`generate`, :meth:`generate_samples`, :meth:`stream_group`;
    each request goes to one engine, picked when its stream is entered.
    Engines: :meth:`engine` (one engine's :class:`~zmqdispatch.Engine`: its
    ready response, stats, control plane), :meth:`states`, :meth:`stats`,
    drain and undrain. With one engine, the per-engine names (``engine_index``,
    ``death``, ``wait_dead``, ``session``, the control-plane calls) speak of
    that engine; with several they need an ``engine_index`` (or
    :meth:`call_all` for every engine).

    Attributes:
        config: the :class:`ClientConfig` in force (for every engine).
        quorum: the number of ``up`` engines below which :meth:`generate`
            refuses new requests (``NoEngineAvailableError``).
    """

    def __init__(self, *, config: ClientConfig, quorum: int, rng: Any = None, serving: _Serving | None = None) -> None:
        """*serving*: the state shared with the shell serving this client
        (:func:`zmqdispatch.connect` passes its own)."""
        self.config = config
        self.quorum = quorum
        self._set = EngineSet()
        self._placement = Placement(self._set, rng=rng)
        self._serving = serving = serving if serving is not None else _Serving()
        self._members = serving.members
        #: the engine with the smallest ``max_model_len`` (unpinned requests are checked
        #: there), recomputed when an engine joins
        self._narrowest: Engine | None = None
        #: the runtime of the first engine that joined (every engine's, the shell checks)
        self._runtime: Runtime | None = None
        self._drains: dict[int, trio.Event] = {}
        self._changed = trio.Event()  # set (and replaced) on every engine state change
        serving.engine_joined = self._engine_joined
        serving.state_changed = self._state_changed
        self._hosting = _Hosting(self._set, self._members, self._validate, self._place, self._check_quorum)

    def __repr__(self) -> str:
        states = ", ".join(f"{s.engine_index}:{s.state.value}" for s in self._set.snapshot())
        return f"<EngineClient engines=[{states}] in_flight={self._set.total_in_flight}>"

    # ------------------------------------------------------------------ engines and states

    @property
    def engines(self) -> dict[int, Engine]:
        """Every known engine's current incarnation, by ``engine_index`` (dead ones included)."""
        return {i: m.engine for i, m in sorted(self._members.items())}

    def engine(self, engine_index: int | None = None) -> Engine:
        """The :class:`~zmqdispatch.Engine` of one engine (its control plane,
        stats, ``ready``); without *engine_index*, the client's only engine.

        Raises:
            LocalProtocolError: no engine has that index (the message lists the
                known ones), or no index was given and the client has several
                engines (or none yet).
        """
        members = self._members
        if engine_index is None:
            if len(members) == 1:
                return next(iter(members.values())).engine
            raise LocalProtocolError(
                f"this client has {len(members)} engines ({format_ranks(members)}): name one with engine_index=, "
                "or use call_all() for every engine"
            )
        m = members.get(engine_index)
        if m is None:
            raise LocalProtocolError(
                f"engine {engine_index!r} is not known (known: {format_ranks(members)})"
            )
        return m.engine

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
        runtime = self._runtime
        return runtime if runtime is not None else self._any().runtime

    @property
    def engine_index(self) -> int | None:
        """The only engine's ``engine_index`` (its DP rank) when the client has
        one engine; None with several (requests are placed per request)."""
        members = self._members
        return next(iter(members)) if len(members) == 1 else None

    @property
    def max_model_len(self) -> int:
        """The smallest ``max_model_len`` among the engines (a request that fits it fits any)."""
        return min(m.engine.max_model_len for m in self._members.values())

    @property
    def ready(self) -> Any:
        """The ready response of the lowest-index engine (``client.engine(i).ready`` for one)."""
        return self._any().ready

    def _any(self) -> Engine:
        if not self._members:
            raise LocalProtocolError("no engine has completed its handshake")
        return self._members[min(self._members)].engine

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
        Raises what :meth:`Engine.check_request` raises."""
        pin = getattr(request, "data_parallel_rank", None)
        self._validation_engine(pin, "").check_request(request)

    def _validation_engine(self, pin: Any, request_id: str) -> Engine:
        if pin is not None:
            if type(pin) is not int or pin not in self._members:
                raise RequestRejected(
                    f"data_parallel_rank: {pin!r} is not an engine of this client; valid ranks: "
                    f"{format_ranks(self._members)}",
                    request_id=request_id,
                    field="data_parallel_rank",
                )
            return self._members[pin].engine
        # The smallest context window: a request valid there is valid on every engine.
        narrowest = self._narrowest
        if narrowest is None:
            narrowest = self._narrowest = min((m.engine for m in self._members.values()),
                                              key=lambda c: c.max_model_len)
        return narrowest

    def _check_quorum(self) -> None:
        if self._serving.closed:
            raise EngineDeadError("the engine client is closed", reason="closed")
        if not self._set.has_quorum(self.quorum):
            if len(self._members) == 1:
                only = next(iter(self._members.values())).engine
                only.check_alive()  # one engine, dead or going: its own cause
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

    def _place(self, request_id: str, pin: int | None) -> Engine:
        """Place one request (its stream is being entered) and return its engine."""
        self._check_quorum()
        return self._members[self._placement.place_one(request_id, pin).index].engine

    def generate(self, request: EngineRequest, *, deadlines: Deadlines | None = None) -> RequestStream:
        """Validate *request*; return its stream (use ``async with``).

        Args:
            request: an :data:`~zmqdispatch.EngineRequest`: a
                ``wire.vllm.EngineCoreRequest`` for a vLLM engine, a
                ``wire.tokenspeed.TokenizedGenerateReqInput`` for TokenSpeed
                (see :attr:`runtime`; ``translate_vllm_request`` /
                ``translate_tokenspeed_request`` build them). Its
                ``sampling_params.n`` must be 1: ``n > 1`` is :meth:`generate_samples`.
                ``request.data_parallel_rank`` pins it to that engine.
            deadlines: optional time limits (:class:`~zmqdispatch.Deadlines`:
                first token, total, stall between tokens), counted from
                entering the stream; past one the request is aborted on the
                engine and the stream raises ``DeadlineExceeded``.

        Synchronous: validates now (against the pinned engine, or the one with
        the smallest ``max_model_len``). Entering the stream (``async with``)
        places the request (the least loaded engine, random ties), queues its
        ADD and waits until the socket accepted it, so a stream never entered
        sends nothing and is never placed. Errors after that are raised from
        the stream's ``receive()`` / iteration (:class:`~zmqdispatch.RequestStream`).

        Raises (now, nothing sent; entering raises the same when the engines
        changed meanwhile):
            RuntimeMismatchError: the request is for the other runtime.
            RequestRejected: the request fails validation (the message names
                the field and the limit), ``data_parallel_rank`` names no engine
                (``field="data_parallel_rank"``, the message lists the ranks),
                or ``deadlines`` is not a ``Deadlines``.
            DuplicateRequestIdError: the ``request_id`` is live on some engine.
            EngineDeadError: the client closed; with one engine, that engine is
                dead (its cause); the pinned engine is dead.
            NoEngineAvailableError: fewer than :attr:`quorum` engines are up.
            EngineDrainingError: the pinned engine is draining.
        """
        host = _PlacedHost(self._hosting, getattr(request, "data_parallel_rank", None), self.runtime)
        in_force = host.validate(request, deadlines)
        return RequestStream(host, host.runtime.request_id(request), request, in_force)

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

        Every sample goes to one engine (its prefix cache): the least loaded
        when entered, or the first sample's ``data_parallel_rank``. Entering
        queues every sample's ADD in index order; leaving the block (normally,
        on error, cancelled) aborts the live samples in one ABORT. Errors are
        raised from the stream's ``receive()`` / iteration
        (:class:`~zmqdispatch.SampleStream`).

        Raises (nothing is sent for any sample): what :meth:`generate` raises;
            also RequestRejected when ``requests`` is empty (n = 0), and
            DuplicateRequestIdError when two samples share an id.
        """
        pin = getattr(requests[0], "data_parallel_rank", None) if requests else None
        return open_samples(_PlacedHost(self._hosting, pin, self.runtime), requests, deadlines)

    def stream_group(self) -> StreamGroup:
        """A new :class:`~zmqdispatch.StreamGroup` (use ``async with``): many
        requests read by one task, one batch per wake-up;
        ``group.generate(request)`` adds one and returns its member handle,
        placed on its own (pins honoured). Leaving the block aborts the live
        members in one ABORT."""
        return StreamGroup(_GroupHost(self._hosting, self.runtime))

    def stats(self) -> dict[int, EngineStats]:
        """Each engine's :class:`~zmqdispatch.metrics.EngineStats` (names and
        meaning in ``docs/operations.md``), by ``engine_index``. Cheap (a few
        small copies per engine)."""
        return {i: m.engine.stats() for i, m in sorted(self._members.items())}

    # ------------------------------------------------------------------ one engine

    @property
    def protocol(self) -> EngineProtocol:
        """The only engine's sans-IO state (counters, in flight); read-only
        use. ``LocalProtocolError`` with several engines (``engine(i).protocol``)."""
        return self.engine().protocol

    @property
    def process(self) -> trio.Process | None:
        """The engine process ``connect(launch=...)`` started (one process may
        run every rank), or None. The client stops it on exit; read-only use."""
        return self._serving.process

    @property
    def engine_version(self) -> EngineVersion:
        """The engine's version from its ready response (the lowest-index
        engine's with several; every engine's handshake checked its own)."""
        return self._any().engine_version

    @property
    def load(self) -> Any:
        """The only engine's :attr:`Engine.load` (TokenSpeed's load snapshot)."""
        return self.engine().load

    @property
    def session(self) -> EngineSession | None:
        """The only engine's :attr:`Engine.session` (for ``connect(resume=...)``),
        ``None`` when its data-plane addresses were private."""
        return self.engine().session

    @property
    def death(self) -> EngineDeadError | None:
        """Why the only engine is considered dead, ``None`` while alive
        (:attr:`Engine.death`)."""
        return self.engine().death

    async def wait_dead(self) -> EngineDeadError:
        """Block until the only engine (its current incarnation) is declared
        dead; return the cause (:meth:`Engine.wait_dead`)."""
        return await self.engine().wait_dead()

    # ------------------------------------------------------------------ control plane

    async def call_all(self, method: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Call ``Engine.<method>(*args, **kwargs)`` (``is_sleeping``,
        ``reset_prefix_cache``, ``sleep``, ``call_utility``, ...) on every
        engine that is not dead, concurrently; one result per engine, by
        ``engine_index``. An engine's failure is its value (the exception
        instance), so one engine's error hides no other's result.

        Raises:
            AttributeError: no such ``Engine`` method (nothing is sent).
        """
        targets = {i: m.engine for i, m in sorted(self._members.items())
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

    # One engine's control plane (``Engine``, ``docs/control-plane.md``):
    # *engine_index* names it, None the only engine (LocalProtocolError with
    # several: name one, or use call_all). Each raises what the Engine method raises.

    async def call_utility(self, method: str, *args: Any, engine_index: int | None = None,
                           timeout: float | None = None) -> Any:
        """:meth:`Engine.call_utility` on one engine."""
        return await self.engine(engine_index).call_utility(method, *args, timeout=timeout)

    async def get_supported_tasks(self, *, engine_index: int | None = None,
                                  timeout: float | None = None) -> tuple[str, ...]:
        """:meth:`Engine.get_supported_tasks` on one engine."""
        return await self.engine(engine_index).get_supported_tasks(timeout=timeout)

    async def is_sleeping(self, *, engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`Engine.is_sleeping` on one engine."""
        return await self.engine(engine_index).is_sleeping(timeout=timeout)

    async def sleep(self, level: int = 1, mode: control.PauseMode = "abort", *, engine_index: int | None = None,
                    timeout: float | None = None) -> None:
        """:meth:`Engine.sleep` on one engine."""
        await self.engine(engine_index).sleep(level, mode, timeout=timeout)

    async def wake_up(self, tags: Sequence[str] | None = None, *, engine_index: int | None = None,
                      timeout: float | None = None) -> bool:
        """:meth:`Engine.wake_up` on one engine."""
        return await self.engine(engine_index).wake_up(tags, timeout=timeout)

    async def pause_scheduler(self, mode: control.PauseMode = "abort", clear_cache: bool = True, *,
                              engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`Engine.pause_scheduler` on one engine."""
        await self.engine(engine_index).pause_scheduler(mode, clear_cache, timeout=timeout)

    async def resume_scheduler(self, *, engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`Engine.resume_scheduler` on one engine."""
        await self.engine(engine_index).resume_scheduler(timeout=timeout)

    async def is_scheduler_paused(self, *, engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`Engine.is_scheduler_paused` on one engine."""
        return await self.engine(engine_index).is_scheduler_paused(timeout=timeout)

    async def pause_generation(self, mode: control.PauseMode = "abort", clear_cache: bool = True, *,
                               engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`Engine.pause_generation` on one engine (vLLM >= 0.33)."""
        await self.engine(engine_index).pause_generation(mode, clear_cache, timeout=timeout)

    async def resume_generation(self, *, engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`Engine.resume_generation` on one engine (vLLM >= 0.33)."""
        await self.engine(engine_index).resume_generation(timeout=timeout)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False, *,
                                 engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`Engine.reset_prefix_cache` on one engine."""
        return await self.engine(engine_index).reset_prefix_cache(reset_running_requests, reset_connector,
                                                                  timeout=timeout)

    async def add_lora(self, lora: control.LoRARequest, *, engine_index: int | None = None,
                       timeout: float | None = None) -> bool:
        """:meth:`Engine.add_lora` on one engine."""
        return await self.engine(engine_index).add_lora(lora, timeout=timeout)

    async def remove_lora(self, lora_id: int, *, engine_index: int | None = None,
                          timeout: float | None = None) -> bool:
        """:meth:`Engine.remove_lora` on one engine."""
        return await self.engine(engine_index).remove_lora(lora_id, timeout=timeout)

    async def pin_lora(self, lora_id: int, *, engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`Engine.pin_lora` on one engine."""
        return await self.engine(engine_index).pin_lora(lora_id, timeout=timeout)

    async def list_loras(self, *, engine_index: int | None = None, timeout: float | None = None) -> frozenset[int]:
        """:meth:`Engine.list_loras` on one engine."""
        return await self.engine(engine_index).list_loras(timeout=timeout)

    async def collective_rpc(self, method: str, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                             rpc_timeout: float | None = None, engine_index: int | None = None,
                             timeout: float | None = None) -> list[Any]:
        """:meth:`Engine.collective_rpc` on one engine."""
        return await self.engine(engine_index).collective_rpc(method, args=args, kwargs=kwargs,
                                                              rpc_timeout=rpc_timeout, timeout=timeout)

    async def profile(self, is_start: bool = True, *, profile_prefix: str | None = None,
                      delay_iterations: int | None = None, max_iterations: int | None = None,
                      profiler_kwargs: dict[str, Any] | None = None, engine_index: int | None = None,
                      timeout: float | None = None) -> None:
        """:meth:`Engine.profile` on one engine."""
        await self.engine(engine_index).profile(is_start, profile_prefix=profile_prefix,
                                                delay_iterations=delay_iterations, max_iterations=max_iterations,
                                                profiler_kwargs=profiler_kwargs, timeout=timeout)

    async def flush_cache(self, timeout_s: float = 0.0, *, engine_index: int | None = None,
                          timeout: float | None = None) -> str | None:
        """:meth:`Engine.flush_cache` (SGLang) on one engine."""
        return await self.engine(engine_index).flush_cache(timeout_s, timeout=timeout)

    async def start_profile(self, *, engine_index: int | None = None, timeout: float | None = None,
                            **options: Any) -> str | None:
        """:meth:`Engine.start_profile` (SGLang) on one engine."""
        return await self.engine(engine_index).start_profile(timeout=timeout, **options)

    async def stop_profile(self, *, engine_index: int | None = None, timeout: float | None = None) -> str | None:
        """:meth:`Engine.stop_profile` (SGLang) on one engine."""
        return await self.engine(engine_index).stop_profile(timeout=timeout)

    # ------------------------------------------------------------------ engine events (shell)

    def _engine_joined(self, member: _Member) -> None:
        index = member.route.engine_index
        if index in self._members:
            route = self._set.engine_returned(index)
        else:
            route = self._set.add_engine(index)
        member.route = route
        self._members[index] = member
        self._narrowest = None
        if self._runtime is None:
            self._runtime = member.engine.runtime
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
                                      kv_cache_usage=stats.kv_usage)  # reported only with a KV total

        protocol.on_retired = on_retired
        protocol.on_load = on_load
        conn.on_ending = on_ending
        self._state_changed()


