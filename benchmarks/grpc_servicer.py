#!/usr/bin/env python3
"""What ``zmqdispatch serve-grpc`` costs per token: a ``grpc.aio`` client (this
process) streams ``Generate`` through the servicer (a subprocess, over the
embedded mock engine, its own subprocess) and the servicer process's CPU
(utime + stime of its own threads, ``/proc``; the mock engine is a child and
is not counted) is divided by the tokens delivered.

    .venv/bin/python benchmarks/grpc_servicer.py --streams 100 --tokens 200 --repeats 3

Prints one JSON line per repeat and a summary line: tokens/s (wall, client
side), servicer CPU µs per token, client CPU µs per token, chunks per
token. On 2 cores the three processes share the machine; the mock's step
interval (``--step-interval-ms``) paces the engine as a real one would.
Not a comparison: the servicer over ``AsyncLLM`` needs a real engine and is
not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (own threads only)


async def one_run(address: str, streams: int, tokens: int, run: int) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.VllmEngineStub(ch)

        async def stream(i: int) -> tuple[int, int]:
            req = pb.GenerateRequest(request_id=f"b{run}-{i}", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, i % 97]),
                                     sampling_params=pb.SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                       ignore_eos=True), stream=True)
            got = chunks = 0
            async for r in stub.Generate(req):
                if r.HasField("chunk"):
                    got += len(r.chunk.token_ids)
                    chunks += 1
            return got, chunks

        results = await asyncio.gather(*(stream(i) for i in range(streams)))
    return sum(g for g, _ in results), sum(c for _, c in results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-interval-ms", type=float, default=1.0)
    args = p.parse_args()
    proc = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "serve-grpc", "--port", "0",
                             "--mock-step-interval-ms", str(args.step_interval_ms), "--mock-max-model-len", "65536"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().decode().strip().removeprefix("grpc://")
        assert address, "serve-grpc did not start"
        asyncio.run(one_run(address, 4, 8, -1))  # warm-up
        rows = []
        for run in range(args.repeats):
            s0, c0, t0 = cpu_seconds(proc.pid), time.process_time(), time.monotonic()
            got, chunks = asyncio.run(one_run(address, args.streams, args.tokens, run))
            wall, client, server = time.monotonic() - t0, time.process_time() - c0, cpu_seconds(proc.pid) - s0
            assert got == args.streams * args.tokens, (got, args.streams * args.tokens)
            row = {"run": run, "streams": args.streams, "tokens": got, "wall_s": round(wall, 3),
                   "tokens_per_s": round(got / wall), "servicer_cpu_us_per_token": round(server / got * 1e6, 2),
                   "client_cpu_us_per_token": round(client / got * 1e6, 2), "chunks_per_token": round(chunks / got, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        summary = {k: statistics.median(r[k] for r in rows)
                   for k in ("tokens_per_s", "servicer_cpu_us_per_token", "client_cpu_us_per_token")}
        print(json.dumps({"median": summary, "step_interval_ms": args.step_interval_ms}), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
