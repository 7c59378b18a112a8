"""The engine stops reading its input: sends time out, requests fail, and the
client serves again once an engine is back on the same addresses (issue 7).

What "stops reading" does on the wire depends on where it stops:

- **the whole engine process is frozen** (SIGSTOP, swapped out, a debugger):
  libzmq's I/O thread in the engine stops too, the kernel socket buffer fills,
  our input pipe fills to ``send_hwm`` and a send waits: after
  ``send_timeout`` the engine is dead with ``reason="send_timeout"``.
- **only the engine's input thread stops** (vLLM's input thread dies silently
  on a request its checks refuse; the mock's ``--fault stop-reading:N``):
  vLLM's input DEALER has ``RCVHWM`` 0, so the engine's libzmq keeps
  accepting and buffering every ADD; our sends never block. What catches it
  is the silence watchdog (``reason="silence"``). Asserted below, because it
  means ``send_timeout`` alone does not protect against a dead input thread.

What "back on the same addresses" means with vLLM's topology
(``docs/vllm-wire.md`` §6): an engine keeps re-dialing the fixed
input/output addresses it got in its handshake, and never handshakes again.
So

- the *same* engine coming back (thawed) is re-attached with
  ``connect(resume=session)``, no handshake;
- a *restarted* engine (a new process) dials the handshake address again: a
  new ``connect(handshake_address, config)`` on the same fixed handshake and
  data-plane addresses. The stale socket files the previous client left
  behind (libzmq does not remove them on close) are unlinked by ``_ipc``.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from zmqdispatch import EngineDeadError, connect
from zmqdispatch.testing import external_mock, fixed_addresses

from ..helpers import GUARD, make_request

# ~3 KB per ADD (1,000 two-byte-msgpack token ids): the kernel buffers fill fast.
BIG_PROMPT = list(range(1000, 2000))


async def collect(stream) -> list[int]:
    tokens = []
    async for delta in stream:
        tokens += delta.token_ids
    return tokens


async def fill_until_dead(client, prefix: str, max_tokens: int = 4) -> list:
    """Submit and enter requests until one cannot be sent; return them all."""
    streams = []
    with pytest.raises(EngineDeadError) as ei:
        for i in range(100_000):
            s = client.generate(make_request(f"{prefix}{i}", prompt=BIG_PROMPT, max_tokens=max_tokens))
            streams.append(s)
            await s.__aenter__()
    assert ei.value.reason == client.death.reason
    return streams


async def test_a_frozen_engine_times_sends_out_then_serves_again_after_resume(tmp_path):
    hs, cfg = fixed_addresses(tmp_path, handshake_timeout=20, send_timeout=0.5, send_hwm=8, silence_timeout=60)
    with trio.fail_after(GUARD):
        async with external_mock(hs, "--step-interval-ms", "20") as proc:
            async with connect(hs, config=cfg) as client:
                running = [client.generate(make_request(f"run{i}", max_tokens=40)) for i in range(4)]
                for s in running:
                    await s.__aenter__()
                    assert (await s.receive()).token_ids
                os.kill(proc.pid, signal.SIGSTOP)
                t_stop = trio.current_time()
                sent = await fill_until_dead(client, "w")
                elapsed = trio.current_time() - t_stop
                assert client.death.reason == "send_timeout"
                # one send waited the full send_timeout; filling the buffers is quick
                assert cfg.send_timeout <= elapsed < cfg.send_timeout + 3.0
                assert 2 <= len(sent) < 10_000
                # the last one's `async with` entry raised it already (pytest.raises above)
                for s in running + sent[:-1]:
                    with pytest.raises(EngineDeadError) as ei:
                        while True:
                            await s.receive()
                    assert ei.value.reason == "send_timeout"
                    await s.__aexit__(None, None, None)
                assert client.protocol.inflight == 0
                with pytest.raises(EngineDeadError):
                    client.generate(make_request("refused"))
                with pytest.raises(EngineDeadError):
                    await client.call_utility("zmqd_live_requests")
                session = client.session
            assert session is not None

            # The same engine comes back and re-dials the fixed addresses.
            os.kill(proc.pid, signal.SIGCONT)
            async with connect(config=cfg, resume=session) as client:
                async with client.generate(make_request("back", max_tokens=5)) as s:
                    assert len(await collect(s)) == 5
                # The ADDs that reached the engine before it froze run to their
                # max_tokens; their outputs are dropped as unknown here.
                while await client.call_utility("zmqd_live_requests") > 0:
                    await trio.sleep(0.05)
                assert client.protocol.unknown_outputs > 0
                assert client.protocol.inflight == 0


async def test_an_engine_whose_input_thread_stops_dies_of_silence_and_a_restarted_engine_serves(tmp_path):
    hs, cfg = fixed_addresses(tmp_path, handshake_timeout=20, send_timeout=0.5, send_hwm=8, silence_timeout=1.0)
    with trio.fail_after(GUARD):
        async with external_mock(hs, "--fault", "stop-reading:2", "--step-interval-ms", "5"):
            async with connect(hs, config=cfg) as client:
                for i in range(2):  # read and served
                    async with client.generate(make_request(f"ok{i}", max_tokens=3)) as s:
                        assert len(await collect(s)) == 3
                # Never read; but nothing blocks either: 300 ADDs (~1 MB) are
                # accepted, because the engine's libzmq keeps receiving.
                streams = [client.generate(make_request(f"lost{i}", prompt=BIG_PROMPT)) for i in range(300)]
                for s in streams:
                    await s.__aenter__()
                t_sent = trio.current_time()
                cause = await client.wait_dead()
                assert cause.reason == "silence"
                assert trio.current_time() - t_sent < cfg.silence_timeout + 2.0
                for s in streams:
                    with pytest.raises(EngineDeadError) as ei:
                        await s.receive()
                    assert ei.value.reason == "silence"
                    await s.__aexit__(None, None, None)
                assert client.protocol.inflight == 0
        # The wedged engine was restarted (killed above): the new process dials
        # the same handshake address; the client binds the same addresses again.
        assert os.path.exists(f"{tmp_path}/in.sock")  # stale socket files left by libzmq
        async with external_mock(hs, "--step-interval-ms", "5"):
            async with connect(hs, config=cfg) as client:
                async with client.generate(make_request("fresh", max_tokens=4)) as s:
                    assert len(await collect(s)) == 4
                assert await client.call_utility("zmqd_live_requests") == 0


async def test_requests_orphaned_by_a_send_timeout_are_aborted_once_the_engine_is_back(tmp_path):
    hs, cfg = fixed_addresses(tmp_path, handshake_timeout=20, send_timeout=0.3, send_hwm=8, silence_timeout=60)
    with trio.fail_after(GUARD):
        async with external_mock(hs, "--step-interval-ms", "20") as proc:
            async with connect(hs, config=cfg) as client:
                s = client.generate(make_request("long", max_tokens=3000))
                await s.__aenter__()
                await s.receive()
                os.kill(proc.pid, signal.SIGSTOP)
                await fill_until_dead(client, "w")
                session = client.session
            os.kill(proc.pid, signal.SIGCONT)
            async with connect(config=cfg, resume=session) as client:
                with trio.move_on_after(0.5):
                    while await client.call_utility("zmqd_live_requests") > 0:
                        await trio.sleep(0.05)
                assert await client.call_utility("zmqd_live_requests") == 0
