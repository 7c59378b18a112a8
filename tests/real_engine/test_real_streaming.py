"""Streaming from a real EngineCore that the client launched: every engine step
reaches a consumer that keeps up as its own delta.

A real vLLM EngineCore busy-polls (its loop and its worker each take most of a
core). Started in a session of its own, it lands in another scheduling
autogroup and can keep the client's process off the CPU for hundreds of
milliseconds; the streams then receive their tokens merged into one or two
deltas, and the engine's next ADDs arrive late. ``connect(launch=...)`` keeps
the engine in the caller's session (``docs/deployment.md``). This test counts
deliveries, never time.
"""

from __future__ import annotations

import pytest
import trio

from zmqdispatch import ClientConfig, connect

from ..helpers import make_request
from .conftest import engine_argv

pytestmark = pytest.mark.real_engine

SEQUENCES = 8  # the engine's --max-num-seqs: all run in one batch, one token each per step
MAX_TOKENS = 120
GENERATIONS = 6  # the starved launch spoiled about every second generation


async def test_launched_engine_streams_every_step_as_its_own_delta(vllm_py, model_dir):
    argv = engine_argv(vllm_py, model_dir, "{handshake_address}")
    deliveries: dict[str, list[int]] = {}

    async def consume(client, rid: str, prompt: list[int]) -> None:
        sizes = deliveries.setdefault(rid, [])
        req = make_request(rid, prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        async with client.generate(req) as stream:
            async for delta in stream:
                sizes.append(len(delta.token_ids))

    with trio.fail_after(400):
        async with connect(launch=argv, config=ClientConfig(handshake_timeout=300)) as client:
            for g in range(GENERATIONS):
                async with trio.open_nursery() as nursery:
                    for i in range(SEQUENCES):
                        nursery.start_soon(consume, client, f"g{g}-s{i}", [1 + i, 2 + i, 3 + i, 4 + i, 5 + i])

    assert len(deliveries) == GENERATIONS * SEQUENCES
    for rid, sizes in deliveries.items():
        assert sum(sizes) == MAX_TOKENS, rid
    # Each stream got at least half of its tokens as separate deltas (a starved
    # client gets 1-2 deltas for the whole stream).
    starved = {rid: len(sizes) for rid, sizes in deliveries.items() if len(sizes) < MAX_TOKENS // 2}
    assert not starved, f"streams delivered in fewer than {MAX_TOKENS // 2} deltas: {starved}"
