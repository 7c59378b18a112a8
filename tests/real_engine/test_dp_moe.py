"""A mixture-of-experts model served with data parallelism: ``vllm serve
--headless --data-parallel-size 2`` on a tiny random-weight Mixtral
(``scripts/real_vllm/tiny_model.py --moe``). vLLM runs such ranks in
lock-step waves (each rank's ready response reports the DP size, 2), a
protocol zmqdispatch does not implement: the handshake must refuse them with
an error that says why, never serve them as independent engines
(docs/many-engines.md).

Sorts before the single-engine modules so that its two busy-polling ranks do
not share the cores with the session's engine (see ``test_dp_one_process.py``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from zmqdispatch import ClientConfig, EngineHandshakeError
from zmqdispatch.multi import connect_engines

from .conftest import SCRIPTS
from .serve import STARTUP_TIMEOUT, free_port, serve_argv, serve_processes

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def moe_model_dir(vllm_py, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_moe")
    subprocess.run([sys.executable, str(SCRIPTS / "tiny_model.py"), "--moe", str(d)], check=True,
                   stdout=subprocess.DEVNULL)
    return str(d)


async def test_lock_step_moe_ranks_are_refused_at_the_handshake(vllm_py, moe_model_dir):
    port = free_port()
    argv = serve_argv(vllm_py, moe_model_dir, port, "--data-parallel-size", "2")
    config = ClientConfig(handshake_timeout=STARTUP_TIMEOUT)
    with serve_processes(argv), trio.fail_after(STARTUP_TIMEOUT + 30):
        with pytest.raises(EngineHandshakeError, match="lock-step") as info:
            async with connect_engines(f"tcp://127.0.0.1:{port}", data_parallel_size=2, config=config):
                pass  # pragma: no cover
    message = str(info.value)
    # the rank's own report, and why it is refused
    assert "reports data_parallel_size 2" in message and "wave protocol" in message, message
