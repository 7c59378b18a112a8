"""The mock engine as a separate process, for fault injection, and process checks.

:func:`external_mock` starts ``zmqdispatch mock-engine`` as an engine the client
did not launch (``vllm serve --headless`` is one): a test can then SIGKILL,
SIGSTOP or SIGCONT it, or start it with ``--fault KIND[:N]`` (a sentinel, an
exit, garbage, silence, a reader that stops; ``docs/mock-engine.md``).
:func:`mock_argv` is the same program for ``connect(launch=...)``.
:func:`proc_state` and :func:`live_group_members` read ``/proc`` (Linux) to
check that nothing was left running or unreaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ..config import ClientConfig

__all__ = ["external_mock", "fixed_addresses", "live_group_members", "mock_argv", "proc_state"]


def mock_argv(handshake_address: str = "{handshake_address}", *extra: str) -> list[str]:
    """argv of the mock engine program run by this interpreter; *extra* are more
    ``zmqdispatch mock-engine`` flags (``--runtime tokenspeed``, ``--fault
    sentinel:3``). The default *handshake_address* is the placeholder
    ``connect(launch=...)`` fills in."""
    return [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", handshake_address, *extra]


def fixed_addresses(d: Path, **config: Any) -> tuple[str, ClientConfig]:
    """``(handshake_address, config)`` with fixed ipc data-plane addresses in the
    directory *d*, as a restartable front-end uses them (``docs/vllm-wire.md``
    §6); *config* are further ``ClientConfig`` fields.

    Raises:
        TypeError: *config* names a field ``ClientConfig`` lacks.
    """
    cfg = ClientConfig(input_address=f"ipc://{d}/in.sock", output_address=f"ipc://{d}/out.sock", **config)
    return f"ipc://{d}/hs.sock", cfg


@asynccontextmanager
async def external_mock(handshake_address: str, *extra: str) -> AsyncIterator[trio.Process]:
    """Start the mock engine program dialing *handshake_address* (*extra*: more
    flags) in a session of its own, and yield its process: an engine the client
    did not ``launch=``, which it knows only by its sockets.

    On exit (cancellation included) its process group is SIGCONTed then
    SIGKILLed, and reaped (waiting at most 5 s).
    """
    proc = await trio.lowlevel.open_process(
        mock_argv(handshake_address, *extra), stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            with trio.move_on_after(5):
                await proc.wait()


def proc_state(pid: int) -> str | None:
    """The /proc state letter of *pid* (``"Z"`` zombie), ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data.rsplit(")", 1)[1].split()[0]


def live_group_members(pgid: int) -> list[int]:
    """Pids of processes in group *pgid* that are alive (zombies excluded:
    nobody may reap a reparented grandchild in a container). Linux ``/proc``."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # fields[0] = state, fields[1] = ppid, fields[2] = pgrp
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids
