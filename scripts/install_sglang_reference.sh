#!/usr/bin/env bash
# Fetch SGLang 0.5.21's wire sources and the SGLang plugin (smg-grpc-servicer 0.14.1) for
# the reference checks in tests/wire/test_sglang_reference.py (SGLang's own structs and
# the plugin's decoder, run by scripts/sglang_reference.py; no torch, no GPU).
#
# Usage:
#   eval "$(scripts/install_sglang_reference.sh)"
#   # stdout: one `export` line, ZMQD_SGLANG_PATH (the two unzipped trees, os.pathsep-separated)
#
# Where: ${ZMQD_SGLANG_HOME:-$HOME/.cache/zmqdispatch/sglang-0.5.21}: sglang/ holds the two
# files of the sglang wheel the checks read (io_struct.py, sampling_params.py), servicer/
# the unzipped smg-grpc-servicer wheel. Both downloaded with --no-deps. Re-running is cheap
# (a marker file). Needs the package registries the first time. Progress goes to stderr.
set -euo pipefail

HOME_DIR="${ZMQD_SGLANG_HOME:-${HOME:-/tmp}/.cache/zmqdispatch/sglang-0.5.21}"
MARKER="$HOME_DIR/.zmqdispatch-sglang-ok"
BASE_PYTHON="${ZMQD_PYTHON:-python3}"
say() { printf '[install_sglang_reference] %s\n' "$*" >&2; }

if [[ ! -f "$MARKER" ]]; then
    mkdir -p "$HOME_DIR"
    dl="$(mktemp -d)"
    trap 'rm -rf "$dl"' EXIT
    say "downloading sglang==0.5.21 and smg-grpc-servicer==0.14.1 (no dependencies)"
    "$BASE_PYTHON" -m pip download -qq --no-deps sglang==0.5.21 smg-grpc-servicer==0.14.1 -d "$dl" >&2
    rm -rf "$HOME_DIR/sglang" "$HOME_DIR/servicer"
    "$BASE_PYTHON" - "$dl" "$HOME_DIR" <<'PY'
import glob, sys, zipfile
dl, home = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(f"{dl}/sglang-0.5.21-*.whl")[0]) as z:
    for name in ("sglang/srt/managers/io_struct.py", "sglang/srt/sampling/sampling_params.py"):
        z.extract(name, f"{home}/sglang")
with zipfile.ZipFile(glob.glob(f"{dl}/smg_grpc_servicer-0.14.1-*.whl")[0]) as z:
    z.extractall(f"{home}/servicer")
PY
    echo "sglang==0.5.21 smg-grpc-servicer==0.14.1" > "$MARKER"
fi
printf 'export ZMQD_SGLANG_PATH=%q\n' "$HOME_DIR/sglang:$HOME_DIR/servicer"
