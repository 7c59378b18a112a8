"""The many-engine cells: one :class:`~zmqdispatch.EngineClient` over N benchmark engines.

Run by the ``zmqdispatch`` runner (:mod:`.run_zmqdispatch`, a task per
stream) for the cells of kind ``many_*`` (:mod:`.harness`'s cell table). Each
cell starts its own fleet (:class:`Fleet`): N benchmark engine processes
(:mod:`.engine`, one per ``engine_index`` 0..N-1, each with its own control
socket and credit window) dialing one private handshake address, and
``connect(address, data_parallel_size=N)`` waiting for them, the way
the ranks of ``vllm serve --headless --data-parallel-size N`` (independent,
non-MoE ranks) dial one front end. The fleet is torn down when the cell ends.

Kinds (figures: the functions' docstrings):

- ``many_sat``: saturation throughput on N engines against the same client
  on one engine at the same total concurrency, and the balance of it.
- ``many_balance``: closed-loop traffic of requests of mixed lengths; requests
  and tokens per engine.
- ``many_death``: SIGKILL of one engine mid-run: time to its requests failing
  and to placement leaving it; the survivors' failures.
- ``many_idle_rss``: memory per idle stream spread over N engines.

vLLM's own client has a data-parallel client too; it is not wired up here, so
these cells run for zmqdispatch only.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
import zmq

from .. import ClientConfig, EngineClient, EngineDeadError, EngineState, connect
from ..wire import vllm as wire
from . import _common as common

__all__ = ["KINDS", "Fleet", "open_fleet", "run_cell", "window_per_engine"]

#: The cell kinds this module runs.
KINDS = ("many_sat", "many_balance", "many_death", "many_idle_rss")
#: Seconds between two looks at the engines' states while timing a death.
STATE_POLL_S = 0.0005


def window_per_engine(concurrency: int, engines: int) -> int:
    """Each engine's credit window for *concurrency* streams spread over
    *engines*: the harness's rule (``max(16 x C, 4096)``) for its share."""
    return max(16 * -(-concurrency // engines), 4096)


def _request(rid: str, prompt: list[int], max_tokens: int) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time(),
    )


class Fleet:
    """N benchmark engines behind one :class:`EngineClient` (use :func:`open_fleet`).

    Attributes:
        client: the client.
        client_fds: file descriptors the client opened in this process (``connect``).
        procs: the engine processes, by ``engine_index``.
        controls / ackers: each engine's control channel and credit channel, by ``engine_index``.
    """

    def __init__(self, client: EngineClient, procs: list[trio.Process], controls: list[common.Control],
                 ackers: list[common.Acker], client_fds: int) -> None:
        self.client = client
        self.client_fds = client_fds
        self.procs = procs
        self.controls = controls
        self.ackers = ackers

    @property
    def size(self) -> int:
        return len(self.procs)

    async def each(self, fn: Callable[[common.Control], Any], engines: Sequence[int] | None = None) -> list[Any]:
        """``fn(control)`` for each engine (all by default), one after the other in a worker thread."""
        controls = [self.controls[i] for i in (range(self.size) if engines is None else engines)]
        return await trio.to_thread.run_sync(lambda: [fn(c) for c in controls])

    async def hold(self, tokens_per_tick: int) -> tuple[int, list[int]]:
        """Every engine accepts ADDs without stepping; returns (ADDs so far in all, each engine's next epoch)."""
        held = await self.each(lambda c: c.hold(tokens_per_tick))
        return sum(a for a, _ in held), [e for _, e in held]

    async def wait_adds(self, total: int, timeout: float = 120.0) -> None:
        """Until the engines received *total* ADDs in all."""
        with trio.fail_after(timeout):
            while sum(s["adds"] for s in await self.each(lambda c: c.request("stats"))) < total:
                await trio.sleep(0.05)


@asynccontextmanager
async def open_fleet(engines: int, *, engine_args: Sequence[str] = ()) -> AsyncIterator[Fleet]:
    """Start *engines* benchmark engines dialing one handshake address and
    connect a :class:`EngineClient` to them (``silence_timeout`` off:
    the idle cells' streams get no output by design). On exit the client
    closes, then every engine still alive is stopped (its control ``stop``,
    then SIGTERM, then SIGKILL).

    Raises:
        EngineHandshakeTimeout: not every engine came up within 60 s.
    """
    tmp = common.PrivateDir(prefix="zmqd-many-")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    procs: list[trio.Process] = []
    controls: list[common.Control] = []
    ackers: list[common.Acker] = []
    address = tmp.ipc("hs.sock")
    try:
        for i in range(engines):
            os.mkdir(os.path.join(tmp.path, f"e{i}"))
            ctl = tmp.ipc(f"e{i}/control.sock")
            argv = common.engine_argv(sys.executable, control=ctl, handshake_address=address)
            argv += ["--engine-index", str(i), *engine_args]
            # The engines dial before the client binds: libzmq retries until it does.
            procs.append(await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL))
            controls.append(common.Control(ctx, ctl))
        config = ClientConfig(handshake_timeout=60, silence_timeout=math.inf)
        fds = _fds()
        async with connect(address, data_parallel_size=engines, config=config) as client:
            fds = _fds() - fds
            # Each engine made its ack FIFO before it dialed: every one exists now.
            ackers.extend(common.Acker(c) for c in (tmp.ipc(f"e{i}/control.sock") for i in range(engines)))
            yield Fleet(client, procs, controls, ackers, fds)
    finally:
        with trio.CancelScope(shield=True):
            await _stop(procs, controls)
        for a in ackers:
            a.close()
        for c in controls:
            c.close()
        ctx.term()
        tmp.cleanup()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _stop(procs: list[trio.Process], controls: list[common.Control]) -> None:
    for proc, ctl in zip(procs, controls, strict=False):
        if proc.returncode is None:
            try:
                await trio.to_thread.run_sync(functools.partial(ctl.request, "stop", timeout=2))
            except (TimeoutError, RuntimeError, zmq.ZMQError):
                pass
    for proc in procs:
        with trio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.terminate()
            with trio.move_on_after(5):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ---------------------------------------------------------------------- cells


async def run_cell(cell: dict[str, Any], *, client_name: str = "zmqdispatch") -> dict[str, Any]:
    """Run one ``many_*`` cell (a fleet of its own) and return its figures."""
    kind = cell["kind"]
    if kind == "many_sat":
        return await many_sat(cell, client_name)
    if kind == "many_balance":
        return await many_balance(cell, client_name)
    if kind == "many_death":
        return await many_death(cell, client_name)
    if kind == "many_idle_rss":
        return await many_idle_rss(cell, client_name)
    raise ValueError(f"unknown many-engine cell kind {kind!r} (known: {', '.join(KINDS)})")


def _spread(values: Sequence[int | float]) -> float | None:
    """Most over least (None when the least is 0)."""
    return max(values) / min(values) if values and min(values) > 0 else None


def _fleet_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The engines' window counters summed, in the shape :func:`._common.throughput_result` reads."""
    wall = max(s["wall_s"] for s in stats)
    busy = sum(s["busy_s"] for s in stats)
    rows = sum(s["rows"] for s in stats)
    steps = sum(s["steps"] for s in stats)
    return {
        "rows": rows,
        "wall_s": wall,
        "cpu_s": sum(s["cpu_s"] for s in stats),
        "steps_per_s": steps / wall if wall > 0 else 0.0,
        # per CPU second the engines spent building and sending (their sum)
        "max_steps_per_s": steps / busy if busy > 0 else None,
        "max_request_ticks_per_s": rows / busy if busy > 0 else None,
        "late_steps": sum(s["late_steps"] for s in stats),
        "window_stalls": sum(s["window_stalls"] for s in stats),
    }


async def _saturate(fleet: Fleet, cell: dict[str, Any], tag: str) -> dict[str, Any]:
    """C streams (a task each) over the fleet, saturation as :meth:`Runner.throughput`
    measures it; the figures of :func:`._common.throughput_result` plus the balance."""
    client, c, n = fleet.client, cell["concurrency"], fleet.size
    adds, epochs = await fleet.hold(cell["tokens_per_tick"])
    window = window_per_engine(c, n)
    for acker, epoch in zip(fleet.ackers, epochs, strict=True):
        acker.start(epoch, window)
    tally = common.Tally()
    ticks_by_engine = [0] * n
    now = time.monotonic

    async def consume(i: int) -> None:
        req = _request(f"{tag}-{i}", common.prompt_tokens(cell["prompt_len"], i), cell["max_tokens"])
        first = True
        lat = tally.latency
        async with client.generate(req) as stream:
            index = client.engine_of(req.request_id)
            assert index is not None  # placed when entered
            acker = fleet.ackers[index]
            async for d in stream:
                if first:
                    first = False
                    tally.first_seen += 1
                if tally.measuring:
                    lat.append(now() - d.engine_timestamp)
                    tally.ticks += d.ticks
                    tally.tokens += len(d.token_ids)
                    tally.deliveries += 1
                    ticks_by_engine[index] += d.ticks
                acker.delivered(d.ticks)

    async with trio.open_nursery() as nursery:
        for i in range(c):
            nursery.start_soon(consume, i)
        await fleet.wait_adds(adds + c)
        await fleet.each(lambda ctl: ctl.run({**cell, "window": window}))
        with trio.fail_after(120):
            while tally.first_seen < c:
                await trio.sleep(0.02)
        await trio.sleep(cell["warmup_s"])
        await fleet.each(lambda ctl: ctl.request("mark"))
        with tally.gc:
            cpu0, t0 = time.process_time(), now()
            tally.measuring = True
            await trio.sleep(cell["seconds"])
            tally.measuring = False
            cpu1, t1 = time.process_time(), now()
        stats = await fleet.each(lambda ctl: ctl.request("stats"))
        requests = [s.requests for s in client.stats().values()]
        nursery.cancel_scope.cancel()
    await fleet.each(lambda ctl: ctl.wait_idle())
    result = common.throughput_result("zmqdispatch", cell, tally, wall=t1 - t0, cpu=cpu1 - cpu0,
                                      engine=_fleet_stats(stats))
    result.update(engines=n, client_fds=fleet.client_fds, window_per_engine=window, requests_per_engine=requests,
                  ticks_per_engine=ticks_by_engine, requests_most_over_least=_spread(requests),
                  ticks_most_over_least=_spread(ticks_by_engine))
    return result


async def many_sat(cell: dict[str, Any], client_name: str) -> dict[str, Any]:
    """Saturation (engines stepping as fast as their credit windows let
    them), C streams over ``cell["engines"]`` engines and over one engine (the
    same ``EngineClient``, ``data_parallel_size=1``), one after the other,
    each on a fresh fleet; the order alternates with ``cell["round"]``.

    Figures: ``one_engine`` and ``many_engines`` (the throughput figures of a
    ``sat-c*`` cell, plus requests and request-ticks per engine and
    ``client_fds``, the file descriptors ``connect`` opened), and
    ``ratio`` (many / one, request-ticks/s). Each engine's credit window is
    :func:`window_per_engine`.
    """
    n = cell["engines"]
    order = (1, n) if cell.get("round", 1) % 2 else (n, 1)
    figures: dict[int, dict[str, Any]] = {}
    for engines in order:
        async with open_fleet(engines) as fleet:
            figures[engines] = await _saturate(fleet, cell, f"s{engines}")
    one, many = figures[1], figures[n]
    return {
        "client": client_name,
        "cell": cell["name"],
        "engines": n,
        "concurrency": cell["concurrency"],
        "order": list(order),
        "one_engine": one,
        "many_engines": many,
        "ratio": (many["request_ticks_per_s"] / one["request_ticks_per_s"]
                  if one["request_ticks_per_s"] else None),
    }


def _lengths(count: int, mean: int, seed: int) -> list[int]:
    """*count* deterministic ``max_tokens`` in 1..2 x mean - 1 (mean *mean*)."""
    span = max(1, 2 * mean - 1)
    return [1 + (seed * 7919 + i * 104729) % span for i in range(count)]


async def many_balance(cell: dict[str, Any], client_name: str) -> dict[str, Any]:
    """Closed-loop traffic over ``cell["engines"]`` engines stepping every
    ``step_interval_ms``: C workers, each entering a request, reading it to
    its end and entering the next; each request's ``max_tokens`` is drawn
    from 1..2 x ``mean_tokens`` - 1. After ``warmup_s``, a window of
    ``seconds``; then every worker ends its current request and stops.

    Figures of the window: ``requests_per_engine`` (placed on each engine:
    ``client.stats()``), ``tokens_per_engine`` (sent by each engine: its own
    counters), their most / least, ``requests_per_s`` (requests placed).
    Whole cell: ``requests_completed`` (read to their end by the workers),
    ``requests_placed`` (``client.stats()``) and ``engine_adds`` (ADDs the
    engines received): equal when nothing was lost; ``failures`` (any error:
    its worker stops; must be 0).
    """
    n, c = cell["engines"], cell["concurrency"]
    async with open_fleet(n) as fleet:
        client = fleet.client
        await fleet.each(lambda ctl: ctl.request("cfg", {"mode": "run", "window": 0,
                                                         "step_interval_ms": cell["step_interval_ms"]}))
        state = {"stop": False, "first": 0, "completed": 0, "tokens": 0}
        failures: list[str] = []
        lengths = _lengths(997, cell["mean_tokens"], 1)

        def placed() -> list[int]:
            return [s.requests for s in client.stats().values()]

        async def worker(w: int) -> None:
            k = 0
            while not state["stop"]:
                k += 1
                rid = f"b{w}.{k}"
                req = _request(rid, common.prompt_tokens(cell["prompt_len"], w), lengths[(w * 31 + k) % len(lengths)])
                try:
                    async with client.generate(req) as stream:
                        async for d in stream:
                            state["tokens"] += len(d.token_ids)
                except Exception as exc:  # counted and reported; this worker stops
                    failures.append(f"{rid}: {exc!r}")
                    return
                state["completed"] += 1
                if k == 1:
                    state["first"] += 1

        async with trio.open_nursery() as nursery:
            for w in range(c):
                nursery.start_soon(worker, w)
            with trio.fail_after(120):
                while state["first"] < c and not failures:
                    await trio.sleep(0.02)
            await trio.sleep(cell["warmup_s"])
            await fleet.each(lambda ctl: ctl.request("mark"))
            before, cpu0, t0 = placed(), time.process_time(), time.monotonic()
            await trio.sleep(cell["seconds"])
            after, cpu1, t1 = placed(), time.process_time(), time.monotonic()
            window = await fleet.each(lambda ctl: ctl.request("stats"))
            state["stop"] = True  # each worker ends its current request, then stops
        total_placed = placed()
        stats = await fleet.each(lambda ctl: ctl.wait_idle())
    wall, cpu = t1 - t0, cpu1 - cpu0
    requests_by = [a - b for a, b in zip(after, before, strict=True)]
    tokens_by = [w["tokens"] for w in window]
    return {
        "client": client_name,
        "cell": cell["name"],
        "engines": n,
        "workers": c,
        "wall_s": wall,
        "requests": sum(requests_by),
        "tokens": sum(tokens_by),
        "requests_per_s": sum(requests_by) / wall if wall > 0 else 0.0,
        "tokens_per_s": sum(tokens_by) / wall if wall > 0 else 0.0,
        "cpu_us_per_request": 1e6 * cpu / sum(requests_by) if sum(requests_by) else None,
        "requests_per_engine": requests_by,
        "tokens_per_engine": tokens_by,
        "requests_most_over_least": _spread(requests_by),
        "tokens_most_over_least": _spread(tokens_by),
        "requests_completed": state["completed"],
        "requests_placed": sum(total_placed),
        "engine_adds": sum(s["adds"] for s in stats),
        "failures": len(failures),
        "failure_examples": failures[:3],
    }


async def many_death(cell: dict[str, Any], client_name: str) -> dict[str, Any]:
    """One of ``cell["engines"]`` engines SIGKILLed under load.

    C long streams run over the engines (a task each), stepping every
    ``step_interval_ms`` (no credit window), while a submitter enters a short
    request (``burst_max_tokens`` tokens) every ``submit_interval_ms`` into
    one :class:`~zmqdispatch.StreamGroup` (``group.generate`` places the
    request at once, so its engine and the time it was placed are exact).
    After ``warmup_s`` the highest-index engine's process is SIGKILLed; the
    cell waits until every request placed on it ended, then watches
    ``after_s`` more.

    Figures, ms from the kill (``time.monotonic()`` in the runner):
    ``out_of_placement_ms``, when ``client.states()`` first showed it not
    ``up`` (looked at every 0.5 ms); ``last_failed_ms``, when the last
    request on it raised ``EngineDeadError``; ``last_placed_ms``, when the
    last request was placed on it (None: none after the kill). Counts:
    ``victim_requests`` (in flight on it at the kill) and ``victim_failed``
    (of them, failed with ``EngineDeadError``), ``placed_on_victim_after_out``
    (must be 0), ``survivor_failures`` (any error on another engine; must be
    0), ``survivor_ticks_after_kill``, ``new_requests`` (short requests
    placed in all) and ``new_requests_per_engine``.
    """
    n, c = cell["engines"], cell["concurrency"]
    victim = n - 1
    now = time.monotonic
    async with open_fleet(n) as fleet:
        client = fleet.client
        await fleet.each(lambda ctl: ctl.request("cfg", {"mode": "run", "window": 0,
                                                         "step_interval_ms": cell["step_interval_ms"]}))
        placed: dict[str, tuple[float, int]] = {}  # rid -> (time placed, engine)
        ended: dict[str, tuple[float, str]] = {}  # rid -> (time ended, "ok" / "dead" / another error's name)
        t: dict[str, float] = {}
        counts = {"first": 0, "survivor_ticks_after_kill": 0, "refused": 0}

        def outcome(exc: BaseException) -> str:
            return "dead" if isinstance(exc, EngineDeadError) else type(exc).__name__

        async def long_stream(i: int) -> None:
            rid = f"long{i}"
            req = _request(rid, common.prompt_tokens(cell["prompt_len"], i), cell["max_tokens"])
            try:
                async with client.generate(req) as stream:
                    index = client.engine_of(rid)  # live: it cannot have ended (max_tokens is huge)
                    assert index is not None
                    placed[rid] = (now(), index)
                    first = True
                    async for d in stream:
                        if first:
                            first = False
                            counts["first"] += 1
                        if "kill" in t and index != victim:
                            counts["survivor_ticks_after_kill"] += d.ticks
            except Exception as exc:
                ended[rid] = (now(), outcome(exc))
                return
            ended[rid] = (now(), "ok")

        async with client.stream_group() as group:

            async def submitter() -> None:
                k = 0
                while True:
                    k += 1
                    rid = f"new{k}"
                    req = _request(rid, common.prompt_tokens(cell["prompt_len"], k), cell["burst_max_tokens"])
                    try:
                        group.generate(req)
                    except Exception:  # NoEngineAvailableError would be counted, never expected
                        counts["refused"] += 1
                    else:
                        index = client.engine_of(rid)
                        assert index is not None  # placed synchronously
                        placed[rid] = (now(), index)
                    await trio.sleep(cell["submit_interval_ms"] / 1000.0)

            async def reader() -> None:
                async for batch in group:
                    t_batch = now()
                    for member, item in batch:
                        if isinstance(item, BaseException):
                            ended[member.request_id] = (t_batch, outcome(item))
                        elif item.finish_reason is not None:
                            ended[member.request_id] = (t_batch, "ok")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                for i in range(c):
                    nursery.start_soon(long_stream, i)
                with trio.fail_after(120):
                    while counts["first"] < c:
                        await trio.sleep(0.02)
                nursery.start_soon(submitter)
                await trio.sleep(cell["warmup_s"])
                t["kill"] = now()
                fleet.procs[victim].send_signal(signal.SIGKILL)
                with trio.fail_after(60):
                    while client.states()[victim].state is EngineState.UP:
                        await trio.sleep(STATE_POLL_S)
                    t["out"] = now()
                    # Every request placed on it ends (fails).
                    while any(rid not in ended for rid, (_, e) in list(placed.items()) if e == victim):
                        await trio.sleep(0.001)
                await trio.sleep(cell["after_s"])
                reason = client.states()[victim].reason
                nursery.cancel_scope.cancel()
        await fleet.each(lambda ctl: ctl.wait_idle(), engines=range(n - 1))
    kill, out = t["kill"], t["out"]
    victim_rids = [rid for rid, (_, e) in placed.items() if e == victim]
    failed_at = [ended[rid][0] for rid in victim_rids if ended[rid][1] == "dead"]
    after_kill = [placed[rid][0] for rid in victim_rids if placed[rid][0] >= kill]
    at_kill = [rid for rid in victim_rids if placed[rid][0] <= kill and ended[rid][0] >= kill]
    survivors = [rid for rid, (_, e) in placed.items() if e != victim]
    new = [rid for rid in placed if rid.startswith("new")]
    return {
        "client": client_name,
        "cell": cell["name"],
        "engines": n,
        "victim": victim,
        "long_streams": c,
        "death_reason": reason,
        "out_of_placement_ms": 1000.0 * (out - kill),
        "last_failed_ms": 1000.0 * (max(failed_at) - kill) if failed_at else None,
        "last_placed_ms": 1000.0 * (max(after_kill) - kill) if after_kill else None,
        "victim_requests": len(at_kill),
        "victim_failed": sum(1 for rid in at_kill if ended[rid][1] == "dead"),
        "victim_other_outcomes": sum(1 for rid in victim_rids if ended[rid][1] not in ("ok", "dead")),
        "placed_on_victim_after_out": sum(1 for rid in victim_rids if placed[rid][0] > out),
        "survivor_requests": len(survivors),
        "survivor_failures": sum(1 for rid in survivors if rid in ended and ended[rid][1] != "ok"),
        "survivor_ticks_after_kill": counts["survivor_ticks_after_kill"],
        "new_requests": len(new),
        "new_requests_refused": counts["refused"],
        "new_requests_per_engine": [sum(1 for rid in new if placed[rid][1] == i) for i in range(n)],
    }


async def many_idle_rss(cell: dict[str, Any], client_name: str) -> dict[str, Any]:
    """C streams, each read by its own task, entered on ``cell["engines"]``
    engines that accept them and never step.

    Figures: ``rss_per_stream_bytes`` (the process's RSS growth, as
    ``idle-rss``), then, the streams closed and entered again under
    ``tracemalloc``, ``python_bytes_per_stream`` (the Python allocations
    alone, the request objects made before the baseline);
    ``streams_per_engine``: where they were placed.
    """
    n, c = cell["engines"], cell["concurrency"]
    async with open_fleet(n) as fleet:
        client = fleet.client
        await fleet.each(lambda ctl: ctl.request("cfg", {"mode": "hold", "window": 0}))

        async def consume(req: wire.EngineCoreRequest) -> None:
            async with client.generate(req) as stream:
                async for _ in stream:
                    pass

        async def open_all(tag: str, measure: Callable[[], int]) -> tuple[int, int, list[int]]:
            requests = [_request(f"{tag}{i}", common.prompt_tokens(cell["prompt_len"], i), cell["max_tokens"])
                        for i in range(c)]
            base = sum(s["adds"] for s in await fleet.each(lambda ctl: ctl.request("stats")))
            gc.collect()
            before = measure()
            async with trio.open_nursery() as nursery:
                for req in requests:
                    nursery.start_soon(consume, req)
                await fleet.wait_adds(base + c)
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.5)  # let the allocator settle before reading RSS (bench, not a test)
                gc.collect()
                after = measure()
                per_engine = [s.in_flight for s in client.states()]
                nursery.cancel_scope.cancel()
            del requests
            await fleet.each(lambda ctl: ctl.wait_idle())
            return before, after, per_engine

        rss_before, rss_after, per_engine = await open_all("i", common.rss_bytes)
        tracemalloc.start()
        try:
            t_before, t_after, _ = await open_all("t", lambda: tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        traced = t_after - t_before
    result = common.rss_result(client_name, cell, rss_before, rss_after, c)
    result.update(engines=n, streams_per_engine=per_engine, python_bytes_per_stream=traced / c if c else None)
    return result
