"""The mock engine program: a wire-faithful vLLM EngineCore stand-in.

Run as ``zmqdispatch mock-engine --handshake-address ADDR``. It dials in exactly
as vLLM's EngineCore does (:mod:`.dial`), then runs two tasks, each owning one
socket: an input reader (DEALER) and a stepper (PUSH) that emits one
``EngineCoreOutputs`` per step covering every running request
(:class:`.core.MockEngineCore`).

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

import math
import os
import signal
import sys
import time

import attrs
import trio

from ..wire import vllm as wire
from .core import FatalEngineError, MockEngineCore
from .dial import EngineSockets, dial

__all__ = ["MockEngineConfig", "parse_fault", "run_mock_engine", "FAULT_KINDS"]

FAULT_KINDS = ("sentinel", "exit", "garbage", "silent", "stop-reading", "no-ready")


def parse_fault(spec: str) -> tuple[str, int]:
    """Parse ``KIND[:N]`` into ``(kind, n)``; N defaults to 0.

    Raises:
        ValueError: unknown kind or a bad N.
    """
    kind, _, n = spec.partition(":")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULT_KINDS)}")
    count = int(n) if n else 0
    if count < 0:
        raise ValueError(f"fault count must be >= 0, got {count}")
    return kind, count


@attrs.frozen(kw_only=True)
class MockEngineConfig:
    """Settings of one mock engine process (see ``zmqdispatch mock-engine --help``)."""

    handshake_address: str
    engine_index: int = 0
    max_model_len: int = 4096
    vocab_size: int = 32_000
    step_interval: float = 0.001  # seconds; 0 = as fast as possible
    tokens_per_step: int = 1
    faults: tuple[tuple[str, int], ...] = ()
    headless: bool = False

    def fault(self, kind: str) -> int | None:
        """The N of fault *kind* when it was requested, else ``None``."""
        for k, n in self.faults:
            if k == kind:
                return n
        return None


def _input_thread_would_die(req: wire.EngineCoreRequest) -> bool:
    sp = req.sampling_params
    if sp is None:
        return False
    return (
        sp.top_p == 0.0
        or (sp.max_tokens is not None and sp.max_tokens <= 0)
        or type(sp.top_k) is not int
    )


class _MockEngine:
    def __init__(self, cfg: MockEngineConfig, socks: EngineSockets) -> None:
        self.cfg = cfg
        self.socks = socks
        self.core = MockEngineCore(
            engine_index=cfg.engine_index,
            max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size,
            tokens_per_step=cfg.tokens_per_step,
        )
        self.extra: list[list[bytes]] = []  # utility replies / error outputs, sent by the stepper
        self.wake = trio.Event()
        self.fatal: str | None = None
        self.steps = 0

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
                    req = wire.decode_request(frames[1:])
                    if _input_thread_would_die(req):
                        return
                    adds += 1
                    try:
                        err = self.core.add(req)
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
                    self.core.abort(wire.decode_abort(payload))
                elif kind == wire.RequestType.UTILITY:
                    call = wire.decode_utility_call(payload)
                    result, failure = self.core.utility(call.method, tuple(call.args))
                    self.extra.append(
                        self._encode([], utility=wire.UtilityOutput(call_id=call.call_id, failure_message=failure,
                                                                    result=None if failure else wire.UtilityResult(result)))
                    )
                    self._poke()
                elif kind == wire.RequestType.START_DP_WAVE:
                    pass
                else:
                    return  # unknown type byte: EngineCoreRequestType(...) raises, thread dies
            except Exception:
                return  # undecodable payload: the input thread dies silently

    def _encode(self, outputs, *, finished=None, utility=None) -> list[bytes]:
        return wire.encode_outputs(
            self.cfg.engine_index,
            outputs,
            timestamp=time.monotonic(),
            finished_requests=finished,
            utility_output=utility,
            weight_version=None if (utility is not None or finished) else "default",
        )

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
                await out.send([wire.ENGINE_CORE_DEAD])
                print(f"mock engine {cfg.engine_index}: fatal: {self.fatal}", file=sys.stderr)
                out.close(linger_ms=4000)
                time.sleep(0.2)  # let libzmq flush the sentinel; nothing else may run now
                os._exit(1)
            while self.extra:
                await out.send(self.extra.pop(0))
            if not self.core.running:
                self.wake = trio.Event()
                await self.wake.wait()
                next_step = trio.current_time()
                continue
            if cfg.step_interval > 0:
                next_step = max(next_step + cfg.step_interval, trio.current_time() - cfg.step_interval)
                await trio.sleep_until(next_step)
            else:
                await trio.sleep(0)
            if self.fatal is not None or not self.core.running:
                continue
            self.steps += 1
            if sentinel_at is not None and self.steps > sentinel_at:
                self.fatal = "fault injection: sentinel"
                continue
            if exit_at is not None and self.steps > exit_at:
                os._exit(1)
            outputs = self.core.step()
            if silent_at is not None and self.steps > silent_at:
                continue
            if garbage_at is not None and self.steps > garbage_at:
                await out.send([b"\xc1garbage"])
                continue
            await out.send(self._encode(outputs))

    async def shutdown(self) -> None:
        if self.socks.output.closed:
            return
        outs = self.core.abort_all()
        if outs:
            await self.socks.output.send(self._encode(outs, finished=tuple(o.request_id for o in outs)))


async def run_mock_engine(cfg: MockEngineConfig) -> int:
    """Dial *cfg.handshake_address*, serve until SIGTERM/SIGINT; return the exit code."""
    ready = wire.EngineCoreReadyResponse(
        max_model_len=cfg.max_model_len,
        num_gpu_blocks=max(1, cfg.max_model_len // 16) * 64,
        block_size=16,
        dtype="float32",
        vllm_version="0.32.0+zmqdispatch.mock",
        data_parallel_rank=cfg.engine_index,
        max_num_seqs=1024,
        instance_id=f"zmqdispatch-mock-{cfg.engine_index}",
    )
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        socks = await dial(
            cfg.handshake_address,
            ready,
            engine_index=cfg.engine_index,
            local=not cfg.headless,
            headless=cfg.headless,
            send_ready=cfg.fault("no-ready") is None,
        )
        engine = _MockEngine(cfg, socks)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.reader)
            nursery.start_soon(engine.stepper)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
        with trio.move_on_after(2):
            await engine.shutdown()
        socks.output.close(linger_ms=2000)
        socks.input.close()
    return 0


def main_sync(cfg: MockEngineConfig) -> int:
    """Blocking entry point for the CLI."""
    if not math.isfinite(cfg.step_interval) or cfg.step_interval < 0:
        raise ValueError("step interval must be >= 0")
    return trio.run(run_mock_engine, cfg)
