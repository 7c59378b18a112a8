"""The many-engine cells of ``zmqdispatch bench`` at a tiny size: structure and invariants, never speed.

Each cell runs its own fleet of benchmark engine processes behind one
``MultiEngineClient``; these tests assert the shape of the results and what
must hold whatever the machine's load (balances that add up, nothing lost,
no failure on the engines that stay up, the killed engine left alone).
"""

from __future__ import annotations

import json
import math

import pytest

from zmqdispatch import cli
from zmqdispatch.bench import _common as common
from zmqdispatch.bench import harness


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _settings(tmp_path, *extra: str) -> harness.BenchSettings:
    args = cli._build_parser().parse_args([
        "bench", "--rounds", "1", "--seconds", "0.3", "--warmup", "0.1", "--idle-streams", "40",
        "--clients", "raw", "zmqdispatch", "--no-plot", "--no-progress", "--output-dir", str(tmp_path / "out"),
        *extra,
    ])
    return harness.BenchSettings(args)


def _tiny(settings: harness.BenchSettings) -> None:
    """Shrink the real-size many-engine cells (2-3 engines, a few streams)."""
    sizes = {
        "many_sat": {"engines": 2, "concurrency": 8},
        "many_balance": {"engines": 3, "concurrency": 9, "mean_tokens": 4},
        "many_death": {"engines": 3, "concurrency": 12, "step_interval_ms": 2.0, "after_s": 0.1},
        "many_idle_rss": {"engines": 2},
    }
    settings.cells = [common.cell_settings({**c, **sizes[c["kind"]]}) for c in settings.cells]


def test_many_cells_are_opt_in_and_named() -> None:
    parser = cli._build_parser()
    default = harness.BenchSettings(parser.parse_args(["bench"]))
    assert not any(c["kind"].startswith("many_") for c in default.cells)
    picked = harness.BenchSettings(parser.parse_args(["bench", "--cells", "many4", "sat-c1"]))
    assert [c["name"] for c in picked.cells] == ["sat-c1", "many4-sat-c1000", "many4-balance", "many4-death",
                                                 "many4-idle-rss"]
    assert {c["engines"] for c in picked.cells if c["kind"].startswith("many_")} == {4}
    assert harness.BenchSettings(parser.parse_args(["bench", "--cells", "none"])).cells == []
    with pytest.raises(ValueError, match=r"no cell named many5-death; known: .*many4-death"):
        harness.BenchSettings(parser.parse_args(["bench", "--cells", "many5-death"]))


def test_unknown_cell_name_exits_2(capsys) -> None:
    assert cli.main(["bench", "--cells", "sat-c7"]) == 2
    assert "no cell named sat-c7" in capsys.readouterr().err


def test_many_engine_cells_end_to_end(tmp_path) -> None:
    settings = _settings(tmp_path, "--cells", "many4")
    _tiny(settings)
    lines: list[str] = []
    doc = harness.run(settings, out=lines.append)
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == json.loads(json.dumps(doc))
    # the raw loop runs none of these cells: no runner was started for it
    assert set(doc["runners"]) == {"zmqdispatch"}
    cells = {c["kind"]: c for c in doc["cells"]}
    assert set(cells) == {"many_sat", "many_balance", "many_death", "many_idle_rss"}
    for cell in doc["cells"]:
        assert "skipped" in cell["results"]["raw"]["median"]
        assert "vLLM's data-parallel client is not wired up" in cell["results"]["raw"]["median"]["skipped"]
        assert "error" not in cell["results"]["zmqdispatch"]["median"], cell["results"]["zmqdispatch"]

    sat = cells["many_sat"]["results"]["zmqdispatch"]["median"]
    assert sat["engines"] == 2 and sorted(sat["order"]) == [1, 2]
    one, many = sat["one_engine"], sat["many_engines"]
    assert one["engines"] == 1 and many["engines"] == 2
    for fig in (one, many):
        assert fig["ticks"] > 0 and _is_number(fig["request_ticks_per_s"]) and _is_number(fig["cpu_us_per_tick"])
        # every stream was placed (held engines: exactly C requests in all), and the ticks add up
        assert sum(fig["requests_per_engine"]) == 8
        assert sum(fig["ticks_per_engine"]) == fig["ticks"]
        assert fig["client_fds"] > 0
    assert many["requests_per_engine"] == [4, 4]  # all entered on held engines: least loaded spreads them evenly
    assert sat["ratio"] == pytest.approx(many["request_ticks_per_s"] / one["request_ticks_per_s"])

    bal = cells["many_balance"]["results"]["zmqdispatch"]["median"]
    assert bal["failures"] == 0 and bal["failure_examples"] == []
    assert len(bal["requests_per_engine"]) == 3 and sum(bal["requests_per_engine"]) == bal["requests"] > 0
    assert sum(bal["tokens_per_engine"]) == bal["tokens"] > 0
    assert min(bal["requests_per_engine"]) > 0 and bal["requests_most_over_least"] >= 1.0
    # nothing lost: every placed request was read to its end and reached its engine
    assert bal["requests_completed"] == bal["requests_placed"] == bal["engine_adds"] >= bal["requests"]

    death = cells["many_death"]["results"]["zmqdispatch"]["median"]
    # SIGKILL: the socket's disconnect, or the link's liveness rule when that is seen first on a busy machine
    assert death["victim"] == 2 and death["death_reason"] in ("disconnected", "unreachable"), death
    assert death["victim_requests"] >= 4  # its share of the long streams, at least
    assert death["victim_failed"] >= 4 and death["victim_other_outcomes"] == 0
    assert death["out_of_placement_ms"] > 0 and death["last_failed_ms"] > 0
    assert death["placed_on_victim_after_out"] == 0
    assert death["survivor_failures"] == 0 and death["survivor_ticks_after_kill"] > 0
    assert death["new_requests_refused"] == 0 and sum(death["new_requests_per_engine"]) == death["new_requests"]

    idle = cells["many_idle_rss"]["results"]["zmqdispatch"]["median"]
    assert idle["streams"] == 40 and idle["streams_per_engine"] == [20, 20]
    assert _is_number(idle["rss_per_stream_bytes"]) and idle["python_bytes_per_stream"] > 0

    md = (tmp_path / "out" / "bench.md").read_text()
    for name in ("many4-sat-c1000", "many4-balance", "many4-death", "many4-idle-rss"):
        assert f"| {name} | zmqdispatch |" in md
    assert "| many4-balance | raw |" not in md  # skipped clients are not rows
    assert "not wired up here" in md and md.strip() in "\n".join(lines)
