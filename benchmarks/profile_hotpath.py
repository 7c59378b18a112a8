#!/usr/bin/env python3
"""Where zmqdispatch's CPU goes in one benchmark cell: py-spy, summarized.

Starts the zmqdispatch benchmark runner (``zmqdispatch.bench.run_zmqdispatch``,
with its benchmark engine), sends it one cell, and while the cell's
measurement window runs, samples the runner with ``py-spy record`` (on-CPU
samples only, ``--nonblocking`` so the process is never paused). Then it
prints, from the collapsed stacks:

- self time by area (the file of the innermost Python frame: msgpack and
  pyzmq C code counts toward the Python function that called it);
- inclusive time of the hot-path functions (a sample counts once for each
  function on its stack);
- the top functions by self time.

    pip install py-spy
    python benchmarks/profile_hotpath.py --concurrency 1000                       # saturation
    python benchmarks/profile_hotpath.py --concurrency 100 --step-interval-ms 5   # paced
    python benchmarks/profile_hotpath.py --concurrency 1000 --group               # the StreamGroup client
    python benchmarks/profile_hotpath.py ... --json out.json --raw stacks.txt

The sampling starts ``--settle`` seconds after the cell was sent (streams
opened, first outputs, warm-up) and lasts ``--duration`` seconds, inside the
cell's ``--seconds`` window.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

#: (area, regex on the frame's file) in order; the first match names the area. attrs
#: generated methods name their class ("<attrs generated methods trio._core...>").
AREAS = [
    ("wire decode (zmqdispatch/wire)", r"zmqdispatch[/.]wire[/.]"),
    ("routing (protocol/routing.py, engine.py)", r"zmqdispatch[/.]protocol[/.](routing|engine)"),
    ("mailbox merge/put/take + OutputDelta (protocol/mailbox.py)", r"zmqdispatch[/.]protocol[/.]mailbox"),
    ("client shell: pumps, _park (client.py)", r"zmqdispatch[/.]client"),
    ("socket recv (_zmq_trio.py)", r"zmqdispatch[/.]_zmq_trio"),
    ("streams (request_stream.py, stream_group.py, sample_stream.py)",
     r"zmqdispatch[/.](streams|request_stream|sample_stream|stream_group)"),
    ("benchmark consumer loop + acks (bench/)", r"zmqdispatch[/.]bench[/.]"),
    ("trio scheduler, traps, outcome", r"(^|[/ ])(trio|outcome)[/.]"),
    ("pyzmq (recv_multipart)", r"(^|/)zmq/"),
]

#: Hot-path functions whose inclusive share is reported: (label, qualified name, file regex).
HOT = [
    ("output pump (EngineClient._output_pump)", "EngineClient._output_pump", r"client\.py"),
    ("  recv_batch (TrioSocket.recv_batch)", "TrioSocket.recv_batch", r"_zmq_trio\.py"),
    ("  EngineProtocol.frames_received", "OutputRouting.frames_received", r"protocol/routing\.py"),
    ("    decode_outputs (msgpack + row checks)", "decode_outputs", r"wire/vllm\.py"),
    ("    EngineProtocol._route", "OutputRouting._route", r"protocol/routing\.py"),
    ("      Mailbox.put (merge + wake)", "Mailbox.put", r"protocol/mailbox\.py"),
    ("        wake: the stream's waiter -> trio reschedule", "RequestStream._wake", r"request_stream\.py"),
    ("consumer side: RequestStream.__anext__", "RequestStream.__anext__", r"request_stream\.py"),
    ("  RequestStream._receive", "RequestStream._receive", r"request_stream\.py"),
    ("  park (wait_task_rescheduled)", "wait_task_rescheduled", r"trio/_core/_traps\.py"),
    ("consumer task (bench consume, inclusive)", "Runner.throughput.<locals>.consume", r"bench/run_zmqdispatch\.py"),
    ("benchmark acks (Acker.delivered)", "Acker.delivered", r"bench/_common\.py"),
    ("StreamGroup.receive (group reader)", "StreamGroup.receive", r"stream_group\.py"),
    ("trio run loop (unrolled_run)", "unrolled_run", r"trio/_core/_run\.py"),
]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def parse_collapsed(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """``[(frames (func, file) outermost first, count)]`` from py-spy ``-f raw`` output."""
    stacks = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        frames = []
        for part in stack.split(";"):
            m = _FRAME.match(part)
            frames.append((m.group("func"), m.group("file")) if m else (part, ""))
        stacks.append((frames, int(count)))
    return stacks


def area_of(file: str) -> str:
    for name, pattern in AREAS:
        if re.search(pattern, file):
            return name
    return "other (stdlib, GC)"


def summarize(stacks: list[tuple[list[tuple[str, str]], int]]) -> dict:
    total = sum(c for _, c in stacks) or 1
    by_area: Counter[str] = Counter()
    by_func: Counter[str] = Counter()
    hot: Counter[str] = Counter()
    for frames, count in stacks:
        func, file = frames[-1]
        by_area[area_of(file)] += count
        by_func[f"{func} ({file})"] += count
        for label, name, pattern in HOT:
            if any(f == name and re.search(pattern, fl) for f, fl in frames):
                hot[label] += count
    pct = lambda n: round(100.0 * n / total, 1)  # noqa: E731
    return {
        "samples": total,
        "self_by_area_pct": {a: pct(n) for a, n in by_area.most_common()},
        "inclusive_hot_path_pct": {label: pct(hot[label]) for label, _, _ in HOT},
        "top_self_functions_pct": {f: pct(n) for f, n in by_func.most_common(25)},
    }


def print_summary(title: str, s: dict) -> None:
    print(f"\n## {title} ({s['samples']} on-CPU samples)\n")
    print("| self time by area | % |\n|---|---:|")
    for a, p in s["self_by_area_pct"].items():
        print(f"| {a} | {p} |")
    print("\n| inclusive, hot path | % |\n|---|---:|")
    for a, p in s["inclusive_hot_path_pct"].items():
        print(f"| {a} | {p} |")
    print("\n| top functions, self | % |\n|---|---:|")
    for f, p in list(s["top_self_functions_pct"].items())[:15]:
        print(f"| `{f}` | {p} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--step-interval-ms", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=12.0, help="the cell's measurement window")
    ap.add_argument("--settle", type=float, default=4.0, help="seconds before sampling starts")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of sampling")
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--group", action="store_true", help="profile the StreamGroup client (one reader task)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--raw", help="keep py-spy's collapsed stacks here")
    args = ap.parse_args()
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(py_spy):
        sys.exit("py-spy not found: pip install py-spy")

    window = max(16 * args.concurrency, 4096)  # harness.window_for
    cell = {"name": "profile", "concurrency": args.concurrency, "step_interval_ms": args.step_interval_ms,
            "seconds": args.seconds, "warmup_s": 1.0, "window": window}
    runner = subprocess.Popen([sys.executable, "-m", "zmqdispatch.bench.run_zmqdispatch",
                               *(["--group"] if args.group else [])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tmp = tempfile.mkdtemp(prefix="zmqd-profile-")
    raw_path = args.raw or os.path.join(tmp, "stacks.txt")
    try:
        ready = json.loads(runner.stdout.readline())
        assert ready["event"] == "ready", ready
        runner.stdin.write(json.dumps({"op": "cell", "cell": cell}) + "\n")
        runner.stdin.flush()
        time.sleep(args.settle)
        subprocess.run([py_spy, "record", "--pid", str(runner.pid), "--rate", str(args.rate), "--duration",
                        str(int(args.duration)), "--nonblocking", "-f", "raw", "-o", raw_path],
                       check=True, stdout=subprocess.DEVNULL)
        result = json.loads(runner.stdout.readline())
        runner.stdin.write('{"op": "quit"}\n')
        runner.stdin.flush()
        runner.wait(60)
    finally:
        if runner.poll() is None:
            runner.kill()
    with open(raw_path) as f:
        summary = summarize(parse_collapsed(f.read()))
    r = result.get("result", {})
    summary["cell"] = cell
    summary["figures"] = {k: r.get(k) for k in ("request_ticks_per_s", "cpu_us_per_tick", "deliveries_per_tick",
                                                "latency_ms", "cpu_util", "gc_share_of_cpu", "gc_collections",
                                                "gc_max_pause_ms")}
    title = (f"zmqdispatch{' StreamGroup' if args.group else ''}, C={args.concurrency}, "
             + (f"one step per {args.step_interval_ms:g} ms" if args.step_interval_ms else "saturation"))
    print(f"{title}: {json.dumps(summary['figures'])}")
    print_summary(title, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
