"""Run a launched engine so that it ends when the client that launched it is gone.

The client starts ``python -I -S <this file> GRACE ERRFD -- ENGINE_ARGV...``
with a pipe as stdin whose write end only the client holds
(:func:`zmqdispatch._engine_lifecycle.launch`). This program forks a watchdog,
then ``exec``\\ s the engine command in its own place: the engine keeps the pid,
the process group, the exit status and the signals the client gives it. An
exec that fails is reported on ERRFD (:func:`main`), as :mod:`subprocess`
reports its own.

The watchdog (a child of the engine, in the engine's process group) waits for
one of two things:

- the pipe reaches end of file: every copy of the write end is closed, i.e. the
  client exited, however it died (SIGKILL, the OOM killer, a crash). The watchdog
  then does what the client would have done: SIGTERM to the engine, SIGCONT to
  the group, and SIGKILL to the whole group once the engine exited or after
  GRACE seconds (its workers included; the watchdog goes with them);
- the engine exits: the watchdog exits too (the kernel kills it through
  ``PR_SET_PDEATHSIG``, and it checks its parent once a second besides).

The pipe, not the client's pid, is what is watched: it cannot be mistaken for a
recycled pid, and it needs no polling. Its write end closes on exec, so the
client's other programs do not hold it; a child the client forked without
exec (``os.fork``, multiprocessing's ``fork`` start) does, and keeps the engine
running until it exits. A signal to the whole group (SIGTERM, SIGKILL) ends the
watchdog with the rest.

Run by path with ``-I -S`` (nothing but the standard library, not the
package's ``__init__``): it starts in milliseconds. ``PR_SET_PDEATHSIG`` is
Linux's; elsewhere, or without ``ctypes``, the watchdog still sees the
client's exit but notices the engine's only by the once a second parent check.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: The exit status when the engine command cannot be executed (as a shell's).
EXIT_CANNOT_EXEC = 127
#: How often the watchdog checks that its parent (the engine) is still there, in seconds.
PARENT_CHECK_INTERVAL = 1.0


def _set_parent_death_signal(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (ImportError, OSError, AttributeError):  # no ctypes, or not Linux: the parent check alone
        pass


def _stop_engine(engine_pid: int, grace: float) -> None:
    """The client is gone: SIGTERM the engine, then SIGKILL its group (and us)."""
    _set_parent_death_signal(0)  # outlive the engine long enough to kill its workers
    try:
        os.kill(engine_pid, signal.SIGTERM)
        os.killpg(0, signal.SIGCONT)  # a stopped engine acts on SIGTERM only once resumed
    except OSError:  # gone already, or not ours to signal (it changed its user)
        pass
    deadline = time.monotonic() + grace
    while os.getppid() == engine_pid and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)


def _watch(client_fd: int, engine_pid: int, grace: float) -> None:
    """The watchdog's life (module docstring); never returns."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != engine_pid:  # the engine ended before the line above
        os._exit(0)
    try:
        with open("/proc/self/comm", "w") as f:
            f.write("zmqd-watchdog")
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # hold no reader of the engine's output open
    os.close(devnull)
    for sig in (signal.SIGINT, signal.SIGHUP):  # the engine's to handle; SIGTERM to the group ends us
        signal.signal(sig, signal.SIG_IGN)
    while True:
        readable, _, _ = select.select([client_fd], [], [], PARENT_CHECK_INTERVAL)
        if os.getppid() != engine_pid:
            os._exit(0)
        if readable and not os.read(client_fd, 4096):
            _stop_engine(engine_pid, grace)
            os._exit(0)


def main(argv: list[str]) -> None:
    """``GRACE ERRFD -- ENGINE_ARGV...``: fork the watchdog, then exec the
    engine (stdin ``/dev/null``). ERRFD is a pipe the client reads to its end
    (it closes on exec): ``+`` once this program runs, then, if anything
    failed before the exec, ``ERRNO:STRERROR`` (``0:TYPE: MESSAGE`` for an
    error without errno) and exit status :data:`EXIT_CANNOT_EXEC`. Exit 2 on a
    malformed command line."""
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        sys.stderr.write("zmqdispatch watchdog: usage: GRACE ERRFD -- ENGINE_ARGV...\n")
        os._exit(2)
    err_fd, engine_argv = int(argv[1]), argv[3:]
    os.write(err_fd, b"+")
    try:
        grace = float(argv[0])
        os.set_inheritable(err_fd, False)  # closed by the exec: the client's "it started"
        engine_pid = os.getpid()
        if os.fork() == 0:
            try:
                os.close(err_fd)
                _watch(0, engine_pid, grace)
            finally:
                os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the engine does not hold the client's pipe
        os.close(devnull)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by Python's startup, as subprocess restores them
            signal.signal(sig, signal.SIG_DFL)
        os.execvp(engine_argv[0], engine_argv)
    except BaseException as exc:  # everything goes to the client
        if isinstance(exc, OSError) and exc.errno:
            report = f"{exc.errno}:{exc.strerror}"
        else:
            report = f"0:{type(exc).__name__}: {exc}"
        os.write(err_fd, report.encode(errors="replace"))
        os._exit(EXIT_CANNOT_EXEC)


if __name__ == "__main__":
    main(sys.argv[1:])
