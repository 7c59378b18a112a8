"""The asyncio client: :func:`connect` and :class:`AsyncEngineClient`, the
asyncio face of :class:`zmqdispatch.EngineClient`.

The trio client runs unchanged in the loop's trio guest run
(:mod:`._guest`); this module holds no rule of its own. Synchronous reads
(``states()``, ``stats()``, ``max_model_len``) read the trio client directly
(same thread); the control plane runs each call as a trio task and awaits its
result; streams read their mailboxes directly (:mod:`.streams`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..client import EngineClient
from ..config import ClientConfig, EngineSession
from ..engine import Engine
from ..errors import EngineDeadError
from ..metrics import EngineStats
from ..protocol import control
from ..protocol.deadlines import Deadlines
from ..protocol.engines import EngineStatus
from ..protocol.placement import EngineLoad
from ..protocol.runtime import Runtime
from ..request_stream import EngineRequest
from ..shell import connect as trio_connect
from ._guest import GuestRunError, TrioGuest, acquire, release, wait_uncancelled
from .group import AsyncStreamGroup, adopt
from .samples import AsyncSampleStream
from .streams import AsyncRequestStream, stream_parts

__all__ = ["AsyncEngineClient", "connect"]


class AsyncEngineClient:
    """The client of one engine or many, for asyncio. Create with :func:`connect`.

    The same names, arguments, results and errors as
    :class:`zmqdispatch.EngineClient`; its streams are asyncio streams
    (:class:`~zmqdispatch.aio.AsyncRequestStream`, ...). ``client.trio`` is
    the trio client itself (its synchronous API may be used from asyncio
    code; its async methods only through :func:`zmqdispatch.aio.run_in_trio`).
    """

    def __init__(self, client: EngineClient, guest: TrioGuest) -> None:
        #: the trio client this one drives
        self.trio = client
        self._guest = guest

    def __repr__(self) -> str:
        return f"<AsyncEngineClient {self.trio!r}>"

    # ------------------------------------------------------------------ reads (synchronous)

    @property
    def max_model_len(self) -> int:
        """The smallest ``max_model_len`` of the engines served (tokens)."""
        return self.trio.max_model_len

    @property
    def ready(self) -> Any:
        """The ready response of the lowest-index engine (:attr:`zmqdispatch.EngineClient.ready`)."""
        return self.trio.ready

    @property
    def runtime(self) -> Runtime:
        """The engines' dialect."""
        return self.trio.runtime

    @property
    def is_alive(self) -> bool:
        """False once the client closed or fewer than ``quorum`` engines are up."""
        return self.trio.is_alive

    @property
    def has_quorum(self) -> bool:
        """At least ``quorum`` engines are up."""
        return self.trio.has_quorum

    @property
    def quorum(self) -> int:
        """Below this many up engines new requests are refused."""
        return self.trio.quorum

    @property
    def up_count(self) -> int:
        """Engines up now."""
        return self.trio.up_count

    @property
    def engine_index(self) -> int | None:
        """The only engine's index; None with several."""
        return self.trio.engine_index

    @property
    def engines(self) -> dict[int, Engine]:
        """Every engine by ``engine_index`` (trio objects: read their
        synchronous attributes; await their methods through ``run_in_trio``)."""
        return self.trio.engines

    def engine(self, engine_index: int | None = None) -> Engine:
        """One engine (:meth:`zmqdispatch.EngineClient.engine`)."""
        return self.trio.engine(engine_index)

    @property
    def death(self) -> EngineDeadError | None:
        """The only engine's death, or None while it lives."""
        return self.trio.death

    @property
    def session(self) -> EngineSession | None:
        """What re-attaching to the only engine needs (``connect(resume=...)``)."""
        return self.trio.session

    @property
    def process(self) -> Any:
        """The launched engine process (``connect(launch=...)``), or None."""
        return self.trio.process

    def states(self) -> tuple[EngineStatus, ...]:
        """Each engine's state (:meth:`zmqdispatch.EngineClient.states`)."""
        return self.trio.states()

    def stats(self) -> dict[int, EngineStats]:
        """Each engine's :class:`~zmqdispatch.EngineStats`, by ``engine_index``."""
        return self.trio.stats()

    def loads(self) -> tuple[EngineLoad, ...]:
        """Each engine's placement load."""
        return self.trio.loads()

    def engine_of(self, request_id: str) -> int | None:
        """The engine a live request is on, or None."""
        return self.trio.engine_of(request_id)

    def origin(self, engine_index: int) -> tuple[str, int]:
        """``(handshake address, identity)`` of an engine."""
        return self.trio.origin(engine_index)

    def check_request(self, request: Any) -> None:
        """:meth:`zmqdispatch.EngineClient.check_request` (validate, send nothing)."""
        self.trio.check_request(request)

    # ------------------------------------------------------------------ streams

    def generate(self, request: EngineRequest, *, deadlines: Deadlines | None = None) -> AsyncRequestStream:
        """Validate *request*; return its asyncio stream (use ``async with``).

        Arguments, placement and errors as :meth:`zmqdispatch.EngineClient.generate`
        (synchronous: validates now; nothing is sent before the stream is entered).
        """
        host, request_id, req, in_force = stream_parts(self.trio.generate(request, deadlines=deadlines))
        return AsyncRequestStream(host, request_id, req, in_force, self._guest.loop)

    def generate_samples(self, requests: Sequence[EngineRequest], *, deadlines: Deadlines | None = None
                         ) -> AsyncSampleStream:
        """Validate the ``n`` samples of one parent request; return their merged
        asyncio stream (use ``async with``), which yields ``(index, OutputDelta)``.

        Arguments, placement and errors as :meth:`zmqdispatch.EngineClient.generate_samples`.
        """
        return AsyncSampleStream.of(self.trio.generate_samples(requests, deadlines=deadlines))

    def stream_group(self) -> AsyncStreamGroup:
        """A new :class:`~zmqdispatch.aio.AsyncStreamGroup` (use ``async with``):
        many requests read by one asyncio task, one batch per wake-up
        (:meth:`zmqdispatch.EngineClient.stream_group`)."""
        return adopt(self.trio.stream_group())

    # ------------------------------------------------------------------ trio calls

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            return await self._guest.run(lambda: fn(*args, **kwargs))
        return await self._guest.run(fn, *args)

    async def wait_dead(self) -> EngineDeadError:
        """Wait until the only engine is declared dead; its cause."""
        result: EngineDeadError = await self._call(self.trio.wait_dead)
        return result

    async def wait_for_engines(self, n: int) -> None:
        """Wait until at least *n* engines are up (no timeout of its own: wrap
        it in ``asyncio.timeout``)."""
        await self._call(self.trio.wait_for_engines, n)

    async def drain(self, engine_index: int) -> None:
        """:meth:`zmqdispatch.EngineClient.drain`."""
        await self._call(self.trio.drain, engine_index)

    def start_drain(self, engine_index: int) -> bool:
        """:meth:`zmqdispatch.EngineClient.start_drain`."""
        return self.trio.start_drain(engine_index)

    def undrain(self, engine_index: int) -> None:
        """:meth:`zmqdispatch.EngineClient.undrain`."""
        self.trio.undrain(engine_index)

    async def call_all(self, method: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """:meth:`zmqdispatch.EngineClient.call_all`."""
        result: dict[int, Any] = await self._call(self.trio.call_all, method, *args, **kwargs)
        return result

    async def call_utility(self, method: str, *args: Any, engine_index: int | None = None,
                           timeout: float | None = None) -> Any:
        """:meth:`zmqdispatch.EngineClient.call_utility`."""
        return await self._call(self.trio.call_utility, method, *args, engine_index=engine_index, timeout=timeout)

    async def get_supported_tasks(self, *, engine_index: int | None = None,
                                  timeout: float | None = None) -> tuple[str, ...]:
        """:meth:`zmqdispatch.EngineClient.get_supported_tasks`."""
        result: tuple[str, ...] = await self._call(self.trio.get_supported_tasks, engine_index=engine_index,
                                                   timeout=timeout)
        return result

    async def is_sleeping(self, *, engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.is_sleeping`."""
        return bool(await self._call(self.trio.is_sleeping, engine_index=engine_index, timeout=timeout))

    async def sleep(self, level: int = 1, mode: control.PauseMode = "abort", *, engine_index: int | None = None,
                    timeout: float | None = None) -> None:
        """:meth:`zmqdispatch.EngineClient.sleep`."""
        await self._call(self.trio.sleep, level, mode, engine_index=engine_index, timeout=timeout)

    async def wake_up(self, tags: Sequence[str] | None = None, *, engine_index: int | None = None,
                      timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.wake_up`."""
        return bool(await self._call(self.trio.wake_up, tags, engine_index=engine_index, timeout=timeout))

    async def pause_scheduler(self, mode: control.PauseMode = "abort", clear_cache: bool = True, *,
                              engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`zmqdispatch.EngineClient.pause_scheduler`."""
        await self._call(self.trio.pause_scheduler, mode, clear_cache, engine_index=engine_index, timeout=timeout)

    async def resume_scheduler(self, *, engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`zmqdispatch.EngineClient.resume_scheduler`."""
        await self._call(self.trio.resume_scheduler, engine_index=engine_index, timeout=timeout)

    async def is_scheduler_paused(self, *, engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.is_scheduler_paused`."""
        return bool(await self._call(self.trio.is_scheduler_paused, engine_index=engine_index, timeout=timeout))

    async def pause_generation(self, mode: control.PauseMode = "abort", clear_cache: bool = True, *,
                               engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`zmqdispatch.EngineClient.pause_generation`."""
        await self._call(self.trio.pause_generation, mode, clear_cache, engine_index=engine_index, timeout=timeout)

    async def resume_generation(self, *, engine_index: int | None = None, timeout: float | None = None) -> None:
        """:meth:`zmqdispatch.EngineClient.resume_generation`."""
        await self._call(self.trio.resume_generation, engine_index=engine_index, timeout=timeout)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False, *,
                                 engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.reset_prefix_cache`."""
        return bool(await self._call(self.trio.reset_prefix_cache, reset_running_requests, reset_connector,
                                     engine_index=engine_index, timeout=timeout))

    async def add_lora(self, lora: control.LoRARequest, *, engine_index: int | None = None,
                       timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.add_lora`."""
        return bool(await self._call(self.trio.add_lora, lora, engine_index=engine_index, timeout=timeout))

    async def remove_lora(self, lora_id: int, *, engine_index: int | None = None,
                          timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.remove_lora`."""
        return bool(await self._call(self.trio.remove_lora, lora_id, engine_index=engine_index, timeout=timeout))

    async def pin_lora(self, lora_id: int, *, engine_index: int | None = None, timeout: float | None = None) -> bool:
        """:meth:`zmqdispatch.EngineClient.pin_lora`."""
        return bool(await self._call(self.trio.pin_lora, lora_id, engine_index=engine_index, timeout=timeout))

    async def list_loras(self, *, engine_index: int | None = None, timeout: float | None = None) -> frozenset[int]:
        """:meth:`zmqdispatch.EngineClient.list_loras`."""
        result: frozenset[int] = await self._call(self.trio.list_loras, engine_index=engine_index, timeout=timeout)
        return result

    async def collective_rpc(self, method: str, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                             rpc_timeout: float | None = None, engine_index: int | None = None,
                             timeout: float | None = None) -> list[Any]:
        """:meth:`zmqdispatch.EngineClient.collective_rpc`."""
        result: list[Any] = await self._call(self.trio.collective_rpc, method, args=args, kwargs=kwargs,
                                             rpc_timeout=rpc_timeout, engine_index=engine_index, timeout=timeout)
        return result

    async def profile(self, is_start: bool = True, *, profile_prefix: str | None = None,
                      delay_iterations: int | None = None, max_iterations: int | None = None,
                      profiler_kwargs: dict[str, Any] | None = None, engine_index: int | None = None,
                      timeout: float | None = None) -> None:
        """:meth:`zmqdispatch.EngineClient.profile`."""
        await self._call(self.trio.profile, is_start, profile_prefix=profile_prefix,
                         delay_iterations=delay_iterations, max_iterations=max_iterations,
                         profiler_kwargs=profiler_kwargs, engine_index=engine_index, timeout=timeout)

    async def flush_cache(self, timeout_s: float = 0.0, *, engine_index: int | None = None,
                          timeout: float | None = None) -> str | None:
        """:meth:`zmqdispatch.EngineClient.flush_cache` (SGLang)."""
        result: str | None = await self._call(self.trio.flush_cache, timeout_s, engine_index=engine_index,
                                              timeout=timeout)
        return result

    async def start_profile(self, *, engine_index: int | None = None, timeout: float | None = None,
                            **options: Any) -> str | None:
        """:meth:`zmqdispatch.EngineClient.start_profile` (SGLang)."""
        result: str | None = await self._call(self.trio.start_profile, engine_index=engine_index, timeout=timeout,
                                              **options)
        return result

    async def stop_profile(self, *, engine_index: int | None = None, timeout: float | None = None) -> str | None:
        """:meth:`zmqdispatch.EngineClient.stop_profile` (SGLang)."""
        result: str | None = await self._call(self.trio.stop_profile, engine_index=engine_index, timeout=timeout)
        return result


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # looked at: no "exception was never retrieved" log for an abandoned future


async def _serve(kwargs: dict[str, Any], ready: asyncio.Future[EngineClient], stop: trio.Event,
                 scope: trio.CancelScope, ended: asyncio.Future[None]) -> None:
    """The trio task of one asyncio client: ``zmqdispatch.connect`` until *stop*
    (or *scope* cancelled: the caller left during the handshake)."""
    try:
        with scope:
            async with trio_connect(**kwargs) as client:
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
    except trio.Cancelled:
        exc: BaseException = GuestRunError("the trio guest run stopped under an open client")
        if not ready.done():
            ready.set_exception(exc)
        if not ended.done():
            ended.set_result(None)
        raise
    except BaseException as error:  # handed to the asyncio side, raised there
        if not ready.done():
            ready.set_exception(error)
        elif not ended.done():
            ended.set_exception(error)
        if not ended.done():
            ended.set_result(None)
        if not isinstance(error, Exception):
            raise
        return
    if not ready.done():
        ready.cancel()
    if not ended.done():
        ended.set_result(None)


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
) -> AsyncIterator[AsyncEngineClient]:
    """:func:`zmqdispatch.connect` for asyncio: the same arguments, the same
    errors, yields an :class:`AsyncEngineClient`.

    The trio client runs in the running loop's trio guest run (one per loop,
    shared by every client of the loop; a second client works as the first).
    Works under asyncio's default loop and uvloop.

    Exit (normally, on an error, the task cancelled, ``asyncio.run`` ending
    with the block open): the trio client closes as in trio (open streams get
    ``EngineDeadError(reason="closed")``, queued ABORTs are sent best-effort,
    a launched engine is terminated) and the exit waits for that even when
    cancelled meanwhile (the cancellation is raised afterwards). The last
    client of a loop to leave ends the guest run. A loop closed from outside
    with the block still open stops the launched engine (SIGTERM to its process
    group) once nothing can run trio any more; a task destroyed with the loop
    leaves the block without awaiting.

    Raises: what :func:`zmqdispatch.connect` raises; also
        GuestRunError: a trio run already owns this thread (from trio code use
            ``zmqdispatch.connect``).
    """
    kwargs = dict(handshake_address=handshake_address, data_parallel_size=data_parallel_size, quorum=quorum,
                  launch=launch, config=config, launch_stdout=launch_stdout, resume=resume, runtime=runtime,
                  data_plane_host=data_plane_host, rng=rng)
    guest = await acquire()
    abandoned = False
    try:
        loop = guest.loop
        ready: asyncio.Future[EngineClient] = loop.create_future()
        ended: asyncio.Future[None] = loop.create_future()
        stop = trio.Event()
        scope = trio.CancelScope()
        ready.add_done_callback(_retrieved)
        guest.spawn(_serve, kwargs, ready, stop, scope, ended)
        try:
            client = await asyncio.shield(ready)
        except asyncio.CancelledError:
            if ready.cancelled() or not ready.done():  # the caller was cancelled during the handshake
                scope.cancel()  # connect()'s own clean-up stops a launched engine
                ended.add_done_callback(_retrieved)
                await wait_uncancelled(ended)
            raise
        process = client.process
        if process is not None:
            guest.engine_groups.add(process.pid)  # launched in a process group of its own
        try:
            yield AsyncEngineClient(client, guest)
        except GeneratorExit:
            # the task holding the block was destroyed (its loop closed under
            # it): nothing can be awaited any more; the engine stays listed
            # for the guest run's host_closed
            abandoned = True
            stop.set()
            raise
        finally:
            if not abandoned:
                stop.set()
                try:
                    await wait_uncancelled(ended)
                finally:
                    if process is not None and ended.done():  # stopped by the trio client
                        guest.engine_groups.discard(process.pid)
                error = ended.exception()
                if error is not None:
                    raise error
    finally:
        if not abandoned:
            await release(guest)
