"""The public engine doubles of ``zmqdispatch.testing`` keep their promises."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
import zmq

from zmqdispatch import ClientConfig, EngineDeadError, EngineHandshakeError, connect
from zmqdispatch._zmq_trio import ZmqContext
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.protocol.versions import EngineVersion
from zmqdispatch.testing import (
    EngineSockets,
    FakeEngine,
    dial,
    open_fake_engine_pair,
    open_mock_engine_pair,
    ready_response,
)
from zmqdispatch.wire.vllm import FinishReason

from ..helpers import GUARD, make_request, make_ts_request


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
def test_ready_response_is_one_a_client_accepts_for_its_runtime(runtime: Literal["vllm", "tokenspeed"]) -> None:
    r = ready_response(2048, runtime=runtime, engine_index=3)
    assert Runtime.of_ready_response(r) is Runtime(runtime)
    assert EngineVersion.parse(r.vllm_version).known
    assert (r.max_model_len, r.data_parallel_rank, r.block_size) == (2048, 3, 16)
    assert (r.kv_cache_size_tokens is not None) is (runtime == "tokenspeed")
    assert ready_response(vllm_version="0.34.0").vllm_version == "0.34.0"
    with pytest.raises(TypeError):
        ready_response(no_such_field=1)


async def test_fake_engine_pair_takes_client_config_fields_and_ready() -> None:
    with trio.fail_after(GUARD):
        async with open_fake_engine_pair(ready=ready_response(77), handshake_timeout=GUARD) as (engine, client):
            assert client.max_model_len == 77
            async with client.generate(make_request("r1", max_tokens=2)) as stream:
                add = await engine.receive_add()
                await engine.send_tokens(add.request_id, [5, 6], finish=FinishReason.LENGTH)
                assert [t async for d in stream for t in d.token_ids] == [5, 6]


async def test_fake_engine_pair_refuses_an_unknown_config_field_naming_it() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        async with open_fake_engine_pair(no_such_option=1):
            pass  # pragma: no cover


async def test_fake_engine_pair_raises_a_refused_handshake_as_itself_and_closes_the_engine() -> None:
    seen: list[FakeEngine] = []
    real_init = FakeEngine.__init__

    def recording_init(self: FakeEngine, *a: Any, **kw: Any) -> None:
        real_init(self, *a, **kw)
        seen.append(self)

    with trio.fail_after(GUARD), pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeEngine, "__init__", recording_init)
        with pytest.raises(EngineHandshakeError, match=r"0\.34\.0"):  # not an ExceptionGroup around it
            async with open_fake_engine_pair(ready=ready_response(vllm_version="0.34.0"), handshake_timeout=GUARD):
                pass  # pragma: no cover
    (engine,) = seen
    assert engine.socks is not None and engine.socks.input.closed and engine.socks.output.closed


@pytest.mark.parametrize("pair", [open_fake_engine_pair, open_mock_engine_pair])
async def test_an_error_in_the_body_of_a_pair_comes_out_as_itself(pair: Callable[..., Any]) -> None:
    with trio.fail_after(GUARD), pytest.raises(KeyError, match="from the body"):
        async with pair(handshake_timeout=GUARD):
            raise KeyError("from the body")


@pytest.mark.parametrize("runtime, make", [("vllm", make_request), ("tokenspeed", make_ts_request)])
async def test_mock_engine_pair_streams_for_each_runtime(runtime: Literal["vllm", "tokenspeed"],
                                                         make: Callable[[str], Any]) -> None:
    with trio.fail_after(GUARD):
        async with open_mock_engine_pair(runtime=runtime, handshake_timeout=GUARD) as (engine, client):
            assert client.runtime is Runtime(runtime)
            async with client.generate(make("r1")) as stream:
                deltas = [d async for d in stream]
            assert sum(len(d.token_ids) for d in deltas) == 16
            assert engine.core.requests_received == 1


@pytest.mark.parametrize("tokenspeed", [False, True])
@pytest.mark.parametrize("stage", ["HELLO", "INIT", "READY"])
async def test_an_engine_that_hangs_up_in_its_handshake_fails_it(tmp_path: Path, tokenspeed: bool,
                                                                  stage: Literal["HELLO", "INIT", "READY"]) -> None:
    addr = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            socks: list[EngineSockets] = []

            async def engine() -> None:
                socks.append(await dial(addr, ready_response(runtime="tokenspeed" if tokenspeed else "vllm"),
                                        tokenspeed=tokenspeed, hang_up_after=stage))

            nursery.start_soon(engine)
            if stage == "READY" and not tokenspeed:
                # vLLM sends READY last: the engine goes away as its handshake completes.
                # Whether the client saw the handshake close first or the engine die
                # just after, it gets a typed error, never a hang.
                with pytest.raises((EngineHandshakeError, EngineDeadError)):
                    async with connect(addr, config=ClientConfig(handshake_timeout=5)) as client, \
                            client.generate(make_request("r1")) as stream:
                        async for _ in stream:
                            pass
            else:
                with pytest.raises(EngineHandshakeError):
                    async with connect(addr, config=ClientConfig(handshake_timeout=5)):
                        pass  # pragma: no cover
    (s,) = socks
    assert s.input.closed and s.output.closed


async def test_a_fake_engine_that_never_sends_ready_times_the_handshake_out(tmp_path: Path,
                                                                            mock_clock: object) -> None:
    addr = f"ipc://{tmp_path}/hs.sock"
    engine = FakeEngine(addr, send_ready=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run_handshake)
        with pytest.raises(EngineHandshakeError, match="READY"):
            async with connect(addr, config=ClientConfig(handshake_timeout=60)):
                pass  # pragma: no cover
        await engine.handshake_done.wait()
        engine.close()


async def test_detach_hands_a_working_socket_to_blocking_code() -> None:
    ctx = ZmqContext()
    addr = f"inproc://zmqd-test-{uuid.uuid4().hex}"
    a = ctx.socket(zmq.PAIR, name="a")
    b = ctx.socket(zmq.PAIR, name="b")
    a.bind(addr)
    b.connect(addr)
    raw = b.detach()
    assert b.closed and not raw.closed
    with pytest.raises(trio.ClosedResourceError):
        b.detach()
    await a.send([b"x"])
    assert raw.recv_multipart() == [b"x"]
    raw.close(linger=0)
    a.close()
