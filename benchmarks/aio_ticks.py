#!/usr/bin/env python3
"""The asyncio API against the trio API: request-ticks/s and client CPU per
request-tick, against the mock engine, side by side in one run.

The measurement of ``quick_ticks.py`` (C streams over one mock engine
process, each read by its own task as fast as it can), once per client:

- ``trio``: ``zmqdispatch.connect``, a trio task per stream;
- ``asyncio``: ``zmqdispatch.aio.connect`` under asyncio's default loop, an
  asyncio task per stream (trio runs as the loop's guest);
- ``uvloop``: the same under uvloop.

Client CPU is this process's CPU time (every thread: trio's I/O wait thread in
guest mode counts) per delivered request-tick; the ratio column is against
the trio row of the same C.

    python benchmarks/aio_ticks.py --concurrency 1 100 1000 --seconds 5 [--step-interval-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import trio
import uvloop

from zmqdispatch import ClientConfig, aio, connect
from zmqdispatch.wire import vllm as wire


def request(rid: str, max_tokens: int) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=(1, 2, 3, 4),
        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        arrival_time=time.time(),
    )


def _launch(step_ms: float) -> list[str]:
    return [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
            "--step-interval-ms", str(step_ms), "--max-model-len", str(10**8)]


class Counts:
    def __init__(self) -> None:
        self.ticks = self.deliveries = self.tokens = 0
        self.measuring = False

    def result(self, client: Any, concurrency: int, wall: float, cpu: float, msgs: int) -> dict[str, Any]:
        return {
            "concurrency": concurrency,
            "request_ticks_per_s": self.ticks / wall,
            "deliveries_per_tick": self.deliveries / self.ticks if self.ticks else 0.0,
            "engine_steps_per_s": msgs / wall,
            "client_cpu_us_per_tick": 1e6 * cpu / self.ticks if self.ticks else 0.0,
        }


async def run_trio(concurrency: int, seconds: float, step_ms: float) -> dict[str, Any]:
    c = Counts()
    async with connect(launch=_launch(step_ms), config=ClientConfig(handshake_timeout=60)) as client:
        async def consume(i: int) -> None:
            async with client.generate(request(f"b{i}", 10**7)) as stream:
                async for d in stream:
                    if c.measuring:
                        c.ticks += d.ticks
                        c.deliveries += 1

        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(consume, i)
            await trio.sleep(1.0)  # warm-up: every stream admitted and flowing
            msgs0 = client.protocol.messages_received
            cpu0, t0 = time.process_time(), time.perf_counter()
            c.measuring = True
            await trio.sleep(seconds)
            c.measuring = False
            cpu1, t1 = time.process_time(), time.perf_counter()
            msgs1 = client.protocol.messages_received
            nursery.cancel_scope.cancel()
    return c.result(client, concurrency, t1 - t0, cpu1 - cpu0, msgs1 - msgs0)


async def run_asyncio(concurrency: int, seconds: float, step_ms: float) -> dict[str, Any]:
    c = Counts()
    async with aio.connect(launch=_launch(step_ms), config=ClientConfig(handshake_timeout=60)) as client:
        async def consume(i: int) -> None:
            async with client.generate(request(f"b{i}", 10**7)) as stream:
                async for d in stream:
                    if c.measuring:
                        c.ticks += d.ticks
                        c.deliveries += 1

        tasks = [asyncio.create_task(consume(i)) for i in range(concurrency)]
        await asyncio.sleep(1.0)
        msgs0 = client.trio.protocol.messages_received
        cpu0, t0 = time.process_time(), time.perf_counter()
        c.measuring = True
        await asyncio.sleep(seconds)
        c.measuring = False
        cpu1, t1 = time.process_time(), time.perf_counter()
        msgs1 = client.trio.protocol.messages_received
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return c.result(client, concurrency, t1 - t0, cpu1 - cpu0, msgs1 - msgs0)


RUNNERS: dict[str, Callable[[int, float, float], dict[str, Any]]] = {
    "trio": lambda c, s, ms: trio.run(run_trio, c, s, ms),
    "asyncio": lambda c, s, ms: asyncio.run(run_asyncio(c, s, ms)),
    "uvloop": lambda c, s, ms: uvloop.run(run_asyncio(c, s, ms)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 100, 1000])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--step-interval-ms", type=float, default=0.0)
    ap.add_argument("--clients", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args()
    print(f"{'client':>8} {'C':>6} {'req-ticks/s':>12} {'deliv/tick':>10} {'steps/s':>9} {'CPU us/tick':>11} "
          f"{'x trio':>7}", flush=True)
    for conc in args.concurrency:
        base = None
        for name in args.clients:
            r = RUNNERS[name](conc, args.seconds, args.step_interval_ms)
            r["client"] = name
            if name == "trio":
                base = r["client_cpu_us_per_tick"]
            ratio = r["client_cpu_us_per_tick"] / base if base else float("nan")
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{name:>8} {conc:>6} {r['request_ticks_per_s']:>12,.0f} {r['deliveries_per_tick']:>10.2f} "
                      f"{r['engine_steps_per_s']:>9,.0f} {r['client_cpu_us_per_tick']:>11.2f} {ratio:>7.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
