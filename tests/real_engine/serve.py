"""``vllm serve --headless`` processes and one long-lived many-engine client for
the data-parallel tests of ``tests/real_engine/``.

A ``vllm serve --headless`` rank dials the handshake once: after its READY it
closes its handshake socket and never says HELLO again (docs/vllm-wire.md), so a
client cannot re-attach to it the way ``connect(resume=...)`` re-attaches to
one engine on fixed addresses. To share one engine start across several tests,
:class:`ClientThread` keeps one :class:`~zmqdispatch.multi.MultiEngineClient`
open in a trio run of its own, in a thread, and each test runs its async body
there (:meth:`ClientThread.run`).

Every process is started in a process group of its own (in the test's session,
so that its busy loop does not starve the client, docs/deployment.md) and is
SIGKILLed as a group when its fixture ends, whatever happened; each also stops
itself when the test process is gone (``ZMQD_PARENT_PID``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

from zmqdispatch import ClientConfig
from zmqdispatch.multi import MultiEngineClient, connect_engines

from .conftest import MAX_MODEL_LEN, SCRIPTS

T = TypeVar("T")

#: Seconds an engine gets from spawn to READY (~45 s measured on 2 idle cores;
#: the machine running the suite may be busy).
STARTUP_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_argv(vllm_py: str, model_dir: str, port: int, *dp_args: str) -> list[str]:
    """``vllm serve MODEL --headless`` dialing ``tcp://127.0.0.1:PORT``, with
    the model flags the reference (``scripts/real_vllm/reference.py``) uses."""
    return [vllm_py, str(SCRIPTS / "vllm_cli.py"), "serve", model_dir, "--headless", *dp_args,
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port),
            "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", str(MAX_MODEL_LEN),
            "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8", "--seed", "0"]


class ServeProcess:
    """One ``vllm serve`` process tree (its own process group), logging to a temp file."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.log = tempfile.TemporaryFile()
        self.started_at = time.monotonic()
        # vLLM's scratch files (engine<->worker ipc sockets, rendezvous files):
        # vllm_cli.py removes its own private dir on a normal exit, but a
        # SIGKILLed tree leaves it, so this dir is ours and stop() removes it.
        tmp = tempfile.gettempdir()
        self.scratch = tempfile.mkdtemp(prefix="zmqd_vllm_", dir=tmp if len(tmp) <= 48 else "/tmp")
        env = {**os.environ, "ZMQD_PARENT_PID": str(os.getpid()), "VLLM_RPC_BASE_PATH": self.scratch,
               "TMPDIR": self.scratch,
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"torchinductor_{getpass.getuser()}")}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     process_group=0, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def group_pids(self) -> list[int]:
        """Every live process of this process group (the serve parent, its
        EngineCore(s) and worker(s), the resource tracker)."""
        pids = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.getpgid(int(name)) == self.proc.pid:
                        pids.append(int(name))
                except ProcessLookupError:
                    pass
        return pids

    def rss_mib(self) -> int:
        """The summed RSS of the process group, MiB."""
        kib = 0
        for pid in self.group_pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            except OSError:
                pass
        return kib // 1024

    def kill_group(self) -> None:
        """SIGKILL the whole process group (no engine process survives to send anything)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM the serve parent (it stops its engines), then SIGKILL
        whatever of the group is left. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill_group()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def tail(self, n: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:].decode(errors="replace")


@contextmanager
def serve_processes(*argvs: list[str]) -> Iterator[list[ServeProcess]]:
    """Start every ``vllm serve`` at once; stop them all (and any process
    appended to the yielded list) on exit, printing the logs of those that
    are still needed for a diagnosis when the body failed."""
    procs: list[ServeProcess] = []
    try:
        for argv in argvs:
            procs.append(ServeProcess(argv))
        yield procs
    except BaseException:
        for p in procs:
            print(f"--- vllm serve {p.pid} log tail ---\n{p.tail()}")
        raise
    finally:
        for p in procs:
            p.stop()
            p.log.close()


class ClientThread:
    """A :class:`MultiEngineClient` kept open in a trio run of its own (a
    daemon thread) so that several tests use the same engines.

    ``run(fn, *args)`` runs ``await fn(client, *args)`` in that trio run and
    returns its result (or raises its exception) in the calling thread.
    """

    def __init__(self, handshake_address: str, data_parallel_size: int, config: ClientConfig) -> None:
        self._address = handshake_address
        self._size = data_parallel_size
        self._config = config
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._client: MultiEngineClient | None = None
        self.error: BaseException | None = None
        self.connect_seconds: float | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True, name="dp-client")

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        t0 = trio.current_time()
        try:
            async with connect_engines(self._address, data_parallel_size=self._size, config=self._config) as client:
                self.connect_seconds = trio.current_time() - t0
                self._client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> None:
        """Wait until the client has its engines; raise its startup error."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"no {self._size} engines within {timeout} s")
        if self.error is not None:
            raise self.error

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        assert self._token is not None and self._client is not None
        client = self._client
        return trio.from_thread.run(fn, client, *args, trio_token=self._token)

    def close(self) -> None:
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(60)


@contextmanager
def client_thread(port: int, data_parallel_size: int, **config: Any) -> Iterator[ClientThread]:
    """A :class:`ClientThread` bound on ``tcp://127.0.0.1:PORT``, closed on exit."""
    config.setdefault("handshake_timeout", STARTUP_TIMEOUT)
    ct = ClientThread(f"tcp://127.0.0.1:{port}", data_parallel_size, ClientConfig(**config))
    ct.start()
    try:
        yield ct
    finally:
        ct.close()
