"""EngineClient's typed control plane against the scripted fake engine: what
goes on the wire, how replies are typed, what is refused before sending."""

from __future__ import annotations


import attrs
import pytest
import trio

from zmqdispatch import RemoteProtocolError, UnsupportedByRuntimeError, UtilityCallError
from zmqdispatch.protocol import control
from zmqdispatch.protocol.control import LoRARequest
from zmqdispatch.protocol.versions import EngineVersion
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.testing import ready_response
from zmqdispatch.wire import vllm as wire

GUARD = 30
V032 = EngineVersion.parse("0.32.0")
V033 = EngineVersion.parse("0.33.0")
TS = EngineVersion.parse("tokenspeed-0.1.1")


def pair(version: str = "0.32.0"):
    return fake_pair(ready=attrs.evolve(ready_response(), vllm_version=version), handshake_timeout=GUARD)


async def roundtrip(engine, client, call, reply, *, failure=None):
    """Run *call* (a coroutine function of the client), answer its UTILITY with
    *reply*; return (the decoded UtilityCall, the result or the exception)."""
    box = {}

    async def caller():
        try:
            box["result"] = await call(client)
        except Exception as exc:  # returned to the test
            box["result"] = exc

    async with trio.open_nursery() as n:
        n.start_soon(caller)
        msg = await engine.receive()
        assert msg.kind == wire.RequestType.UTILITY
        await engine.reply_utility(msg.value.call_id, reply, failure=failure)
    return msg.value, box["result"]


CASES = [
    # (client call, expected method, expected args, reply, expected result)
    (lambda c: c.sleep(), "sleep", [1, "abort"], None, None),
    (lambda c: c.sleep(0, "keep"), "sleep", [0, "keep"], None, None),
    (lambda c: c.wake_up(), "wake_up", [None], True, True),
    (lambda c: c.wake_up(["scheduling"]), "wake_up", [["scheduling"]], False, False),
    (lambda c: c.is_scheduler_paused(), "is_scheduler_paused", [], True, True),
    (lambda c: c.pause_scheduler("wait", False), "pause_scheduler", ["wait", False], None, None),
    (lambda c: c.resume_scheduler(), "resume_scheduler", [], None, None),
    (lambda c: c.reset_prefix_cache(), "reset_prefix_cache", [False, False], True, True),
    (lambda c: c.reset_prefix_cache(True, True), "reset_prefix_cache", [True, True], False, False),
    (lambda c: c.add_lora(LoRARequest(lora_name="a", lora_int_id=3, lora_path="/p")), "add_lora",
     [["a", 3, "/p", None, False, False]], True, True),
    (lambda c: c.remove_lora(3), "remove_lora", [3], False, False),
    (lambda c: c.pin_lora(3), "pin_lora", [3], True, True),
    (lambda c: c.list_loras(), "list_loras", [], [3, 1], frozenset({1, 3})),
    (lambda c: c.collective_rpc("check_health"), "collective_rpc", ["check_health", None, [], None], [None], [None]),
    (lambda c: c.collective_rpc("m", args=(1, "x"), kwargs={"k": 2}, rpc_timeout=5),
     "collective_rpc", ["m", 5.0, [1, "x"], {"k": 2}], [1, 2], [1, 2]),
    (lambda c: c.profile(), "profile", [True], None, None),
    (lambda c: c.profile(False), "profile", [False], None, None),
    (lambda c: c.profile(True, profile_prefix="run1", max_iterations=4), "profile", [True, "run1", None, 4],
     None, None),
]


@pytest.mark.parametrize("call, method, args, reply, expected", CASES)
async def test_typed_call_on_the_wire_and_typed_result(call, method, args, reply, expected):
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            sent, result = await roundtrip(engine, client, call, reply)
    assert sent.method == method
    assert list(sent.args) == args
    assert result == expected and type(result) is type(expected)


async def test_pause_generation_needs_vllm_0_33():
    async with pair("0.32.0") as (engine, client):
        with trio.fail_after(GUARD):
            for call in (client.pause_generation, client.resume_generation):
                with pytest.raises(UnsupportedByRuntimeError, match=r"vLLM 0\.32\.0.*0\.33") as ei:
                    await call()
                assert ei.value.runtime == "vllm"
            with pytest.raises(UnsupportedByRuntimeError, match=r"0\.32\.0"):
                await client.profile(True, profiler_kwargs={"record_shapes": True})
            # nothing was sent: the next message the engine sees is the next call
            sent, result = await roundtrip(engine, client, lambda c: c.is_scheduler_paused(), False)
            assert sent.method == "is_scheduler_paused" and result is False
    async with pair("0.33.0") as (engine, client):
        with trio.fail_after(GUARD):
            sent, _ = await roundtrip(engine, client, lambda c: c.pause_generation("keep"), None)
            assert (sent.method, list(sent.args)) == ("pause_generation", ["keep", True])
            sent, _ = await roundtrip(engine, client, lambda c: c.resume_generation(), None)
            assert (sent.method, list(sent.args)) == ("resume_scheduler", [])
            sent, _ = await roundtrip(engine, client, lambda c: c.profile(True, profiler_kwargs={"a": 1}), None)
            assert list(sent.args) == [True, None, None, None, {"a": 1}]


@pytest.mark.parametrize("call, reply", [
    (lambda c: c.wake_up(), 1),                  # an int, not a bool
    (lambda c: c.sleep(), True),                 # sleep returns nothing
    (lambda c: c.list_loras(), ["1"]),
    (lambda c: c.collective_rpc("x"), {"a": 1}),
])
async def test_reply_of_the_wrong_type_is_a_remote_protocol_error(call, reply):
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            sent, result = await roundtrip(engine, client, call, reply)
    assert isinstance(result, RemoteProtocolError), result
    assert sent.method in str(result)


async def test_engine_failure_is_a_utility_call_error():
    async with pair() as (engine, client):
        with trio.fail_after(GUARD):
            _, result = await roundtrip(engine, client, lambda c: c.list_loras(), None,
                                        failure="Call to list_loras method failed: LoRA is not enabled")
    assert isinstance(result, UtilityCallError) and "LoRA is not enabled" in str(result)


@pytest.mark.parametrize("build, exc, words", [
    (lambda v: control.sleep(v, 3), ValueError, "level"),
    (lambda v: control.sleep(v, True), ValueError, "level"),
    (lambda v: control.sleep(v, 1, "drain"), ValueError, "mode"),
    (lambda v: control.pause_scheduler(v, "abort", 1), TypeError, "clear_cache"),
    (lambda v: control.wake_up(v, "weights"), TypeError, "tags"),
    (lambda v: control.wake_up(v, [1]), TypeError, "tags"),
    (lambda v: control.remove_lora(v, 0), ValueError, "lora_id"),
    (lambda v: control.pin_lora(v, "1"), TypeError, "lora_id"),
    (lambda v: control.add_lora(v, {"lora_name": "a"}), TypeError, "LoRARequest"),
    (lambda v: control.collective_rpc(v, print), TypeError, "pickled"),
    (lambda v: control.collective_rpc(v, "m", timeout=0), ValueError, "rpc_timeout"),
    (lambda v: control.collective_rpc(v, "m", args="ab"), TypeError, "args"),
    (lambda v: control.profile(v, True, max_iterations=0), ValueError, "max_iterations"),
    (lambda v: control.reset_prefix_cache(v, "yes"), TypeError, "reset_running_requests"),
])
def test_bad_arguments_are_refused_naming_the_argument(build, exc, words):
    with pytest.raises(exc, match=words):
        build(V032)


@pytest.mark.parametrize("kw, words", [
    ({"lora_name": "", "lora_int_id": 1, "lora_path": "/p"}, "lora_name"),
    ({"lora_name": "a", "lora_int_id": 0, "lora_path": "/p"}, "lora_int_id"),
    ({"lora_name": "a", "lora_int_id": True, "lora_path": "/p"}, "lora_int_id"),
    ({"lora_name": "a", "lora_int_id": 1, "lora_path": ""}, "lora_path"),
    ({"lora_name": "a", "lora_int_id": 1, "lora_path": "/p", "load_inplace": 1}, "load_inplace"),
])
def test_lora_request_refuses_what_vllm_refuses(kw, words):
    with pytest.raises((TypeError, ValueError), match=words):
        LoRARequest(**kw)


@pytest.mark.parametrize("name", [
    "sleep", "wake_up", "is_sleeping", "pause_scheduler", "resume_scheduler", "is_scheduler_paused",
    "pause_generation", "resume_generation", "reset_prefix_cache", "list_loras", "profile",
])
def test_tokenspeed_has_no_control_plane(name):
    with pytest.raises(UnsupportedByRuntimeError, match=r"TokenSpeed 0\.1\.1") as ei:
        getattr(control, name)(TS)
    assert ei.value.runtime == "tokenspeed"


async def test_tokenspeed_client_refuses_typed_calls():
    from tests.helpers import tokenspeed_pair

    async with tokenspeed_pair() as (_, client):
        with trio.fail_after(GUARD):
            with pytest.raises(UnsupportedByRuntimeError, match="TokenSpeed"):
                await client.sleep(0)
            with pytest.raises(UnsupportedByRuntimeError, match="TokenSpeed"):
                await client.add_lora(LoRARequest(lora_name="a", lora_int_id=1, lora_path="/p"))


@pytest.mark.parametrize("timeout", [-1, float("nan"), "5", True])
async def test_a_bad_utility_timeout_is_refused_naming_it_and_nothing_is_sent(timeout):
    async with pair() as (engine, client):
        with pytest.raises(ValueError, match="timeout"):
            await client.is_sleeping(timeout=timeout)
        assert client.protocol.pending_utility_calls == 0
