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

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
import trio

from zmqdispatch import ClientConfig, EngineHandshakeError, connect
from zmqdispatch import _engine_lifecycle as lifecycle
from zmqdispatch._engine_lifecycle import WATCHDOG_PATH
from zmqdispatch._launch_watchdog import EXIT_CANNOT_EXEC
from zmqdispatch.testing import live_group_members, proc_state

from ..helpers import ENGINE_WITH_STUBBORN_WORKER, GUARD

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3+)")

# The client: launches the engine script it is given (its extra arguments: the
# ranks), says "connected" once the handshake is done, then waits.
CLIENT = r"""
import sys, trio
from zmqdispatch import ClientConfig, connect

async def main():
    size = int(sys.argv[4])
    async with connect(launch=[sys.executable, "-c", sys.argv[1], sys.argv[2], "{handshake_address}",
                               "--data-parallel-size", str(size)],
                       config=ClientConfig(terminate_grace=float(sys.argv[3])),
                       data_parallel_size=size):
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


@pytest.mark.parametrize("data_parallel_size", [1, 2], ids=["connect", "connect_engines"])
async def test_a_sigkilled_client_takes_its_launched_engine_and_the_engine_group_with_it(tmp_path, data_parallel_size):
    info = tmp_path / "engine"
    client = await trio.lowlevel.open_process(
        [sys.executable, "-c", CLIENT, ENGINE_WITH_STUBBORN_WORKER, str(info), "1.0", str(data_parallel_size)],
        stdout=subprocess.PIPE)
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


@contextmanager
def watchdog(grace: float, *argv: str, **kw) -> Iterator[tuple[subprocess.Popen, int]]:
    """The launch as :func:`zmqdispatch._engine_lifecycle.launch` makes it:
    the process and the read end of its exec-error pipe."""
    err_r, err_w = os.pipe()
    try:
        with subprocess.Popen([sys.executable, "-I", "-S", WATCHDOG_PATH, str(grace), str(err_w), "--", *argv],
                              stdin=subprocess.PIPE, process_group=0, pass_fds=(err_w,), **kw) as proc:
            os.close(err_w)
            yield proc, err_r
    finally:
        os.close(err_r)
        with suppress(OSError):
            os.close(err_w)


async def wait(proc: subprocess.Popen) -> int:
    await exited(proc.pid)
    return proc.wait()


async def test_closing_the_pipe_sigterms_the_engine_then_sigkills_a_group_member_that_ignores_it():
    # the engine exits 0 on SIGTERM; its child ignores SIGTERM
    with watchdog(0.5, "sh", "-c", "(trap '' TERM; exec sleep 600) & trap 'exit 0' TERM; "
                  "echo $!; while :; do sleep 0.05; done", stdout=subprocess.PIPE) as (proc, _):
        with trio.fail_after(GUARD):
            worker = int(proc.stdout.readline())
            proc.stdin.close()  # as the kernel does for a dead client
            assert await wait(proc) == 0
            await exited(worker)
        assert live_group_members(proc.pid) == []


async def test_a_stopped_engine_is_resumed_to_act_on_the_sigterm():
    with watchdog(GUARD, "sh", "-c", "trap 'exit 0' TERM; echo up; while :; do sleep 0.05; done",
                  stdout=subprocess.PIPE) as (proc, _):
        assert proc.stdout.readline() == b"up\n"
        os.kill(proc.pid, signal.SIGSTOP)
        proc.stdin.close()
        with trio.fail_after(GUARD):  # well before the grace: SIGCONT came with the SIGTERM
            assert await wait(proc) == 0


async def test_the_engine_keeps_its_exit_status_and_its_signals():
    with trio.fail_after(GUARD):
        with watchdog(5, "sh", "-c", "exit 3") as (proc, err):
            assert await wait(proc) == 3 and os.read(err, 100) == b"+"  # it ran; the exec succeeded
        with watchdog(5, "sh", "-c", "kill -USR1 $$") as (proc, _):
            assert await wait(proc) == -signal.SIGUSR1
        # SIGTERM to the pid reaches the engine itself (how terminate() stops it)
        with watchdog(5, "sh", "-c", "trap 'exit 7' TERM; echo up; while :; do sleep 0.05; done",
                      stdout=subprocess.PIPE) as (proc, _):
            assert proc.stdout.readline() == b"up\n"
            proc.send_signal(signal.SIGTERM)
            assert await wait(proc) == 7


async def test_the_watchdog_ends_with_the_engine():
    # the engine names its children (the watchdog was forked before the exec) and exits
    with watchdog(5, sys.executable, "-c", "import os\n"
                  "for e in os.listdir('/proc'):\n"
                  "    if e.isdigit() and open(f'/proc/{e}/stat').read().rsplit(')', 1)[1].split()[1] == "
                  "str(os.getpid()):\n"
                  "        print(e)\n", stdout=subprocess.PIPE) as (proc, _):
        with trio.fail_after(GUARD):
            assert await wait(proc) == 0
            (watchdog_pid,) = map(int, proc.stdout.read().split())
            await exited(watchdog_pid)


async def test_a_command_that_cannot_be_executed_is_reported_on_the_error_pipe_and_exits_127():
    with watchdog(5, os.devnull) as (proc, err):
        with trio.fail_after(GUARD):
            assert await wait(proc) == EXIT_CANNOT_EXEC
        assert os.read(err, 100) == f"+{errno.EACCES}:{os.strerror(errno.EACCES)}".encode()


@pytest.mark.parametrize("command, said", [
    ("zmqd-no-such-engine", "[Errno 2] No such file or directory: 'zmqd-no-such-engine'"),
    (os.devnull, f"[Errno 13] Permission denied: '{os.devnull}'"),
    ("{bad_interpreter}", "[Errno 2] No such file or directory: '{bad_interpreter}'"),
])
async def test_connect_raises_a_typed_error_with_the_errno_for_a_command_that_cannot_be_executed(
        tmp_path, command, said):
    script = tmp_path / "engine.sh"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    command, said = command.replace("{bad_interpreter}", str(script)), said.replace("{bad_interpreter}", str(script))
    with trio.fail_after(GUARD), pytest.raises(EngineHandshakeError) as ei:
        async with connect(launch=[command], config=ClientConfig(handshake_timeout=GUARD)):
            pass  # pragma: no cover
    assert str(ei.value) == f"cannot start engine command {command!r}: {said}"


# A client that is a child subreaper (as PID 1 of a container is): the watchdog
# and any orphaned worker become its children when the engine exits.
SUBREAPER = r"""
import ctypes, os, sys, trio
from zmqdispatch import connect

ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER

async def main():
    for _ in range(3):
        async with connect(launch=[sys.executable, "-m", "zmqdispatch", "mock-engine",
                                   "--handshake-address", "{handshake_address}"]):
            pass

trio.run(main)
zombies = []
for e in os.listdir("/proc"):
    if e.isdigit():
        try:
            fields = open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(os.getpid()) and fields[0] == "Z":
            zombies.append(e)
print(len(zombies))
"""


async def test_a_subreaper_client_reaps_the_watchdog_of_each_engine_it_stopped():
    with trio.fail_after(GUARD):
        done = await trio.run_process([sys.executable, "-c", SUBREAPER], capture_stdout=True, capture_stderr=True)
    assert done.stdout == b"0\n", done.stderr.decode()[-2000:]


async def test_a_launch_that_cannot_start_its_python_raises_and_leaves_no_descriptor_open(monkeypatch):
    monkeypatch.setattr(lifecycle, "_watchdog_python", lambda: "/nonexistent/python")
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(EngineHandshakeError, match=r"cannot start engine command 'true': .*/nonexistent/python"):
        await lifecycle.launch(["true"], "ipc:///nowhere", None, 1.0)
    assert set(os.listdir("/proc/self/fd")) <= before


async def test_a_watchdog_python_that_does_not_run_it_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr(lifecycle, "_watchdog_python", lambda: "/bin/false")  # runs, ignores its arguments
    with trio.fail_after(GUARD), pytest.raises(EngineHandshakeError) as ei:
        await lifecycle.launch(["true"], "ipc:///nowhere", None, 1.0)
    assert str(ei.value) == ("cannot start engine command 'true': the launch watchdog's Python '/bin/false' "
                             "exited with code 1 before running it")
