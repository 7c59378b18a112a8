"""Benchmark runner: zmqdispatch's asyncio API (``zmqdispatch.aio``) under uvloop
(client ``zmqdispatch-asyncio``).

``aio.connect(launch=...)`` starts the benchmark engine; every stream is one
``client.generate(request)`` read by its own asyncio task with ``async for
delta in stream``, as an asyncio gateway's request handlers would (latency
from ``OutputDelta.engine_timestamp``). The trio client runs as the loop's
guest. It runs the throughput cells (saturated, paced, slow-consumer mixes);
the burst, idle-RSS and many-engine cells are the trio runner's
(:mod:`.run_zmqdispatch`) and are reported as skipped here.

    python -m zmqdispatch.bench.run_aio [--loop asyncio]

Commands and answers: JSON lines (:mod:`._common`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import sys
import time
import traceback
from typing import Any, TextIO

import trio
import zmq

from .. import ClientConfig, aio
from ..wire import vllm as wire
from . import _common as common

NAME = "zmqdispatch-asyncio"


def _request(rid: str, prompt: list[int], max_tokens: int) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time(),
    )


class Runner:
    def __init__(self, client: aio.AsyncEngineClient, ctl: common.Control, acker: common.Acker) -> None:
        self.client = client
        self.ctl = ctl
        self.acker = acker
        self.cell_no = 0

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

        async def consume(i: int, slow: bool) -> None:
            req = _request(f"a{self.cell_no}-{i}", common.prompt_tokens(cell["prompt_len"], i), cell["max_tokens"])
            first = True
            lat = tally.latency_slow if slow else tally.latency
            async with client.generate(req) as stream:
                async for d in stream:
                    if first:
                        first = False
                        tally.first_seen += 1
                    if tally.measuring:
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
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._ctl(self.ctl.wait_idle)
        return common.throughput_result(NAME, cell, tally, wall=t1 - t0, cpu=cpu1 - cpu0, engine=stats)


async def amain(out: TextIO, loop_name: str) -> None:
    tmp = common.PrivateDir()
    ctx = zmq.Context()
    ctl: common.Control | None = None
    acker: common.Acker | None = None
    try:
        ctl_addr = tmp.ipc("control.sock")
        launch = common.engine_argv(sys.executable, control=ctl_addr, handshake_address="{handshake_address}")
        config = ClientConfig(handshake_timeout=60, silence_timeout=math.inf)
        async with aio.connect(launch=launch, config=config) as client:
            ctl = common.Control(ctx, ctl_addr)
            acker = common.Acker(ctl_addr)
            runner = Runner(client, ctl, acker)
            await runner.cell(common.cell_settings({"name": "warmup", "concurrency": 10, "seconds": 0.3,
                                                    "warmup_s": 0.1, "window": 256}))
            info = {"client": NAME, "python": sys.version.split()[0], "trio": trio.__version__, "loop": loop_name,
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "gc": common.settle_gc()}
            common.emit(out, "ready", info=info)
            while True:
                cmd = await asyncio.to_thread(common.read_command)
                if cmd["op"] == "quit":
                    break
                try:
                    result = await runner.cell(common.cell_settings(cmd["cell"]))
                    common.emit(out, "result", result=result)
                except Exception:
                    common.emit(out, "error", error=traceback.format_exc())
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
    args = p.parse_args(argv)
    out = common.protocol_stream()
    loop_name = args.loop
    if loop_name == "uvloop":
        try:
            import uvloop
        except ImportError:
            loop_name = "asyncio"
        else:
            uvloop.run(amain(out, loop_name))
            return 0
    asyncio.run(amain(out, loop_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
