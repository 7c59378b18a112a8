"""The many-engine client (``zmqdispatch.multi``) against the mock engine:
cost of one socket pair per engine, balance, death detection, idle memory.

Prints, for the mock launched with N ranks (``--step-interval-ms 0``):

1. fds and throughput: REQUESTS requests of TOKENS tokens at once, the client's
   new fds, tokens/s and client CPU per token, for the one-engine ``connect``
   and ``connect_engines`` with 1, 2 and 4 engines; with several engines, the
   balance: requests per engine, most / least loaded.
2. death (4 engines, one process each): DEATH_REQUESTS long requests spread
   over them, then one engine process is SIGKILLed; the time from the kill to
   the engine leaving placement (new requests avoid it) and to the last of its
   requests failing with ``EngineDeadError`` (the others go on).
3. memory per idle stream: IDLE_STREAMS streams entered on a 4-engine client
   whose engines never step (``--step-interval-ms`` huge), measured with
   ``tracemalloc`` (the client's Python allocations; the request objects
   themselves are made before the baseline).

Figures: ``docs/many-engines.md`` §5. Run: ``python benchmarks/many_engines.py``.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import trio

from zmqdispatch import ClientConfig, EngineDeadError, EngineState, MultiEngineClient, connect, connect_engines
from zmqdispatch.wire import vllm as wire

REQUESTS = 400
TOKENS = 32
DEATH_REQUESTS = 40
IDLE_STREAMS = 10_000


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _request(rid: str, tokens: int = TOKENS) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(request_id=rid, prompt_token_ids=(1, 2, 3), arrival_time=0.0,
                                  sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=tokens))


def _mock(step_ms: str = "0") -> list[str]:
    return [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
            "--step-interval-ms", step_ms]


async def throughput(n: int, many: bool) -> None:
    mock = _mock() + (["--data-parallel-size", str(n)] if n > 1 else [])
    before = _fds()
    cm = connect_engines(launch=mock, data_parallel_size=n) if many else connect(launch=mock)
    counts: list[int] = []
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
        if isinstance(client, MultiEngineClient):
            counts = [s.requests for s in client.stats().values()]  # requests sent to each engine
    label = f"connect_engines, {n} engine(s)" if many else "connect, 1 engine"
    balance = ""
    if len(counts) > 1:
        balance = f"  requests per engine {counts} (most/least {max(counts)}/{min(counts)})"
    print(f"{label:32} fds +{fds:3d}  {tokens / wall:9,.0f} tokens/s  {cpu / tokens * 1e6:5.1f} us CPU/token"
          + balance, flush=True)


async def death(n: int = 4) -> None:
    """SIGKILL one of *n* engine processes under load; time to avoid it and to fail its requests."""
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/hs.sock"
        procs = [subprocess.Popen([*(a.replace("{handshake_address}", address) for a in _mock("2")),
                                   "--engine-index", str(r)], stdin=subprocess.DEVNULL, start_new_session=True)
                 for r in range(n)]
        try:
            async with connect_engines(address, data_parallel_size=n) as client:
                victim = n - 1
                streaming = trio.Event()
                started = 0
                failed_at: dict[str, float] = {}
                where: dict[str, int | None] = {}
                done = 0

                async def one(i: int) -> None:
                    nonlocal started, done
                    rid = f"d{i}"
                    try:
                        async with client.generate(_request(rid, 4000)) as stream:
                            where[rid] = client.engine_of(rid)
                            async for _ in stream:
                                if rid not in failed_at and started < DEATH_REQUESTS:
                                    started += 1
                                    failed_at[rid] = 0.0
                                    if started == DEATH_REQUESTS:
                                        streaming.set()
                    except EngineDeadError:
                        failed_at[rid] = time.perf_counter()
                    done += 1

                async with trio.open_nursery() as nursery:
                    for i in range(DEATH_REQUESTS):
                        nursery.start_soon(one, i)
                    await streaming.wait()
                    t_kill = time.perf_counter()
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    while client.states()[victim].state is EngineState.UP:
                        await client._changed.wait()
                    t_avoid = time.perf_counter()
                    on_victim = [rid for rid, e in where.items() if e == victim]
                    while any(failed_at[rid] == 0.0 for rid in on_victim):
                        await trio.sleep(0.001)
                    t_failed = max(failed_at[rid] for rid in on_victim)
                    survivors = sum(1 for rid, e in where.items() if e != victim and failed_at[rid] == 0.0)
                    reason = client.states()[victim].reason
                    nursery.cancel_scope.cancel()
            print(f"death ({n} engines, SIGKILL of engine {victim}, {len(on_victim)} of {DEATH_REQUESTS} requests "
                  f"on it): out of placement after {(t_avoid - t_kill) * 1e3:.1f} ms, its last request failed after "
                  f"{(t_failed - t_kill) * 1e3:.1f} ms (reason {reason!r}); {survivors} requests on the others "
                  "still streaming", flush=True)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait(timeout=30)


async def idle_memory(n: int = 4) -> None:
    """Python memory per entered stream that receives nothing."""
    mock = _mock("3600000") + ["--data-parallel-size", str(n)]
    requests = [_request(f"idle{i}", 1000) for i in range(IDLE_STREAMS)]
    config = ClientConfig(silence_timeout=3600.0)
    async with connect_engines(launch=mock, data_parallel_size=n, config=config) as client:
        streams: list[Any] = [None] * IDLE_STREAMS
        for i in range(100):  # warm caches and free lists first
            async with client.generate(_request(f"warm{i}", 1)):
                pass
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for i, req in enumerate(requests):
            streams[i] = client.generate(req)
            await streams[i].__aenter__()
        await trio.sleep(0.5)  # the pumps have sent every ADD
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        per_engine = [s.in_flight for s in client.states()]
        for s in streams:
            await s.__aexit__(None, None, None)
    print(f"idle streams ({n} engines, {IDLE_STREAMS} streams entered, {per_engine} per engine): "
          f"{used / IDLE_STREAMS:,.0f} bytes per stream (tracemalloc)", flush=True)


if __name__ == "__main__":
    for n, many in [(1, False), (1, True), (2, True), (4, True)]:
        trio.run(throughput, n, many)
    trio.run(death)
    trio.run(idle_memory)
