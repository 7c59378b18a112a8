"""The mock engine program: a wire-faithful vLLM EngineCore or TokenSpeed stand-in.

Run as ``zmqdispatch mock-engine --handshake-address ADDR [--runtime tokenspeed|sglang]``.
Each data-parallel rank it runs (``--data-parallel-size N``: ranks 0..N-1, see
:func:`rank_configs`) dials in exactly as vLLM's EngineCore (or TokenSpeed's scheduler) does
(:mod:`zmqdispatch.testing.dial`), then runs two tasks, each owning one socket: an input reader
(DEALER) and a stepper (PUSH) that emits one ``EngineCoreOutputs`` (TokenSpeed:
one ``BatchTokenIDOutSlim``) per step covering every running request
(:class:`.core.MockEngineCore`, :class:`.tokenspeed_core.MockTokenSpeedScheduler`,
:class:`.sglang_core.MockSGLangScheduler`: an SGLang scheduler behind the SGLang plugin,
which answers CONTROL calls, an ADD it cannot decode with a terminal ``"abort"`` when
its rid can be read, and sends the sentinel when it stops).

TokenSpeed differs at the I/O level (``docs/tokenspeed-wire.md`` §1.12): a message
that does not decode, or an unknown type byte, is dropped and the reader goes
on; a refused request gets one terminal ``"abort"`` batch; shutdown sends the
``ENGINE_CORE_DEAD`` sentinel. The rest of this docstring describes vLLM's.

Real-engine behaviours it reproduces at the I/O level:

- an ADD that does not decode, an unknown request-type byte, or values that
  fail vLLM's checks in its input thread (``top_p`` 0.0, ``max_tokens`` 0, a
  float ``top_k``) stop the input reader for good: the process stays alive
  and never reads input again (the real input thread dies silently);
- a fatal error (duplicate live id, token id >= vocab) sends the single-frame
  ``ENGINE_CORE_DEAD`` sentinel and exits with code 1;
- SIGTERM/SIGINT abort running requests with finish ABORT outputs, then exit 0.

Faults (``--fault KIND[:N]``, repeatable), for the failure tests:

=====================  ==========================================================
``sentinel:N``         after N steps, send ENGINE_CORE_DEAD and exit 1
``exit:N``             after N steps, exit 1 at once, no sentinel (like SIGKILL)
``garbage:N``          after N steps, send undecodable frames instead of outputs
``silent:N``           from step N on, send nothing (alive but wedged)
``stop-reading:N``     after N ADDs, stop reading the input socket (its libzmq
                       keeps receiving: RCVHWM 0 as in vLLM, so the client's
                       sends never block; silence is what reveals it. To make
                       sends block, freeze the process: SIGSTOP)
``no-ready``           never send READY (the handshake never completes)
=====================  ==========================================================
"""

from __future__ import annotations

import abc
import functools
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence

import attrs
import trio
import zmq

from .._zmq_trio import TrioSocket, parse_monitor_event
from ..addresses import check_address
from ..testing.dial import EngineSockets, dial, ready_response
from ..wire import sglang as sg
from ..wire import sglang_engine as sg_engine
from ..wire import tokenspeed as ts
from ..wire import tokenspeed_engine as ts_engine
from ..wire import vllm as wire
from ..wire import vllm_engine as wire_engine
from ..wire.vllm_multimodal import decode_mm_features
from .core import FatalEngineError, MockEngineCore
from .sglang_core import MockSGLangScheduler
from .tokenspeed_core import MockTokenSpeedScheduler, embedding_fault, typed_multimodal

_log = logging.getLogger("zmqdispatch.mock")

__all__ = [
    "MockEngineConfig",
    "parse_fault",
    "rank_configs",
    "run_mock_engine",
    "serve_mock_engine",
    "serve_mock_ranks",
    "start_mock_engine",
    "FAULT_KINDS",
    "MOCK_VOCAB_SIZE",
    "RUNTIMES",
]

#: ``--runtime`` values.
RUNTIMES = ("vllm", "tokenspeed", "sglang")

#: the mock engine's default vocabulary (``zmqdispatch mock-engine --vocab-size``)
MOCK_VOCAB_SIZE = 32_000
FAULT_KINDS = ("sentinel", "exit", "garbage", "silent", "stop-reading", "no-ready")


def parse_fault(spec: str) -> tuple[str, int]:
    """Parse ``KIND[:N]`` into ``(kind, n)``; N defaults to 0.

    Raises:
        ValueError: unknown kind or a bad N.
    """
    kind, _, n = spec.partition(":")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULT_KINDS)}")
    if n and not (n.isascii() and n.isdigit()):
        raise ValueError(f"fault count must be a whole number >= 0, got {n!r}")
    count = int(n) if n else 0
    return kind, count


@attrs.frozen(kw_only=True)
class MockEngineConfig:
    """Settings of one mock engine process (see ``zmqdispatch mock-engine --help``).

    ``engine_index`` is the first DP rank the process runs, and
    ``data_parallel_size_local`` how many consecutive ranks it runs (vLLM's
    ``--data-parallel-start-rank`` / ``--data-parallel-size-local``): each rank
    dials the one handshake address with its own 2-byte identity and is an
    independent engine (:func:`rank_configs`). ``data_parallel_size`` is the
    whole DP group's size; only the TokenSpeed ready response reports it (a
    non-MoE vLLM engine runs as an independent DP=1 engine and reports 1).
    """

    handshake_address: str
    engine_index: int = 0
    data_parallel_size_local: int = 1
    data_parallel_size: int = 1
    max_model_len: int = 4096
    vocab_size: int = MOCK_VOCAB_SIZE
    step_interval: float = 0.001  # seconds; 0 = as fast as possible
    tokens_per_step: int = 1
    #: vLLM: the multimodal receiver cache's capacity (``--mm-processor-cache-gb``)
    mm_cache_gb: float = 4.0
    faults: tuple[tuple[str, int], ...] = ()
    headless: bool = False
    runtime: str = "vllm"
    #: TokenSpeed: the model's EOS ids (TokenSpeed stops at EOS by itself).
    eos_token_ids: tuple[int, ...] = ()
    #: TokenSpeed: ``--stream-interval``.
    stream_interval: int = 1
    #: TokenSpeed: ``--enable-output-logprobs``.
    enable_output_logprobs: bool = True
    #: TokenSpeed: the ready response's ``multimodal_encoder_dtype`` (the dtype of the
    #: model's vision / audio tower; None: a text model, as the scheduler reports it).
    multimodal_encoder_dtype: str | None = None

    def fault(self, kind: str) -> int | None:
        """The N of fault *kind* when it was requested, else ``None``."""
        for k, n in self.faults:
            if k == kind:
                return n
        return None


class _Exited(Exception):
    """An in-process mock engine "exited" (see :func:`start_mock_engine`)."""


def _exit(engine: _EngineLoop, code: int, *, flush: bool = False) -> None:
    """Exit the mock engine's process at once (no cleanup, like a crash), or, for an
    in-process engine (tests), stop it with its sockets closed."""
    if engine.in_process:
        raise _Exited(code)
    if flush:
        time.sleep(0.2)  # let libzmq flush the sentinel; nothing else may run now
    os._exit(code)


def _input_thread_would_die(req: wire.EngineCoreRequest) -> bool:
    sp = req.sampling_params
    if sp is None:
        return False
    return (
        sp.top_p == 0.0
        or (sp.max_tokens is not None and sp.max_tokens <= 0)
        or type(sp.top_k) is not int
    )


class _EngineLoop(abc.ABC):
    """The stepping loop both mock engines share: send queued extras (replies,
    admission aborts), step while requests run (paced by ``step_interval``), and
    apply the step-counted faults. Subclasses set ``label`` and ``core`` (their
    runtime's scheduler state) and implement :meth:`_schedulable`,
    :meth:`_step_frames`, :meth:`reader` and :meth:`shutdown`."""

    label = "mock engine"
    sentinel = wire.ENGINE_CORE_DEAD  # the same 16 bytes on both runtimes

    def __init__(self, cfg: MockEngineConfig, socks: EngineSockets) -> None:
        self.cfg = cfg
        self.socks = socks
        #: encoded messages (replies, admission aborts) the stepper sends before its next step
        self.extra: list[list[bytes]] = []
        self.wake = trio.Event()
        #: set by the reader on a fatal error: the stepper sends the sentinel and exits
        self.fatal: str | None = None
        self.steps = 0
        #: set by :func:`start_mock_engine`: an "exit" ends :meth:`run` instead of the process
        self.in_process = False

    @abc.abstractmethod
    def _schedulable(self) -> bool:
        """Whether a step would do anything."""

    @abc.abstractmethod
    def _step_frames(self) -> list[bytes] | None:
        """Advance the core one step; the message to send, or None."""

    @abc.abstractmethod
    async def reader(self) -> None:
        """Read the input socket until the reader stops (as the real engine's would)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """What the engine sends on SIGTERM (best effort; the sockets stay open)."""

    async def stepper(self) -> None:
        out = self.socks.output
        cfg = self.cfg
        sentinel_at = cfg.fault("sentinel")
        exit_at = cfg.fault("exit")
        garbage_at = cfg.fault("garbage")
        silent_at = cfg.fault("silent")
        next_step = trio.current_time()
        while True:
            if self.fatal is not None:
                _log.warning("%s %d: fatal error, sending ENGINE_CORE_DEAD and exiting: %s", self.label,
                             cfg.engine_index, self.fatal)
                await out.send([self.sentinel])
                print(f"{self.label} {cfg.engine_index}: fatal: {self.fatal}", file=sys.stderr)
                out.close(linger_ms=4000)
                _exit(self, 1, flush=True)
            while self.extra:
                await out.send(self.extra.pop(0))
            if not self._schedulable():
                self.wake = trio.Event()
                await self.wake.wait()
                next_step = trio.current_time()
                continue
            if cfg.step_interval > 0:
                next_step = max(next_step + cfg.step_interval, trio.current_time() - cfg.step_interval)
                await trio.sleep_until(next_step)
            else:
                await trio.sleep(0)
            if self.fatal is not None or not self._schedulable():
                continue
            self.steps += 1
            if sentinel_at is not None and self.steps > sentinel_at:
                self.fatal = "fault injection: sentinel"
                continue
            if exit_at is not None and self.steps > exit_at:
                _log.warning("%s %d: fault exit:%d: exiting at step %d", self.label, cfg.engine_index, exit_at,
                             self.steps)
                _exit(self, 1)
            frames = self._step_frames()
            if frames is None or (silent_at is not None and self.steps > silent_at):
                continue
            if garbage_at is not None and self.steps > garbage_at:
                await out.send([b"\xc1garbage"])
                continue
            await out.send(frames)

    async def run(self) -> None:
        """Serve until cancelled (reader and stepper), or until the engine exits."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.reader)
                nursery.start_soon(self.stepper)
        except* _Exited:
            self.socks.close()


class _MockEngine(_EngineLoop):
    def __init__(self, cfg: MockEngineConfig, socks: EngineSockets) -> None:
        super().__init__(cfg, socks)
        self.core = MockEngineCore(
            engine_index=cfg.engine_index,
            max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size,
            tokens_per_step=cfg.tokens_per_step,
            mm_cache_bytes=int(cfg.mm_cache_gb * (1 << 30)),
        )

    def _schedulable(self) -> bool:
        return self.core.schedulable

    def _poke(self) -> None:
        self.wake.set()

    async def reader(self) -> None:
        adds = 0
        stop_after = self.cfg.fault("stop-reading")
        while True:
            frames = await self.socks.input.recv_multipart()
            if len(frames) < 2 or len(frames[0]) != 1:
                return  # the real input thread dies on a malformed frame
            kind, payload = frames[0][0], frames[1]
            try:
                if kind == wire.RequestType.ADD:
                    req = wire_engine.decode_request(frames[1:])
                    _log.debug("mock engine %d: ADD %r", self.cfg.engine_index, req.request_id)
                    if _input_thread_would_die(req):
                        _log.warning("mock engine %d: request %r fails vLLM's input checks: the input reader "
                                     "stops, as the real engine's input thread dies", self.cfg.engine_index,
                                     req.request_id)
                        return
                    # vLLM's decoder fails on these while decoding the ADD: the input thread dies
                    mm = None if req.mm_features is None else decode_mm_features(req.mm_features, frames[1:])
                    adds += 1
                    try:
                        err = self.core.add(req, mm)
                    except FatalEngineError as exc:
                        self.fatal = str(exc)
                        self._poke()
                        return
                    if err is not None:
                        self.extra.append(self._encode([err], finished=(req.request_id,)))
                    self._poke()
                    if stop_after is not None and adds >= stop_after:
                        await trio.sleep_forever()
                elif kind == wire.RequestType.ABORT:
                    ids = wire_engine.decode_abort(payload)
                    _log.debug("mock engine %d: ABORT %s", self.cfg.engine_index, list(ids))
                    self.core.abort(ids)
                elif kind == wire.RequestType.UTILITY:
                    call = wire_engine.decode_utility_call(payload)
                    result, failure = self.core.utility(call.method, tuple(call.args))
                    if self.core.utility_outputs:  # a pause that aborted requests: their finishes first
                        outs, self.core.utility_outputs = self.core.utility_outputs, []
                        self.extra.append(self._encode(outs, finished=tuple(o.request_id for o in outs)))
                    utility = wire.UtilityOutput(call_id=call.call_id, failure_message=failure,
                                                 result=None if failure else wire.UtilityResult(result))
                    self.extra.append(self._encode([], utility=utility))
                    self._poke()
                elif kind == wire.RequestType.START_DP_WAVE:
                    pass
                else:
                    return  # unknown type byte: EngineCoreRequestType(...) raises, thread dies
            except Exception:
                return  # undecodable payload: the input thread dies silently

    def _encode(self, outputs: Sequence[wire_engine.EngineCoreOutput], *, finished: tuple[str, ...] | None = None,
                utility: wire.UtilityOutput | None = None) -> list[bytes]:
        return wire_engine.encode_outputs(
            self.cfg.engine_index,
            outputs,
            timestamp=time.monotonic(),
            finished_requests=finished,
            utility_output=utility,
            weight_version=None if (utility is not None or finished) else "default",
        )

    def _step_frames(self) -> list[bytes]:
        return self._encode(self.core.step())

    async def shutdown(self) -> None:
        if self.socks.output.closed:
            return
        outs = self.core.abort_all()
        if outs:
            await self.socks.output.send(self._encode(outs, finished=tuple(o.request_id for o in outs)))


class _TokenSpeedMockEngine(_EngineLoop):
    """The I/O half of the TokenSpeed mock (the state is :class:`MockTokenSpeedScheduler`)."""

    label = "mock tokenspeed"

    def __init__(self, cfg: MockEngineConfig, socks: EngineSockets) -> None:
        super().__init__(cfg, socks)
        self.core = MockTokenSpeedScheduler(
            engine_index=cfg.engine_index,
            max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size,
            tokens_per_step=cfg.tokens_per_step,
            eos_token_ids=cfg.eos_token_ids,
            stream_interval=cfg.stream_interval,
            enable_output_logprobs=cfg.enable_output_logprobs,
        )
        #: input messages dropped as undecodable (TokenSpeed logs and goes on)
        self.dropped = 0

    def _schedulable(self) -> bool:
        return bool(self.core.running)

    async def reader(self) -> None:
        adds = 0
        stop_after = self.cfg.fault("stop-reading")
        while True:
            frames = await self.socks.input.recv_multipart()
            try:
                _, body = ts_engine.decode_input(frames)
                if not isinstance(body, tuple):
                    body = typed_multimodal(body, frames[1:])
            except Exception as exc:  # the real receiver logs and drops the message
                self.dropped += 1
                print(f"mock tokenspeed {self.cfg.engine_index}: dropped input: {exc}", file=sys.stderr)
                continue
            if isinstance(body, tuple):  # an ABORT: its request ids
                self.core.abort(body)
                continue
            adds += 1
            if embedding_fault(body, self.cfg.vocab_size) is not None:
                # An id past the embedding table is a device-side fault: the engine crashes.
                self.fatal = "token id out of range for the embedding table"
                self.wake.set()
                return
            immediate = self.core.add(body)
            if immediate is not None:
                self.extra.append(ts_engine.encode_outputs(immediate))
            self.wake.set()
            if stop_after is not None and adds >= stop_after:
                await trio.sleep_forever()

    def _step_frames(self) -> list[bytes] | None:
        batch = self.core.step()
        return None if batch is None else ts_engine.encode_outputs(batch)

    async def shutdown(self) -> None:
        # TokenSpeed's event loop sends the sentinel (best effort) when it closes.
        if not self.socks.output.closed:
            self.socks.output.try_send([ts.ENGINE_CORE_DEAD])


class _SGLangMockEngine(_EngineLoop):
    """The I/O half of the SGLang mock (the state is :class:`MockSGLangScheduler`)."""

    label = "mock sglang"

    def __init__(self, cfg: MockEngineConfig, socks: EngineSockets) -> None:
        super().__init__(cfg, socks)
        self.core = MockSGLangScheduler(
            engine_index=cfg.engine_index, max_model_len=cfg.max_model_len, vocab_size=cfg.vocab_size,
            tokens_per_step=cfg.tokens_per_step, eos_token_ids=cfg.eos_token_ids,
            stream_interval=cfg.stream_interval,
        )

    def _schedulable(self) -> bool:
        return bool(self.core.running)

    async def reader(self) -> None:
        adds = 0
        stop_after = self.cfg.fault("stop-reading")
        while True:
            frames = await self.socks.input.recv_multipart()
            dropped = self.core.dropped
            self.extra += self.core.receive(frames)
            if self.core.dropped != dropped:
                print(f"mock sglang {self.cfg.engine_index}: dropped an undecodable input", file=sys.stderr)
            self.wake.set()
            if bytes(frames[0]) == sg.RequestType.ADD.frame:
                adds += 1
                if stop_after is not None and adds >= stop_after:
                    await trio.sleep_forever()

    def _step_frames(self) -> list[bytes] | None:
        batch = self.core.step()
        return None if batch is None else sg_engine.encode_outputs(batch)

    async def shutdown(self) -> None:
        # The plugin sends the sentinel (best effort) when the scheduler's loop exits.
        if not self.socks.output.closed:
            self.socks.output.try_send([sg.ENGINE_CORE_DEAD])


async def start_mock_engine(cfg: MockEngineConfig, *, in_process: bool = False,
                            monitor_input: bool = False) -> _MockEngine | _TokenSpeedMockEngine | _SGLangMockEngine:
    """Dial *cfg.handshake_address* and return the engine, ready to ``run()``.

    ``in_process=True`` is for tests that run the mock inside their own trio run
    (its state inspectable): an engine "exit" (fault or fatal error) then closes
    its sockets and ends ``run()`` instead of ending the process. The program
    entry point is :func:`run_mock_engine`; :func:`serve_mock_engine` serves one
    client after another. ``monitor_input``: see :func:`zmqdispatch.testing.dial.dial`.

    Raises:
        InvalidAddressError: a malformed handshake address (checked before
            dialing: a port in 1..65535, no wildcard).
    """
    if cfg.runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {cfg.runtime!r}; choose from {', '.join(RUNTIMES)}")
    check_address(cfg.handshake_address, role="handshake_address", bind=False, any_port=False)
    tokenspeed = cfg.runtime == "tokenspeed"
    sglang = cfg.runtime == "sglang"
    socks = await dial(
        cfg.handshake_address,
        ready_response(cfg.max_model_len, runtime=cfg.runtime,  # type: ignore[arg-type]  # checked above
                       engine_index=cfg.engine_index, build="zmqdispatch.mock",
                       # vLLM non-MoE ranks are independent engines (DP size 1 each)
                       data_parallel_size=1 if cfg.runtime == "vllm" else cfg.data_parallel_size,
                       multimodal_encoder_dtype=cfg.multimodal_encoder_dtype if tokenspeed else None),
        engine_index=cfg.engine_index,
        local=not cfg.headless,
        headless=cfg.headless,
        send_ready=cfg.fault("no-ready") is None,
        tokenspeed=tokenspeed,
        sglang=sglang,
        monitor_input=monitor_input,
    )
    engine: _MockEngine | _TokenSpeedMockEngine | _SGLangMockEngine
    if sglang:
        engine = _SGLangMockEngine(cfg, socks)
    else:
        engine = _TokenSpeedMockEngine(cfg, socks) if tokenspeed else _MockEngine(cfg, socks)
    engine.in_process = in_process
    _log.info("%s %d: handshake with %s done (pid %d, faults %s)", engine.label, cfg.engine_index,
              cfg.handshake_address, os.getpid(), list(cfg.faults) or "none")
    return engine


async def _client_left(monitor: TrioSocket) -> None:
    """Return when the engine's input connection to its client closed."""
    while True:
        event, _, _ = parse_monitor_event(await monitor.recv_multipart())
        if event == zmq.EVENT_DISCONNECTED:
            return


async def _client_back(monitor: TrioSocket) -> None:
    """Return when the engine's input connection is up again (a resumed client)."""
    while True:
        event, _, _ = parse_monitor_event(await monitor.recv_multipart())
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return


async def serve_mock_engine(
    cfg: MockEngineConfig,
    *,
    in_process: bool = False,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve clients one after another, until cancelled or the engine exits.

    Dial the handshake address, serve that client; when its input connection
    closes (the client closed or died: a monitor ``EVENT_DISCONNECTED`` on the
    engine's input DEALER), two things race: the old data-plane sockets
    reconnecting (a client resuming the session on the same input/output
    addresses, as a real vLLM engine's do: the engine and its running requests
    go on), and a new handshake on the handshake address (a new client: a fresh
    engine, the old one's sockets closed). ``task_status.started()`` is called
    once the first handshake completed.

    Cancellation: the engine being served is shut down as on SIGTERM (its
    running requests get a finish ABORT, best effort, for at most 1 s) and
    every socket is closed; a handshake in progress is abandoned.

    Raises:
        InvalidAddressError: a malformed handshake address.
    """
    engine: _EngineLoop = await start_mock_engine(cfg, in_process=in_process, monitor_input=True)
    task_status.started()
    while True:
        replacement: list[_EngineLoop] = []
        try:
            async with trio.open_nursery() as nursery:

                # This iteration's engine, monitor and replacement are passed in, not closed over.
                async def run_then_stop(engine: _EngineLoop) -> None:
                    await engine.run()  # returns only when an in-process engine "exited"
                    nursery.cancel_scope.cancel()

                nursery.start_soon(run_then_stop, engine)
                monitor = engine.socks.input_monitor
                assert monitor is not None
                while True:
                    await _client_left(monitor)
                    _log.info("mock engine %d: the client's input connection closed; waiting for it to come back "
                              "or for a new client's handshake", cfg.engine_index)
                    async with trio.open_nursery() as race:

                        async def back(monitor: TrioSocket) -> None:
                            await _client_back(monitor)
                            race.cancel_scope.cancel()

                        async def next_client(replacement: list[_EngineLoop]) -> None:
                            replacement.append(
                                await start_mock_engine(cfg, in_process=in_process, monitor_input=True))
                            race.cancel_scope.cancel()

                        race.start_soon(back, monitor)
                        race.start_soon(next_client, replacement)
                    if replacement:
                        nursery.cancel_scope.cancel()
                        break
                    _log.info("mock engine %d: the client reconnected (a resumed session)", cfg.engine_index)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await engine.shutdown()
            engine.socks.close(output_linger_ms=1000)
            for other in replacement:
                other.socks.close()
            raise
        engine.socks.close()
        if not replacement:
            return  # the in-process engine exited
        engine = replacement[0]


def rank_configs(cfg: MockEngineConfig) -> list[MockEngineConfig]:
    """One config per DP rank *cfg* runs: ranks ``engine_index`` ..
    ``engine_index + data_parallel_size_local - 1``, each with
    ``data_parallel_size_local`` 1 (what :func:`serve_mock_engine` serves).

    Raises:
        ValueError: ``data_parallel_size_local`` < 1, or a rank past 65535
            (the identity is 2 bytes).
    """
    if cfg.data_parallel_size_local < 1:
        raise ValueError(f"data_parallel_size_local must be >= 1, got {cfg.data_parallel_size_local}")
    last = cfg.engine_index + cfg.data_parallel_size_local - 1
    if not 0 <= cfg.engine_index <= last < 2**16:
        raise ValueError(f"DP ranks {cfg.engine_index}..{last} do not fit a 2-byte identity (0..65535)")
    return [attrs.evolve(cfg, engine_index=cfg.engine_index + i, data_parallel_size_local=1)
            for i in range(cfg.data_parallel_size_local)]


async def serve_mock_ranks(
    cfg: MockEngineConfig,
    *,
    in_process: bool = False,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run every DP rank of *cfg* (:func:`rank_configs`) at once, each a
    :func:`serve_mock_engine` of its own, as the ``EngineCore_DPn`` processes of
    one ``vllm serve --data-parallel-size N`` are: all dial the same handshake
    address concurrently, each with its identity, answers its own INIT with its
    own ready response and READY, then serves on the addresses its INIT named
    and re-dials for a new client on its own. ``task_status.started()`` is
    called once every rank completed its first handshake.

    A rank whose in-process engine "exited" ends alone; in a process, a fatal
    error of any rank ends the whole process (as the ``vllm serve`` parent
    tears the tree down when one engine dies). Cancellation: every rank shuts
    down as :func:`serve_mock_engine` does.

    Raises:
        ValueError: see :func:`rank_configs`.
        InvalidAddressError: a malformed handshake address.
    """
    ranks = rank_configs(cfg)
    up = 0
    all_up = trio.Event()
    async with trio.open_nursery() as nursery:

        async def rank(rank_cfg: MockEngineConfig) -> None:
            nonlocal up
            await nursery.start(functools.partial(serve_mock_engine, rank_cfg, in_process=in_process))
            up += 1
            if up == len(ranks):
                all_up.set()

        for rank_cfg in ranks:
            nursery.start_soon(rank, rank_cfg)
        await all_up.wait()
        task_status.started()


async def run_mock_engine(cfg: MockEngineConfig) -> int:
    """Serve clients one after another (:func:`serve_mock_engine`; with several
    DP ranks, :func:`serve_mock_ranks`) until SIGTERM/SIGINT, in any state
    (before a client, during a handshake, serving, between clients); return
    the exit code (0)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            if cfg.data_parallel_size_local == 1:
                nursery.start_soon(serve_mock_engine, cfg)
            else:
                nursery.start_soon(serve_mock_ranks, cfg)
            async for signum in signals:
                _log.info("mock engine %d: %s, shutting down", cfg.engine_index, signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel()
    return 0


def main_sync(cfg: MockEngineConfig) -> int:
    """Blocking entry point for the CLI."""
    if not math.isfinite(cfg.step_interval) or cfg.step_interval < 0:
        raise ValueError("step interval must be >= 0")
    return trio.run(run_mock_engine, cfg)
