"""The mock engine as a service: it serves one client after another (both
runtimes), stops at once on SIGINT / SIGTERM in every state, and dies on a
prompt that reaches ``max_model_len`` as vLLM 0.32 does."""

from __future__ import annotations

import errno
import signal
import socket
import time

import pytest
import trio
import zmq

from zmqdispatch import ClientConfig, EngineDeadError, connect
from zmqdispatch.mock.server import MockEngineConfig, serve_mock_engine, start_mock_engine
from zmqdispatch.wire import vllm as wire

from zmqdispatch.testing import external_mock, fixed_addresses

from ..helpers import GUARD, make_request, make_ts_request

#: a stop must take well under a second; the bound only keeps a hang from
#: blocking the suite (the machine may be busy)
STOP_BOUND = 5.0


def request(runtime: str, rid: str):
    return make_ts_request(rid, max_new_tokens=3) if runtime == "tokenspeed" else make_request(rid, max_tokens=3)


async def one_generate(address: str, runtime: str, rid: str) -> int:
    async with connect(address, config=ClientConfig(handshake_timeout=GUARD), runtime=runtime) as client:
        async with client.generate(request(runtime, rid)) as stream:
            return sum([len(d.token_ids) async for d in stream])


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
async def test_the_in_process_mock_serves_one_client_after_another(tmp_path, runtime):
    address = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=address, runtime=runtime, step_interval=0)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_mock_engine(cfg, in_process=True))
            for i in range(3):
                assert await one_generate(address, runtime, f"r{i}") == 3
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed"])
async def test_the_mock_engine_program_serves_one_client_after_another(tmp_path, runtime):
    address = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with external_mock(address, "--runtime", runtime, "--step-interval-ms", "0") as proc:
            for i in range(2):
                assert await one_generate(address, runtime, f"r{i}") == 3
            assert proc.returncode is None


async def test_a_resumed_client_gets_the_same_engine_back_not_a_new_one(tmp_path):
    address, cfg = fixed_addresses(tmp_path, handshake_timeout=GUARD)
    with trio.fail_after(GUARD):
        async with external_mock(address, "--step-interval-ms", "0"):
            async with connect(address, config=cfg) as client:
                async with client.generate(make_request("a", max_tokens=2)) as s:
                    [d async for d in s]
                session = client.session
            async with connect(config=cfg, resume=session) as client:
                stats = await client.call_utility("zmqd_stats")
                assert stats["requests_received"] == 1  # the engine that served "a"


# ------------------------------------------------------------------ signals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def accept_one(listener: trio.SocketListener) -> None:
    """Wait until the mock's handshake DEALER connects (it is dialing)."""
    stream = await listener.accept()
    await stream.aclose()


async def stop(proc: trio.Process, sig: int) -> float:
    start = time.monotonic()
    proc.send_signal(sig)
    with trio.fail_after(STOP_BOUND):
        code = await proc.wait()
    assert code == 0
    return time.monotonic() - start


async def tcp_listener(port: int) -> trio.SocketListener:
    """Listen on *port*. libzmq closes a closed socket's listener in its I/O
    thread, after ``close()`` returned: a port a client just released may
    still be taken for a moment, so EADDRINUSE is retried (the caller's
    ``fail_after`` bounds it)."""
    while True:
        try:
            (listener,) = await trio.open_tcp_listeners(port, host="127.0.0.1")
            return listener
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            await trio.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_the_mock_stops_on_a_signal_before_any_client_came(sig):
    port = free_port()
    listener = await tcp_listener(port)
    with trio.fail_after(GUARD):
        async with external_mock(f"tcp://127.0.0.1:{port}") as proc:
            await accept_one(listener)  # it dials; nobody answers with ZMTP
            await stop(proc, sig)
    await listener.aclose()


async def test_the_mock_stops_on_a_signal_during_the_handshake():
    port = free_port()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    try:
        with trio.fail_after(GUARD):
            async with external_mock(f"tcp://127.0.0.1:{port}") as proc:
                while not router.poll(10):  # HELLO arrived; no INIT is sent
                    await trio.sleep(0.01)
                router.recv_multipart()
                await stop(proc, signal.SIGTERM)
    finally:
        router.close(linger=0)


async def test_the_mock_stops_on_a_signal_while_serving_and_aborts_the_stream():
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with trio.fail_after(GUARD):
        async with external_mock(address) as proc:
            async with connect(address, config=ClientConfig(handshake_timeout=GUARD)) as client:
                async with client.generate(make_request("long", max_tokens=4000)) as stream:
                    last = None
                    async for delta in stream:
                        if last is None:
                            await stop(proc, signal.SIGINT)
                        last = delta
            assert last.finish_reason is wire.FinishReason.ABORT  # vLLM's clean stop


async def test_the_mock_stops_on_a_signal_between_clients():
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with trio.fail_after(GUARD):
        async with external_mock(address) as proc:
            async with connect(address, config=ClientConfig(handshake_timeout=GUARD)) as client:
                async with client.generate(make_request("a", max_tokens=2)) as s:
                    [d async for d in s]
            # the client left (its handshake ROUTER closed): the mock dials for the next one
            listener = await tcp_listener(port)
            await accept_one(listener)
            await stop(proc, signal.SIGTERM)
            await listener.aclose()


# ------------------------------------------------------------------ max_model_len


@pytest.mark.parametrize("extra", [0, 1])
async def test_a_prompt_reaching_max_model_len_kills_the_vllm_mock_as_vllm_032(tmp_path, extra):
    address = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=address, max_model_len=16)
    exited = trio.Event()

    async def engine() -> None:
        mock = await start_mock_engine(cfg, in_process=True)
        await mock.run()  # returns when the in-process engine "exits"
        exited.set()

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine)
            async with connect(address, config=ClientConfig(handshake_timeout=GUARD)) as client:
                # the client's own check refuses it first ...
                too_long = make_request("long", prompt=range(16 + extra), max_tokens=1)
                with pytest.raises(Exception, match=r"max_model_len|context"):
                    client.generate(too_long)
                # ... so bypass it, as a client without that check would
                client.engine().check_request = lambda _request: None  # type: ignore[method-assign]
                with pytest.raises(EngineDeadError) as ei:
                    async with client.generate(too_long) as stream:
                        [d async for d in stream]
                assert ei.value.reason == "sentinel"
            await exited.wait()


async def test_a_prompt_one_below_max_model_len_still_gets_its_token(tmp_path):
    address = f"ipc://{tmp_path}/hs.sock"
    cfg = MockEngineConfig(handshake_address=address, max_model_len=16)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_mock_engine(cfg, in_process=True))
            async with connect(address, config=ClientConfig(handshake_timeout=GUARD)) as client:
                async with client.generate(make_request("fits", prompt=range(15), max_tokens=1)) as stream:
                    deltas = [d async for d in stream]
            assert sum(len(d.token_ids) for d in deltas) == 1
            assert deltas[-1].finish_reason is wire.FinishReason.LENGTH
            nursery.cancel_scope.cancel()
