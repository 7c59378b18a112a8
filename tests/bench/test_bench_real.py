"""The real-engine comparison's machinery (``zmqdispatch bench --real-engine``): structure, never speed.

Runs without vLLM: the runners and the service engine are replaced by fakes
that answer what a runner would (figures built by the real
``_common.real_result`` from synthetic delivery logs). The ``real_engine``
test at the end runs the real thing at a tiny size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest

from zmqdispatch import cli
from zmqdispatch.bench import _common as common
from zmqdispatch.bench import _schedstat, harness, real


def _log(submitted: float, recv: list[float], tokens: list[int], engine_ts: list[float] | None = None):
    log = common.StreamLog()
    log.submitted = submitted
    log.recv.extend(recv)
    log.tokens.extend(tokens)
    if engine_ts is not None:
        log.engine_ts.extend(engine_ts)
    return log


def test_real_result_ttft_itl_and_merging_from_delivery_logs() -> None:
    # stream A: 4 tokens, each its own delivery, 10 ms apart; first after 50 ms
    a = _log(0.0, [0.05, 0.06, 0.07, 0.08], [1, 1, 1, 1], engine_ts=[0.04, 0.05, 0.06, 0.07])
    # stream B: 4 tokens in 2 deliveries (1, then 3 merged after a 300 ms stall)
    b = _log(0.0, [0.10, 0.40], [1, 3])
    r = common.real_result("x", "service", [a, b], wall=2.0, cpu=0.004)
    assert r["client"] == "x" and r["topology"] == "service" and r["streams"] == 2
    assert r["tokens"] == 8 and r["tokens_per_s"] == 4.0 and r["cpu_us_per_token"] == pytest.approx(500.0)
    assert r["latency_source"] == "receipt"
    assert r["ttft_ms"]["samples"] == 2 and r["ttft_ms"]["p50"] == pytest.approx(50.0)
    assert r["ttft_ms"]["p99"] == pytest.approx(100.0)
    # ITL: A gives 3 x 10 ms; B gives 300 ms (first of the merged three) then 0, 0
    assert r["itl_ms"]["samples"] == 6
    assert r["itl_ms"]["p99"] == pytest.approx(300.0) and r["itl_ms"]["p50"] == pytest.approx(10.0)
    assert r["longest_gap_ms"] == pytest.approx(300.0)
    assert r["deliveries_per_stream"] == {"mean": 3.0, "min": 2, "max": 4}
    assert r["separate_delta_fraction"] == pytest.approx(5 / 8)
    # engine timestamps: only where every delivery has one (stream A)
    assert r["ttft_engine_ms"]["samples"] == 1 and r["ttft_engine_ms"]["p50"] == pytest.approx(40.0)
    assert r["itl_engine_ms"]["p50"] == pytest.approx(10.0)
    assert common.real_result("x", "launched", [b], wall=1.0, cpu=0.0).get("ttft_engine_ms") is None


def test_gaps_count_a_merged_first_delivery_as_zeros() -> None:
    assert common._gaps([1.0, 1.5], [3, 2]) == [0.0, 0.0, 0.5, 0.0]
    assert common._gaps([], []) == []


def test_smg_handshake_port_matches_smg() -> None:
    # Values printed by smg 1.13.0's own smg.serve._zmq_handshake_port.
    assert common.smg_handshake_port("ipc:///tmp/smgtest/w0") == 20561
    assert common.smg_handshake_port("ipc:///tmp/smgtest/sock/w0") == 28516
    assert 20000 <= common.smg_handshake_port("ipc:///x") < 30000


def test_process_sessions_tells_a_new_session_from_a_process_group() -> None:
    same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], process_group=0)
    apart = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        me = common.process_sessions()
        kids = {p["pid"]: p for p in me["descendants"]}
        assert me["sid"] == os.getsid(0) and me["pgid"] == os.getpgid(0)
        assert kids[same.pid]["sid"] == me["sid"] and kids[same.pid]["pgid"] == same.pid
        assert kids[apart.pid]["sid"] == apart.pid != me["sid"]
        assert common.process_sessions(apart.pid)["sid"] == apart.pid
    finally:
        for p in (same, apart):
            p.kill()
            p.wait()


def test_service_engine_runs_headless_in_a_session_of_its_own_and_stops(tmp_path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "engine.py").write_text(
        "import json, os, sys, time\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        "time.sleep(60)\n")
    engine = real.ServiceEngine(sys.executable, scripts, "ipc:///x/hs.sock", ["--seed", "0"], tmp_path / "e.log")
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "argv.json").exists():
            assert time.monotonic() < deadline and engine.proc.poll() is None
            time.sleep(0.01)  # waiting for a child process to start, not for a state to settle
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[:3] == ["--headless", "--handshake-address", "ipc:///x/hs.sock"]
        assert argv[3:5] == ["--seed", "0"] and argv[5:] == ["--parent-pid", str(os.getpid())]
        procs = engine.processes()
        assert procs["sid"] == engine.proc.pid != os.getsid(0)
    finally:
        engine.stop(timeout=10)
    assert engine.proc.returncode is not None


def _settings(tmp_path: Path, *extra: str) -> harness.BenchSettings:
    args = cli._build_parser().parse_args([
        "bench", "--cells", "none", "--real-engine", "--no-plot", "--no-progress", "--output-dir",
        str(tmp_path / "out"), *extra])
    return harness.BenchSettings(args)


class _Progress:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def describe(self, text: str) -> None:
        pass

    def advance(self, line: str) -> None:
        self.lines.append(line)


class _FakeEngine:
    started: ClassVar[list[tuple[str, list[str]]]] = []
    nice: ClassVar[list[int | None]] = []
    stopped = 0

    def __init__(self, python: str, scripts: Path, handshake: str, args: list[str], log_path: Path, *,
                 autogroup_nice: int | None = None) -> None:
        _FakeEngine.started.append((handshake, args))
        _FakeEngine.nice.append(autogroup_nice)
        self.pid = 1000 + len(_FakeEngine.started)

    def processes(self) -> dict:
        return {"pid": 1, "sid": 99, "pgid": 99, "autogroup": None, "descendants": []}

    def stop(self) -> None:
        _FakeEngine.stopped += 1


class _FakeRunner:
    """Answers like a runner: the figures from fixed delivery logs; vLLM slower, SMG slower still."""

    runs: ClassVar[list[tuple[str, list[str]]]] = []
    commands: ClassVar[list[tuple[str, dict]]] = []

    def __init__(self, name: str, argv: list[str], log_path: Path, env=None) -> None:
        self.name, self.argv = name, argv
        _FakeRunner.runs.append((name, argv))

    def wait_ready(self) -> None:
        if self.name == "smg" and "--worker-url" in self.argv and "broken" in os.environ.get("FAKE_SMG", ""):
            raise harness.RunnerError("smg exited (code 1)")

    def command(self, cmd: dict, timeout: float) -> dict:
        topology = "service" if ("--attach" in self.argv or "--worker-url" in self.argv) else "launched"
        n, k = cmd["sequences"], cmd["max_tokens"]
        step = {"zmqdispatch": 0.010, "vllm": 0.011}.get(self.name, 0.012)
        logs = [_log(0.0, [0.02 + step * j for j in range(k)], [1] * k) for _ in range(n * cmd["repeats"])]
        me = {"pid": 2, "sid": 7, "pgid": 7, "autogroup": None,
              "descendants": [] if topology == "service" else [{"pid": 3, "sid": 7, "pgid": 3, "autogroup": None,
                                                                 "name": "python"}]}
        _FakeRunner.commands.append((topology, cmd))
        res = common.real_result(self.name, topology, logs, wall=step * k * cmd["repeats"], cpu=0.01,
                                 processes=me)
        # the scheduler's accounting: vLLM's client waits twice as long per timeslice as the others
        wait = 2 if self.name == "vllm" else 1
        client = {"on_cpu_ns": 10_000_000, "wait_ns": wait * 20_000_000, "timeslices": 100, "voluntary": 80,
                  "involuntary": 20}
        io = {"on_cpu_ns": 1_000, "wait_ns": 0, "timeslices": 1, "voluntary": 1, "involuntary": 0}
        engine = {"on_cpu_ns": 1_800_000_000, "wait_ns": 200_000_000, "timeslices": 50, "voluntary": 0,
                  "involuntary": 50}
        raw = {"wall_s": 1.0, "client": client, "client_threads": {"main": client, "ZMQbg/IO/0": io},
               "client_threads_ended": 0, "engine": engine, "engine_processes": {"VLLM::EngineCor": engine},
               "engine_pids": 2, "cpus": 2, "machine_busy_s": 1.9}
        res["sched"] = _schedstat.report(raw, res["tokens"])
        return res

    def close(self, timeout: float = 30.0) -> None:
        pass


def test_every_client_runs_in_both_topologies_interleaved_in_alternating_order(tmp_path) -> None:
    _FakeRunner.runs, _FakeRunner.commands, _FakeEngine.started, _FakeEngine.stopped = [], [], [], 0
    settings = _settings(tmp_path, "--real-rounds", "2", "--real-repeats", "2", "--real-sequences", "3",
                         "--real-max-tokens", "5", "--vllm-python", sys.executable, "--smg", sys.executable,
                         "--real-topologies", "launched", "service")
    doc = real.run_real(settings, "/tmp/model", tmp_path / "logs", _Progress(), clients=["zmqdispatch", "vllm", "smg"],
                        scripts=Path("/scripts"), smg="/bin/smg", runner_cls=_FakeRunner, engine_cls=_FakeEngine)
    order = [(name, "service" if ("--attach" in argv or "--worker-url" in argv) else "launched")
             for name, argv in _FakeRunner.runs]
    first = [(c, t) for t in ("launched", "service") for c in ("zmqdispatch", "vllm", "smg")]
    assert order == first + first[::-1]
    # a service engine per service run, each stopped; same engine arguments for everyone
    assert len(_FakeEngine.started) == 6 and _FakeEngine.stopped == 6
    want = real.engine_args("/tmp/model", 3)
    assert all(args == want for _, args in _FakeEngine.started)
    for name, argv in _FakeRunner.runs:
        if "--attach" in argv or "--worker-url" in argv:
            continue
        if name in ("zmqdispatch", "smg"):
            assert [a.split("=", 1)[1] for a in argv if a.startswith("--engine-arg=")] == want
        else:
            assert argv[argv.index("--max-num-seqs") + 1] == "3" and argv[argv.index("--max-model-len") + 1] == "256"
    # SMG's engine dials the port SMG derives from the worker URL it is given
    smg_urls = [argv[argv.index("--worker-url") + 1] for name, argv in _FakeRunner.runs if "--worker-url" in argv]
    assert {f"tcp://127.0.0.1:{common.smg_handshake_port(u)}" for u in smg_urls} <= {h for h, _ in _FakeEngine.started}

    assert doc["topologies"] == ["launched", "service"] and doc["rounds"] == 2
    for topology in ("launched", "service"):
        for client in ("zmqdispatch", "vllm", "smg"):
            r = doc["results"][topology][client]
            assert [x["round"] for x in r["rounds"]] == [1, 2]
            assert r["median"]["tokens"] == 3 * 2 * 5 and r["median"]["topology"] == topology
            assert all(x["same_session_as_engine"] is (topology == "launched") for x in r["rounds"])
        p = doc["paired"][topology]["zmqdispatch"]
        assert p["rounds"] == 2 and p["median"] == pytest.approx(1.1) and p["ours_ahead"] == 2
        t = doc["targets"][topology]
        assert t["zmqdispatch"]["tokens_per_s_met"] is True and t["zmqdispatch"]["separate_deltas_met"] is True
        assert t["smg"]["tokens_per_s_met"] is False and t["vllm"]["ttft_met"] is True
    assert doc["service_vs_launched"] == {c: pytest.approx(1.0) for c in ("zmqdispatch", "vllm", "smg")}
    # the runner is told which engine to account for when it did not start it
    cmds = _FakeRunner.commands[-12:]
    assert all(("engine_pid" in cmd) is (topology == "service") for topology, cmd in cmds)
    assert {cmd["engine_pid"] for topology, cmd in cmds if topology == "service"} == {1001, 1002, 1003, 1004,
                                                                                      1005, 1006}
    sched = doc["results"]["service"]["vllm"]["median"]["sched"]
    assert sched["client"]["wait_us_per_token"] == pytest.approx(40_000 / 30)
    assert sched["client"]["wait_us_per_timeslice"] == pytest.approx(400.0)
    assert sched["engine"]["cores"] == pytest.approx(1.8)
    md = real.format_real(doc)
    assert "Where the client's time goes" in md
    # tokens 30: on-CPU 10 ms -> 333.3 µs/token; wait 20 ms (vLLM 40 ms) -> 666.7 (1333.3); per timeslice 200 (400)
    assert "| service | zmqdispatch | 333.3 | 666.7 | 200 | 2.67 | 0.67 | 67% | 0.01 | 1.80 | 10% | 1.90 / 0.09 |" in md
    assert "| service | vllm | 333.3 | 1333.3 | 400 |" in md
    # a thread under 2 % of the client's on-CPU time gets no row of its own
    assert "| launched | smg | `main` | 333.3 |" in md and "| `ZMQbg/IO/0` |" not in md
    assert "| service | zmqdispatch |" in md and "| launched | smg |" in md and "1.100x" in md
    assert "session: zmqdispatch 1.00x, vllm 1.00x, smg 1.00x." in md
    assert json.loads(json.dumps(doc)) == doc


def test_a_failed_run_is_kept_as_an_error_and_the_rest_goes_on(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SMG", "broken")
    _FakeRunner.runs, _FakeEngine.started, _FakeEngine.stopped = [], [], 0
    settings = _settings(tmp_path, "--real-rounds", "1", "--real-repeats", "1", "--real-sequences", "2",
                         "--real-max-tokens", "3", "--vllm-python", sys.executable,
                         "--real-topologies", "launched", "service")
    doc = real.run_real(settings, "/m", tmp_path / "logs", _Progress(), clients=["zmqdispatch", "vllm", "smg"],
                        scripts=Path("/s"), smg="/bin/smg", runner_cls=_FakeRunner, engine_cls=_FakeEngine)
    assert "smg exited" in doc["results"]["service"]["smg"]["median"]["error"]
    assert _FakeEngine.stopped == 3  # the failed run's engine too
    assert "tokens_per_s" in doc["results"]["launched"]["smg"]["median"]
    assert doc["paired"]["service"]["smg"] is None
    assert "| service | smg | smg exited" in real.format_real(doc)


def test_topologies_and_clients_can_be_chosen(tmp_path) -> None:
    _FakeRunner.runs = []
    settings = _settings(tmp_path, "--real-rounds", "1", "--real-repeats", "1", "--real-sequences", "1",
                         "--real-max-tokens", "2", "--real-topologies", "service", "--real-clients", "zmqdispatch",
                         "vllm", "--vllm-python", sys.executable)
    doc = real.run_real(settings, "/m", tmp_path / "logs", _Progress(), clients=settings.real_clients,
                        scripts=Path("/s"), smg=None, runner_cls=_FakeRunner, engine_cls=_FakeEngine)
    assert list(doc["results"]) == ["service"] and list(doc["results"]["service"]) == ["zmqdispatch", "vllm"]


def test_service_niced_lowers_the_engine_autogroup_and_is_reported_under_its_own_name(tmp_path) -> None:
    _FakeRunner.runs, _FakeEngine.started, _FakeEngine.nice = [], [], []
    settings = _settings(tmp_path, "--real-rounds", "1", "--real-repeats", "1", "--real-sequences", "1",
                         "--real-max-tokens", "2", "--vllm-python", sys.executable)
    assert settings.real_topologies == ["launched", "service", "service-niced"]  # the default: all three
    doc = real.run_real(settings, "/m", tmp_path / "logs", _Progress(), clients=["zmqdispatch", "vllm"],
                        scripts=Path("/s"), smg=None, runner_cls=_FakeRunner, engine_cls=_FakeEngine)
    assert _FakeEngine.nice == [None, None, common.SERVICE_AUTOGROUP_NICE, common.SERVICE_AUTOGROUP_NICE]
    r = doc["results"]["service-niced"]["zmqdispatch"]
    assert r["rounds"][0]["topology"] == "service-niced" and r["median"]["tokens"] == 2
    assert "| service-niced | zmqdispatch |" in real.format_real(doc)


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="kernel without CONFIG_SCHED_AUTOGROUP")
def test_a_service_engine_gets_its_own_session_and_the_autogroup_nice_asked_for(tmp_path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "engine.py").write_text("import time\ntime.sleep(60)\n")
    engine = real.ServiceEngine(sys.executable, scripts, "ipc:///nowhere", [], tmp_path / "engine.log",
                                autogroup_nice=7)
    try:
        procs = engine.processes()
        assert procs["sid"] == engine.pid != os.getsid(0)
        assert procs["autogroup"].endswith(" nice 7")
        own = common.process_sessions()["autogroup"]  # None in the root group (a container's first session)
        assert own is None or own.split()[0] != procs["autogroup"].split()[0]
    finally:
        engine.stop(timeout=5)
    assert engine.proc.returncode is not None


@pytest.mark.parametrize("flag, value, limit", [
    ("--rounds", "0", "at least 1"), ("--seconds", "0", "above 0"), ("--real-rounds", "0", "at least 1"),
    ("--real-repeats", "-1", "at least 1"), ("--real-sequences", "0", "at least 1"),
    ("--real-max-tokens", "252", "1 to 251"), ("--real-max-tokens", "0", "1 to 251"),
    ("--concurrency", "0", "at least 1 each"),
])
def test_a_count_out_of_range_is_refused_naming_the_option(tmp_path, flag: str, value: str, limit: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag} .*expected {limit}"):
        _settings(tmp_path, flag, value)
    assert _settings(tmp_path, "--real-max-tokens", "251").real_max_tokens == 251


def test_the_cli_reports_a_bad_count_in_one_line_with_exit_2(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "zmqdispatch", "bench", "--cells", "none", "--real-engine",
                        "--real-rounds", "0", "--output-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "zmqdispatch bench: --real-rounds 0: expected at least 1"


def test_a_topology_or_client_named_twice_runs_once(tmp_path) -> None:
    s = _settings(tmp_path, "--real-topologies", "service", "service", "launched", "--real-clients", "vllm",
                  "vllm", "--clients", "raw", "raw")
    assert s.real_topologies == ["service", "launched"] and s.real_clients == ["vllm"] and s.clients == ["raw"]


def test_service_niced_is_not_run_where_an_autogroup_nice_cannot_apply(tmp_path, monkeypatch) -> None:
    _FakeRunner.runs, _FakeEngine.started, _FakeEngine.nice = [], [], []
    monkeypatch.setattr(real, "_autogroup_enabled", lambda: False)
    settings = _settings(tmp_path, "--real-rounds", "1", "--real-repeats", "1", "--real-sequences", "1",
                         "--real-max-tokens", "2", "--vllm-python", sys.executable)
    doc = real.run_real(settings, "/m", tmp_path / "logs", _Progress(), clients=["zmqdispatch", "vllm"],
                        scripts=Path("/s"), smg=None, runner_cls=_FakeRunner, engine_cls=_FakeEngine)
    assert doc["topologies"] == ["launched", "service"] and common.SERVICE_AUTOGROUP_NICE not in _FakeEngine.nice
    assert "sched_autogroup_enabled is 0" in doc["skipped_topologies"]["service-niced"]
    assert "Topology service-niced not run: autogroup scheduling is off" in real.format_real(doc)


def test_an_autogroup_nice_the_kernel_refuses_names_the_file_and_stops_the_engine(tmp_path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "engine.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(OSError, match=r"cannot set nice 99 in /proc/\d+/autogroup"):
        real.ServiceEngine(sys.executable, scripts, "ipc:///nowhere", [], tmp_path / "engine.log", autogroup_nice=99)
    assert not any(p.name == "engine.py" for p in _children())


def _children() -> list[Path]:
    """The command-line scripts of this process's live children."""
    out: list[Path] = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.extend(Path(a) for a in (d / "cmdline").read_bytes().decode().split("\0")[1:2])
        except (OSError, IndexError, ValueError):
            pass
    return out


def test_targets_say_when_no_client_keeps_tokens_apart() -> None:
    def m(tps, sep, ttft):
        return {"median": {"tokens_per_s": tps, "separate_delta_fraction": sep, "ttft_ms": {"p50": ttft}},
                "rounds": [{"tokens_per_s": tps, "same_session_as_engine": False}]}

    doc = {"sequences": 8, "max_tokens": 240, "repeats": 5, "rounds": 1, "autogroup_enabled": True,
           "results": {"service": {"zmqdispatch": m(90.0, 0.5, 30.0), "vllm": m(100.0, 0.6, 20.0)}},
           "paired": {"service": {"zmqdispatch": real.paired_ratios([{"tokens_per_s": 90.0}],
                                                                      [{"tokens_per_s": 100.0}])}}}
    doc["targets"] = real.targets(doc)
    t = doc["targets"]["service"]["zmqdispatch"]
    assert t["tokens_per_s_met"] is False and t["separate_deltas_met"] is False and t["ttft_met"] is False
    md = real.format_real(doc)
    assert "no client (AsyncLLM included) delivered 95 %" in md and "**no**" in md


def test_smg_is_skipped_with_a_message_when_not_installed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ZMQD_SMG", str(tmp_path / "no-smg"))
    assert real.smg_executable() is None
    monkeypatch.delenv("ZMQD_SMG")
    monkeypatch.setenv("ZMQD_SMG_VENV", str(tmp_path / "no-venv"))
    assert real.smg_executable() is None
    assert _settings(tmp_path).smg is None


def test_plot_real(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed; scripts/test installs it")
    from zmqdispatch.bench.plot import plot_real

    _FakeRunner.runs = []
    settings = _settings(tmp_path, "--real-rounds", "2", "--real-repeats", "1", "--real-sequences", "2",
                         "--real-max-tokens", "3", "--vllm-python", sys.executable)
    real_doc = real.run_real(settings, "/m", tmp_path / "logs", _Progress(), clients=["zmqdispatch", "vllm"],
                             scripts=Path("/s"), smg=None, runner_cls=_FakeRunner, engine_cls=_FakeEngine)
    path = plot_real({"machine": {"cpu": "test", "cpus": 2}, "real_engine": real_doc}, tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.mark.real_engine
@pytest.mark.slow
def test_real_engine_comparison_structure_at_a_tiny_size(tmp_path) -> None:
    """One round, every available client in every topology on the real engine (a few minutes)."""
    if harness.vllm_python() is None:
        msg = "real vLLM not installed: run scripts/install_real_vllm.sh (or set ZMQD_VLLM_PYTHON)"
        if os.environ.get("ZMQD_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    settings = _settings(tmp_path, "--real-rounds", "1", "--real-repeats", "1", "--real-sequences", "2",
                         "--real-max-tokens", "16")
    t0 = time.monotonic()
    doc = harness.run(settings, out=lambda _: None)
    real_doc = doc["real_engine"]
    clients = ["zmqdispatch", "zmqdispatch-asyncio", "vllm"] + (["smg"] if settings.smg else [])
    assert real_doc["clients"] == clients, (real_doc.get("skipped_clients"), time.monotonic() - t0)
    assert real_doc["topologies"] == ["launched", "service", "service-niced"]
    for topology in real_doc["topologies"]:
        for client in clients:
            (run,) = real_doc["results"][topology][client]["rounds"]
            assert "error" not in run, run
            assert run["tokens"] == 2 * 16 and run["streams"] == 2
            assert _is_number(run["tokens_per_s"]) and _is_number(run["ttft_ms"]["p50"])
            assert 0 <= run["separate_delta_fraction"] <= 1 and run["deliveries_per_stream"]["max"] <= 16
            assert run["same_session_as_engine"] is (topology == "launched"), run.get("processes")
            if topology != "launched":  # the engine's session: niced only in service-niced
                nice = run["engine_processes"]["autogroup"].split()[-1]
                assert nice == (str(common.SERVICE_AUTOGROUP_NICE) if topology == "service-niced" else "0"), run
            if client.startswith("zmqdispatch"):
                assert run["ttft_engine_ms"]["p50"] <= run["ttft_ms"]["p50"]
            # the scheduler's accounting found the client's threads and the engine's processes
            sched = run["sched"]
            assert sched["engine_pids"] >= 2, sched  # EngineCore and its worker at least
            assert sched["client"]["on_cpu_ns"] > 0 and sched["client"]["timeslices"] > 0
            assert sched["engine"]["on_cpu_ns"] > 0 and _is_number(sched["engine"]["cores"])
            assert any(name.startswith("VLLM::") for name in sched["engine_processes"]), sched["engine_processes"]
            if client != "smg":
                assert "main" in sched["client_threads"]
    out = tmp_path / "out"
    assert json.loads((out / "real-engine.json").read_text())["real_engine"]["clients"] == clients
    md = (out / "real-engine.md").read_text()
    assert "| service | vllm |" in md and "Where the client's time goes" in md
