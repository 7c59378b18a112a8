"""Garbage frames are counted, a streak means death; the sentinel means death
(issue 7), end to end against the mock engine process.

Already covered elsewhere (not repeated): the scripted fake engine's garbage
streak and sentinel (``tests/client/test_engine_death.py``), the launched
mock's sentinel (``tests/mock_engine/test_cli_and_mock.py``), and the
decoders' refusal of every malformed message (``tests/wire``). Added here:

- ``--fault garbage:N`` on the real mock process: tokens before the garbage
  are delivered, each garbage message fails the requests it may have carried
  with ``RemoteProtocolError`` (not death), a valid message in between resets
  the streak, and ``max_decode_errors`` in a row kill the link with every
  counter exact;
- the sentinel from an engine we did not spawn, which exits right after it:
  the cause stays ``"sentinel"`` (not the disconnect that follows).
"""

from __future__ import annotations

import pytest
import trio

from zmqdispatch import ClientConfig, EngineDeadError, RemoteProtocolError, connect, limits
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request
from zmqdispatch.testing import external_mock, mock_argv

from ..helpers import GUARD


async def one_garbage_failure(client, rid: str) -> tuple[list[int], BaseException]:
    """Run one request against the garbage-sending mock: its tokens and error."""
    tokens: list[int] = []
    async with client.generate(make_request(rid, max_tokens=1000)) as s:
        with pytest.raises((RemoteProtocolError, EngineDeadError)) as ei:
            async for delta in s:
                tokens += delta.token_ids
    return tokens, ei.value


async def test_mock_garbage_is_counted_a_valid_message_resets_the_streak_and_a_streak_is_death():
    # garbage from step 3 on; 50 ms steps leave the ABORT time to land, and
    # nothing below depends on it landing (only on message order).
    launch = mock_argv("{handshake_address}", "--fault", "garbage:2", "--step-interval-ms", "50")
    with trio.fail_after(GUARD):
        async with connect(launch=launch, config=ClientConfig(handshake_timeout=20, max_decode_errors=3)) as client:
            p, engine = client.protocol, client.engine()
            tokens, exc = await one_garbage_failure(client, "g0")
            assert len(tokens) == 2  # the two valid steps reached the stream first
            assert type(exc) is RemoteProtocolError and p.decode_errors >= 1 and client.is_alive
            # A valid message (this utility reply; the mock sends it after it
            # handled g0's ABORT, so no garbage follows it) resets the streak.
            assert await client.call_utility("zmqd_live_requests") == 0
            assert p.decode_error_streak == 0
            before = p.decode_errors
            outcomes = []
            while client.is_alive:
                outcomes.append((await one_garbage_failure(client, f"g{len(outcomes) + 1}"))[1])
            assert all(type(e) is RemoteProtocolError for e in outcomes[:-1])
            assert type(outcomes[-1]) is EngineDeadError and outcomes[-1].reason == "decode_errors"
            assert 1 <= len(outcomes) <= 3
            assert p.decode_error_streak == 3 and p.decode_errors == before + 3
            assert engine.death.reason == "decode_errors" and p.inflight == 0
            # the engine keeps sending garbage: a dead link counts nothing more
            await trio.sleep(0.2)
            assert p.decode_errors == before + 3
            # That incarnation takes nothing more (the mock dials the handshake
            # again once its link closed, and is served as a new incarnation).
            with pytest.raises(EngineDeadError):
                engine.check_alive()


async def test_sentinel_from_an_engine_started_elsewhere_is_the_cause_not_the_exit_after_it(tmp_path):
    hs = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with external_mock(hs, "--fault", "sentinel:3", "--step-interval-ms", "20") as proc:
            async with connect(hs, config=ClientConfig(handshake_timeout=20)) as client:
                streams = [client.generate(make_request(f"s{i}", max_tokens=1000)) for i in range(5)]
                for s in streams:
                    await s.__aenter__()
                for s in streams:
                    got = 0
                    with pytest.raises(EngineDeadError) as ei:
                        async for delta in s:
                            got += len(delta.token_ids)
                    assert ei.value.reason == "sentinel" and 1 <= got <= 3
                    await s.__aexit__(None, None, None)
                assert client.death.reason == "sentinel"
                assert await proc.wait() == 1  # the engine exits after its sentinel
                assert client.death.reason == "sentinel"


async def test_a_frame_above_max_frame_bytes_fails_the_requests_it_may_have_carried(monkeypatch):
    from zmqdispatch.testing import open_fake_engine_pair as fake_pair

    monkeypatch.setattr(limits, "MAX_FRAME_BYTES", 4096)  # read by connect() for MAXMSGSIZE
    async with fake_pair() as (engine, client):
        with trio.fail_after(10):
            async with client.generate(make_request("r1", max_tokens=1000)) as s:
                await engine.receive_add()
                await engine.send_tokens("r1", list(range(3, 2003)))  # ~6 KB: dropped by libzmq
                await engine.send_tokens("r1", [7], finish=wire.FinishReason.STOP)
                tokens = []
                with pytest.raises(RemoteProtocolError):
                    async for delta in s:
                        tokens += delta.token_ids
