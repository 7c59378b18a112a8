#!/usr/bin/env bash
# Install SMG (the Rust LLM gateway, PyPI `smg`, pinned) into its own venv, for
# the optional third client of `zmqdispatch bench --real-engine`.
#
# Usage:
#   SMG=$(scripts/install_smg.sh)             # stdout: only the path of the `smg` executable
#   "$SMG" launch --help
#
# Where: ${ZMQD_SMG_VENV:-$HOME/.cache/zmqdispatch/smg-1.13.0}; out of the
# repository and apart from the project's own env.  ZMQD_PYTHON picks the
# interpreter that creates the venv (default python3 on PATH).
#
# The wheel carries the compiled router; nothing is downloaded at run time.
# Re-running is cheap: with the marker present and smg 1.13.0 installed,
# nothing is done.  Concurrent runs are serialised with flock when available.
# Progress and pip output go to stderr.
set -euo pipefail

SMG_SPEC="smg==1.13.0"
VENV="${ZMQD_SMG_VENV:-${HOME:-/tmp}/.cache/zmqdispatch/smg-1.13.0}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
BASE_PYTHON="${ZMQD_PYTHON:-python3}"
PY="$VENV/bin/python"
SMG="$VENV/bin/smg"
MARKER="$VENV/.zmqdispatch-smg-ok"

say() { printf '[install_smg] %s\n' "$*" >&2; }

quick_ok() {
    [[ -x "$SMG" && -f "$MARKER" && "$(cat "$MARKER")" == "$SMG_SPEC" ]] || return 1
    "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("smg") != "1.13.0")' >/dev/null 2>&1
}

finish() {
    printf '%s\n' "$SMG"
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
    if quick_ok; then
        say "already installed in $VENV"
        finish
    fi
fi

rm -f "$MARKER"
if [[ ! -x "$PY" ]] || ! "$PY" -m pip --version >/dev/null 2>&1; then
    say "creating venv $VENV with $("$BASE_PYTHON" -V 2>&1)"
    "$BASE_PYTHON" -m venv --clear "$VENV"
fi
say "pip install $SMG_SPEC into $VENV"
if ! "$PY" -m pip install -qq --progress-bar off --disable-pip-version-check \
        --root-user-action=ignore "$SMG_SPEC" >&2; then
    say "ERROR: pip install $SMG_SPEC failed (no wheel for this platform?)"
    exit 1
fi
if ! "$SMG" --help >/dev/null 2>&1; then
    say "ERROR: $SMG does not run:"
    "$SMG" --help 2>&1 | tail -n 20 >&2 || true
    exit 1
fi
printf '%s\n' "$SMG_SPEC" >"$MARKER"
say "done"
finish
