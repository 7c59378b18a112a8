"""Cost of one socket pair per engine: file descriptors and throughput of the
many-engine client (``zmqdispatch.multi``) against the one-engine ``connect``.

Launches the mock engine (``--data-parallel-size N`` for N ranks in one
process, ``--step-interval-ms 0``), runs REQUESTS requests of TOKENS tokens at
once, and prints the client's new fds, tokens/s and client CPU per token.
Figures: ``docs/many-engines.md`` §5. Run: ``python benchmarks/many_engines.py``.
"""

from __future__ import annotations

import os
import sys
import time

import trio

from zmqdispatch import connect
from zmqdispatch.multi import connect_engines
from zmqdispatch.wire import vllm as wire

REQUESTS = 400
TOKENS = 32


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _request(rid: str) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(request_id=rid, prompt_token_ids=(1, 2, 3), arrival_time=0.0,
                                  sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=TOKENS))


async def run(n: int, many: bool) -> None:
    mock = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
            "--step-interval-ms", "0"] + (["--data-parallel-size", str(n)] if n > 1 else [])
    before = _fds()
    cm = connect_engines(launch=mock, data_parallel_size=n) if many else connect(launch=mock)
    async with cm as client:
        fds = _fds() - before
        tokens = 0

        async def one(i: int) -> None:
            nonlocal tokens
            async with client.generate(_request(f"r{i}")) as stream:
                async for delta in stream:
                    tokens += len(delta.token_ids)

        t0, c0 = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for i in range(REQUESTS):
                nursery.start_soon(one, i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    label = f"connect_engines, {n} engine(s)" if many else "connect, 1 engine"
    print(f"{label:32} fds +{fds:3d}  {tokens / wall:9,.0f} tokens/s  {cpu / tokens * 1e6:5.1f} us CPU/token")


if __name__ == "__main__":
    for n, many in [(1, False), (1, True), (2, True), (4, True)]:
        trio.run(run, n, many)
