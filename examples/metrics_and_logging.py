#!/usr/bin/env python3
"""Logging, metrics and per-request deadlines against the mock engine.

Starts the wire-faithful mock engine (``zmqdispatch mock-engine``, one step
every 20 ms, as ``zmqdispatch generate`` does when no engine is named), runs a
few requests, one of which misses its deadline, then prints the engine link's
``EngineStats`` and, when ``prometheus_client`` is installed (the
``prometheus`` extra), the Prometheus exposition of it.

    python examples/metrics_and_logging.py [--log-level info|debug]

Logs go to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from zmqdispatch import DeadlineExceeded, Deadlines, connect
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
        "--step-interval-ms", "20"]


def request(rid: str, max_tokens: int):
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, 4]),
                              sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              stream=True)


async def main() -> None:
    async with connect(launch=MOCK) as client:
        config = TranslationConfig(max_model_len=client.max_model_len)

        async def run(rid: str, max_tokens: int, deadlines: Deadlines | None) -> None:
            t = translate_request(request(rid, max_tokens), config)
            tokens = 0
            try:
                async with client.generate(t.request, deadlines=deadlines) as stream:
                    async for delta in stream:
                        tokens += len(delta.token_ids)
                print(f"{rid}: {tokens} tokens, finish_reason={delta.finish_reason.name.lower()}")
            except DeadlineExceeded as exc:  # aborted on the engine; the tokens before it were delivered
                print(f"{rid}: {tokens} tokens, then DeadlineExceeded(limit={exc.limit!r}, seconds={exc.seconds})")

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(run, f"req-{i}", 8, Deadlines(first_token=5.0, stall=2.0))
            # 50 tokens take about a second at 20 ms a step: a 0.3 s total limit stops it
            nursery.start_soon(run, "too-long", 50, Deadlines(total=0.3))

        stats = client.stats()[client.engine_index]  # one EngineStats per engine, by engine_index
        ttft, itl = stats.time_to_first_token, stats.inter_token_latency
        print(f"engine {stats.engine_index} ({stats.runtime}) {stats.state}: {stats.requests} requests, "
              f"finishes {dict(stats.finishes)}, aborts {stats.aborts}, "
              f"deadlines exceeded {dict(stats.deadlines_exceeded)}")
        print(f"time to first token: {ttft.count} observations, mean {ttft.sum / ttft.count:.3f} s, "
              f"p50 <= {ttft.quantile(0.5)} s")
        print(f"inter-token latency: {itl.count} observations, mean {itl.sum / itl.count:.3f} s, "
              f"p99 <= {itl.quantile(0.99)} s")

        try:
            from prometheus_client import CollectorRegistry, generate_latest
        except ImportError:
            print("(install zmqdispatch[prometheus] for the Prometheus exposition)")
            return
        from zmqdispatch.metrics import StatsCollector

        registry = CollectorRegistry()
        registry.register(StatsCollector([client]))
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith(("zmqdispatch_requests_total", "zmqdispatch_deadlines_exceeded_total",
                                "zmqdispatch_time_to_first_token_seconds_count")):
                print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args()
    # An application configures logging; the library only emits records.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("zmqdispatch").setLevel(args.log_level.upper())
    trio.run(main)
