"""A launched engine does not outlive its client, however the client dies.

``connect(launch=...)`` runs the engine command under
``zmqdispatch/_launch_watchdog.py``: the engine keeps its pid, group and exit
status, and a watchdog it carries stops it (SIGTERM, then SIGKILL of the whole
group after ``terminate_grace``) once the client's end of a pipe is closed,
which the kernel does when the client dies, SIGKILL included.

The end-to-end test kills a real client process; the others drive the watchdog
program directly. Every wait is on a pidfd (the kernel's "this process exited"),
under a guard, never a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import trio

from zmqdispatch import ClientConfig, EngineHandshakeError, connect
from zmqdispatch._engine_lifecycle import WATCHDOG_PATH
from zmqdispatch._launch_watchdog import EXIT_CANNOT_EXEC
from zmqdispatch.testing import live_group_members, proc_state

from ..helpers import GUARD

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3+)")

# The engine: records its pid, its group and a worker's pid (the worker ignores
# SIGTERM, as a wedged vLLM worker would), then becomes a mock engine.
ENGINE = r"""
import os, subprocess, sys
info, address = sys.argv[1], sys.argv[2]
worker = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 600"])
with open(info + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.getpgrp()} {worker.pid}")
os.rename(info + ".tmp", info)
os.execv(sys.executable, [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", address])
"""

# The client: launches ENGINE, says "connected" once the handshake is done, then waits.
CLIENT = r"""
import sys, trio
from zmqdispatch import ClientConfig, connect

async def main():
    async with connect(launch=[sys.executable, "-c", sys.argv[1], sys.argv[2], "{handshake_address}"],
                       config=ClientConfig(terminate_grace=float(sys.argv[3]))):
        print("connected", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def exited(pid: int) -> None:
    """Return once *pid* has exited (at once if it is gone already)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def test_a_sigkilled_client_takes_its_launched_engine_and_the_engine_group_with_it(tmp_path):
    info = tmp_path / "engine"
    client = await trio.lowlevel.open_process(
        [sys.executable, "-c", CLIENT, ENGINE, str(info), "1.0"], stdout=subprocess.PIPE)
    try:
        with trio.fail_after(GUARD):
            assert client.stdout is not None
            assert (await client.stdout.receive_some(100)).startswith(b"connected")
            engine_pid, pgid, worker_pid = map(int, info.read_text().split())
            assert pgid == engine_pid and proc_state(worker_pid) not in (None, "Z")
            client.kill()
            await client.wait()
            await exited(engine_pid)  # SIGTERM from the watchdog: the mock engine stops
            await exited(worker_pid)  # it ignored SIGTERM: the group's SIGKILL after the grace
        assert live_group_members(pgid) == []
    finally:
        client.kill()
        await client.wait()
        await client.stdout.aclose()


def start_watchdog(grace: float, *argv: str, **kw) -> subprocess.Popen:
    """The launch as :func:`zmqdispatch._engine_lifecycle.launch` makes it."""
    return subprocess.Popen([sys.executable, "-I", "-S", WATCHDOG_PATH, str(grace), "--", *argv],
                            stdin=subprocess.PIPE, process_group=0, **kw)


async def wait(proc: subprocess.Popen) -> int:
    await exited(proc.pid)
    return proc.wait()


async def test_closing_the_pipe_sigterms_the_engine_then_sigkills_a_group_member_that_ignores_it():
    # the engine exits 0 on SIGTERM; its child ignores SIGTERM
    proc = start_watchdog(0.5, "sh", "-c", "(trap '' TERM; exec sleep 600) & trap 'exit 0' TERM; "
                          "echo $!; while :; do sleep 0.05; done", stdout=subprocess.PIPE)
    with trio.fail_after(GUARD):
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        proc.stdin.close()  # as the kernel does for a dead client
        assert await wait(proc) == 0
        await exited(worker)
    assert live_group_members(proc.pid) == []


async def test_the_engine_keeps_its_exit_status_and_its_signals():
    with trio.fail_after(GUARD):
        assert await wait(start_watchdog(5, "sh", "-c", "exit 3")) == 3
        assert await wait(start_watchdog(5, "sh", "-c", "kill -USR1 $$")) == -signal.SIGUSR1
        # SIGTERM to the pid reaches the engine itself (how terminate() stops it)
        proc = start_watchdog(5, "sh", "-c", "trap 'exit 7' TERM; echo up; while :; do sleep 0.05; done",
                              stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"up\n"
        proc.send_signal(signal.SIGTERM)
        assert await wait(proc) == 7


async def test_the_watchdog_ends_with_the_engine():
    # the engine names its children (the watchdog was forked before the exec) and exits
    proc = start_watchdog(5, sys.executable, "-c", "import os\n"
                          "for e in os.listdir('/proc'):\n"
                          "    if e.isdigit() and open(f'/proc/{e}/stat').read().rsplit(')', 1)[1].split()[1] == "
                          "str(os.getpid()):\n"
                          "        print(e)\n", stdout=subprocess.PIPE)
    with trio.fail_after(GUARD):
        assert await wait(proc) == 0
        (watchdog,) = map(int, proc.stdout.read().split())
        await exited(watchdog)


async def test_a_command_that_cannot_be_executed_exits_127_with_one_line():
    proc = start_watchdog(5, os.devnull, stderr=subprocess.PIPE)
    with trio.fail_after(GUARD):
        assert await wait(proc) == EXIT_CANNOT_EXEC
    assert proc.stderr.read().decode().startswith(f"zmqdispatch: cannot start engine command {os.devnull!r}")


@pytest.mark.parametrize("command, said", [
    ("zmqd-no-such-engine", "'zmqd-no-such-engine': not found, or not an executable file on PATH"),
    (os.devnull, f"{os.devnull!r}: not found, or not an executable file"),
])
async def test_connect_raises_a_typed_error_for_an_engine_command_that_cannot_run(command, said):
    with trio.fail_after(GUARD), pytest.raises(EngineHandshakeError, match="cannot start engine command " + said):
        async with connect(launch=[command], config=ClientConfig(handshake_timeout=GUARD)):
            pass  # pragma: no cover
