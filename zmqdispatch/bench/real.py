"""``zmqdispatch bench --real-engine``: clients of a real vLLM EngineCore, in three topologies.

Clients: ``zmqdispatch`` (:mod:`.run_zmqdispatch`), ``zmqdispatch-asyncio``
(:mod:`.run_aio`: the asyncio API under uvloop, a task per stream), ``vllm`` (vLLM's own
``AsyncLLM``, ``run_vllm.py``) and, where ``scripts/install_smg.sh`` installed
it, ``smg`` (the Rust gateway, ``run_smg.py``). Every client drives the same
engine (``scripts/real_vllm/engine.py``, or ``AsyncLLM``'s own engine start with
the same arguments: tiny random Llama, ``--max-num-seqs`` = sequences,
``--max-model-len 256``, seed 0, float32, eager, no tokenizer).

Topologies (:data:`._common.TOPOLOGIES`):

- ``launched``: the client starts the engine, which stays in the client's
  session (zmqdispatch: ``connect(launch=...)``, its own process group;
  AsyncLLM: its own engine processes; SMG: the runner starts it beside ``smg
  launch``).
- ``service``: this harness starts the engine with ``start_new_session=True``
  (``setsid``, as a ``vllm serve --headless`` service is deployed), dialing the
  client's handshake address (zmqdispatch: ``connect(address)``; AsyncLLM:
  ``client_addresses``, the runner answering the handshake; SMG: the port it
  derives from its worker URL).
- ``service-niced``: as ``service``, and the harness writes
  :data:`._common.SERVICE_AUTOGROUP_NICE` to the engine's
  ``/proc/<pid>/autogroup`` right after starting it (the session's scheduling
  group at a lower weight, as ``docs/deployment.md`` recommends; as the
  engine's user, no privilege needed). Not run where an autogroup nice cannot
  apply (:func:`autogroup_nice_unavailable`; the report says why).

With Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``)
a session is a scheduling group: in ``service`` the busy-polling engine and the
client are two groups that the scheduler shares the cores between, whatever
their load (``docs/deployment.md``).

Every round runs every (client, topology) once, each on a fresh engine, one at
a time (two CPU engines side by side would share the cores), in an order that
is reversed every other round. A run: one warm-up generation before the
runner reports ready, then ``repeats`` generations of ``sequences`` concurrent
streams of ``max_tokens`` tokens (``ignore_eos``), back to back. Figures per
run: :func:`._common.real_result`; per (client, topology): medians over the
rounds, and the round-by-round ratio of tokens/s to AsyncLLM's in the same
topology (the two runs of a round are minutes apart at most, so slow drift of
the machine cancels out).
"""

from __future__ import annotations

import errno
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import _common as common

__all__ = ["REAL_CLIENTS", "smg_executable", "run_real", "paired_ratios", "targets", "format_real", "format_sched"]

REAL_CLIENTS = ("zmqdispatch", "zmqdispatch-asyncio", "vllm", "smg")
PACKAGE_DIR = Path(__file__).resolve().parent
MAX_MODEL_LEN = 256
#: Prompt tokens of every real-engine request.
PROMPT_LEN = 5
#: Reported, never asserted (speed is not test material).
TARGETS = {"tokens_per_s_ratio": 1.0, "separate_delta_fraction": 0.95}


def smg_executable(explicit: str | None = None) -> str | None:
    """The ``smg`` executable: *explicit*, ``$ZMQD_SMG``, else the venv of
    ``scripts/install_smg.sh`` when its install marker is there."""
    path = explicit or os.environ.get("ZMQD_SMG")
    if path:
        return path if os.access(path, os.X_OK) else None
    venv = os.environ.get("ZMQD_SMG_VENV") or os.path.join(
        os.environ.get("HOME", "/tmp"), ".cache", "zmqdispatch", "smg-1.13.0")
    smg = os.path.join(venv, "bin", "smg")
    if os.path.exists(os.path.join(venv, ".zmqdispatch-smg-ok")) and os.access(smg, os.X_OK):
        return smg
    return None


def engine_args(model_dir: str, sequences: int) -> list[str]:
    """``engine.py`` arguments shared by every client and topology."""
    return ["--model-dir", model_dir, "--max-num-seqs", str(sequences), "--max-model-len", str(MAX_MODEL_LEN),
            "--seed", "0"]


class ServiceEngine:
    """A real engine started apart from its client, in a session of its own;
    with *autogroup_nice*, that session's autogroup gets this nice value (0-19:
    a lower weight; :class:`OSError` if ``/proc/<pid>/autogroup`` refuses it)."""

    def __init__(self, vllm_python: str, scripts: Path, handshake_address: str, args: list[str],
                 log_path: Path, *, autogroup_nice: int | None = None) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [vllm_python, str(scripts / "engine.py"), "--headless", "--handshake-address", handshake_address,
             *args, "--parent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, start_new_session=True)
        if autogroup_nice is not None:
            try:  # the session exists once Popen returns; the workers it starts later join it
                _set_autogroup_nice(self.proc.pid, autogroup_nice)
            except OSError:
                self.stop()
                raise

    @property
    def pid(self) -> int:
        """The engine's first process (EngineCore's parent; its workers descend from it)."""
        return self.proc.pid

    def processes(self) -> dict[str, Any]:
        return common.process_sessions(self.proc.pid)

    def stop(self, timeout: float = 45.0) -> None:
        """SIGTERM (vLLM's clean stop), then SIGKILL to its session's process group."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            try:  # the worker child, should it have outlived the engine
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        finally:
            self._log.close()


def _set_autogroup_nice(pid: int, nice: int) -> None:
    """Write *nice* to ``/proc/<pid>/autogroup``. Without ``CAP_SYS_ADMIN`` the
    kernel takes one such write per 100 ms machine-wide (EAGAIN otherwise):
    retried for a second. OSError naming the file and value otherwise."""
    path = f"/proc/{pid}/autogroup"
    for attempt in range(10):
        try:
            with open(path, "w") as f:
                f.write(str(nice))
            return
        except BlockingIOError:  # EAGAIN
            if attempt == 9:
                raise OSError(errno.EAGAIN, f"cannot set nice {nice} in {path}: busy for a second") from None
            time.sleep(0.11)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot set nice {nice} in {path}: {exc.strerror}") from None


def autogroup_nice_unavailable() -> str | None:
    """Why an autogroup's nice would not apply on this machine (``None``: it does).

    Not detected: processes in a cgroup of the ``cpu`` controller other than the
    root, where autogroups do not apply either."""
    if not os.path.exists("/proc/self/autogroup"):
        return "this kernel has no autogroup scheduling (CONFIG_SCHED_AUTOGROUP)"
    if _autogroup_enabled() is False:
        return "autogroup scheduling is off (/proc/sys/kernel/sched_autogroup_enabled is 0)"
    return None


def _runner_argv(client: str, topology: str, settings: Any, model_dir: str, attach: str | None,
                 scripts: Path, smg: str | None) -> list[str]:
    args = engine_args(model_dir, settings.real_sequences)
    if client in ("zmqdispatch", "zmqdispatch-asyncio"):
        module = "run_zmqdispatch" if client == "zmqdispatch" else "run_aio"
        argv = [sys.executable, "-m", f"zmqdispatch.bench.{module}", "--real",
                "--vllm-python", str(settings.vllm_python), "--real-vllm-scripts", str(scripts)]
        return argv + (["--attach", attach] if attach else [f"--engine-arg={a}" for a in args])
    if client == "vllm":
        argv = [str(settings.vllm_python), str(PACKAGE_DIR / "run_vllm.py"), "--engine-python", sys.executable,
                "--model-dir", model_dir, "--real-vllm-scripts", str(scripts), "--real",
                "--max-num-seqs", str(settings.real_sequences), "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
        return argv + (["--attach", attach] if attach else [])
    assert client == "smg" and smg
    argv = [str(settings.vllm_python), str(PACKAGE_DIR / "run_smg.py"), "--smg", smg, "--model-dir", model_dir,
            "--topology", topology]
    if attach:
        return argv + ["--worker-url", attach]
    return argv + ["--engine-python", str(settings.vllm_python), "--real-vllm-scripts", str(scripts),
                   *[f"--engine-arg={a}" for a in args]]


def run_real(settings: Any, model_dir: str, logs: Path, progress: Any, *, clients: list[str],
             scripts: Path, smg: str | None, runner_cls: Any, engine_cls: Any = None) -> dict[str, Any]:
    """Run the comparison (module docstring); returns the ``real_engine`` document.

    *runner_cls* is :class:`.harness.Runner` (a runner process per run);
    *engine_cls* the service engine (default :class:`ServiceEngine`).
    Failed runs are kept as ``{"error": ...}`` rounds.
    """
    engine_cls = engine_cls or ServiceEngine
    cmd = {"op": "real", "sequences": settings.real_sequences, "max_tokens": settings.real_max_tokens,
           "prompt_len": PROMPT_LEN, "repeats": settings.real_repeats}
    topologies = list(settings.real_topologies)
    skipped_topologies: dict[str, str] = {}
    if "service-niced" in topologies and (why := autogroup_nice_unavailable()):
        topologies.remove("service-niced")
        skipped_topologies["service-niced"] = why
    configs = [(c, t) for t in topologies for c in clients]
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {t: {c: [] for c in clients} for t in topologies}
    sockets = common.PrivateDir(prefix="zmqd-real-")
    try:
        for rnd in range(settings.real_rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            for client, topology in order:
                label = f"real engine round {rnd + 1}/{settings.real_rounds} {client} ({topology})"
                res = _one_run(settings, model_dir, logs, progress, cmd, rnd, client, topology, label, sockets,
                               scripts, smg, runner_cls, engine_cls)
                rounds[topology][client].append(res)
                progress.advance(f"real {client} ({topology}): {_fmt(res.get('tokens_per_s'), ',.0f')} tokens/s, "
                                 f"TTFT p50 {_fmt((res.get('ttft_ms') or {}).get('p50'), '.0f')} ms, "
                                 f"separate deltas {_fmt(res.get('separate_delta_fraction'), '.0%')}"
                                 + (f" ERROR {res['error']}" if "error" in res else ""))
    finally:
        sockets.cleanup()
    from .harness import summarize

    doc: dict[str, Any] = {
        "sequences": settings.real_sequences,
        "max_tokens": settings.real_max_tokens,
        "repeats": settings.real_repeats,
        "rounds": settings.real_rounds,
        "clients": clients,
        "topologies": topologies,
        "skipped_topologies": skipped_topologies,
        "engine_args": engine_args("MODEL_DIR", settings.real_sequences),
        "autogroup_enabled": _autogroup_enabled(),
        "results": {t: {c: {"median": summarize(r), "rounds": r} for c, r in by.items()}
                    for t, by in rounds.items()},
        "paired": {t: {c: paired_ratios(by[c], by["vllm"]) for c in by if c != "vllm"} if "vllm" in by else {}
                   for t, by in rounds.items()},
    }
    doc["targets"] = targets(doc)
    doc["service_vs_launched"] = service_vs_launched(doc)
    return doc


def service_vs_launched(doc: dict[str, Any]) -> dict[str, float | None]:
    """Per client: median tokens/s with the engine as a service over the same
    with the engine launched by the client (what the session split costs it)."""
    by = doc["results"]
    if not {"launched", "service"} <= set(by):
        return {}
    out: dict[str, float | None] = {}
    for client in by["launched"]:
        a = by["launched"][client]["median"].get("tokens_per_s")
        b = by.get("service", {}).get(client, {}).get("median", {}).get("tokens_per_s")
        out[client] = b / a if a and b else None
    return out


def _one_run(settings: Any, model_dir: str, logs: Path, progress: Any, cmd: dict[str, Any], rnd: int, client: str,
             topology: str, label: str, sockets: common.PrivateDir, scripts: Path, smg: str | None,
             runner_cls: Any, engine_cls: Any) -> dict[str, Any]:
    engine = None
    attach = None
    name = f"real-round{rnd + 1}-{client}-{topology}"
    try:
        progress.describe(f"{label}: starting an engine")
        if topology != "launched":
            if client == "smg":
                attach = sockets.ipc(f"smg-r{rnd + 1}")
                handshake = f"tcp://127.0.0.1:{common.smg_handshake_port(attach)}"
            else:
                attach = handshake = sockets.ipc(f"hs-r{rnd + 1}-{client}.sock")
            nice = common.SERVICE_AUTOGROUP_NICE if topology == "service-niced" else None
            engine = engine_cls(str(settings.vllm_python), scripts, handshake,
                                engine_args(model_dir, settings.real_sequences), logs / f"{name}-engine.log",
                                autogroup_nice=nice)
        runner = runner_cls(client, _runner_argv(client, topology, settings, model_dir, attach, scripts, smg),
                            logs / f"{name}.log", env=settings.runner_env())
        try:
            runner.wait_ready()
            progress.describe(label)
            # the runner samples the engine's processes' scheduler accounting (_schedstat)
            where = {"engine_pid": engine.pid} if engine is not None else {}
            res: dict[str, Any] = runner.command({**cmd, "round": rnd, **where}, 600)
            if engine is not None:
                res["engine_processes"] = engine.processes()
        finally:
            runner.close(60)
    except Exception as exc:  # RunnerError, or an engine that could not start
        res = {"client": client, "topology": topology, "error": str(exc)}
    finally:
        if engine is not None:
            engine.stop()
    res["round"] = rnd + 1
    res["topology"] = topology  # a runner knows "attached" or "launched", not the engine's autogroup
    res["same_session_as_engine"] = _same_session(res)
    return res


def _same_session(res: dict[str, Any]) -> bool | None:
    """Whether the engine (EngineCore and its worker) ran in the client's session."""
    client = res.get("processes")
    if not client:
        return None
    engine = res.get("engine_processes")
    if engine is not None:
        sids = {engine["sid"], *(p["sid"] for p in engine["descendants"])}
    else:
        sids = {p["sid"] for p in client["descendants"]}
    return sids == {client["sid"]} if sids else None


def _autogroup_enabled() -> bool | None:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def paired_ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Tokens/s over AsyncLLM's, round by round (runs of one round are close in time).

    Returns ``None`` when no round has both figures, else ``{"rounds": n,
    "ratios": [...], "median": m, "min": .., "max": .., "ours_ahead": k}``
    (``ours_ahead``: rounds where this client's tokens/s was the higher).
    """
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)
              if a.get("tokens_per_s") and b.get("tokens_per_s")]
    if not ratios:
        return None
    return {"rounds": len(ratios), "ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
            "max": max(ratios), "ours_ahead": sum(r > 1 for r in ratios)}


def targets(doc: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per topology and client: the three targets, met or not (``None``: no figure).

    tokens/s >= 1.0x AsyncLLM (median of the round ratios); >= 95 % of tokens
    as deltas of their own; TTFT p50 (receipt times) <= AsyncLLM's.
    """
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for topology, by in doc["results"].items():
        vllm_ttft = ((by.get("vllm", {}).get("median") or {}).get("ttft_ms") or {}).get("p50")
        for client, r in by.items():
            m = r["median"]
            paired = doc["paired"].get(topology, {}).get(client)
            ratio = 1.0 if client == "vllm" and m.get("tokens_per_s") else (paired or {}).get("median")
            sep = m.get("separate_delta_fraction")
            ttft = (m.get("ttft_ms") or {}).get("p50")
            out.setdefault(topology, {})[client] = {
                "tokens_per_s_vs_vllm": ratio,
                "tokens_per_s_met": None if ratio is None else ratio >= TARGETS["tokens_per_s_ratio"],
                "separate_delta_fraction": sep,
                "separate_deltas_met": None if sep is None else sep >= TARGETS["separate_delta_fraction"],
                "ttft_p50_ms": ttft,
                "ttft_vllm_p50_ms": vllm_ttft,
                "ttft_met": None if ttft is None or vllm_ttft is None else ttft <= vllm_ttft,
            }
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def format_real(real: dict[str, Any]) -> str:
    """The markdown of the real-engine comparison."""
    if "skipped" in real:
        return f"Real engine: {real['skipped']}"
    lines = [
        f"Real vLLM EngineCore (CPU, tiny random Llama), {real['sequences']} concurrent sequences x "
        f"{real['max_tokens']} tokens, {real['repeats']} generations back to back per run, medians of "
        f"{real['rounds']} round{'' if real['rounds'] == 1 else 's'} (autogroup scheduling "
        f"{ {True: 'on', False: 'off', None: 'unknown'}[real.get('autogroup_enabled')] }). "
        "launched: the client starts the engine, which stays in the client's session; "
        "service: the engine runs in a session of its own (setsid) and the client attaches"
        + ("; service-niced: the same, the engine session's autogroup at nice "
           f"{common.SERVICE_AUTOGROUP_NICE} (/proc/PID/autogroup)." if "service-niced" in real["results"] else "."),
        "",
        "| topology | client | tokens/s | × AsyncLLM, round by round | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| engine-timestamp TTFT p50 / ITL p99 ms | longest gap ms | deliveries per stream | tokens as own delta "
        "| client CPU µs/token | engine in client's session |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for topology, by in real["results"].items():
        for client, r in by.items():
            m = r["median"]
            if "tokens_per_s" not in m:
                lines.append(f"| {topology} | {client} | {m.get('skipped') or m.get('error')} ||||||||||")
                continue
            p = real["paired"].get(topology, {}).get(client)
            ratio = ("1 (reference)" if client == "vllm" else
                     f"{p['median']:.3f}x ({p['min']:.2f}-{p['max']:.2f}; ahead {p['ours_ahead']}/{p['rounds']})"
                     if p else "-")
            ttft, itl = m.get("ttft_ms") or {}, m.get("itl_ms") or {}
            eng = (f"{_fmt(m['ttft_engine_ms']['p50'], '.1f')} / {_fmt(m['itl_engine_ms']['p99'], '.1f')}"
                   if m.get("ttft_engine_ms") else "-")
            same = [x.get("same_session_as_engine") for x in r["rounds"] if "error" not in x]
            session = "-" if not same or None in same else ("yes" if all(same) else "no" if not any(same) else "mixed")
            errors = sum("error" in x for x in r["rounds"])
            lines.append(
                f"| {topology} | {client} | {m['tokens_per_s']:,.0f} | {ratio} "
                f"| {_fmt(ttft.get('p50'), '.1f')} / {_fmt(ttft.get('p99'), '.1f')} "
                f"| {_fmt(itl.get('p50'), '.2f')} / {_fmt(itl.get('p99'), '.1f')} | {eng} "
                f"| {_fmt(m.get('longest_gap_ms'), ',.0f')} "
                f"| {_fmt((m.get('deliveries_per_stream') or {}).get('mean'), '.1f')} "
                f"| {_fmt(m.get('separate_delta_fraction'), '.1%')} | {_fmt(m.get('cpu_us_per_token'), '.1f')} "
                f"| {session}{f' ({errors} failed runs)' if errors else ''} |")
    lines += [
        "",
        "TTFT: request handed to the client -> first token seen by the consumer; ITL: per token after the first, "
        "the wait since the previous delivery (tokens that came merged with it count 0), receipt times for every "
        "client; engine-timestamp columns (zmqdispatch only): the same from `EngineCoreOutputs.timestamp`. "
        "Longest gap: the longest wait between two deliveries of one stream (median over rounds of each run's "
        "maximum). Client CPU: the client process, all threads (SMG: its router process; SMG also detokenizes, and "
        "sent one event per engine output in every run we saw, never merging: its own-delta share stays 100 % and its "
        "stalls show in the longest gap). "
        "× AsyncLLM: tokens/s over AsyncLLM's in the same topology and round: median (range; rounds ahead).",
        "",
        "Targets (reported, not tests): tokens/s >= 1.0x AsyncLLM; >= 95 % of tokens as a delta of their own; "
        "TTFT p50 <= AsyncLLM's.",
        "",
        "| topology | client | tokens/s >= 1.0x AsyncLLM | >= 95 % own deltas | TTFT p50 <= AsyncLLM's |",
        "|---|---|---|---|---|",
    ]
    for topology, by in real.get("targets", {}).items():
        for client, t in by.items():
            lines.append(f"| {topology} | {client} | {_mark(t['tokens_per_s_met'])} "
                         f"({_fmt(t['tokens_per_s_vs_vllm'], '.3f')}x) "
                         f"| {_mark(t['separate_deltas_met'])} ({_fmt(t['separate_delta_fraction'], '.1%')}) "
                         f"| {_mark(t['ttft_met'])} ({_fmt(t['ttft_p50_ms'], '.1f')} vs "
                         f"{_fmt(t['ttft_vllm_p50_ms'], '.1f')} ms) |")
    sched = format_sched(real)
    if sched:
        lines += ["", sched]
    cost = real.get("service_vs_launched")
    if cost:
        lines.append("\nTokens/s with the engine as a service over the same with the engine in the client's "
                     "session: " + ", ".join(f"{c} {_fmt(v, '.2f')}x" for c, v in cost.items()) + ".")
    for topology, by in real.get("targets", {}).items():
        if by and all(t["separate_deltas_met"] is False for t in by.values()):
            lines.append(f"\nIn topology {topology}, no client (AsyncLLM included) delivered 95 % of its tokens "
                         "as deltas of their own.")
    for topology, why in real.get("skipped_topologies", {}).items():
        lines.append(f"\nTopology {topology} not run: {why}.")
    return "\n".join(lines)


#: A client thread gets a row of its own in the per-thread table from this share of the client's on-CPU time.
THREAD_ROW_SHARE = 0.02


def format_sched(real: dict[str, Any]) -> str:
    """The markdown of where each client's time went (``sched`` of the runs,
    :func:`._schedstat.report`): "" when no run has it."""
    rows, threads = [], []
    for topology, by in real["results"].items():
        for client, r in by.items():
            s = r["median"].get("sched")
            if not s:
                continue
            c, e, m = s["client"], s["engine"], s.get("machine") or {}
            rows.append(
                f"| {topology} | {client} | {_fmt(c['on_cpu_us_per_token'], '.1f')} "
                f"| {_fmt(c['wait_us_per_token'], '.1f')} | {_fmt(c['wait_us_per_timeslice'], '.0f')} "
                f"| {_fmt(c['wakeups_per_token'], '.2f')} | {_fmt(c['involuntary_per_token'], '.2f')} "
                f"| {_fmt(c['wait_share'], '.0%')} | {_fmt(c['cores'], '.2f')} "
                f"| {_fmt(None if e['cores'] is None else e['cores'] + (e.get('ended_threads_cores') or 0.0), '.2f')} "
                f"| {_fmt(e['wait_share'], '.0%')} "
                f"| {_fmt(m.get('busy_cores'), '.2f')} / {_fmt(m.get('others_cores'), '.2f')} |")
            total = c["on_cpu_us_per_token"] or 0.0
            for name, t in s["client_threads"].items():
                if total and (t["on_cpu_us_per_token"] or 0.0) < THREAD_ROW_SHARE * total:
                    continue
                threads.append(
                    f"| {topology} | {client} | `{name}` | {_fmt(t['on_cpu_us_per_token'], '.1f')} "
                    f"| {_fmt(t['wait_us_per_token'], '.1f')} | {_fmt(t['wait_us_per_timeslice'], '.0f')} "
                    f"| {_fmt(t['wakeups_per_token'], '.2f')} | {_fmt(t['involuntary_per_token'], '.2f')} |")
    if not rows:
        return ""
    return "\n".join([
        "Where the client's time goes: the scheduler's own accounting over the measured window "
        "(`/proc/PID/task/*/schedstat` and `status`, every thread; medians over the rounds, per token delivered). "
        "on-CPU: time it ran (the same as client CPU above, from the kernel); run-queue wait: time it was runnable "
        "but waited for a CPU; per timeslice: that wait divided by the times it was put on a CPU; wakeups: "
        "voluntary switches (it blocked, then was woken); involuntary: preemptions; waiting share: run-queue wait "
        "over (wait + on-CPU). Engine: EngineCore and its worker processes summed (cores: with the CPU of "
        "threads that ended inside the window, from the processes' utime + stime). Machine: busy cores of the "
        "whole machine / what the client, its load generator (SMG) and the engine leave of them (other work).",
        "",
        "| topology | client | on-CPU µs/token | run-queue wait µs/token | wait µs per timeslice | wakeups/token "
        "| involuntary/token | runnable time waiting | client cores | engine cores | engine runnable time waiting "
        "| machine busy / others cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Client threads with at least {THREAD_ROW_SHARE:.0%} of the client's on-CPU time (`main`: the thread "
        "whose id is the pid; others by their kernel name, e.g. libzmq's `ZMQbg/IO/0`; threads of one name summed):",
        "",
        "| topology | client | thread | on-CPU µs/token | run-queue wait µs/token | wait µs per timeslice "
        "| wakeups/token | involuntary/token |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        *threads,
    ])
