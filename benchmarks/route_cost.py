#!/usr/bin/env python3
"""Sans-IO cost of one engine tick: decode + route, no sockets, no trio.

Feeds pre-encoded output messages (one row per live request per message, one
token each, as a GPU engine's decode step looks) into an ``EngineProtocol``
with C live requests, and takes every mailbox every ``--take-every`` messages
(1 = a consumer that keeps up, larger = lagging consumers whose ticks merge).
Reports nanoseconds per request-tick for decode + route (+ take).

    python benchmarks/route_cost.py --concurrency 100 1000 --runtime vllm tokenspeed
"""

from __future__ import annotations

import argparse
import time

from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine


def _requests(runtime: Runtime, c: int) -> list:
    if runtime is Runtime.VLLM:
        return [
            wire.EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=(1, 2, 3),
                                   sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=10**6),
                                   arrival_time=0.0)
            for i in range(c)
        ]
    return [ts.TokenizedGenerateReqInput(rid=f"r{i}", input_ids=(1, 2, 3),
                                         sampling_params=ts.TokenSpeedSamplingParams(max_new_tokens=10**6))
            for i in range(c)]


def _message(runtime: Runtime, c: int, step: int) -> list[bytes]:
    if runtime is Runtime.VLLM:
        outs = [wire_engine.EngineCoreOutput(request_id=f"r{i}", new_token_ids=(100 + step % 1000,)) for i in range(c)]
        return wire_engine.encode_outputs(0, outs, timestamp=time.monotonic())
    return ts_engine.encode_outputs(ts.TokenSpeedBatch(
        rids=tuple(f"r{i}" for i in range(c)), output_ids=tuple((100 + step % 1000,) for _ in range(c)),
        finished_reasons=("",) * c, prompt_tokens=(3,) * c, completion_tokens=(step + 1,) * c,
        cached_tokens=(0,) * c, logprob_vals=((),) * c, logprob_ids=((),) * c, num_running=c, kv_total_pages=1))


def measure(runtime: Runtime, c: int, take_every: int, seconds: float) -> float:
    p = EngineProtocol(runtime=runtime, max_pending_tokens=10**9)
    boxes = [p.submit(r)[0] for r in _requests(runtime, c)]
    while p.pop_send() is not None:
        pass
    messages = [_message(runtime, c, s) for s in range(16)]
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        for frames in messages:
            p.frames_received(frames)
            n += 1
            if n % take_every == 0:
                for mb in boxes:
                    mb.take()
        if time.perf_counter() >= deadline:
            break
    return (time.perf_counter() - t0) / (n * c) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--runtime", nargs="+", default=["vllm", "tokenspeed"], choices=["vllm", "tokenspeed"])
    ap.add_argument("--take-every", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    print(f"{'runtime':>10} {'C':>6} {'take every':>10} {'ns / request-tick':>18}")
    for rt in args.runtime:
        for c in args.concurrency:
            for k in args.take_every:
                ns = measure(Runtime(rt), c, k, args.seconds)
                print(f"{rt:>10} {c:>6} {k:>10} {ns:>18,.0f}")


if __name__ == "__main__":
    main()
