"""Benchmark runner: the limit, a raw pyzmq + msgpack loop with no routing.

It binds the input ROUTER and output PULL itself (the benchmark engine dials
them directly), sends the ADDs (encoded with :mod:`zmqdispatch.wire`, outside
the measurement), then for the whole window does only this: drain the PULL
socket in batches, ``msgpack.unpackb`` each message (arrays as tuples), count
its rows and tokens, and take one latency sample per message (every row of a
message is received at the same instant). No per-request state, no consumer
tasks: what any client on this machine would pay at least for receiving and
decoding.

    python -m zmqdispatch.bench.run_raw

Commands and answers: JSON lines (:mod:`._common`). ``idle_rss`` and slow
consumers do not apply (no streams): they answer ``{"skipped": ...}``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
from typing import Any

import msgpack
import zmq

from ..wire import vllm as wire
from . import _common as common

_ADD = bytes([wire.RequestType.ADD])
_ABORT = bytes([wire.RequestType.ABORT])


class RawLoop:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], tmp: common.PrivateDir) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        inp, outp, ctl = tmp.ipc("input.sock"), tmp.ipc("output.sock"), tmp.ipc("control.sock")
        self.router.bind(inp)
        self.pull.bind(outp)
        self.engine = subprocess.Popen(
            common.engine_argv(sys.executable, control=ctl, input_address=inp, output_address=outp),
            stdin=subprocess.DEVNULL,
        )
        if not self.router.poll(60_000):
            raise TimeoutError("the bench engine sent no ready response within 60 s")
        self.identity, _ready = self.router.recv_multipart()
        self.ctl = common.Control(ctx, ctl)
        self.acker = common.Acker(ctl)
        self.cell_no = 0

    def close(self) -> None:
        try:
            self.ctl.request("stop", timeout=2)
        except Exception:
            pass
        self.ctl.close()
        self.acker.close()
        self.router.close(0)
        self.pull.close(0)
        self.engine.terminate()
        try:
            self.engine.wait(5)
        except subprocess.TimeoutExpired:
            self.engine.kill()

    def _drain_quietly(self, quiet: float = 0.1) -> None:
        while self.pull.poll(int(quiet * 1000)):
            while True:
                try:
                    self.pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    def throughput(self, cell: dict[str, Any]) -> dict[str, Any]:
        if cell["slow_fraction"] > 0:
            return {"client": "raw", "cell": cell["name"], "skipped": "no per-request consumers in the raw loop"}
        self.cell_no += 1
        adds, epoch = self.ctl.hold(cell["tokens_per_tick"])
        acker = self.acker
        acker.start(epoch, cell["window"])
        c = cell["concurrency"]
        ids = [f"r{self.cell_no}-{i}" for i in range(c)]
        for i, rid in enumerate(ids):
            req = wire.EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=tuple(common.prompt_tokens(cell["prompt_len"], i)),
                sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=cell["max_tokens"], ignore_eos=True),
                arrival_time=time.time(),
            )
            self.router.send_multipart([self.identity, _ADD, *wire.encode_request(req)])
        self.ctl.wait_adds(adds + c)
        assert self.ctl.run(cell)["epoch"] == epoch

        tally = common.Tally()
        pull, unpackb, monotonic = self.pull, msgpack.unpackb, time.monotonic
        lat = tally.latency
        poll = pull.poll
        recv = pull.recv_multipart
        noblock = zmq.NOBLOCK

        def run_until(deadline: float, measuring: bool, until_rows: int = 0) -> int:
            """Receive, decode, count until *deadline* (or a message of *until_rows* rows)."""
            last_rows = 0
            while True:
                now = monotonic()
                if now >= deadline:
                    return last_rows
                if not poll(max(1, int((deadline - now) * 1000))):
                    continue
                for _ in range(256):
                    try:
                        frames = recv(noblock)
                    except zmq.Again:
                        break
                    msg = unpackb(frames[0], use_list=False)
                    rows = msg[1]
                    n = len(rows)
                    if measuring:
                        lat.append(monotonic() - msg[3])
                        tokens = 0
                        for row in rows:
                            tokens += len(row[1])
                        tally.tokens += tokens
                        tally.ticks += n
                        tally.deliveries += n
                    acker.delivered(n)
                    last_rows = n
                    if until_rows and last_rows >= until_rows:
                        return last_rows
                    if monotonic() >= deadline:
                        return last_rows

        # Warm-up: until one message covers every stream, then warmup_s.
        ramp_deadline = monotonic() + 120
        if run_until(ramp_deadline, False, until_rows=c) < c:
            raise TimeoutError(f"no message covered all {c} requests within 120 s")
        run_until(monotonic() + cell["warmup_s"], False)
        self.ctl.request("mark")
        with tally.gc:
            cpu0, t0 = time.process_time(), monotonic()
            run_until(t0 + cell["seconds"], True)
            cpu1, t1 = time.process_time(), monotonic()
        stats = self.ctl.request("stats")
        self.router.send_multipart([self.identity, _ABORT, wire.encode_abort(ids)])
        while self.ctl.request("stats")["running"]:
            self._drain_quietly(0.05)
        self._drain_quietly()
        return common.throughput_result("raw", cell, tally, wall=t1 - t0, cpu=cpu1 - cpu0, engine=stats)


def main() -> int:
    out = common.protocol_stream()
    tmp = common.PrivateDir()
    ctx = zmq.Context()
    loop = RawLoop(ctx, tmp)
    try:
        loop.throughput(common.cell_settings({"name": "warmup", "concurrency": 10, "seconds": 0.3,
                                              "warmup_s": 0.1, "window": 256}))
        gc_policy = common.settle_gc()
        common.emit(out, "ready", info={"client": "raw", "gc": gc_policy, "python": sys.version.split()[0],
                                        "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                                        "msgpack": ".".join(map(str, msgpack.version))})
        while True:
            cmd = common.read_command()
            if cmd["op"] == "quit":
                break
            try:
                cell = common.cell_settings(cmd["cell"])
                if cell["kind"] == "idle_rss":
                    result = {"client": "raw", "cell": cell["name"],
                              "skipped": "the raw loop keeps no per-stream state"}
                else:
                    result = loop.throughput(cell)
                common.emit(out, "result", result=result)
            except Exception:
                common.emit(out, "error", error=traceback.format_exc())
    finally:
        loop.close()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
