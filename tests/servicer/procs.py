"""``zmqdispatch serve-grpc`` as a subprocess for tests: started, its bound
address read from its one stdout line, its stderr collected line by line (the
embedded mock engine logs each ABORT it receives there at ``--log-level
debug``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Served:
    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc = proc
        self.address = address  # host:port
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, daemon=True)

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, needle: str, timeout: float = 30.0) -> str:
        """The first stderr line containing *needle* (waits for it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if needle in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise AssertionError(f"no stderr line with {needle!r}; stderr:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 0.5))

    def stderr(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


@contextmanager
def serve_grpc(*args: str, timeout: float = 60.0) -> Iterator[Served]:
    """Start ``zmqdispatch serve-grpc --port 0 *args``; yield once it printed its address.
    On exit: SIGTERM, then SIGKILL after 30 s."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "serve-grpc", "--port", "0", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        holder: list[bytes] = []
        reader = threading.Thread(target=lambda: holder.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = holder[0].decode().strip() if holder else ""
        if not line.startswith("grpc://"):
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise AssertionError(f"serve-grpc printed {line!r} (exit {proc.poll()}); stderr:\n{err[-3000:]}")
        served = Served(proc, line.removeprefix("grpc://"))
        served._thread.start()
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def descendants(pid: int) -> list[int]:
    """Every live descendant of *pid* (``/proc/PID/task/*/children``)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    """*pid* exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
