"""The benchmark's PNG: throughput and p99 added latency against concurrency.

One line per client. Left: request-ticks/s delivered at saturation (``sat-c*``
cells). Right: p99 added latency (engine send -> consumer receipt) in the paced
cells, where latency means something (at saturation it measures the credit
window's queue). matplotlib is imported here only (the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._common import SERVICE_AUTOGROUP_NICE

__all__ = ["plot", "plot_real"]

_STYLE = {"raw": ("#7f7f7f", "--", "s"), "zmqdispatch": ("#1f77b4", "-", "o"),
          "zmqdispatch-group": ("#2ca02c", "-.", "D"),
          "zmqdispatch-asyncio": ("#ff7f0e", ":", "P"), "vllm": ("#d62728", "-", "^"), "smg": ("#9467bd", "-", "v")}
_LABEL = {"raw": "raw pyzmq+msgpack loop (limit)", "zmqdispatch": "zmqdispatch (a task per stream)",
          "smg": "SMG (Rust gateway)",
          "zmqdispatch-group": "zmqdispatch StreamGroup (one reader task)",
          "zmqdispatch-asyncio": "zmqdispatch.aio under uvloop (an asyncio task per stream)", "vllm": "vLLM AsyncLLM"}


def _series(doc: dict[str, Any], prefix: str, key: Any) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for cell in doc["cells"]:
        if not cell["name"].startswith(prefix):
            continue
        for client, r in cell["results"].items():
            value = key(r["median"])
            if value is not None:
                out.setdefault(client, []).append((cell["concurrency"], value))
    return {c: sorted(v) for c, v in out.items()}


def plot(doc: dict[str, Any], path: Path | str) -> Path:
    """Write the PNG; returns its path. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sat = _series(doc, "sat-", lambda m: m.get("request_ticks_per_s"))
    paced = _series(doc, "paced-", lambda m: (m.get("latency_ms") or {}).get("p99"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for client, points in sat.items():
        color, ls, marker = _STYLE.get(client, ("k", "-", "x"))
        left.plot([c for c, _ in points], [v for _, v in points], ls, color=color, marker=marker,
                  label=_LABEL.get(client, client))
    left.set(xscale="log", yscale="log", xlabel="concurrent streams C",
             ylabel="request-ticks/s delivered", title="Saturation throughput (higher is better)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    for client, points in paced.items():
        color, ls, marker = _STYLE.get(client, ("k", "-", "x"))
        right.plot([c for c, _ in points], [v for _, v in points], ls, color=color, marker=marker,
                   label=_LABEL.get(client, client))
        for c, v in points:
            right.annotate(f"{v:.2f}" if v < 10 else f"{v:.0f}", (c, v), textcoords="offset points",
                           xytext=(6, 2), fontsize=7, color=color)
    right.set(xscale="log", yscale="log", xlabel="concurrent streams C (C=100: 5 ms/step, C=1000: 10 ms/step)",
              ylabel="p99 added latency, ms", title="Paced engine: p99 added latency (lower is better)")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    machine = doc.get("machine", {})
    fig.suptitle(f"zmqdispatch transport benchmark: {machine.get('cpu', '?')}, {machine.get('cpus', '?')} cores, "
                 f"Python {machine.get('python', '?')}; medians of {doc['settings']['rounds']} interleaved rounds",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_real(doc: dict[str, Any], path: Path | str) -> Path:
    """The real-engine comparison's PNG: per topology and client, tokens/s,
    TTFT p50 and the share of tokens delivered as a delta of their own (bars:
    medians over the rounds, dots: the rounds). Raises ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = doc["real_engine"]
    topologies = list(real["results"])
    clients = list(dict.fromkeys(c for by in real["results"].values() for c in by))
    panels: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
        ("tokens/s (higher is better)", lambda m: m.get("tokens_per_s")),
        ("TTFT p50, ms (lower is better)", lambda m: (m.get("ttft_ms") or {}).get("p50")),
        ("tokens delivered as their own delta, % (higher is better)",
         lambda m: None if m.get("separate_delta_fraction") is None else 100 * m["separate_delta_fraction"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4.2))
    width = 0.8 / max(1, len(clients))
    for ax, (title, key) in zip(axes, panels):
        for j, client in enumerate(clients):
            color = _STYLE.get(client, ("k",))[0]
            xs, heights = [], []
            for i, topology in enumerate(topologies):
                r = real["results"][topology].get(client)
                if not r:
                    continue
                x = i + (j - (len(clients) - 1) / 2) * width
                value = key(r["median"])
                if value is not None:
                    xs.append(x)
                    heights.append(value)
                points = [key(x_) for x_ in r["rounds"] if "error" not in x_]
                points = [p for p in points if p is not None]
                ax.plot([x] * len(points), points, ".", color="k", markersize=3, zorder=3)
            ax.bar(xs, heights, width, color=color, alpha=0.8, label=_LABEL.get(client, client))
        ax.set_xticks(range(len(topologies)))
        ax.set_xticklabels([{"launched": "engine in the\nclient's session",
                             "service": "engine in a\nsession of its own",
                             "service-niced": f"its own session,\nautogroup nice {SERVICE_AUTOGROUP_NICE}"}.get(t, t)
                            for t in topologies],
                           fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    machine = doc.get("machine", {})
    fig.suptitle(f"Real vLLM EngineCore (tiny model, CPU): {real['sequences']} sequences x "
                 f"{real['max_tokens']} tokens; "
                 f"{machine.get('cpu', '?')}, {machine.get('cpus', '?')} cores; medians of {real['rounds']} rounds "
                 "(dots: rounds)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
