"""The grpc.aio shell of ``zmqdispatch serve-grpc``: I/O and tasks only (every
rule is in :mod:`.generate`, :mod:`.facts`, :mod:`.status`,
:mod:`.tokenizer_zip`).

:class:`ServicerCore` implements the RPCs over one :mod:`zmqdispatch.aio`
client; :class:`VllmEngineServicer` (``vllm.grpc.engine.VllmEngine``),
:class:`TokenSpeedSchedulerServicer` (``tokenspeed.grpc.scheduler.TokenSpeedScheduler``) and
:class:`SglangSchedulerServicer` (``sglang.grpc.scheduler.SglangScheduler``) adapt it to
each proto package. :func:`open_server` binds and starts a
``grpc.aio`` server with the servicer, ``grpc.health.v1`` and reflection;
:func:`serve` is the command: connect, serve, drain on SIGTERM / SIGINT, or
once every engine has been dead for ``engine_lost_grace`` (:class:`EnginesLost`).

Cancellation: a Generate runs in the RPC's own task; a client cancel, a
deadline, a disconnect or the end of the drain grace cancels that task, and
leaving the stream's ``async with`` aborts the request on the engine. An
``Abort`` RPC cancels the open Generate tasks of its request ids the same
way; their streams then end with a complete of ``finish_reason`` ``"abort"``
per open sample.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg_pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts_pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as ts_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from ..errors import RequestRejected, ZmqDispatchError
from ..protocol.engines import EngineState
from ..limits import DEFAULT_MAX_MM_BYTES
from . import facts as facts_mod
from .facts import ModelFacts
from .generate import GenerateCall, TranslateOptions, translate
from .status import status_of
from .tokenizer_zip import TokenizerBundle

__all__ = ["EnginesLost", "RunningServer", "ServeOptions", "ServicerCore", "SglangSchedulerServicer",
           "TokenSpeedSchedulerServicer", "VllmEngineServicer",
           "bind_server", "engines_lost", "open_server", "serve", "warn_at_startup", "watch_engines"]

_log = logging.getLogger("zmqdispatch.servicer")

#: gRPC's message cap: the largest multimodal payload translation takes
#: (``limits.DEFAULT_MAX_MM_BYTES``) plus room for the rest of the request
_MAX_MESSAGE_BYTES = DEFAULT_MAX_MM_BYTES + 16 * 1024 * 1024
#: Seconds between liveness checks of a many-engine client for ``grpc.health.v1``
#: (one engine: its death is awaited, no polling).
_HEALTH_POLL_SECONDS = 1.0


@attrs.frozen(kw_only=True)
class ServeOptions:
    """What ``serve-grpc`` serves and how.

    Attributes:
        host / port: where to listen (port 0: a free one, printed when bound).
        facts: the model the servicer announces (:class:`~.facts.ModelFacts`).
        translate: how requests are translated (:class:`~.generate.TranslateOptions`;
            its ``runtime`` picks the proto service).
        bundle: the GetTokenizer ZIP (``None``: ``FAILED_PRECONDITION``).
        drain_grace: seconds in-flight streams get to finish after SIGTERM
            before they are cancelled (and aborted on the engine).
        engine_lost_grace: :func:`serve`: seconds every engine may stay dead
            (health ``NOT_SERVING``, Generate ``UNAVAILABLE``) for one to come
            back, an engine started elsewhere dialing the handshake again,
            before :func:`serve` drains and raises :class:`EnginesLost`.
            ``None``: serve on, however long.
        version: GetLoads' ``version``.
    """

    host: str = "127.0.0.1"
    port: int = 0
    facts: ModelFacts
    translate: TranslateOptions = TranslateOptions()
    bundle: TokenizerBundle | None = None
    drain_grace: float = 30.0
    engine_lost_grace: float | None = 5.0
    version: str = "zmqdispatch"

    @property
    def runtime(self) -> str:
        return self.translate.runtime


class _Open:
    """One open Generate: its RPC task, and whether an ``Abort`` cancelled it."""

    __slots__ = ("aborted", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.aborted = False


class ServicerCore:
    """The RPCs over one ``zmqdispatch.aio`` client, for either proto package.

    Attributes:
        open_calls: request_id -> the open Generate calls of that id.
        draining: set once the server stops taking requests (health says so).
    """

    def __init__(self, client: Any, options: ServeOptions) -> None:
        self.client = client
        self.options = options
        self.open_calls: dict[str, list[_Open]] = {}
        self.draining = False
        self.started = time.time()
        self.last_receive = 0.0
        self._tokenspeed = options.runtime == "tokenspeed"
        self._sglang = options.runtime == "sglang"

    def mm_dtype(self, request: Any) -> str | None:
        """What float32 tensors of a multimodal *request* are cast to, else None.

        vLLM: the engines' model dtype (ready response ``dtype``), as vLLM's own
        front end casts. TokenSpeed: the ready response's ``multimodal_encoder_dtype``
        (the dtype of the loaded vision / audio tower, which its scheduler reports),
        or the model dtype when it reports none, the dtype TokenSpeed's own gRPC
        servicer casts encoder inputs to. SGLang carries no multimodal input: None.
        """
        if self._sglang:
            return None
        # TokenSpeed's GenerateRequest has no extra_mm_inputs
        if not (request.HasField("mm_inputs") or (not self._tokenspeed and request.extra_mm_inputs)):
            return None
        try:
            ready = self.client.ready
        except ZmqDispatchError:  # no engine up: the request is refused as UNAVAILABLE later
            return None
        dtype = ready.dtype
        if self._tokenspeed:
            encoder = getattr(ready, "multimodal_encoder_dtype", None)
            if isinstance(encoder, str) and encoder:
                dtype = encoder
        return dtype if isinstance(dtype, str) and dtype else None

    @property
    def active_requests(self) -> int:
        return sum(len(v) for v in self.open_calls.values())

    # ------------------------------------------------------------------ Generate

    async def generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Stream the ``GenerateResponse`` messages of *request* with ``context.write``.

        Status: ``INVALID_ARGUMENT`` for a refused field (named), ``UNAVAILABLE``
        when no engine takes it or its engine dies, other errors per
        :func:`~.status.status_of`. A cancel of the RPC aborts the request on
        the engine (leaving the stream); an ``Abort`` RPC ends it with
        ``"abort"`` completes.
        """
        self.last_receive = time.time()
        client = self.client
        try:
            # engine_index None: a data_parallel_rank is checked by the client against its engines
            translations = translate(request, self.options.translate, max_model_len=client.max_model_len,
                                     engine_index=None, mm_dtype=self.mm_dtype(request))
        except RequestRejected as exc:
            await _abort_with(context, exc)
            return
        call = GenerateCall(request.request_id, translations)
        task = asyncio.current_task()
        assert task is not None
        entry = _Open(task)
        self.open_calls.setdefault(call.request_id, []).append(entry)
        write = context.write
        try:
            try:
                if len(call.requests) == 1:
                    builder = call.builders[0]
                    async with client.generate(call.requests[0]) as stream:
                        async for delta in stream:
                            for response in builder.feed(delta):
                                await write(response)
                            if builder.done:
                                break  # a client-side stop string: leaving aborts the rest on the engine
                else:
                    async with client.generate_samples(call.requests) as samples:
                        async for index, delta in samples:
                            for response in call.feed(index, delta):
                                await write(response)
                            if call.stopped_early(index):
                                samples.abort_sample(index)
                            if call.done:
                                break
            except asyncio.CancelledError:
                # Only an Abort of ours is answered; any other cancel (the client
                # went away, its deadline, the drain grace) goes on up to grpc.
                if not entry.aborted or task.uncancel() > 0:
                    raise
                for response in call.abort_responses():
                    await write(response)
        except ZmqDispatchError as exc:
            await _abort_with(context, exc)
        finally:
            entries = self.open_calls.get(call.request_id)
            if entries is not None:
                entries.remove(entry)
                if not entries:
                    del self.open_calls[call.request_id]

    def abort(self, request_ids: list[str]) -> int:
        """Cancel the open Generate calls of *request_ids*; how many there were."""
        n = 0
        for rid in request_ids:
            for entry in self.open_calls.get(rid, ()):
                if not entry.aborted:
                    entry.aborted = True
                    entry.task.cancel()
                    n += 1
        return n

    # ------------------------------------------------------------------ the other RPCs

    def health(self) -> tuple[bool, str]:
        """``(healthy, message)``: not draining, and the client takes requests."""
        if self.draining:
            return False, "shutting down"
        if not self.client.is_alive:
            dead = [f"engine {s.engine_index}: {s.state.value}" + (f" ({s.reason})" if s.reason else "")
                    for s in self.client.states()]
            return False, "no engine takes requests (" + ", ".join(dead) + ")"
        return True, "ok"

    def model_info(self) -> Any:
        if self._sglang:
            return facts_mod.sglang_model_info(self.options.facts, self.client.max_model_len)
        builder = facts_mod.tokenspeed_model_info if self._tokenspeed else facts_mod.vllm_model_info
        return builder(self.options.facts, self.client.max_model_len)

    def server_info(self) -> Any:
        dp = len(self.client.states())
        uptime = time.time() - self.started
        if self._sglang:
            return facts_mod.sglang_server_info(
                active_requests=self.active_requests, uptime_seconds=uptime, data_parallel_size=dp,
                start_time=self.started, facts=self.options.facts, max_model_len=self.client.max_model_len,
                engine_version=next((e.engine_version.raw for e in self.client.engines.values()), ""),
                last_receive_timestamp=self.last_receive)
        if self._tokenspeed:
            return facts_mod.tokenspeed_server_info(
                active_requests=self.active_requests, uptime_seconds=uptime, data_parallel_size=dp,
                start_time=self.started, facts=self.options.facts, max_model_len=self.client.max_model_len)
        return facts_mod.vllm_server_info(active_requests=self.active_requests, uptime_seconds=uptime,
                                          data_parallel_size=dp, last_receive_timestamp=self.last_receive)

    def loads(self, request: Any) -> Any:
        """The runtime's ``GetLoadsResponse`` (one rank's with ``dp_rank``).

        Raises:
            RequestRejected: ``dp_rank`` names no engine (field ``dp_rank``).
        """
        stats = self.client.stats()
        rows = facts_mod.load_rows(self.client.loads(), {i: s.in_flight for i, s in stats.items()})
        dp_rank = request.dp_rank if request.HasField("dp_rank") else None
        if dp_rank is not None and dp_rank not in stats:
            raise RequestRejected(f"dp_rank: {dp_rank} is not an engine of this servicer (ranks "
                                  f"{', '.join(map(str, sorted(stats)))})", field="dp_rank")
        if self._sglang:
            return facts_mod.sglang_loads(rows, version=self.options.version, dp_rank=dp_rank)
        builder = facts_mod.tokenspeed_loads if self._tokenspeed else facts_mod.vllm_loads
        return builder(rows, version=self.options.version, dp_rank=dp_rank)

    async def flush_cache(self) -> tuple[bool, str]:
        """``reset_prefix_cache`` (SGLang: ``flush_cache``) on every engine:
        ``(all succeeded, message)``."""
        if self._sglang:
            return _outcome(await self.client.call_all("flush_cache"), "cache flushed")
        return _outcome(await self.client.call_all("reset_prefix_cache"), "prefix cache reset")

    async def profile(self, is_start: bool, request: Any = None) -> tuple[bool, str]:
        """Start or stop every engine's profiler: ``(all succeeded, message)``."""
        if self._sglang:
            return await self._sglang_profile(is_start, request)
        kwargs: dict[str, Any] = {}
        if request is not None:
            if request.HasField("output_dir"):
                return False, ("output_dir: the engine writes its traces where its own profiler config says; "
                               "it cannot be set per call")
            if request.HasField("start_step"):
                kwargs["delay_iterations"] = request.start_step
            if request.HasField("num_steps"):
                kwargs["max_iterations"] = request.num_steps
        results = await self.client.call_all("profile", is_start, **kwargs)
        return _outcome(results, "profiler started" if is_start else "profiler stopped")

    async def _sglang_profile(self, is_start: bool, request: Any) -> tuple[bool, str]:
        # SGLang's start_profile takes the request's options as they are.
        if not is_start:
            return _outcome(await self.client.call_all("stop_profile"), "profiler stopped")
        options: dict[str, Any] = {}
        if request is not None:
            for name in ("output_dir", "start_step", "num_steps", "with_stack", "record_shapes"):
                if request.HasField(name):
                    options[name] = getattr(request, name)
            if request.activities:
                options["activities"] = list(request.activities)
            if request.profile_by_stage:
                options["profile_by_stage"] = True
        return _outcome(await self.client.call_all("start_profile", **options), "profiler started")

    async def tokenizer(self, context: grpc.aio.ServicerContext) -> None:
        bundle = self.options.bundle
        if bundle is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this servicer has no tokenizer: start it with --tokenizer-path DIR")
            return
        for data, sha256 in bundle.chunks():
            await context.write(common_pb2.GetTokenizerChunk(data=data, sha256=sha256))


def _outcome(results: Mapping[int, Any], ok: str) -> tuple[bool, str]:
    """``call_all``'s results as ``(success, message)``: an exception, or
    ``False`` (vLLM's ``reset_prefix_cache`` while requests hold cache blocks), fails."""
    if not results:
        return False, "no engine is up"
    failures = [f"engine {i}: {type(r).__name__}: {r}" if isinstance(r, BaseException) else f"engine {i}: refused"
                for i, r in results.items() if isinstance(r, BaseException) or r is False]
    if failures:
        return False, "; ".join(failures)
    return True, f"{ok} on engine(s) {', '.join(map(str, results))}"


async def _abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_of(exc)
    await context.abort(grpc.StatusCode[code], message)


async def _unimplemented(context: grpc.aio.ServicerContext, what: str) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, what)


class _SharedRPCs:
    """The RPCs both services answer alike over a :class:`ServicerCore`
    (their messages are the services' own; ``common`` ones where shared)."""

    core: ServicerCore

    def __init__(self, core: ServicerCore) -> None:
        self.core = core

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        await self.core.generate(request, context)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.core.model_info()

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.core.server_info()

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return self.core.loads(request)
        except RequestRejected as exc:
            await _abort_with(context, exc)

    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ok, message = await self.core.flush_cache()
        return common_pb2.FlushCacheResponse(success=ok, message=message)

    async def StartProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ok, message = await self.core.profile(True, request)
        return common_pb2.ProfileResponse(success=ok, message=message)

    async def StopProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ok, message = await self.core.profile(False)
        return common_pb2.ProfileResponse(success=ok, message=message)

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        await self.core.tokenizer(context)

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        await _unimplemented(context, "SubscribeKvEvents: KV events are not relayed by this servicer")


class VllmEngineServicer(_SharedRPCs, vllm_grpc.VllmEngineServicer):  # type: ignore[misc]  # generated, untyped base
    """``vllm.grpc.engine.VllmEngine`` over a :class:`ServicerCore`."""

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "Embed: the ZMQ transport serves generation only")

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        healthy, message = self.core.health()
        return vllm_pb.HealthCheckResponse(healthy=healthy, message=message)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.core.abort(list(request.request_ids))
        return vllm_pb.AbortResponse()


class TokenSpeedSchedulerServicer(_SharedRPCs, ts_grpc.TokenSpeedSchedulerServicer):  # type: ignore[misc]
    """``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` over a :class:`ServicerCore`."""

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        healthy, message = self.core.health()
        return ts_pb.HealthCheckResponse(healthy=healthy, message=message)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self.core.abort([request.request_id])
        if n:
            return ts_pb.AbortResponse(success=True, message=f"aborted {n} open stream(s)")
        return ts_pb.AbortResponse(success=False, message=f"no open request {request.request_id!r}")


class SglangSchedulerServicer(_SharedRPCs, sg_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """``sglang.grpc.scheduler.SglangScheduler`` over a :class:`ServicerCore` (the
    SGLang schedulers behind it answer FlushCache / StartProfile / StopProfile as
    CONTROL calls)."""

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "Embed: the ZMQ transport serves generation only")

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        healthy, message = self.core.health()
        return sg_pb.HealthCheckResponse(healthy=healthy, message=message)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self.core.abort([request.request_id])
        if n:
            return sg_pb.AbortResponse(success=True, message=f"aborted {n} open stream(s)")
        return sg_pb.AbortResponse(success=False, message=f"no open request {request.request_id!r}")

    async def LoadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "LoadLoRAAdapter: LoRA adapters are not carried over the SGLang ZMQ transport")

    async def UnloadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "UnloadLoRAAdapter: LoRA adapters are not carried over the SGLang ZMQ "
                                      "transport")

    async def ListLoadedLoRAAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _unimplemented(context, "ListLoadedLoRAAdapters: LoRA adapters are not carried over the SGLang ZMQ "
                                      "transport")


@attrs.define
class RunningServer:
    """A started server (:func:`open_server`).

    Attributes:
        address: ``host:port`` it listens on.
        core: the servicer's :class:`ServicerCore`.
        server: the ``grpc.aio.Server``.
    """

    address: str
    core: ServicerCore
    server: grpc.aio.Server
    health: Any

    async def drain(self, grace: float) -> None:
        """Stop taking RPCs (health: NOT_SERVING), give in-flight ones *grace*
        seconds, then cancel the rest (each cancel aborts its request on the engine)."""
        self.core.draining = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def _service_names(runtime: str) -> tuple[str, ...]:
    pb, service = {"tokenspeed": (ts_pb, "TokenSpeedScheduler"),
                   "sglang": (sg_pb, "SglangScheduler")}.get(runtime, (vllm_pb, "VllmEngine"))
    return (pb.DESCRIPTOR.services_by_name[service].full_name,)


def bind_server(options: ServeOptions) -> RunningServer:
    """A ``grpc.aio`` server with the servicer of ``options.runtime``,
    ``grpc.health.v1`` and reflection, bound to ``options.host:port`` but not
    started (its client is set by :func:`open_server`): the address is
    checked before the engines are waited for.

    Raises:
        OSError: the address cannot be bound (named).
    """
    core = ServicerCore(None, options)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    names = _service_names(options.runtime)
    if options.runtime == "sglang":
        sg_grpc.add_SglangSchedulerServicer_to_server(SglangSchedulerServicer(core), server)
    elif options.runtime == "tokenspeed":
        ts_grpc.add_TokenSpeedSchedulerServicer_to_server(TokenSpeedSchedulerServicer(core), server)
    else:
        vllm_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    target = f"[{options.host}]:{options.port}" if ":" in options.host else f"{options.host}:{options.port}"
    try:
        port = server.add_insecure_port(target)
    except RuntimeError as exc:
        raise OSError(f"--host/--port {target}: cannot bind: {exc}") from None
    return RunningServer(address=target.rsplit(":", 1)[0] + f":{port}", core=core, server=server,
                         health=health_servicer)


@asynccontextmanager
async def open_server(client: Any, options: ServeOptions, *, bound: RunningServer | None = None
                      ) -> AsyncIterator[RunningServer]:
    """Serve *client* (a ``zmqdispatch.aio`` client) on ``options.host:port``
    (or on the server *bound* by :func:`bind_server`) until the block is left;
    leaving drains with ``options.drain_grace``.

    Raises:
        OSError: the address cannot be bound (named).
    """
    running = bound if bound is not None else bind_server(options)
    running.core.client = client
    names = _service_names(options.runtime)
    health_servicer = running.health
    await running.server.start()

    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *names):
            await health_servicer.set(name, status)

    async def watch_health() -> None:
        serving = client.is_alive
        await set_health(serving)
        while True:
            if serving and len(client.states()) == 1:
                await client.wait_dead()  # one engine up: its death, at once
            else:  # several engines, or none up: liveness changes both ways (a restarted engine rejoins)
                await asyncio.sleep(_HEALTH_POLL_SECONDS)
            if client.is_alive != serving:
                serving = client.is_alive
                await set_health(serving)

    watcher = asyncio.create_task(watch_health())
    try:
        yield running
    finally:
        watcher.cancel()
        try:
            await running.drain(options.drain_grace)
        finally:
            await asyncio.gather(watcher, return_exceptions=True)


class EnginesLost(ZmqDispatchError):
    """:func:`serve`: every engine was dead for ``engine_lost_grace`` seconds
    and none came back; the message names each engine and why it died."""


def engines_lost(client: Any) -> str | None:
    """Why no engine takes requests when every engine of *client* is dead
    (``"engine 0: process_exit: engine process 7 exited with code 1"``, one
    part per engine); ``None`` while any is up or draining, or the client is closing."""
    states = client.states()
    if client.is_alive or not states or any(s.state is not EngineState.DEAD or s.reason == "closed"
                                            for s in states):
        return None
    parts = []
    for s in states:
        death = client.engine(s.engine_index).death
        parts.append(f"engine {s.engine_index}: {s.reason}" + (f": {death}" if death is not None else ""))
    return "; ".join(parts)


async def watch_engines(client: Any, grace: float) -> str:
    """Return :func:`engines_lost`'s reason once every engine of *client* has
    been dead for *grace* seconds on end (an engine that comes back within
    them, e.g. restarted elsewhere and dialing the handshake again, starts the
    watch over). One engine: its death is awaited; several: polled every
    :data:`_HEALTH_POLL_SECONDS`."""
    while True:
        reason = engines_lost(client)
        if reason is None:
            if client.is_alive and len(client.states()) == 1:
                await client.wait_dead()
            else:
                await asyncio.sleep(_HEALTH_POLL_SECONDS)
            continue
        _log.info("no engine takes requests (%s): exiting unless one is up within %.1f s", reason, grace)
        try:
            await asyncio.wait_for(client.wait_for_engines(1), grace)
        except TimeoutError:
            return reason
        _log.info("an engine is up again: serving")


def warn_at_startup(options: ServeOptions) -> None:
    """Log what a serving setup lacks that a caller should know: no
    vocabulary size means token ids go to the engine unchecked. Called once
    the address is bound, so a bind failure stays the only line."""
    if options.facts.vocab_size is None:
        _log.warning("no vocabulary size (--vocab-size, or --model-path / --tokenizer-path with a config.json): "
                     "token ids are not checked against it, and an id past the model's vocabulary crashes a vLLM "
                     "engine for every client")


async def serve(options: ServeOptions, connect_kwargs: Mapping[str, Any], *,
                ready: Callable[[str], None] | None = None) -> str:
    """``zmqdispatch serve-grpc``: connect (``zmqdispatch.aio.connect(**connect_kwargs)``),
    serve until SIGTERM or SIGINT, then drain (``options.drain_grace``) and
    close the client (a launched engine is stopped). *ready* gets the bound
    ``host:port`` once serving.

    Returns:
        the signal's name (``"SIGTERM"``), or that name with ``"-early"`` when
        it came before the server was up (the connect was cancelled). A second
        signal during the drain cuts it short: every open stream is aborted.

    Raises:
        EnginesLost: every engine was dead for ``options.engine_lost_grace``
            seconds (:func:`watch_engines`); raised after the drain and the
            client's close (a launched engine is stopped).
        what ``aio.connect`` raises (handshake, bind), ``OSError`` for the gRPC address.
    """
    from ..aio import connect  # the asyncio API (a trio guest run); open_server takes any client of its shape

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    body = asyncio.current_task()
    assert body is not None
    serving = False
    got: list[str] = []
    lost: list[str] = []

    async def watch(client: Any, grace: float) -> None:
        try:
            lost.append(await watch_engines(client, grace))
        finally:
            stop.set()  # a failure of the watch stops the server too (raised below), never a silent hang

    def on_signal(sig: signal.Signals) -> None:
        got.append(sig.name)
        if serving and len(got) == 1:
            stop.set()
        else:
            body.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    bound = bind_server(options)
    warn_at_startup(options)
    try:
        async with connect(**connect_kwargs) as client, open_server(client, options, bound=bound) as running:
            serving = True
            _log.info("serving %s on %s (%d engine(s))", _service_names(options.runtime)[0], running.address,
                      len(client.states()))
            if ready is not None:
                ready(running.address)
            watcher = None
            if options.engine_lost_grace is not None:
                watcher = asyncio.create_task(watch(client, options.engine_lost_grace))
            try:
                await stop.wait()
            finally:
                if watcher is not None:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
            if watcher is not None and not watcher.cancelled() and (failure := watcher.exception()) is not None:
                raise failure
            _log.info("%s: draining (grace %.1f s)", "every engine lost" if lost else got[0], options.drain_grace)
    except asyncio.CancelledError:
        if not got or body.uncancel() > 0:
            raise
        return got[0] if serving else got[0] + "-early"
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await bound.server.stop(None)  # unbinds a server that never started (a failed connect); else a no-op
    if lost:
        raise EnginesLost(f"every engine was dead for {options.engine_lost_grace:g} s and none came back: {lost[0]}")
    return got[0] if got else ""
