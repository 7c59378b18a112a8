#!/usr/bin/env python3
"""Sans-IO cost of one placement decision (zmqdispatch/protocol/placement.py), no sockets, no trio.

Keeps ``--in-flight`` requests per engine live (so the scan compares real loads), with a
load report on every engine, and measures ``place`` + ``request_finished`` of one request
(the steady state: one finishes, one is placed). Variants: an unpinned request (the scan),
``n = 4`` samples of one request, a pinned request, and the worst case for ties (every
engine idle, so every decision is an all-way tie). Reports nanoseconds per placement.

    python benchmarks/placement_cost.py --engines 4 64
"""

from __future__ import annotations

import argparse
import random
import time
import timeit
from collections.abc import Callable

from zmqdispatch.protocol.engines import EngineSet
from zmqdispatch.protocol.placement import Placement


def _setup(engines: int, in_flight: int, *, reports: bool) -> Placement:
    s = EngineSet()
    for e in range(engines):
        s.add_engine(e)
    p = Placement(s, rng=random.Random(0))
    for e in range(engines):
        for k in range(in_flight):
            p.place(f"bg{e}.{k}", data_parallel_rank=e)
        if reports:
            p.report_load(e, 0, num_running=in_flight, num_waiting=e % 3, kv_cache_usage=0.6)
    return p


def _loop(p: Placement, n: int, make: Callable[[Placement, int], list[str]]) -> float:
    finish = p.engines.request_finished
    t0 = time.perf_counter_ns()
    for i in range(n):
        for rid in make(p, i):
            finish(rid)
    return (time.perf_counter_ns() - t0) / n


def _unpinned(p: Placement, i: int) -> list[str]:
    rid = f"x{i}"
    p.place(rid)
    return [rid]


def _samples(p: Placement, i: int) -> list[str]:
    ids = [f"x{i}.{k}" for k in range(4)]
    p.place(ids)
    return ids


def _pinned(p: Placement, i: int) -> list[str]:
    rid = f"x{i}"
    p.place(rid, data_parallel_rank=i % len(p.engines.indices))
    return [rid]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, nargs="+", default=[4, 64])
    ap.add_argument("--in-flight", type=int, default=32, help="live requests per engine (default 32)")
    ap.add_argument("--n", type=int, default=200_000, help="placements per cell (default 200000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per cell; the best is reported (default 5)")
    a = ap.parse_args()
    cases: list[tuple[str, Callable[[Placement, int], list[str]], bool, int]] = [
        ("unpinned", _unpinned, True, a.in_flight),
        ("unpinned, all idle (all-way ties)", _unpinned, False, 0),
        ("n=4 samples (per request)", _samples, True, a.in_flight),
        ("pinned", _pinned, True, a.in_flight),
    ]
    # The machine's pace: on a shared box every figure scales with this one.
    call = min(timeit.repeat("f(1, b=2)", "def f(a, *, b=None): return a", number=200_000, repeat=5)) / 200_000
    print(f"calibration: one Python call with a keyword argument = {call * 1e9:.0f} ns")
    print(f"{'engines':>7}  {'case':<36} {'ns/placement':>12}  (place + finish, best of {a.rounds})")
    for engines in a.engines:
        for name, make, reports, in_flight in cases:
            best = min(
                _loop(_setup(engines, in_flight, reports=reports), a.n, make) for _ in range(a.rounds)
            )
            print(f"{engines:>7}  {name:<36} {best:>12.0f}")


if __name__ == "__main__":
    main()
