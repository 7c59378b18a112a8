"""Starting and stopping an engine: what both trio shells share
(:func:`zmqdispatch.client.connect` for one engine,
:func:`zmqdispatch.multi.connect_engines` for many).

- the launch command (``{handshake_address}`` substituted) and the launched
  process: :func:`format_launch`, :func:`launch` (under
  :mod:`zmqdispatch._launch_watchdog`), :func:`terminate`;
- the version guard on an engine's ready response: :func:`check_version`;
- the one error a shell's nursery failure stands for: :func:`unwrap` (over
  :func:`leaves`, which the command line also reads).

In-package names: nothing here is part of the public API (``zmqdispatch.__all__``).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from .errors import EngineHandshakeError
from .protocol.versions import EngineVersion, check_engine_layouts, check_engine_version
from .wire import vllm_handshake as wire

__all__ = ["check_version", "format_launch", "launch", "leaves", "terminate", "unwrap"]

_log = logging.getLogger("zmqdispatch.client")


def format_launch(launch: str | Sequence[str], handshake_address: str) -> list[str]:
    """*launch* as an argv with ``{handshake_address}`` substituted.

    Raises:
        ValueError: an empty command, or a string that shell quoting rules
            cannot split (an unclosed quote); the message names ``launch``.
    """
    try:
        argv = shlex.split(launch) if isinstance(launch, str) else [str(a) for a in launch]
    except ValueError as exc:
        raise ValueError(f"launch: {launch!r} is not a command line: {exc}") from None
    if not argv or not argv[0]:
        raise ValueError("launch: the engine command is empty")
    return [a.replace("{handshake_address}", handshake_address) for a in argv]


#: The program a launched engine runs under (:mod:`zmqdispatch._launch_watchdog`),
#: run by path so that it starts without importing the package.
WATCHDOG_PATH = str(Path(__file__).with_name("_launch_watchdog.py"))


async def launch(launch: str | Sequence[str], handshake_address: str, stdout: int | None,
                 grace: float) -> trio.Process:
    """Start the engine command *launch* (see :func:`format_launch`) told to
    dial *handshake_address*; its stdout goes to *stdout* (default: our stderr),
    its stdin is ``/dev/null``. Returns once the command was executed.

    The process gets a process group of its own (so :func:`terminate` reaches
    its workers too) but stays inside the caller's session: a new session is a
    new scheduling autogroup, and a busy-polling engine there starves the
    client (``docs/deployment.md``).

    The command runs under :mod:`zmqdispatch._launch_watchdog` (same pid,
    group and exit status): if this process dies without stopping the engine
    (SIGKILL, the OOM killer), the engine gets SIGTERM, and its group SIGKILL
    once it exited or after *grace* seconds, as :func:`terminate` would have
    done. Without a Python to run it (a frozen application, or
    ``multiprocessing``'s executable unset) the command runs alone, with a warning.

    Cancellation after the process started kills its group before it propagates.

    Raises:
        EngineHandshakeError: the command cannot be executed (not found, not
            executable, a bad interpreter line); the message has the errno.
        ValueError: as :func:`format_launch`.
    """
    argv = format_launch(launch, handshake_address)
    python = _watchdog_python()
    err_r, err_w = os.pipe()  # the watchdog's report (_launch_watchdog.main); closed by a successful exec
    low = []
    while err_w < 3:  # not one of the standard descriptors the child gets (as subprocess does)
        low.append(err_w)
        err_w = os.dup(err_w)
    for fd in low:
        os.close(fd)
    try:
        if python is None:
            _log.warning("no Python to run the launch watchdog (a frozen application, or multiprocessing's "
                         "executable unset): the engine will outlive this process if it is killed")
            command, stdin = argv, subprocess.DEVNULL
        else:
            command = [python, "-I", "-S", WATCHDOG_PATH, repr(float(grace)), str(err_w), "--", *argv]
            stdin = subprocess.PIPE  # its write end is ours alone: end of file there means we are gone
        try:
            process = await trio.lowlevel.open_process(
                command,
                stdin=stdin,
                stdout=stdout if stdout is not None else _our_stderr(),
                process_group=0,
                pass_fds=(err_w,) if python is not None else (),
            )
        except OSError as exc:
            raise EngineHandshakeError(f"cannot start engine command {argv[0]!r}: {exc}") from exc
    except BaseException:
        os.close(err_r)
        raise
    finally:
        os.close(err_w)
    try:
        async with trio.lowlevel.FdStream(err_r) as reports:
            report = b""
            while chunk := await reports.receive_some():
                report += chunk
        if python is not None and not report.startswith(b"+"):
            code = await process.wait()
            raise EngineHandshakeError(f"cannot start engine command {argv[0]!r}: the launch watchdog's Python "
                                       f"{python!r} exited with code {code} before running it")
        if report[1:]:
            errno_text, _, text = report[1:].decode(errors="replace").partition(":")
            failed: Exception = OSError(int(errno_text), text, argv[0]) if errno_text != "0" else RuntimeError(text)
            raise EngineHandshakeError(f"cannot start engine command {argv[0]!r}: {failed}") from failed
    except BaseException:
        await terminate(process, 0)
        raise
    _log.info("launched engine process %d: %s", process.pid, shlex.join(argv))
    return process


def _watchdog_python() -> str | None:
    """The interpreter to run :mod:`zmqdispatch._launch_watchdog` with: the one
    ``multiprocessing`` starts its children with (``sys.executable`` unless the
    application set another); ``None`` in a frozen application."""
    if getattr(sys, "frozen", False):
        return None
    import multiprocessing.spawn

    executable = multiprocessing.spawn.get_executable()
    return os.fsdecode(executable) if executable else None


async def _close_stdin(proc: trio.Process) -> None:
    if proc.stdin is not None:  # the watchdog's pipe
        await proc.stdin.aclose()


def _our_stderr() -> int:
    """Where a launched engine's output goes by default: our stderr's file
    descriptor; fd 2 when ``sys.stderr`` has none (replaced by a StringIO, as
    under Jupyter or pytest's capture, or ``None`` when fd 2 was closed at
    start); ``/dev/null`` when fd 2 is closed."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        pass
    try:
        os.fstat(2)
    except OSError:
        return subprocess.DEVNULL
    return 2


def _kill_group(proc: trio.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_group(pgid: int) -> None:
    """Reap every child of ours in process group *pgid* (blocking; they were
    SIGKILLed). Returns at once when there is none."""
    if not hasattr(os, "waitid"):  # macOS
        return
    while True:
        try:
            os.waitid(os.P_PGID, pgid, os.WEXITED)
        except ChildProcessError:
            return


async def terminate(proc: trio.Process, grace: float) -> None:
    """SIGTERM the engine process, then SIGKILL its whole process group once it
    exited or after *grace* seconds. Shielded
    from cancellation; a KeyboardInterrupt (a second Ctrl-C) while waiting
    SIGKILLs the group at once, so no engine is orphaned."""
    try:
        await _terminate_gracefully(proc, grace)
    except BaseException:
        _kill_group(proc)
        raise


async def _terminate_gracefully(proc: trio.Process, grace: float) -> None:
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            _log.info("stopping launched engine process %d (SIGTERM, SIGKILL after %s s)", proc.pid, grace)
            # SIGTERM to the engine process alone: it stops its own workers (a
            # vLLM EngineCore whose worker was signalled too fails instead of
            # stopping, and waits out the grace). What is left of the group is
            # SIGKILLed below, as systemd's KillMode=mixed does.
            try:
                proc.send_signal(signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) engine acts on it only once resumed
            except ProcessLookupError:
                pass
            with trio.move_on_after(grace):
                await proc.wait()
        # Kill the whole group: vllm serve / EngineCore spawn workers.
        _kill_group(proc)
        with trio.move_on_after(2):
            await proc.wait()
        await _close_stdin(proc)  # its end of file now finds the group gone
        if proc.returncode is not None:
            # Group members that became our children (we are PID 1 or a child
            # subreaper: the watchdog, orphaned workers) are ours to reap.
            with trio.move_on_after(2):
                await trio.to_thread.run_sync(_reap_group, proc.pid, abandon_on_cancel=True)
        _log.info("launched engine process %d exited with code %s", proc.pid, proc.returncode)


def check_version(ready: wire.EngineCoreReadyResponse, *, allow_unknown: bool) -> EngineVersion:
    """The version guard (:mod:`zmqdispatch.protocol.versions`): refuse an
    engine version the codec was not checked against, or warn when the caller
    allowed it (``ClientConfig.allow_unknown_engine_version``).

    An SGLang scheduler's announced layouts are checked too
    (:func:`~zmqdispatch.protocol.versions.check_engine_layouts`), whatever
    *allow_unknown* says: a differing layout would misread every request.

    Raises:
        EngineHandshakeError: the version is unknown and not allowed, or an SGLang
            layout differs (the message names the version or the first differing field).
    """
    try:
        version = check_engine_version(ready.vllm_version, allow_unknown=allow_unknown)
    except ValueError as exc:
        raise EngineHandshakeError(str(exc)) from None
    try:
        checked = check_engine_layouts(ready)
    except ValueError as exc:
        raise EngineHandshakeError(f"refusing the {version.engine_name} scheduler: {exc}") from None
    if version.runtime == "sglang" and not checked:
        _log.warning("the %s scheduler announced no positional_layouts: only its version is checked",
                     version.engine_name)
    if not version.known:
        _log.warning("%s; connecting anyway (allow_unknown_engine_version)", version.unknown_message())
    return version


def leaves(e: BaseException) -> list[BaseException]:
    """The exceptions of *e* that are not groups (*e* itself if it is none)."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in leaves(sub)]
    return [e]


def unwrap(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one meaningful exception of a nursery failure.

    Cancellations are dropped when something else failed; a group of nothing
    but cancellations becomes one bare ``Cancelled``, so the enclosing scope
    (and any ``except trio.Cancelled``) sees what it expects. Several real
    errors stay a group.
    """
    found = leaves(eg)
    errors = [e for e in found if not isinstance(e, trio.Cancelled)]
    if len(errors) == 1:
        return errors[0]
    if not errors and found:
        return found[0]
    return eg
