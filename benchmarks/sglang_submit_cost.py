#!/usr/bin/env python3
"""Client CPU of submitting one request on an SGLang link, with and without the
check that keeps the live rids prefix-free (``EngineProtocol._prefix_clash``: the
scheduler aborts by rid prefix, ``docs/sglang.md``).

Submits ``--requests`` requests to a sans-IO ``EngineProtocol`` (no sockets, the
ADDs left queued, so every one stays live), best of ``--repeats``, for two id
shapes: ``uuid`` (``chatcmpl-<uuid4>``, 45 characters: no clash) and ``sequential``
(``req-<i>``: ``req-1`` prefixes ``req-10``, so most go under a fresh rid). The
"without" figure replaces the check by ``False`` and skips the sorted-id
bookkeeping (what the other runtimes run).
Prints µs per request; never asserted in tests.

    python benchmarks/sglang_submit_cost.py --requests 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import time
import uuid

from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.wire import sglang as sg


def best_us(reqs: list[sg.TokenizedGenerateReqInput], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        p = EngineProtocol(runtime=Runtime.SGLANG)
        t0 = time.perf_counter()
        for r in reqs:
            p.submit(r)
        best = min(best, (time.perf_counter() - t0) / len(reqs))
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    shapes = {"uuid": [f"chatcmpl-{uuid.uuid4()}" for _ in range(args.requests)],
              "sequential": [f"req-{i}" for i in range(args.requests)]}
    check, add = EngineProtocol._prefix_clash, EngineProtocol._add_sorted
    for shape, rids in shapes.items():
        reqs = [sg.TokenizedGenerateReqInput(rid=r, input_ids=(1, 2), sampling_params=sg.SGLangSamplingParams(),
                                             stream=True) for r in rids]
        with_check = best_us(reqs, args.repeats)
        EngineProtocol._prefix_clash = lambda self, wire_id: False  # type: ignore[method-assign]
        EngineProtocol._add_sorted = lambda self, wire_id: None  # type: ignore[method-assign]
        try:
            without = best_us(reqs, args.repeats)
        finally:
            EngineProtocol._prefix_clash, EngineProtocol._add_sorted = check, add  # type: ignore[method-assign]
        print(f"{shape:>10}: submit {with_check:.2f} µs/request with the prefix check, {without:.2f} without "
              f"({args.requests} live)")


if __name__ == "__main__":
    main()
