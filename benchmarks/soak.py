#!/usr/bin/env python3
"""Soak: N minutes of mixed load against the mock engine, one summary line.

    python benchmarks/soak.py                 # 10 minutes
    python benchmarks/soak.py --minutes 1 --concurrency 32

One mock engine process (started here, like ``vllm serve --headless``: the
client does not ``launch=`` it) on fixed ipc addresses in a private directory.
``--concurrency`` worker tasks draw requests from this mix, through the gateway
path (proto ``GenerateRequest`` -> ``translate_request`` / ``translate_parallel``
-> stream -> ``ResponseBuilder``):

=============  ====  ==========================================================
kind           %     what
=============  ====  ==========================================================
normal         45    stream to the end; the complete's ``output_ids`` must equal
                     the mock's deterministic tokens (nothing lost, nothing extra)
cancel         20    left at a random point: a timeout (0-50 ms, may land in
                     ``async with`` entry), ``break`` after k chunks, or an
                     exception out of the block
fanout         15    ``n`` = 2-4 via ``client.generate_samples``; every index checked;
                     one in four is cancelled midway
slow           12    the consumer sleeps 2-20 ms per delta (ticks merge); tokens
                     checked
stalled        3     the consumer stops reading for 3 s: ``SlowConsumerError``
                     (``max_pending_tokens`` = 512) is the expected outcome
utility        5     ``is_sleeping()``
=============  ====  ==========================================================

Events: at 50 % the engine is SIGKILLed and a **new engine process** is
started on the same handshake address; the client binds the same fixed
addresses again and does a fresh handshake (a new vLLM engine always
handshakes). At 75 % the client is closed and re-attached with
``connect(resume=session)`` (the engine stays; it re-dials the fixed
addresses). Failures those events cause are expected and counted by type.

At the end the workers are cancelled, then: ``leaked`` = the client's
``protocol.inflight`` + the engine's own live-request count
(``zmqd_live_requests``, asked after every ABORT was queued, so it must be
exactly 0). Requests left live after a cancelled ``RequestStream.__aenter__``
(a bug, fixed; see ``tests/faults/test_cancel_storm.py``) would be detected,
counted as ``aenter_leaks`` (expected 0) and aborted by the soak before the count.

stdout gets exactly one line; progress goes to stderr every minute.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import subprocess
import sys
import shutil
import tempfile
import time
from collections import Counter
from contextlib import asynccontextmanager

import trio

from zmqdispatch import ClientConfig, EngineDeadError, SlowConsumerError, connect
from zmqdispatch.mock.core import mock_token
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_parallel, translate_request

VOCAB = 32_000
STALL_PENDING = 512


def rss_mib(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except FileNotFoundError:
        return float("nan")


def expected_tokens(prompt: list[int], seed: int | None, n: int) -> list[int]:
    h = 0
    for t in prompt:
        h = (h * 31 + t) & 0xFFFFFFFF
    return [mock_token(h, i, seed or 0, VOCAB) for i in range(n)]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.client = None
        self.changed = trio.Event()
        self.counts: Counter[str] = Counter()  # outcomes by kind
        self.failures: Counter[str] = Counter()
        self.expected_failures: Counter[str] = Counter()
        self.aenter_leaks: list[str] = []
        self.aenter_leak_total = 0
        self.next_id = 0
        self.tconfig: TranslationConfig | None = None
        self.gen = 0  # client generation (one per connect)
        self.intentional: set[int] = set()  # generations we killed or closed on purpose

    # ----------------------------------------------------------- plumbing

    def publish(self, client) -> None:
        self.client = client
        self.gen += 1
        if client is not None:
            self.tconfig = TranslationConfig(max_model_len=client.max_model_len)
        self.changed.set()
        self.changed = trio.Event()

    async def live_client(self):
        while True:
            c = self.client
            if c is not None and c.is_alive:
                return c, self.gen
            await self.changed.wait()

    def rid(self, kind: str) -> str:
        self.next_id += 1
        return f"{kind}{self.next_id}"

    def fail(self, exc: BaseException, kind: str, gen: int) -> None:
        key = type(exc).__name__
        if isinstance(exc, EngineDeadError):
            key += f"[{exc.reason}]"
            if gen in self.intentional:  # the engine we killed / the client we closed
                self.expected_failures[key] += 1
                return
        if isinstance(exc, SlowConsumerError) and kind == "stalled":
            self.expected_failures[key] += 1
            return
        self.failures[f"{kind}:{key}"] += 1

    def gen_request(self, kind: str, max_tokens: int, n: int = 1, temperature: float = 0.0) -> pb.GenerateRequest:
        prompt = [self.rng.randrange(3, VOCAB) for _ in range(self.rng.randint(1, 64))]
        sp = pb.SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n)
        if temperature > 0:
            sp.seed = self.rng.randrange(0, 2**31 - 1000)
        return pb.GenerateRequest(request_id=self.rid(kind), tokenized=pb.TokenizedInput(input_ids=prompt),
                                  sampling_params=sp, stream=True)

    # ----------------------------------------------------------- request kinds

    @asynccontextmanager
    async def stream(self, client, request):
        """``async with client.generate(request)``, noting a request leaked by
        the known ``RequestStream.__aenter__`` bug: a cancellation at the end of
        the entry leaves no ``__aexit__`` to abort it."""
        entered = False
        try:
            async with client.generate(request) as stream:
                entered = True
                yield stream
        finally:
            if not entered and client.protocol.is_live(request.request_id):
                self.aenter_leaks.append(request.request_id)
                self.aenter_leak_total += 1

    async def run_stream(self, client, req: pb.GenerateRequest, *, delay: tuple[float, float] | None = None,
                         stall: float = 0.0) -> None:
        t = translate_request(req, self.tconfig)
        builder = t.response_builder()
        complete = None
        async with self.stream(client, t.request) as stream:
            first = True
            async for delta in stream:
                if first and stall:
                    first = False
                    await trio.sleep(stall)
                for resp in builder.feed(delta):
                    if resp.HasField("complete"):
                        complete = resp.complete
                if delay:
                    await trio.sleep(self.rng.uniform(*delay))
        sp = t.request.sampling_params
        want = expected_tokens(list(t.request.prompt_token_ids), sp.seed, sp.max_tokens)
        if complete is None or list(complete.output_ids) != want or complete.finish_reason != "length":
            self.failures["token_mismatch"] += 1
        else:
            self.counts["completed"] += 1

    async def run_cancel(self, client) -> None:
        req = self.gen_request("c", self.rng.randint(50, 400))
        t = translate_request(req, self.tconfig)
        how = self.rng.choice(("timeout", "break", "raise"))
        if how == "timeout":
            with trio.move_on_after(self.rng.uniform(0, 0.05)):
                async with self.stream(client, t.request) as stream:
                    async for _ in stream:
                        pass
        else:
            k = self.rng.randint(1, 10)
            try:
                async with self.stream(client, t.request) as stream:
                    i = 0
                    async for _ in stream:
                        i += 1
                        if i >= k:
                            if how == "break":
                                break
                            raise _Leave
            except _Leave:
                pass
        self.counts["cancelled"] += 1

    async def run_fanout(self, client) -> None:
        n = self.rng.randint(2, 4)
        req = self.gen_request("f", self.rng.randint(10, 150), n=n, temperature=0.8)
        samples = translate_parallel(req, self.tconfig)
        builders = [s.response_builder() for s in samples]
        completes: dict[int, object] = {}
        cancel_after = self.rng.randint(1, 20) if self.rng.random() < 0.25 else None
        seen = 0
        async with client.generate_samples([s.request for s in samples]) as merged:
            async for index, delta in merged:
                for resp in builders[index].feed(delta):
                    if resp.HasField("complete"):
                        completes[index] = resp.complete
                seen += 1
                if cancel_after is not None and seen >= cancel_after:
                    break
        if cancel_after is not None and len(completes) < n:
            self.counts["fanout_cancelled"] += 1
            return
        for i, s in enumerate(samples):
            sp = s.request.sampling_params
            want = expected_tokens(list(s.request.prompt_token_ids), sp.seed, sp.max_tokens)
            c = completes.get(i)
            if c is None or list(c.output_ids) != want:
                self.failures["fanout_token_mismatch"] += 1
                return
        self.counts["fanout_completed"] += 1

    async def one(self) -> None:
        client, gen = await self.live_client()
        r = self.rng.random()
        kind = ("normal" if r < 0.45 else "cancel" if r < 0.65 else "fanout" if r < 0.80 else
                "slow" if r < 0.92 else "stalled" if r < 0.95 else "utility")
        self.counts["requests"] += 1
        try:
            if kind == "normal":
                await self.run_stream(client, self.gen_request("n", self.rng.randint(1, 200)))
            elif kind == "slow":
                await self.run_stream(client, self.gen_request("s", self.rng.randint(20, 150)), delay=(0.002, 0.02))
            elif kind == "stalled":
                await self.run_stream(client, self.gen_request("t", 1500), stall=3.0)
            elif kind == "cancel":
                await self.run_cancel(client)
            elif kind == "fanout":
                await self.run_fanout(client)
            else:
                await client.is_sleeping(timeout=10)
                self.counts["utility"] += 1
        except Exception as exc:  # every error is counted by type; the soak goes on
            self.fail(exc, kind, gen)

    async def worker(self) -> None:
        while True:
            await self.one()

    # ----------------------------------------------------------- engine and phases

    async def start_engine(self, hs: str) -> trio.Process:
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", hs,
             "--step-interval-ms", str(self.args.step_interval_ms)],
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    async def run(self) -> str:
        a = self.args
        d = tempfile.mkdtemp(prefix="zmqd-soak-")
        hs = f"ipc://{d}/hs.sock"
        cfg = ClientConfig(input_address=f"ipc://{d}/in.sock", output_address=f"ipc://{d}/out.sock",
                           handshake_timeout=30, silence_timeout=30, send_timeout=10,
                           max_pending_tokens=STALL_PENDING)
        total = a.minutes * 60
        t_start = trio.current_time()
        events: list[str] = []
        engines: list[trio.Process] = []
        gc.collect()
        rss = {"start": rss_mib()}
        workers_scope = trio.CancelScope()
        workers_done = trio.Event()

        async def warm_rss() -> None:
            await trio.sleep(min(60.0, total * 0.1))
            gc.collect()
            rss["warm"] = rss_mib()
            rss["warm_at"] = trio.current_time() - t_start

        async def progress() -> None:
            while True:
                await trio.sleep(60)
                el = trio.current_time() - t_start
                print(f"[{el:5.0f} s] {dict(self.counts)} failures={dict(self.failures)} "
                      f"expected={dict(self.expected_failures)} rss={rss_mib():.1f} MiB "
                      f"engine_rss={rss_mib(engines[-1].pid):.1f} MiB", file=sys.stderr, flush=True)

        async def run_workers() -> None:
            with workers_scope:
                async with trio.open_nursery() as w:
                    for _ in range(a.concurrency):
                        w.start_soon(self.worker)
            workers_done.set()

        async def serve_until(client, t_end: float) -> None:
            with trio.move_on_at(t_end):
                cause = await client.wait_dead()
                self.failures[f"unexpected_engine_death[{cause.reason}]"] += 1
                await trio.sleep_until(t_end)

        async def fresh_engine():
            engines.append(await self.start_engine(hs))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(progress)
                nursery.start_soon(warm_rss)
                nursery.start_soon(run_workers)
                # phase 1: the first engine, until 50 %
                await fresh_engine()
                async with connect(hs, config=cfg) as client:
                    self.publish(client)
                    await serve_until(client, t_start + total * 0.5)
                    self.intentional.add(self.gen)
                    t0 = trio.current_time()
                    os.killpg(engines[-1].pid, signal.SIGKILL)
                    cause = await client.wait_dead()
                    detect = trio.current_time() - t0
                    self.publish(None)
                await engines[-1].wait()
                # phase 2: a new engine process; fresh handshake on the same fixed addresses
                await fresh_engine()
                async with connect(hs, config=cfg) as client:
                    events.append(f"engine SIGKILL@{t0 - t_start:.0f}s (death '{cause.reason}' after "
                                  f"{detect * 1e3:.0f} ms) -> new engine + fresh handshake, serving after "
                                  f"{(trio.current_time() - t0) * 1e3:.0f} ms")
                    self.publish(client)
                    await serve_until(client, t_start + total * 0.75)
                    session = client.session
                    self.intentional.add(self.gen)
                    self.publish(None)
                # phase 3: the same engine, a new client re-attached without a handshake
                t0 = trio.current_time()
                async with connect(config=cfg, resume=session) as client:
                    events.append(f"client closed and re-attached@{t0 - t_start:.0f}s "
                                  f"(resume= serving after {(trio.current_time() - t0) * 1e3:.0f} ms)")
                    self.publish(client)
                    await serve_until(client, t_start + total)
                    # Stop the load: every open stream aborts on its way out.
                    workers_scope.cancel()
                    await workers_done.wait()
                    result = await self.finish(client, engines, rss, events, trio.current_time() - t_start)
                nursery.cancel_scope.cancel()
        finally:
            for p in engines:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(d, ignore_errors=True)
        return result

    async def finish(self, client, engines, rss, events, seconds) -> str:
        # (a leak on an earlier client died with it; only this client's matter)
        live_leaks = [rid for rid in self.aenter_leaks if client.protocol.is_live(rid)]
        # Leaked by a stream entry (reported below): no caller holds their stream, so
        # the sans-IO core aborts them by id, which only a diagnostic may do.
        client.protocol.abort(live_leaks)
        inflight = client.protocol.inflight
        # queued behind every ABORT (pending ABORTs are sent first), read in order by the engine
        engine_live = await client.call_utility("zmqd_live_requests", timeout=10)
        stats = await client.call_utility("zmqd_stats", timeout=10)
        gc.collect()
        fails = dict(sorted(self.failures.items()))
        exp = dict(sorted(self.expected_failures.items()))
        c = self.counts
        settled = (c["completed"] + c["fanout_completed"] + c["cancelled"] + c["fanout_cancelled"] + c["utility"]
                   + sum(self.failures.values()) + sum(self.expected_failures.values()))
        return (
            f"soak: {seconds:.0f} s, concurrency {self.args.concurrency}: requests={c['requests']} "
            f"(completed={c['completed']} fanout_completed={c['fanout_completed']} "
            f"cancelled={c['cancelled'] + c['fanout_cancelled']} utility={c['utility']} "
            f"stopped_at_end={c['requests'] - settled}; "
            f"last engine: ADDs={stats['requests_received']} ABORTed ids={stats['aborts_received']}), "
            f"failures={fails or 0} expected_failures={exp}, "
            f"leaked={inflight + engine_live} (client inflight {inflight}, engine live {engine_live}; "
            f"aenter_leaks={self.aenter_leak_total} during the run, {len(live_leaks)} still live at the end "
            f"and aborted before the count), "
            f"rss_start={rss['start']:.1f} MiB rss_warm={rss.get('warm', float('nan')):.1f} MiB "
            f"(at {rss.get('warm_at', 0):.0f} s) "
            f"rss_end={rss_mib():.1f} MiB (engine {rss_mib(engines[-1].pid):.1f} MiB), "
            f"events: {'; '.join(events)}"
        )


class _Leave(Exception):
    pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--step-interval-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.monotonic()
    line = trio.run(Soak(args).run)
    print(line, flush=True)
    print(f"(wall {time.monotonic() - t0:.0f} s)", file=sys.stderr)
    failed = "failures=0 " not in line or "leaked=0 " not in line
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
