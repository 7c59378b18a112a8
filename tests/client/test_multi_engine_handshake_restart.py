"""A rank that restarts in the middle of its handshake (``zmqdispatch.multi``).

A ``vllm serve --headless`` rank says HELLO as soon as it starts and READY only
after it loaded its model (tens of seconds on a real engine). A rank killed in
between (out of memory while loading, a node drained) and started again by its
supervisor dials the same handshake address with the same identity and says
HELLO again, while the client still waits for the first attempt's READY. The
client must start that rank's handshake over, not refuse the new HELLO: a
refused rank waits for an INIT that never comes and is never served.
"""

from __future__ import annotations

import trio
import trio.testing

from zmqdispatch.multi import connect_engines
from zmqdispatch.protocol.engines import EngineState
from zmqdispatch.testing.dial import dial, ready_response

from ..helpers import GUARD
from .test_multi_engine import rank_cfg, run_one, start_rank


async def crash_mid_handshake(address: str, rank: int) -> None:
    """HELLO, receive the INIT, dial the pair, then die before READY."""
    sockets = await dial(address, ready_response(rank_cfg(address, rank).max_model_len, engine_index=rank),
                         engine_index=rank,
                         send_ready_response=False, send_ready=False)
    sockets.close()


async def test_a_rank_restarted_before_ready_at_startup_is_served(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_rank(nursery, rank_cfg(address, 0))

            async def rank_1_crashes_then_restarts() -> None:
                await crash_mid_handshake(address, 1)
                await start_rank(nursery, rank_cfg(address, 1))

            nursery.start_soon(rank_1_crashes_then_restarts)
            async with connect_engines(address, data_parallel_size=2) as client:
                assert [(s.engine_index, s.state) for s in client.states()] == [(0, EngineState.UP),
                                                                                 (1, EngineState.UP)]
                assert len(await run_one(client, "on1", max_tokens=3, data_parallel_rank=1)) == 3
            nursery.cancel_scope.cancel()


async def test_a_rank_restarted_before_ready_after_startup_joins(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_rank(nursery, rank_cfg(address, 0))
            async with connect_engines(address, data_parallel_size=1) as client:
                await crash_mid_handshake(address, 1)  # a new rank 1 dies while loading
                await start_rank(nursery, rank_cfg(address, 1))  # its supervisor starts it again
                await client.wait_for_engines(2)
                assert client.states()[1].state is EngineState.UP
                assert len(await run_one(client, "on1", max_tokens=3, data_parallel_rank=1)) == 3
                # the abandoned attempt left nothing pending: its sockets are closed
                await trio.testing.wait_all_tasks_blocked()
                assert [s.in_flight for s in client.states()] == [0, 0]
            nursery.cancel_scope.cancel()
