#!/usr/bin/env python3
"""Sans-IO cost of one engine step delivered to a StreamGroup, warm and cold cache.

Decodes and routes pre-encoded ``EngineCoreOutputs`` messages (one row per
live request, one token each) into an ``EngineProtocol`` whose C requests are
members of one :class:`~zmqdispatch.StreamGroup`, then takes the
group's batch, as its reader would. ``cold``: 32 MiB are written between
steps, as a real gateway's caches look after a 10 ms idle gap between engine
steps. Reports the median and p90 nanoseconds per row (GC frozen and off:
collections are measured by ``zmqdispatch bench``).

    python benchmarks/group_route_cost.py --concurrency 1000 --steps 300
"""

from __future__ import annotations

import argparse
import gc
import time

from route_cost import _message, _requests

from zmqdispatch.streams import GroupMember, StreamGroup
from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.protocol.runtime import Runtime


def measure(c: int, steps: int) -> dict[str, tuple[float, float]]:
    p = EngineProtocol(runtime=Runtime.VLLM, max_pending_tokens=10**9)
    group = StreamGroup(None)  # no client: members are added directly, no trio
    for r in _requests(Runtime.VLLM, c):
        mb = p.submit(r)[0]
        member = GroupMember(group, mb.request_id, mb)
        group._members[member.request_id] = member
        mb.waiter = member._hook
    while p.pop_send() is not None:
        pass
    messages = [_message(Runtime.VLLM, c, s) for s in range(16)]
    gc.collect()
    gc.freeze()
    gc.disable()
    junk = bytearray(32 * 1024 * 1024)
    out = {}
    for mode in ("cold", "warm"):
        times = []
        for i in range(steps):
            if mode == "cold":
                junk[::64] = b"\x01" * (len(junk) // 64)
            t0 = time.perf_counter()
            p.frames_received(messages[i % 16])
            batch = group._take_ready()
            times.append(time.perf_counter() - t0)
            assert len(batch) == c
        times.sort()
        out[mode] = (times[len(times) // 2] * 1e9 / c, times[int(len(times) * 0.9)] * 1e9 / c)
    gc.enable()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    for mode, (p50, p90) in measure(args.concurrency, args.steps).items():
        print(f"C={args.concurrency} {mode}: p50 {p50:.0f} ns/row, p90 {p90:.0f} ns/row")


if __name__ == "__main__":
    main()
