"""A handshake that never completes ends at the configured timeout, and an
engine we spawned is killed: its whole process group, not just its pid
(issue 7).

Already covered (``tests/client/test_engine_death.py``): the timeout's stage
and virtual-time precision with a fake engine, a no-READY mock raising
``EngineHandshakeTimeout``, the pid of a child gone after a cancelled
handshake. Added here: the wall-clock bound with a real process, and that
every member of the engine's process group is gone, including a worker that
ignores SIGTERM (vLLM's EngineCore spawns workers; ``vllm serve`` a tree), so
the escalation to SIGKILL of the group is what ends it.
"""

from __future__ import annotations

import sys
import time

import pytest
import trio

from zmqdispatch import ClientConfig, EngineHandshakeTimeout, connect
from zmqdispatch.testing import live_group_members, proc_state

from ..helpers import ENGINE_WITH_STUBBORN_WORKER, GUARD


async def test_handshake_timeout_kills_the_spawned_engine_and_its_whole_process_group(tmp_path):
    info = tmp_path / "pids"
    timeout, grace = 3.0, 1.0
    with trio.fail_after(GUARD):
        t0 = time.monotonic()
        with pytest.raises(EngineHandshakeTimeout) as ei:
            async with connect(launch=[sys.executable, "-c", ENGINE_WITH_STUBBORN_WORKER, str(info),
                                       "{handshake_address}", "--fault", "no-ready"],
                               config=ClientConfig(handshake_timeout=timeout, terminate_grace=grace)):
                pass  # pragma: no cover
        elapsed = time.monotonic() - t0
    assert ei.value.stage in ("HELLO", "READY")
    # the timeout, then SIGTERM (the engine exits at once on it) and SIGKILL of the group
    assert timeout <= elapsed < timeout + grace + 3.0
    assert info.exists(), "the engine wrapper did not start within the handshake timeout (machine overloaded?)"
    engine_pid, pgid, worker_pid = map(int, info.read_text().split())
    assert pgid == engine_pid  # process_group=0: the engine leads its own group
    assert proc_state(engine_pid) in (None, "Z")
    assert proc_state(worker_pid) in (None, "Z")  # ignored SIGTERM: SIGKILLed with the group
    assert live_group_members(pgid) == []
