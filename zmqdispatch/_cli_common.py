"""What the subcommands of the ``zmqdispatch`` program share: the exit
statuses, the one-line failure report, the argument types and the help
formatter (:mod:`zmqdispatch.cli` builds the parser; ``mock-engine``'s options
and runner are in :mod:`zmqdispatch._cli_mock`)."""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from collections.abc import Callable

__all__ = [
    "DEBUG_ENV", "EXIT_ENGINE", "EXIT_ENGINE_LOST", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REJECTED",
    "EXIT_STDOUT_CLOSED", "EXIT_TERMINATED", "INTERNAL_EPILOG", "LAUNCH_PLACEHOLDER", "U32", "Formatter",
    "bounded_int", "fail", "int_list", "launch_command", "seconds", "token_id_list",
]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_REJECTED = 2
EXIT_ENGINE = 3
EXIT_ENGINE_LOST = 4  # serve-grpc: every engine died while serving and none came back
EXIT_INTERRUPTED = 130
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for `... | head -1` writers
EXIT_TERMINATED = 143

#: Set (to anything but "" / "0") to let an internal error's traceback through.
DEBUG_ENV = "ZMQDISPATCH_DEBUG"

INTERNAL_EPILOG = (f"  1    internal error (a bug; {DEBUG_ENV}=1 prints its traceback), or out of file descriptors\n")


def fail(code: int, message: str) -> int:
    """Print *message* as one ``zmqdispatch: error:`` line on stderr; return *code*."""
    one_line = " ".join(message.split())  # library messages may span lines
    sys.stderr.write(f"zmqdispatch: error: {one_line}\n")
    return code


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every help text (unless there is none: unset, a switch,
    an empty list); description and epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


_ASCII_INT = re.compile(r"-?[0-9]+")


def int_list(text: str) -> list[int]:
    """``1,2,3`` (spaces allowed, empty = no ids); every item an ASCII integer."""
    if not text.strip():
        return []
    items = [x.strip() for x in text.split(",")]
    bad = [x for x in items if not _ASCII_INT.fullmatch(x)]
    if bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} (item {bad[0]!r})")
    return [int(x) for x in items]


def token_id_list(text: str) -> list[int]:
    ids = int_list(text)
    for t in ids:
        if not 0 <= t < 2**32:
            raise argparse.ArgumentTypeError(f"token id {t} is outside 0..{2**32 - 1}")
    return ids


def bounded_int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in lo..hi (hi None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"{value} is outside {lo}..{hi}" if hi is not None else f"{value} must be >= {lo}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def seconds(*, zero_ok: bool) -> Callable[[str], float]:
    """An argparse type: seconds, > 0 (or >= 0 with zero_ok), inf allowed, never nan."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if math.isnan(value) or value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>= 0' if zero_ok else '> 0'}")
        return value

    parse.__name__ = "float"
    return parse


U32 = 2**32 - 1


#: What ``--launch`` must contain: replaced by the address the engine dials.
LAUNCH_PLACEHOLDER = "{handshake_address}"


def launch_command(text: str) -> str:
    """An argparse type: an engine command line, non-empty, parseable by shell
    quoting rules, with :data:`LAUNCH_PLACEHOLDER` in it (without it the engine
    cannot learn where to dial, and the handshake could only time out)."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a command line: {exc}") from None
    if not argv:
        raise argparse.ArgumentTypeError("the engine command is empty")
    if not any(LAUNCH_PLACEHOLDER in a for a in argv):
        raise argparse.ArgumentTypeError(
            f"{text!r} lacks the {LAUNCH_PLACEHOLDER} placeholder: put it where the engine takes the address "
            f"to dial (e.g. --handshake-address {LAUNCH_PLACEHOLDER}); it is replaced by the bound address")
    return text
