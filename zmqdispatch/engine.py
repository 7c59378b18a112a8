"""One engine of a client: :class:`Engine`, the handle ``client.engine(i)``
returns (ready response, liveness, stats, the typed control plane), and the
stream host its requests are queued through.

No I/O of its own: it reads the engine's sans-IO state
(:class:`~zmqdispatch.protocol.engine.EngineProtocol`) and reaches the sockets
only through its :class:`~zmqdispatch.connection.EngineConnection`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from .config import ClientConfig, EngineSession
from .connection import EngineConnection, park
from .errors import EngineDeadError, RequestRejected, UtilityCallTimeout
from .metrics import EngineStats
from .protocol import control
from .protocol.deadlines import Deadlines
from .protocol.engine import EngineProtocol
from .protocol.engines import format_ranks
from .protocol.mailbox import Mailbox
from .protocol.versions import EngineVersion
from .streams import EngineRequest
from .wire import vllm_handshake as wire

__all__ = ["Engine"]


class Engine:
    """One engine of an :class:`~zmqdispatch.EngineClient`: its ready response,
    its link's state and counters, and its control plane (vLLM utility calls).
    ``client.engine(i)`` (``client.engine()`` for the only one) returns it;
    requests go through the client, which places them (``data_parallel_rank``
    pins one engine).

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
        return f"<Engine engine={p.engine_index} {p.state.value} inflight={p.inflight}>"

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
        """TokenSpeed / SGLang: the newest load snapshot piggybacked on its outputs
        (``wire.tokenspeed.LoadSnapshot``: running, waiting, KV pages;
        ``wire.sglang.SGLangLoad``: the same in KV tokens), ``None`` before the
        first one and always on vLLM. Stale while the engine is idle
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
                f"data_parallel_rank: {pin!r} is not an engine of this client; valid ranks: "
                f"{format_ranks([self.engine_index])}",
                request_id=self.runtime.request_id(request),
                field="data_parallel_rank",
            )

    # ------------------------------------------------------------------ in-package: the client's streams

    def queue_request(self, request: EngineRequest, deadlines: Deadlines | None) -> Mailbox:
        """Register a request the client validated and placed here, queue its
        ADD (the input pump sends it), start its *deadlines*; its mailbox."""
        return self._conn.queue_request(request, deadlines)

    def abort_mailbox(self, mailbox: Mailbox) -> None:
        """Abort the request of *mailbox* if this engine still holds that very mailbox."""
        self._protocol.abort_mailbox(mailbox)

    def check_alive(self) -> None:
        """Raise this engine's ``EngineDeadError`` once it is dead or gone."""
        self._protocol.check_alive()

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
                    await park(call)
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

    # SGLang schedulers' CONTROL calls (UnsupportedByRuntimeError on other engines).

    async def flush_cache(self, timeout_s: float = 0.0, *, timeout: float | None = None) -> str | None:
        """SGLang: drop the prefix cache (waiting up to *timeout_s* for running
        requests); the scheduler's message, ``UtilityCallError`` when it could not."""
        return await self._control(control.flush_cache(self.engine_version, timeout_s), timeout)

    async def start_profile(self, *, timeout: float | None = None, **options: Any) -> str | None:
        """SGLang: start the profiler (*options*: those of
        :func:`zmqdispatch.protocol.control.start_profile`); the scheduler's message."""
        return await self._control(control.start_profile(self.engine_version, **options), timeout)

    async def stop_profile(self, *, timeout: float | None = None) -> str | None:
        """SGLang: stop the profiler and write its trace; the scheduler's message."""
        return await self._control(control.stop_profile(self.engine_version), timeout)
