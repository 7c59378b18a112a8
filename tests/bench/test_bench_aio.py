"""``zmqdispatch bench --clients zmqdispatch-asyncio`` end to end at a tiny size:
the asyncio runner answers the throughput cells with well-formed figures and
is skipped, with its reason, in the others (the machinery, never the speed)."""

from __future__ import annotations

import math

from zmqdispatch import cli
from zmqdispatch.bench import _common as common
from zmqdispatch.bench import harness


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_the_asyncio_runner_measures_the_throughput_cells(tmp_path) -> None:
    args = cli._build_parser().parse_args([
        "bench", "--rounds", "1", "--seconds", "0.2", "--warmup", "0.05", "--concurrency", "1", "4",
        "--no-paced", "--idle-streams", "40", "--clients", "zmqdispatch", "zmqdispatch-asyncio", "--no-plot",
        "--no-progress", "--output-dir", str(tmp_path / "out"),
    ])
    settings = harness.BenchSettings(args)
    settings.cells.append(common.cell_settings({
        "name": "slowmix-c6-2ms", "concurrency": 6, "step_interval_ms": 2.0, "slow_fraction": 0.5,
        "slow_delay_ms": 5.0, "seconds": 0.3, "warmup_s": 0.05, "window": harness.window_for(6),
    }))
    doc = harness.run(settings, out=lambda _: None)
    assert set(doc["runners"]) == {"zmqdispatch", "zmqdispatch-asyncio"}
    for cell in doc["cells"]:
        m = cell["results"]["zmqdispatch-asyncio"]["median"]
        assert "error" not in m, m
        if cell["kind"] != "throughput":
            assert "skipped" in m and "throughput cells" in m["skipped"]
            continue
        for key in ("request_ticks_per_s", "cpu_us_per_tick", "deliveries_per_tick", "wall_s"):
            assert _is_number(m[key]), (cell["name"], key, m[key])
        assert m["ticks"] > 0 and m["tokens"] == m["ticks"]
        assert m["latency_ms"]["samples"] > 0
        if cell["slow_fraction"]:
            assert m["latency_slow_ms"]["samples"] > 0
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| sat-c4 | zmqdispatch-asyncio |" in md
