"""Engine death: every open stream fails with one typed error, new requests are
refused, nothing hangs. Known failures K8, K9, K12 (docs/known-failures.md) and the death sources of the
transport issue (sentinel, process exit, EHOSTUNREACH/disconnect, decode-error
streak, silence, wedged input)."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile

import pytest
import trio
import trio.testing

from zmqdispatch import limits
from zmqdispatch import (
    ClientConfig,
    EngineDeadError,
    EngineHandshakeError,
    EngineHandshakeTimeout,
    connect,
)
from zmqdispatch.testing import FakeEngine, dial, ready_response
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request

GUARD = 20


async def open_streams(client, engine, n):
    streams = [client.generate(make_request(f"r{i}")) for i in range(n)]
    for s in streams:
        await s.__aenter__()
    for _ in range(n):
        await engine.receive_add()
    return streams


async def expect_all_dead(streams, reason):
    for s in streams:
        with pytest.raises(EngineDeadError) as ei:
            await s.receive()
        assert ei.value.reason == reason
        await s.__aexit__(None, None, None)


async def test_sentinel_fails_all_streams_and_refuses_new_ones():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            streams = await open_streams(client, engine, 3)
            await engine.send_sentinel()
            await expect_all_dead(streams, "sentinel")
            assert not client.is_alive and client.death.reason == "sentinel"
            with pytest.raises(EngineDeadError):
                client.generate(make_request("new"))
            with pytest.raises(EngineDeadError):
                await client.call_utility("is_sleeping")


async def test_garbage_fails_open_streams_and_a_streak_means_death():
    from zmqdispatch import RemoteProtocolError

    async with fake_pair(max_decode_errors=3) as (engine, client):
        with trio.fail_after(GUARD):
            (s,) = await open_streams(client, engine, 1)
            await engine.send_raw([b"\xc1\xc1"])  # could have carried r0's tokens
            with pytest.raises(RemoteProtocolError):
                await s.receive()
            assert await engine.receive_abort() == ("r0",)
            assert client.is_alive
            for _ in range(2):
                await engine.send_raw([b"\xc1\xc1"])
            cause = await client.wait_dead()
            assert cause.reason == "decode_errors" and client.protocol.decode_errors == 3


async def test_silence_with_requests_in_flight_means_death(mock_clock):
    async with fake_pair(silence_timeout=300.0) as (engine, client):
        t0 = trio.current_time()
        (s,) = await open_streams(client, engine, 1)
        await expect_all_dead([s], "silence")
        assert 300.0 <= trio.current_time() - t0 < 301.0


async def test_silence_while_idle_is_not_death(mock_clock):
    async with fake_pair(silence_timeout=10.0) as (engine, client):
        await trio.sleep(100.0)
        assert client.is_alive
        async with client.generate(make_request("r1")) as s:
            await engine.receive_add()
            await engine.send_tokens("r1", [1], finish=wire.FinishReason.STOP)
            assert (await s.receive()).token_ids == [1]


async def test_engine_that_stops_reading_fails_sends_within_send_timeout(mock_clock):
    async with fake_pair(send_timeout=10.0, send_hwm=1, engine_kw={"input_rcvhwm": 1}) as (engine, client):
        # The engine never reads: pipes fill up, a send waits, then times out.
        streams = []
        with pytest.raises(EngineDeadError) as ei:
            for i in range(10_000):
                s = client.generate(make_request(f"r{i}"))
                streams.append(s)
                await s.__aenter__()
        assert ei.value.reason == "send_timeout"
        assert client.death.reason == "send_timeout" and client.protocol.inflight == 0
        assert 3 <= len(streams) < 10_000


async def test_engine_disconnect_is_death_and_submit_fails_fast():  # K12
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            (s,) = await open_streams(client, engine, 1)
            engine.close()
            cause = await client.wait_dead()
            assert cause.reason in ("disconnected", "unreachable")
            await expect_all_dead([s], cause.reason)
            with pytest.raises(EngineDeadError):
                client.generate(make_request("pinned"))
            assert not client.protocol.is_live("pinned")


async def _input_closed_and_noticed(engine, client) -> None:
    """Close the engine's input connection and wait until the client has seen
    it (a death sign; a client without the drain declares the death here)."""
    engine.socks.input.close()
    await client.engine()._ending.wait()


@pytest.mark.parametrize("sentinel", [True, False])
async def test_outputs_sent_before_an_input_disconnect_are_delivered(sentinel):
    # A dying engine's input connection can close before its last outputs are
    # read: the finished request keeps its tokens and finish; the others fail
    # with the engine's own cause (its sentinel) when it sent one.
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            done, other = await open_streams(client, engine, 2)
            await _input_closed_and_noticed(engine, client)
            await engine.send_tokens("r0", [5, 6], finish=wire.FinishReason.STOP)
            if sentinel:
                await engine.send_sentinel()
            engine.socks.output.close(linger_ms=1000)
            delta = await done.receive()
            assert list(delta.token_ids) == [5, 6] and delta.finish_reason == wire.FinishReason.STOP
            await done.__aexit__(None, None, None)
            await expect_all_dead([other], "sentinel" if sentinel else "disconnected")


async def test_an_input_disconnect_with_the_output_link_still_up_is_death_after_the_grace(mock_clock):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            (s,) = await open_streams(client, engine, 1)
            await _input_closed_and_noticed(engine, client)
            t0 = trio.current_time()
            # the death is pending (the open stream may still get outputs),
            # but new requests are refused at once and the client says so
            assert not client.is_alive and client.death.reason == "disconnected"
            with pytest.raises(EngineDeadError) as ei:
                client.generate(make_request("new"))
            assert ei.value.reason == "disconnected"
            with pytest.raises(EngineDeadError):
                await client.call_utility("is_sleeping")
            await expect_all_dead([s], "disconnected")
            assert trio.current_time() - t0 <= limits.OUTPUT_DROP_GRACE + 0.1


async def test_an_input_disconnect_after_the_output_link_dropped_is_death_at_once(mock_clock):
    # SIGKILL of an idle engine: its output connection may be seen closing
    # first; the input disconnect then has no outputs left to wait for.
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            engine.socks.output.close()
            while client.engine()._output_links:  # the client saw the output connection drop
                await trio.sleep(0.01)
            engine.socks.input.close()
            await client.engine()._ending.wait()
            t0 = trio.current_time()
            cause = await client.wait_dead()
            assert cause.reason == "disconnected" and trio.current_time() - t0 < limits.OUTPUT_DROP_GRACE


async def test_handshake_timeout_when_ready_never_comes(mock_clock):  # K9a (fake engine)
    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    engine = FakeEngine(addr, send_ready=False)
    # No jump while HELLO and INIT are in flight (a loaded machine can hold
    # real socket I/O longer than the fixture's 50 ms of idleness): time may
    # run only once the engine got its INIT and is stalling before READY.
    mock_clock.autojump_threshold = math.inf

    async def stall_before_ready() -> None:
        await engine.run_handshake()
        mock_clock.autojump_threshold = 0.05

    try:
        async with trio.open_nursery() as n:
            n.start_soon(stall_before_ready)
            t0 = trio.current_time()
            with pytest.raises(EngineHandshakeTimeout) as ei:
                async with connect(addr, config=ClientConfig(handshake_timeout=5.0)):
                    pass  # pragma: no cover
            assert ei.value.stage == "READY"
            assert 5.0 <= trio.current_time() - t0 < 5.5
            engine.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def mock_argv(*extra: str) -> list[str]:
    return [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}", *extra]


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


async def test_handshake_timeout_kills_the_spawned_engine():  # K9a (real process)
    with trio.fail_after(GUARD + 30):
        with pytest.raises(EngineHandshakeTimeout) as ei:
            async with connect(launch=mock_argv("--fault", "no-ready"),
                               config=ClientConfig(handshake_timeout=8.0, terminate_grace=2.0)):
                pass  # pragma: no cover
        assert ei.value.stage in ("HELLO", "READY")


# How an engine we did not launch dies in its handshake (its DEALER, identity 0).
DYING_HANDSHAKES = {
    # died loading its model: HELLO, INIT received, then gone
    "after INIT": ("vllm", True, "READY"),
    # gone before our INIT can reach it
    "right after HELLO": ("vllm", False, None),
    # TokenSpeed order: READY first, died before connecting its input socket
    "tokenspeed: after READY, before the ready response": ("tokenspeed", True, "input_registration"),
}


async def _dying_engine(addr: str, dies: str) -> None:
    runtime, wait_init, _ = DYING_HANDSHAKES[dies]
    tokenspeed = runtime == "tokenspeed"
    await dial(addr, ready_response(), tokenspeed=tokenspeed,
               hang_up_after="READY" if tokenspeed else "INIT" if wait_init else "HELLO")


@pytest.mark.parametrize("death_on_disconnect", [True, False])
@pytest.mark.parametrize("dies", list(DYING_HANDSHAKES))
async def test_an_engine_that_dies_in_its_handshake_fails_it_at_once(dies, death_on_disconnect):
    # With death_on_disconnect the client says so at once instead of waiting
    # out handshake_timeout (600 s here); without it, the (short) timeout,
    # unless our INIT already met EHOSTUNREACH. Never an internal exception.
    d = tempfile.mkdtemp(prefix="zqt-")
    addr = f"ipc://{d}/hs.sock"
    timeout = 600.0 if death_on_disconnect else 1.0
    try:
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as n:
                n.start_soon(_dying_engine, addr, dies)
                with pytest.raises(EngineHandshakeError) as ei:
                    async with connect(addr, config=ClientConfig(handshake_timeout=timeout,
                                                                 death_on_disconnect=death_on_disconnect)):
                        pass  # pragma: no cover
        stage = DYING_HANDSHAKES[dies][2]
        if death_on_disconnect:
            assert not isinstance(ei.value, EngineHandshakeTimeout)
            assert "closed its handshake connection" in str(ei.value)
            if stage is not None:
                assert f"waited for {stage}" in str(ei.value)
        elif stage is not None:
            assert isinstance(ei.value, EngineHandshakeTimeout)
        # else: EHOSTUNREACH on our INIT, or (if it raced the close) the timeout
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_cancel_during_handshake_terminates_engine_and_removes_ipc_dir(tmp_path):  # K9c
    info = tmp_path / "child.txt"
    child = (
        "import os, sys, time; "
        f"open({str(info)!r}, 'w').write(f'{{os.getpid()}} {{sys.argv[1]}}'); "
        "time.sleep(600)"
    )
    with trio.fail_after(GUARD + 30):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                async def cancel_when_child_is_up():
                    while not info.exists() or not info.read_text():
                        await trio.sleep(0.01)
                    scope.cancel()

                n.start_soon(cancel_when_child_is_up)
                async with connect(launch=[sys.executable, "-c", child, "{handshake_address}"],
                                   config=ClientConfig(handshake_timeout=600, terminate_grace=2.0)):
                    pass  # pragma: no cover
        assert scope.cancelled_caught
    pid_text, address = info.read_text().split()
    assert pid_gone(int(pid_text))
    assert address.startswith("ipc://")
    assert not os.path.exists(os.path.dirname(address[len("ipc://"):]))


async def test_spawned_engine_exit_is_death_for_every_stream():  # K8
    with trio.fail_after(GUARD + 30):
        async with connect(launch=mock_argv("--step-interval-ms", "50"),
                           config=ClientConfig(handshake_timeout=30, death_on_disconnect=False)) as client:
            streams = [client.generate(make_request(f"r{i}", max_tokens=4000)) for i in range(3)]
            for s in streams:
                await s.__aenter__()
            for s in streams:
                await s.receive()
            client.process.kill()
            cause = await client.wait_dead()
            assert cause.reason == "process_exit"
            for s in streams:
                with pytest.raises(EngineDeadError):
                    while True:
                        await s.receive()
            with pytest.raises(EngineDeadError):
                client.generate(make_request("after"))


async def test_leaving_with_a_stopped_spawned_engine_stops_it_with_sigterm_not_after_the_grace():
    # A SIGSTOPped process acts on SIGTERM only once resumed: the client sends
    # SIGCONT with it, so the engine exits cleanly (code 0) instead of being
    # SIGKILLed when terminate_grace runs out.
    import signal

    with trio.fail_after(GUARD + 30):
        config = ClientConfig(handshake_timeout=30, terminate_grace=10.0)
        async with connect(launch=mock_argv(), config=config) as client:
            proc = client.process
            os.killpg(proc.pid, signal.SIGSTOP)
        assert proc.returncode == 0


async def test_spawned_engine_that_exits_during_handshake_is_reported():
    with trio.fail_after(GUARD):
        with pytest.raises(EngineHandshakeError, match="exited with code 3"):
            async with connect(launch=[sys.executable, "-c", "raise SystemExit(3)"],
                               config=ClientConfig(handshake_timeout=30)):
                pass  # pragma: no cover


def test_a_launched_engine_writes_to_fd_2_when_sys_stderr_has_no_file(monkeypatch):
    import io
    import subprocess

    from zmqdispatch import _engine_lifecycle

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # Jupyter, pytest's capture
    assert _engine_lifecycle._our_stderr() == 2
    monkeypatch.setattr(sys, "stderr", None)  # the interpreter started with fd 2 closed
    assert _engine_lifecycle._our_stderr() in (2, subprocess.DEVNULL)


async def test_connect_launch_works_when_sys_stderr_is_a_stringio(monkeypatch):
    import io

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with trio.fail_after(GUARD + 30):
        async with connect(launch=mock_argv(), config=ClientConfig(handshake_timeout=30)) as client:
            assert client.is_alive
