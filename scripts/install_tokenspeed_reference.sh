#!/usr/bin/env bash
# Install TokenSpeed 0.1.1's pure wire modules (not the engine: it needs CUDA) for
# the reference cross-checks in tests/wire/test_tokenspeed_reference.py and
# tests/mock_engine/test_tokenspeed_mock_reference.py.
#
# Usage:
#   eval "$(scripts/install_tokenspeed_reference.sh)"
#   # stdout: two `export` lines, ZMQD_TOKENSPEED_PYTHON and ZMQD_TOKENSPEED_PATH
#
# Where: ${ZMQD_TOKENSPEED_HOME:-$HOME/.cache/zmqdispatch/tokenspeed-0.1.1}:
#   wheel/   the unzipped tokenspeed==0.1.1 wheel (downloaded with --no-deps:
#            torch, CUDA kernels etc. are never installed)
#   venv/    a small venv with numpy, msgspec, msgpack, pyzmq (what the wire
#            modules import; the tests stub the rest)
# Re-running is cheap: a marker file skips everything. Needs the package
# registries the first time (~20 s). Progress goes to stderr.
set -euo pipefail

SPEC="tokenspeed==0.1.1"
HOME_DIR="${ZMQD_TOKENSPEED_HOME:-${HOME:-/tmp}/.cache/zmqdispatch/tokenspeed-0.1.1}"
WHEEL_DIR="$HOME_DIR/wheel"
VENV="$HOME_DIR/venv"
MARKER="$HOME_DIR/.zmqdispatch-tokenspeed-ok"
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
    echo "$SPEC" > "$MARKER"
fi
printf 'export ZMQD_TOKENSPEED_PYTHON=%q\n' "$VENV/bin/python"
printf 'export ZMQD_TOKENSPEED_PATH=%q\n' "$WHEEL_DIR"
