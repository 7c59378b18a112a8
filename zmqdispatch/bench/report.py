"""What ``zmqdispatch bench`` prints and writes (:mod:`.harness` runs it): the
progress bar (tqdm when installed, else one line per step on stderr), the one
line of each result, and the Markdown tables of the medians (stdout and
``bench.md``; the real-engine tables are :func:`.real.format_real`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from . import real as real_mod

__all__ = ["Progress", "format_many", "format_tables", "one_line"]


class Progress:
    """tqdm when installed (the ``bench`` extra), else one line per step on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.done = 0
        self.total = total
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="cell", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text)

    def advance(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def one_line(cell: dict[str, Any], res: dict[str, Any]) -> str:
    """The progress line of one result *res* of *cell*."""
    client = res.get("client", "?")
    if "error" in res:
        return f"{cell['name']} {client}: ERROR {res['error']}"
    if "skipped" in res:
        return f"{cell['name']} {client}: skipped ({res['skipped']})"
    if cell["kind"] == "idle_rss":
        return f"{cell['name']} {client}: {res['rss_per_stream_bytes']:,.0f} B/stream"
    if cell["kind"] == "many_sat":
        one, many = res["one_engine"], res["many_engines"]
        return (f"{cell['name']} {client}: {_fmt(many['request_ticks_per_s'], ',.0f')} req-ticks/s on "
                f"{res['engines']} engines, {_fmt(one['request_ticks_per_s'], ',.0f')} on 1 "
                f"({_fmt(res['ratio'], '.2f')}x); requests per engine {_per_engine(many['requests_per_engine'])}")
    if cell["kind"] == "many_balance":
        return (f"{cell['name']} {client}: requests per engine {_per_engine(res['requests_per_engine'])}, "
                f"tokens {_per_engine(res['tokens_per_engine'])}, failures {res['failures']}")
    if cell["kind"] == "many_death":
        return (f"{cell['name']} {client}: out of placement {_fmt(res['out_of_placement_ms'], '.1f')} ms, last "
                f"request failed {_fmt(res['last_failed_ms'], '.1f')} ms after the kill; placed on it after: "
                f"{res['placed_on_victim_after_out']}, survivor failures {res['survivor_failures']}")
    if cell["kind"] == "many_idle_rss":
        return (f"{cell['name']} {client}: {res['rss_per_stream_bytes']:,.0f} B/stream RSS, "
                f"{_fmt(res['python_bytes_per_stream'], ',.0f')} B Python")
    if cell["kind"] == "burst":
        return (f"{cell['name']} {client}: longest wait {_fmt(res['max_wait_ms'], '.1f')} ms, "
                f"p99 {_fmt(res['latency_ms']['p99'], '.2f')} ms, burst served in {_fmt(res['admit_ms'], '.0f')} ms")
    lat = res["latency_ms"]
    return (f"{cell['name']} {client}: {_fmt(res['request_ticks_per_s'], ',.0f')} req-ticks/s, "
            f"{_fmt(res['cpu_us_per_tick'], '.2f')} us/tick, p99 {_fmt(lat['p99'], '.2f')} ms")


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def _per_engine(values: Any) -> str:
    return " / ".join(f"{v:,}" for v in values) if isinstance(values, list) else "-"


def _rounds_of(r: dict[str, Any], key: Callable[[dict[str, Any]], Any]) -> str:
    """One figure of every good round, "; " between rounds."""
    return "; ".join(_per_engine(key(x)) for x in r["rounds"] if "error" not in x and "skipped" not in x) or "-"


def format_many(doc: dict[str, Any]) -> str:
    """Markdown tables of the many-engine cells ("" when none ran)."""
    sat = ["| cell | client | engines | request-ticks/s, 1 engine | request-ticks/s, N engines | × 1 engine "
           "| CPU µs/tick, 1 / N | client fds, 1 / N | requests per engine (each round) "
           "| request-ticks per engine, most / least |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    bal = ["| cell | client | engines | requests/s | requests per engine (each round) | most / least "
           "| tokens per engine (each round) | most / least | failures |",
           "|---|---|---:|---:|---|---:|---|---:|---:|"]
    death = ["| cell | client | engines | requests on the killed engine | out of placement ms "
             "| its last request failed ms | its last placement ms | placed on it after | failures on the others "
             "| others' request-ticks after the kill | reason |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    idle = ["| cell | client | engines | idle streams | per engine | RSS per stream | Python allocations per stream |",
            "|---|---|---:|---:|---|---:|---:|"]
    for cell in doc["cells"]:
        kind = cell["kind"]
        if not kind.startswith("many_"):
            continue
        for client, r in cell["results"].items():
            m = r["median"]
            head = f"| {cell['name']} | {client} | {cell['engines']} "
            if "error" in m or "skipped" in m:
                if "skipped" not in m:  # skipped clients are named in the notes, not in rows
                    {"many_sat": sat, "many_balance": bal, "many_death": death, "many_idle_rss": idle}[kind].append(
                        head + f"| {m['error']} |")
                continue
            if kind == "many_sat":
                one, many = m["one_engine"], m["many_engines"]
                sat.append(head + f"| {_fmt(one['request_ticks_per_s'], ',.0f')} "
                           f"| {_fmt(many['request_ticks_per_s'], ',.0f')} | {_fmt(m['ratio'], '.2f')} "
                           f"| {_fmt(one['cpu_us_per_tick'], '.2f')} / {_fmt(many['cpu_us_per_tick'], '.2f')} "
                           f"| {one['client_fds']:.0f} / {many['client_fds']:.0f} "
                           f"| {_rounds_of(r, lambda x: x['many_engines']['requests_per_engine'])} "
                           f"| {_fmt(many['ticks_most_over_least'], '.2f')} |")
            elif kind == "many_balance":
                bal.append(head + f"| {_fmt(m['requests_per_s'], ',.0f')} "
                           f"| {_rounds_of(r, lambda x: x['requests_per_engine'])} "
                           f"| {_fmt(m['requests_most_over_least'], '.2f')} "
                           f"| {_rounds_of(r, lambda x: x['tokens_per_engine'])} "
                           f"| {_fmt(m['tokens_most_over_least'], '.2f')} | {m['failures']} |")
            elif kind == "many_death":
                death.append(head + f"| {m['victim_requests']:.0f} | {_fmt(m['out_of_placement_ms'], '.1f')} "
                             f"| {_fmt(m['last_failed_ms'], '.1f')} | {_fmt(m['last_placed_ms'], '.1f')} "
                             f"| {m['placed_on_victim_after_out']} | {m['survivor_failures']} "
                             f"| {m['survivor_ticks_after_kill']:,.0f} | {m['death_reason']} |")
            else:
                idle.append(head + f"| {cell['concurrency']:,} "
                            f"| {_rounds_of(r, lambda x: x['streams_per_engine'])} "
                            f"| {m['rss_per_stream_bytes'] / 1024:.2f} KiB "
                            f"| {_fmt(m['python_bytes_per_stream'], ',.0f')} B |")
    tables = [t for t in (sat, bal, death, idle) if len(t) > 2]
    if not tables:
        return ""
    return ("Many engines: zmqdispatch's `MultiEngineClient` (a task per stream) over N benchmark engine processes "
            "dialing one handshake address, on the same cores as the client; vLLM's data-parallel client is not "
            "wired up here. Medians over rounds; per-engine lists: each round's. Death: ms from the SIGKILL "
            "(the runner's clock); \"placed on it after\": requests placed on the killed engine after it left "
            "placement.\n\n" + "\n\n".join("\n".join(t) for t in tables))


def format_tables(doc: dict[str, Any]) -> str:
    """Markdown tables of the medians (throughput cells, idle RSS, real engine)."""
    lines = [
        "| cell | client | request-ticks/s | tokens/s | deliveries/tick | p50 ms | p99 ms | p99.9 ms "
        "| CPU µs/tick | × vLLM | engine max request-ticks/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rss_lines = ["| client | idle streams | RSS per idle stream |", "|---|---:|---:|"]
    burst_lines = [
        "| cell | client | running streams | burst | longest wait ms | p99 ms | p50 ms | longest pass CPU ms "
        "| burst served in ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell in doc["cells"]:
        results = cell["results"]
        if cell["kind"].startswith("many_"):
            continue  # format_many
        if cell["kind"] == "burst":
            for client, r in results.items():
                m = r["median"]
                if "max_wait_ms" not in m:
                    burst_lines.append(f"| {cell['name']} | {client} | {m.get('skipped') or m.get('error')} |||||||")
                    continue
                lat = m["latency_ms"]
                burst_lines.append(
                    f"| {cell['name']} | {client} | {cell['concurrency']:,} | {cell['burst']:,} "
                    f"| {_fmt(m['max_wait_ms'], '.1f')} | {_fmt(lat['p99'], '.2f')} | {_fmt(lat['p50'], '.2f')} "
                    f"| {_fmt(m.get('longest_pass_cpu_ms'), '.1f')} | {_fmt(m['admit_ms'], '.0f')} |"
                )
            continue
        if cell["kind"] == "idle_rss":
            for client, r in results.items():
                m = r["median"]
                if "rss_per_stream_bytes" in m:
                    kib = m["rss_per_stream_bytes"] / 1024
                    rss_lines.append(f"| {client} | {cell['concurrency']:,} | {kib:.2f} KiB |")
                else:
                    rss_lines.append(f"| {client} | {cell['concurrency']:,} | {m.get('skipped') or m.get('error')} |")
            continue
        vllm = results.get("vllm", {}).get("median", {}).get("request_ticks_per_s")
        for client, r in results.items():
            m = r["median"]
            if "request_ticks_per_s" not in m:
                lines.append(f"| {cell['name']} | {client} | {m.get('skipped') or m.get('error')} |||||||||")
                continue
            # Saturation latency is the credit window's queue: paced cells only.
            # Slow mix: the consumers that keep up (the slow ones are in the JSON).
            lat = m["latency_ms"] if cell["step_interval_ms"] else {"p50": None, "p99": None, "p999": None}
            ratio = m["request_ticks_per_s"] / vllm if vllm else None
            lines.append(
                f"| {cell['name']} | {client} | {m['request_ticks_per_s']:,.0f} | {m['tokens_per_s']:,.0f} "
                f"| {_fmt(m['deliveries_per_tick'], '.2f')} | {_fmt(lat['p50'], '.2f')} | {_fmt(lat['p99'], '.2f')} "
                f"| {_fmt(lat['p999'], '.2f')} | {_fmt(m['cpu_us_per_tick'], '.2f')} | {_fmt(ratio, '.2f')} "
                f"| {_fmt(m['engine']['max_request_ticks_per_s'], ',.0f')} |"
            )
    throughput_rows = len(lines) > 2
    runtime = doc.get("settings", {}).get("runtime", "vllm")
    lines.append("")
    if runtime == "vllm":
        lines.append("Latency: engine send (`EngineCoreOutputs.timestamp`) to consumer receipt, paced cells only "
                     "(slow mix: the consumers that keep up). CPU: the client process, all threads. "
                     "× vLLM: request-ticks/s over vLLM's.")
    else:
        lines.append(f"Runtime: {runtime} (its wire end to end: handshake, requests, per-step batches). Latency: "
                     "engine send of the step (the engine's step table; these batches carry no timestamp) to "
                     "consumer receipt, paced cells only (slow mix: the consumers that keep up). CPU: the client "
                     "process, all threads.")
    out = "\n".join(lines) if throughput_rows or not doc["cells"] else ""
    skipped = doc.get("skipped") or {}
    if skipped:
        out += "\n\nSkipped clients:\n\n" + "\n".join(f"- {why}" for why in skipped.values())
    if len(burst_lines) > 2:
        out += ("\n\nAdmission under load: while the running streams get one tick per step, `burst` requests "
                "enter at once; the running streams' wait for a tick (engine send to consumer receipt) while "
                "the bursts are admitted and served (medians over rounds of each round's longest wait and "
                "percentiles); longest pass: the CPU time of the longest event-loop pass meanwhile (what a "
                "burst holds every stream back on an idle machine).\n\n" + "\n".join(burst_lines))
    if len(rss_lines) > 2:
        out += "\n\n" + "\n".join(rss_lines)
    many = format_many(doc)
    if many:
        out += "\n\n" + many
    real = doc.get("real_engine")
    if real:
        out += "\n\n" + real_mod.format_real(real)
    return out.lstrip("\n")
