"""Ending an asyncio program that has a launched engine streaming: closing
the client with streams open, ``asyncio.run`` returning with the client still
open, Ctrl-C (under ``asyncio.run``, and with a loop run by hand, where
trio takes SIGINT), a loop closed from outside with its client open (also
with trio's next tick queued on it); clients
on loops of three threads at once. Each runs tests/aio/lifecycle_program.py as a process of its
own (its stderr must hold no traceback, it must exit by itself, and the mock
engine it launched must be gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zmqdispatch.testing import live_group_members, proc_state

PROGRAM = Path(__file__).with_name("lifecycle_program.py")
GUARD_S = 60  # a hang guard: the program ends in well under a second once told to


def _run(mode: str, loop_kind: str) -> tuple[int, list[str], str, int]:
    proc = subprocess.Popen([sys.executable, str(PROGRAM), mode, loop_kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=PROGRAM.parent.parent.parent)
    assert proc.stdout is not None
    lines: list[str] = []
    engine_pid = -1
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("ENGINE "):
                engine_pid = int(line.split()[1])
            if line.startswith("STREAMING") and mode.startswith("sigint"):
                proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines += rest.splitlines()
    return proc.returncode, lines, err, engine_pid


@pytest.mark.parametrize("mode", ["close", "return", "sigint", "sigint-bare", "loop-closed",
                                  "loop-closed-tick"])
def test_the_program_ends_cleanly_and_the_engine_is_stopped(mode: str, loop_kind: str) -> None:
    code, lines, err, engine_pid = _run(mode, loop_kind)
    assert "Traceback" not in err, err
    assert engine_pid > 0, (lines, err)
    if mode.startswith("sigint"):
        assert code == 130 and lines[-1] == "INTERRUPTED ENGINE-GONE", (lines, err)
    else:
        assert code == 0 and lines[-1] == "DONE ENGINE-GONE", (lines, err)
    if mode == "close":
        assert lines.count("STREAM-ENDED EngineDeadError") == 3, lines
    assert proc_state(engine_pid) in (None, "Z")
    assert live_group_members(engine_pid) == []  # the engine ran in a process group of its own
    assert os.getpid() != engine_pid


def test_clients_on_loops_of_three_threads_at_once(loop_kind: str) -> None:
    """A loop per thread, a client (and a launched engine) per loop, streaming
    at the same time: each loop has a trio run of its own."""
    code, lines, err, _ = _run("threads", loop_kind)
    assert "Traceback" not in err, err
    assert code == 0, (lines, err)
    assert [ln for ln in lines if ln.startswith("TOKENS")] == [
        "TOKENS main 1000", "TOKENS t0 1000", "TOKENS t1 1000"], lines
    assert lines[-1] == "DONE ENGINE-GONE", lines
