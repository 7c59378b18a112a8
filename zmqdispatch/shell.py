"""The trio shell: :func:`connect`, the nursery that owns every engine's sockets.

It binds one handshake ROUTER (on one or several addresses) and keeps it open:
every engine that dials it (one ``vllm serve --headless``, its data-parallel
ranks, independent engines, TokenSpeed ranks, a restarted rank) is handshaken
on its own, gets its **own** input ROUTER / output PULL pair (INIT names them),
and is served by its own :class:`~zmqdispatch.connection.EngineConnection`, so
its sentinel, its connections closing and its silence are its own::

    handshake ROUTER (bind, stays open) <- every engine: HELLO / INIT / READY
    per engine: input ROUTER <- its DEALER, output PULL <- its PUSH, their monitors

One engine is a group of one: the same sockets, tasks and client. The rules are
the sans-IO core's (:class:`~zmqdispatch.protocol.handshake.Handshake` per
engine, :class:`~zmqdispatch.protocol.handshake.HandshakeTable` for which
engine a HELLO belongs to); the tasks here feed them what the sockets say.
Sockets come from :mod:`zmqdispatch._zmq_trio`, the only module that calls pyzmq.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from . import _ipc, limits
from ._engine_lifecycle import check_version, format_launch, terminate, unwrap
from ._engine_lifecycle import launch as launch_engine
from ._zmq_trio import (
    HANDSHAKE_FAILED_EVENTS,
    MonitorEvent,
    PeerUnreachable,
    SocketKind,
    TrioSocket,
    ZmqContext,
    parse_monitor_event,
)
from .addresses import check_address
from .client import EngineClient, _Member, _Serving
from .config import ClientConfig, EngineSession
from .connection import EngineConnection
from .engine import Engine
from .errors import AddressBindError, EngineDeadError, EngineHandshakeError, EngineHandshakeTimeout
from .protocol.engine import EngineProtocol, LinkState
from .protocol.engines import Route
from .protocol.handshake import ADDRESS_INDEX_STRIDE, Handshake, HandshakeTable, check_not_lockstep
from .protocol.link import EngineLink
from .protocol.runtime import Runtime
from .wire import vllm_handshake as wire

__all__ = ["ADDRESS_INDEX_STRIDE", "connect"]

_log = logging.getLogger("zmqdispatch.client")

_OUTPUT_EVENTS = MonitorEvent.HANDSHAKE_SUCCEEDED | MonitorEvent.DISCONNECTED | HANDSHAKE_FAILED_EVENTS
_INPUT_EVENTS = MonitorEvent.ACCEPTED | MonitorEvent.DISCONNECTED | MonitorEvent.HANDSHAKE_SUCCEEDED


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


class _Binder:
    """Binds sockets: ``ipc://`` paths in one private 0700 directory (made on
    first use, removed by :meth:`cleanup`), errors as ``AddressBindError``."""

    def __init__(self) -> None:
        self._dir: str | None = None

    def ipc(self, name: str) -> str:
        if self._dir is None:
            self._dir = _ipc.private_ipc_dir()
        return f"ipc://{self._dir}/{name}"

    async def bind(self, sock: TrioSocket, address: str, role: str) -> str:
        try:
            # ipc paths: stale socket files unlinked, anything else refused (_ipc)
            prepared = await _ipc.prepare_bind(address)
        except OSError as exc:
            error = AddressBindError(f"{role}: cannot bind {address!r}: {exc.strerror or exc}",
                                     address=address, role=role, errno=exc.errno)
            error.filename = exc.filename
            raise error from None
        return sock.bind(prepared, role=role)

    def cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _check_arguments(handshake_address: str | Sequence[str] | None, data_parallel_size: int, quorum: int,
                     launch: str | Sequence[str] | None, config: ClientConfig, resume: EngineSession | None,
                     data_plane_host: str | None) -> list[str]:
    """Refuse what cannot work before any socket exists; the handshake addresses."""
    if type(data_parallel_size) is not int or not 1 <= data_parallel_size <= 65536:
        raise ValueError(f"data_parallel_size: expected 1..65536 engines, got {data_parallel_size!r}")
    if type(quorum) is not int or not 1 <= quorum:
        raise ValueError(f"quorum: expected an int >= 1, got {quorum!r}")
    if quorum > data_parallel_size:
        raise ValueError(f"quorum: {quorum} engines can never be up when data_parallel_size={data_parallel_size} "
                         "engines are waited for; expected 1..data_parallel_size")
    addresses = [handshake_address] if isinstance(handshake_address, str) else list(handshake_address or [])
    fixed = config.input_address is not None or config.output_address is not None
    if fixed and (data_parallel_size != 1 or len(addresses) > 1 or data_plane_host is not None):
        raise ValueError("input_address / output_address: a fixed socket pair serves one engine; with several, "
                         "each engine gets a pair of its own (data_plane_host= binds them on tcp)")
    if resume is not None:
        if launch is not None or addresses:
            raise ValueError("resume= re-attaches to a running engine: no launch or handshake address")
        if data_parallel_size != 1 or data_plane_host is not None:
            raise ValueError("resume= re-attaches one engine; it does not combine with data_parallel_size")
        check_address(resume.input_address, role="resume.input_address", any_port=False)
        check_address(resume.output_address, role="resume.output_address", any_port=False)
    if launch is not None:
        format_launch(launch, "")  # refuse a malformed command before anything is bound
    for a in addresses:
        check_address(a, role="handshake_address", any_port=launch is not None)
    if data_plane_host is not None:
        check_address(_any_port(data_plane_host), role="data_plane_host", any_port=True)
    return addresses


def _new_link(config: ClientConfig) -> EngineLink:
    return EngineLink(now=trio.current_time(), silence_timeout=config.silence_timeout,
                      watch_input=config.death_on_disconnect, await_output_reconnect=config.death_on_disconnect)


def _serve(client: EngineClient, serving: _Serving, config: ClientConfig, *, identity: bytes, index: int,
           ready: wire.EngineCoreReadyResponse, runtime: Runtime, link: EngineLink, sockets: list[TrioSocket],
           inp: TrioSocket, out: TrioSocket, monitor: TrioSocket | None, out_monitor: TrioSocket | None,
           input_address: str, output_address: str, handshake_address: str,
           orphan_ids: Sequence[str] = ()) -> _Member:
    """Make an engine that completed its handshake (or was resumed) a member of *client*."""
    link.engine_index = index
    protocol = EngineProtocol(engine_index=index, identity=identity, max_pending_tokens=config.max_pending_tokens,
                              max_decode_errors=config.max_decode_errors, runtime=runtime, timer=trio.current_time)
    if orphan_ids:
        protocol.abort_stale(orphan_ids)  # before any ADD of ours
    conn = EngineConnection(protocol=protocol, link=link, input_sock=inp, output_sock=out, process=None,
                            monitor_sock=monitor, output_monitor_sock=out_monitor, send_timeout=config.send_timeout,
                            pause_gc_while_routing=config.pause_gc_while_routing)
    engine = Engine(connection=conn, ready=ready, config=config, input_address=input_address,
                    output_address=output_address)
    member = _Member(engine, conn, Route(index, 0), sockets, handshake_address, identity)
    serving.engine_joined(member)
    return member


async def _serve_engine(member: _Member, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run one engine's tasks until it is declared dead (or the client closes);
    started once they all exist."""
    conn = member.connection
    try:
        async with trio.open_nursery() as tasks:
            conn.start(tasks)
            task_status.started()
            await conn.wait_dead()
            tasks.cancel_scope.cancel()
    finally:
        conn.close_link()
        _close_sockets(member.sockets)
        member.closed.set()


async def _await_reconnect(monitor: TrioSocket, timeout: float, link: EngineLink) -> None:
    """Resume: wait until the engine's DEALER has reconnected to the input
    socket (its ZMTP handshake done), feeding the input connections to *link*."""
    try:
        with trio.fail_after(timeout):
            while True:
                event, value, endpoint = parse_monitor_event(await monitor.recv_multipart())
                if event == MonitorEvent.ACCEPTED:
                    link.input_connected(value)
                elif event == MonitorEvent.DISCONNECTED:
                    link.input_disconnected(value, endpoint, trio.current_time())  # not serving yet: counts only
                elif event == MonitorEvent.HANDSHAKE_SUCCEEDED:
                    return
    except trio.TooSlowError:
        raise EngineHandshakeTimeout(
            f"the engine did not reconnect to the input socket within {timeout} s", stage="reconnect"
        ) from None


@asynccontextmanager
async def connect(
    handshake_address: str | Sequence[str] | None = None,
    *,
    data_parallel_size: int = 1,
    quorum: int = 1,
    launch: str | Sequence[str] | None = None,
    config: ClientConfig | None = None,
    launch_stdout: int | None = None,
    resume: EngineSession | None = None,
    runtime: Runtime | str | None = None,
    data_plane_host: str | None = None,
    rng: Any = None,
) -> AsyncIterator[EngineClient]:
    """Bind the handshake ROUTER, wait for *data_parallel_size* engines, and serve them.

    The engines are vLLM EngineCores or TokenSpeed schedulers in direct-ZMQ
    mode (``ts serve --headless``); which one is read from each ready response
    (:class:`~zmqdispatch.protocol.runtime.Runtime`); every engine of a client
    speaks the same one.

    Args:
        handshake_address: where the engines dial: ``tcp://HOST:PORT`` for
            ``vllm serve --headless --data-parallel-address HOST
            --data-parallel-rpc-port PORT``, ``ipc://PATH``; default an
            ``ipc://`` path in a private 0700 temporary directory. A ``tcp://``
            address is bound exactly as given (use ``127.0.0.1`` unless the
            engine is remote); ``ipc://`` paths are checked first (stale
            sockets unlinked, anything else refused). Several addresses: one
            handshake ROUTER each (independent engines, e.g. two ``vllm
            serve``, each DP rank 0): an engine's ``engine_index`` is ``k *
            ADDRESS_INDEX_STRIDE + identity`` for the k-th address (0-based),
            so engines of the first address keep their rank as index and
            ``data_parallel_rank`` pins that index
            (:meth:`EngineClient.origin` maps it back). The socket stays open:
            engines that dial later (scale out, a restarted rank) are
            handshaken and placed while the client runs.
        data_parallel_size: engines to wait for before yielding, over every
            address (vLLM's name; each engine's identity, its DP rank, is its
            ``engine_index`` on the first address). 1..65536.
        quorum: below this many ``up`` engines :meth:`EngineClient.generate`
            refuses new requests (``NoEngineAvailableError``; with one engine,
            its ``EngineDeadError``); requests on live engines go on, and the
            client serves again once engines return. At most *data_parallel_size*.
        launch: an engine command (string or argv) to start after binding;
            ``{handshake_address}`` in it is replaced by the bound (first)
            address. One launched process may run every rank (``zmqdispatch
            mock-engine --data-parallel-size N``). It runs in its own process
            group, under a watchdog that stops it when this process dies
            without closing; it is terminated (SIGTERM, then SIGKILL after
            ``terminate_grace``) when the block exits or the handshake fails.
        config: :class:`~zmqdispatch.ClientConfig`. A fixed
            ``input_address`` / ``output_address`` serves one engine.
        launch_stdout: fd for the launched engine's stdout (default: our stderr).
        resume: re-attach to an already handshaken engine
            (:class:`~zmqdispatch.EngineSession`): bind its input/output
            addresses, skip the handshake, and wait (up to
            ``handshake_timeout``) until the engine has reconnected.
        runtime: ``"vllm"`` / ``"tokenspeed"`` (or a :class:`Runtime`) to
            require that engine; ``None`` accepts either.
        data_plane_host: bind each engine's socket pair on ``tcp://HOST:<free
            port>`` (engines on other hosts) instead of private ``ipc://``
            paths. Use an address of this host the engines can reach.
        rng: the placement's tie-break ``random.Random`` (tests seed it).

    Yields:
        an :class:`~zmqdispatch.EngineClient` with at least *data_parallel_size* engines up.

    Raises:
        EngineHandshakeTimeout: fewer than *data_parallel_size* engines completed
            their handshake within ``handshake_timeout`` (a launched engine is killed).
        EngineHandshakeError: an engine's handshake failed at startup (malformed,
            its handshake connection closed before READY, a lock-step MoE rank,
            a refused version or runtime), or the launched process exited.
        InvalidAddressError: a malformed address (a handshake port 0 only with
            ``launch``, which is told the port picked), before any socket exists.
        AddressBindError: an address could not be bound (in use, not an
            address of this host, permission, an ipc path refused).
        ValueError: ``data_parallel_size`` / ``quorum`` out of range, a fixed
            address pair or ``resume`` with several engines, or ``launch`` is
            empty or not a command line, before any socket exists.

    After startup a failed handshake (a lock-step rank, a refused version, a
    timeout) is logged at WARNING and that engine is not served; the others go
    on. An engine that says HELLO again before its READY (it restarted during
    its handshake) has its handshake started over, at startup too.

    Cancellation: cancelling the block cancels the handshakes and the pumps,
    sends queued ABORTs best-effort, closes the sockets, removes the private
    ipc directory and terminates a launched engine.
    """
    config = config or ClientConfig()
    addresses = _check_arguments(handshake_address, data_parallel_size, quorum, launch, config, resume,
                                 data_plane_host)
    binder = _Binder()
    serving = _Serving()
    client = EngineClient(config=config, quorum=quorum, rng=rng, serving=serving)
    try:
        if resume is not None:
            async with _resumed(client, serving, config, resume, binder):
                yield client
        else:
            async with _served(client, serving, config, addresses, data_parallel_size, launch, launch_stdout,
                               runtime, data_plane_host, binder):
                yield client
    finally:
        binder.cleanup()


@asynccontextmanager
async def _resumed(client: EngineClient, serving: _Serving, config: ClientConfig, resume: EngineSession,
                   binder: _Binder) -> AsyncIterator[None]:
    """Serve one engine re-attached from its session: no handshake socket."""
    ctx = ZmqContext()
    inp = ctx.socket(SocketKind.ROUTER, name="input", router_mandatory=True, sndhwm=config.send_hwm)
    out = ctx.socket(SocketKind.PULL, name="output", rcvhwm=0, maxmsgsize=limits.MAX_FRAME_BYTES)
    # Created before bind, so that no connection event is missed.
    out_monitor = out.monitor(_OUTPUT_EVENTS, name="output-monitor")
    monitor: TrioSocket | None = inp.monitor(_INPUT_EVENTS, name="input-monitor")
    link = _new_link(config)  # counts the input connections seen while waiting
    sockets = [s for s in (monitor, out_monitor, out, inp) if s is not None]
    try:
        input_address = await binder.bind(inp, resume.input_address, "resume.input_address")
        output_address = await binder.bind(out, resume.output_address, "resume.output_address")
        _log.info("resuming engine identity %s: bound input %s, output %s; waiting for it to reconnect, timeout %s s "
                  "(%d orphan ids to abort)", resume.identity.hex(), input_address, output_address,
                  config.handshake_timeout, len(resume.orphan_ids), extra={"zmqdispatch_wait": True})
        assert monitor is not None
        await _await_reconnect(monitor, config.handshake_timeout, link)
        check_version(resume.ready, allow_unknown=config.allow_unknown_engine_version)
        if not config.death_on_disconnect:
            inp.disable_monitor()
            monitor.close()
            sockets.remove(monitor)
            monitor = None
        identity = resume.identity
        index = int.from_bytes(identity, "little") if len(identity) == 2 else 0
        member = _serve(client, serving, config, identity=identity, index=index, ready=resume.ready,
                        runtime=Runtime.resolve(None, resume.ready), link=link, sockets=sockets, inp=inp, out=out,
                        monitor=monitor, out_monitor=out_monitor, input_address=input_address,
                        output_address=output_address, handshake_address="", orphan_ids=resume.orphan_ids)
        _log.info("engine %d resumed (identity %s): %s, version %s, max_model_len %d", index, identity.hex(),
                  member.connection.protocol.runtime.value, resume.ready.vllm_version, resume.ready.max_model_len)
        try:
            async with trio.open_nursery() as nursery:
                # start_soon: the stale ABORT is queued, not yet sent, when the block begins.
                nursery.start_soon(_serve_engine, member)
                try:
                    yield
                finally:
                    _close_client(serving)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
    finally:
        serving.closed = True
        link.close()
        _close_sockets(sockets)


def _close_client(serving: _Serving) -> None:
    """The client is closing: every engine's live requests fail and are aborted."""
    serving.closed = True
    for m in serving.members.values():
        was_ready = m.connection.protocol.state is LinkState.READY
        aborted = m.connection.close_client()
        if was_ready:
            _log.info("closing the client of engine %d (%d live requests aborted)", m.route.engine_index, aborted)


@asynccontextmanager
async def _served(client: EngineClient, serving: _Serving, config: ClientConfig, addresses: list[str],
                  data_parallel_size: int, launch: str | Sequence[str] | None, launch_stdout: int | None,
                  wanted_runtime: Runtime | str | None, data_plane_host: str | None,
                  binder: _Binder) -> AsyncIterator[None]:
    """Serve the engines that dial the handshake addresses (the body of :func:`connect`)."""
    ctx = ZmqContext()
    seq = itertools.count()
    fixed_pair = config.input_address is not None or config.output_address is not None
    # One handshake ROUTER per address: engines of different addresses may
    # share an identity (two independent engines, both DP rank 0), which one
    # ROUTER could not tell apart. Handover: a restarted engine dials with its
    # old identity, possibly before libzmq reaped the dead process's connection
    # (none at all when its host vanished without closing it); the newcomer
    # must get the identity.
    sockets = [ctx.socket(SocketKind.ROUTER, name="handshake", router_mandatory=True, router_handover=True)
               for _ in range(max(1, len(addresses)))]
    # Each handshake ROUTER's connections (created before bind: no event
    # missed): an engine whose handshake connection closes before its READY
    # (it exited or crashed) is dropped after the drop grace, not at the timeout.
    hs_monitors = ([hs.monitor(MonitorEvent.ACCEPTED | MonitorEvent.DISCONNECTED, name="handshake-monitor")
                    for hs in sockets] if config.death_on_disconnect else [])
    process: trio.Process | None = None
    pending: dict[int, _Pending] = serving.pending
    table = HandshakeTable(max_pending=max(limits.MAX_PENDING_HANDSHAKES, data_parallel_size),
                           one_engine_only=fixed_pair)
    startup = True
    startup_error: list[BaseException] = []
    started = trio.Event()

    def fail_startup(exc: BaseException) -> None:
        if startup:
            startup_error.append(exc)
            started.set()

    async def bound_pair(index: int) -> tuple[TrioSocket, TrioSocket, TrioSocket | None, TrioSocket, str, str]:
        """A fresh input ROUTER / output PULL pair for engine *index*, their
        monitors (made before bind: no event missed), and the bound addresses."""
        n = next(seq)
        inp = ctx.socket(SocketKind.ROUTER, name="input", router_mandatory=True, sndhwm=config.send_hwm)
        out = ctx.socket(SocketKind.PULL, name="output", rcvhwm=0, maxmsgsize=limits.MAX_FRAME_BYTES)
        out_monitor = out.monitor(_OUTPUT_EVENTS, name="output-monitor")
        monitor = inp.monitor(_INPUT_EVENTS, name="input-monitor") if config.death_on_disconnect else None
        try:
            if data_plane_host is not None:
                in_addr = await binder.bind(inp, _any_port(data_plane_host), "input_address")
                out_addr = await binder.bind(out, _any_port(data_plane_host), "output_address")
            else:
                in_addr = await binder.bind(inp, config.input_address or binder.ipc(f"e{index}.{n}.in"),
                                            "input_address")
                out_addr = await binder.bind(out, config.output_address or binder.ipc(f"e{index}.{n}.out"),
                                             "output_address")
        except BaseException:
            _close_sockets([s for s in (monitor, out_monitor, out, inp) if s is not None])
            raise
        return inp, out, monitor, out_monitor, in_addr, out_addr

    # A fixed pair is bound before the handshake socket (an address in use
    # fails the connect at once) and handed to the first engine that dials.
    prebound: list[tuple[TrioSocket, TrioSocket, TrioSocket | None, TrioSocket, str, str]] = []

    async def new_pair(identity: bytes, index: int, address: str) -> _Pending:
        inp, out, monitor, out_monitor, in_addr, out_addr = prebound.pop() if prebound else await bound_pair(index)
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
        member = _serve(client, serving, config, identity=identity, index=index, ready=ready, runtime=resolved,
                        link=_new_link(config), sockets=p.sockets(), inp=p.inp, out=p.out, monitor=p.monitor,
                        out_monitor=p.out_monitor, input_address=p.input_address, output_address=p.output_address,
                        handshake_address=p.handshake_address)
        _log.info("engine %d ready (identity %s): %s, version %s, max_model_len %d; handshake %s, incarnation %d, "
                  "input %s, output %s", index, identity.hex(), resolved.value, ready.vllm_version,
                  ready.max_model_len, p.handshake_address, member.route.incarnation, p.input_address,
                  p.output_address)
        await nursery.start(_serve_engine, member)
        if startup and client.up_count >= data_parallel_size:
            started.set()

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
            old = None
            verdict = table.classify(frames, base, pending, serving.members)
            index = verdict.engine_index
            if verdict.refusal is not None:
                _log.warning("handshake on %s: %s", address, verdict.refusal)
                continue
            p = pending.get(index)
            if verdict.restarted_mid_handshake and p is not None:
                _log.warning("handshake on %s: engine identity %s said HELLO again during its handshake (it "
                             "restarted); starting its handshake over", address, identity.hex())
                del pending[index]
                p.scope.cancel()
                p = None
            try:
                if p is None:
                    old = serving.members.get(index)
                    if old is not None and old.connection.protocol.state is LinkState.READY:
                        # Same identity, a new HELLO: that rank restarted; its old
                        # incarnation is gone (its requests fail, its sockets close).
                        old.connection.protocol.engine_died(EngineDeadError(
                            f"engine {index} dialed the handshake again (it restarted)", engine_index=index,
                            reason="restarted"))
                    if fixed_pair and old is not None:
                        await old.closed.wait()  # the fixed pair is bound again for the new incarnation
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
                if event != MonitorEvent.DISCONNECTED:
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
        if fixed_pair:
            prebound.append(await bound_pair(0))
        bound = [await binder.bind(hs, a, "handshake_address")
                 for hs, a in zip(sockets, addresses or [binder.ipc("handshake.sock")], strict=True)]
        _log.info("bound handshake %s%s", ", ".join(bound),
                  f", input {prebound[0][4]}, output {prebound[0][5]}" if prebound else "")
        if launch is not None:
            process = serving.process = await launch_engine(launch, bound[0], launch_stdout,
                                                            config.terminate_grace)
        _log.info("waiting for %s at %s, timeout %s s",
                  "an engine" if data_parallel_size == 1 else f"{data_parallel_size} engines", ", ".join(bound),
                  config.handshake_timeout, extra={"zmqdispatch_wait": True})
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
                    yield
                finally:
                    serving.closed = True
                    # The handshake sockets close before any engine's data sockets: an
                    # engine that sees its input connection close may dial the handshake
                    # address again at once (the mock engine serving clients in turn, a
                    # restarted rank), and its HELLO must wait for the next client, not be
                    # read by this closing one.
                    close_handshake()
                    _close_client(serving)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
    finally:
        serving.closed = True
        for p in list(pending.values()):
            _close_sockets(p.sockets())
        for pair in prebound:
            _close_sockets([s for s in pair[:4] if isinstance(s, TrioSocket)])
        close_handshake()
        if process is not None:
            await terminate(process, config.terminate_grace)
