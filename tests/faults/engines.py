"""Mock engine processes and process checks shared by the fault tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from zmqdispatch import ClientConfig

#: trio.fail_after guard for whole tests (a hang must fail, not block the suite).
GUARD = 30


def mock_argv(handshake_address: str = "{handshake_address}", *extra: str) -> list[str]:
    """argv of the mock engine program (``{handshake_address}`` for ``launch=``)."""
    return [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", handshake_address, *extra]


def fixed_addresses(d: Path, **config: object) -> tuple[str, ClientConfig]:
    """``(handshake_address, config)`` with fixed ipc data-plane addresses in *d*,
    as a restartable front-end uses them (``docs/vllm-wire.md`` §6)."""
    cfg = ClientConfig(input_address=f"ipc://{d}/in.sock", output_address=f"ipc://{d}/out.sock", **config)
    return f"ipc://{d}/hs.sock", cfg


@asynccontextmanager
async def external_mock(handshake_address: str, *extra: str) -> AsyncIterator[trio.Process]:
    """A mock engine we did not ``launch=`` (started elsewhere, as ``vllm serve
    --headless`` is): the client only sees its sockets. SIGKILLed (with its
    process group) on exit; a SIGSTOPped engine is continued first."""
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
    nobody may reap a reparented grandchild in a container)."""
    pids = []
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
