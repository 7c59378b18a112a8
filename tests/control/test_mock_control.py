"""The mock engine's control plane (what docs/control-plane.md says it answers),
through the typed client calls."""

from __future__ import annotations

import pytest
import trio

from zmqdispatch import UtilityCallError
from zmqdispatch.protocol.control import LoRARequest
from zmqdispatch.wire import vllm as wire
from tests.helpers import make_request
from zmqdispatch.testing import open_mock_engine_pair as vllm_mock_pair

GUARD = 30


def mock_pair():
    return vllm_mock_pair(max_model_len=4096, handshake_timeout=GUARD)


async def test_sleep_wake_and_pause_resume():
    async with mock_pair() as (engine, client):
        with trio.fail_after(GUARD):
            assert await client.is_sleeping() is False
            await client.sleep(0)
            assert await client.is_sleeping() is True and await client.is_scheduler_paused() is True
            assert await client.wake_up(["scheduling"]) is True
            assert await client.is_sleeping() is False
            await client.sleep(1)
            assert await client.wake_up(["scheduling"]) is False  # memory still asleep
            assert await client.is_sleeping() is True
            assert await client.wake_up() is True
            assert await client.is_sleeping() is False
            assert await client.reset_prefix_cache() is True
            assert await client.collective_rpc("check_health") == [None]


async def test_pause_keep_freezes_a_stream_until_resumed():
    async with mock_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1", max_tokens=50)) as stream:
                first = await stream.receive()
                await client.pause_scheduler("keep")
                steps = engine.core.steps
                # the engine is paused: nothing steps while we run other calls
                assert await client.is_scheduler_paused() is True
                assert engine.core.steps == steps and "r1" in engine.core.running
                await client.resume_scheduler()
                total = len(first.token_ids)
                async for delta in stream:
                    total += len(delta.token_ids)
                assert total == 50 and delta.finish_reason is wire.FinishReason.LENGTH


async def test_pause_abort_ends_running_streams_with_abort():
    async with mock_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("r1", max_tokens=4000)) as stream:
                await stream.receive()
                await client.pause_scheduler("abort")
                deltas = [d async for d in stream]
            assert deltas[-1].finish_reason is wire.FinishReason.ABORT
            await client.resume_scheduler()
            async with client.generate(make_request("r2", max_tokens=3)) as stream:
                assert sum([len(d.token_ids) async for d in stream]) == 3


async def test_what_a_default_cpu_engine_refuses():
    async with mock_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with pytest.raises(UtilityCallError, match="LoRA is not enabled"):
                await client.list_loras()
            with pytest.raises(UtilityCallError, match="LoRA is not enabled"):
                await client.add_lora(LoRARequest(lora_name="a", lora_int_id=1, lora_path="/p"))
            with pytest.raises(UtilityCallError, match="Profiling is not enabled"):
                await client.profile(True)
            with pytest.raises(UtilityCallError, match="no attribute 'nope'"):
                await client.collective_rpc("nope")
