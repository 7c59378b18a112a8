#!/usr/bin/env python3
"""Quick throughput check: request-ticks/s delivered to consumers, against the mock engine.

One mock engine process (``zmqdispatch mock-engine --step-interval-ms 0``)
steps as fast as it can, emitting one ``EngineCoreOutputs`` per step for every
running request; C streams are each read by a consumer task as fast as it can.
Reported per concurrency C:

- request-ticks/s: engine outputs delivered to consumers (merged or not);
- deliveries/tick: ``OutputDelta`` objects handed out per request-tick
  (below 1 when a consumer lags and ticks merge);
- engine steps/s: output messages received (the mock's own rate: when
  ``ticks/s ~= steps/s * C`` the mock, not the client, is the limit);
- client CPU us/tick: this process's CPU time per delivered request-tick.

This is the transport issue's quick figure; the full side-by-side benchmark
(raw loop, vLLM's client, paced latency) lives beside it. ``--runtime tokenspeed``
or ``sglang`` runs the same against that runtime's mock (its wire, its output
batches; the mock's own per-step cost differs between runtimes, so compare the
client CPU per tick rather than the rates).

    python benchmarks/quick_ticks.py --concurrency 1 100 1000 --seconds 5
    python benchmarks/quick_ticks.py --runtime sglang --concurrency 100 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from zmqdispatch import ClientConfig, EngineRequest, connect
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import vllm as wire


def request(rid: str, max_tokens: int, runtime: str = "vllm") -> EngineRequest:
    if runtime == "sglang":
        return sg.TokenizedGenerateReqInput(rid=rid, input_ids=(1, 2, 3, 4), stream=True,
                                            sampling_params=sg.SGLangSamplingParams(max_new_tokens=max_tokens))
    if runtime == "tokenspeed":
        return ts.TokenizedGenerateReqInput(rid=rid, input_ids=(1, 2, 3, 4), stream=True,
                                            sampling_params=ts.TokenSpeedSamplingParams(max_new_tokens=max_tokens))
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=(1, 2, 3, 4),
        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        arrival_time=time.time(),
    )


async def run_one(concurrency: int, seconds: float, step_ms: float, runtime: str = "vllm") -> dict:
    launch = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
              "--step-interval-ms", str(step_ms), "--max-model-len", str(10**8), "--runtime", runtime]
    async with connect(launch=launch, runtime=runtime, config=ClientConfig(handshake_timeout=60)) as client:
        ticks = 0
        deliveries = 0
        tokens = 0
        measuring = False

        async def consume(i: int) -> None:
            nonlocal ticks, deliveries, tokens
            async with client.generate(request(f"b{i}", 10**7, runtime)) as stream:
                async for d in stream:
                    if measuring:
                        ticks += d.ticks
                        deliveries += 1
                        tokens += len(d.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(consume, i)
            await trio.sleep(1.0)  # warm-up: every stream admitted and flowing
            msgs0 = client.protocol.messages_received
            cpu0, t0 = time.process_time(), time.perf_counter()
            measuring = True
            await trio.sleep(seconds)
            measuring = False
            cpu1, t1 = time.process_time(), time.perf_counter()
            msgs1 = client.protocol.messages_received
            nursery.cancel_scope.cancel()
    wall = t1 - t0
    return {
        "runtime": runtime,
        "concurrency": concurrency,
        "request_ticks_per_s": ticks / wall,
        "tokens_per_s": tokens / wall,
        "deliveries_per_tick": deliveries / ticks if ticks else 0.0,
        "engine_steps_per_s": (msgs1 - msgs0) / wall,
        "client_cpu_us_per_tick": 1e6 * (cpu1 - cpu0) / ticks if ticks else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 100, 1000])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--step-interval-ms", type=float, default=0.0)
    ap.add_argument("--runtime", choices=("vllm", "tokenspeed", "sglang"), default="vllm",
                    help="which mock engine (and wire) to run against")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args()
    rows = [trio.run(run_one, c, args.seconds, args.step_interval_ms, args.runtime) for c in args.concurrency]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'C':>6} {'req-ticks/s':>12} {'tokens/s':>10} {'deliv/tick':>10} {'steps/s':>9} {'CPU us/tick':>11}")
    for r in rows:
        print(f"{r['concurrency']:>6} {r['request_ticks_per_s']:>12,.0f} {r['tokens_per_s']:>10,.0f} "
              f"{r['deliveries_per_tick']:>10.2f} {r['engine_steps_per_s']:>9,.0f} "
              f"{r['client_cpu_us_per_tick']:>11.2f}")


if __name__ == "__main__":
    main()
