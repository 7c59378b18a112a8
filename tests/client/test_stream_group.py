"""StreamGroup: many requests read by one task in batches, over real sockets
(the in-process TokenSpeed mock engine, and the vLLM mock engine process)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from zmqdispatch import ClientConfig, connect
from zmqdispatch.errors import DuplicateRequestIdError, EngineAbortedRequest, EngineDeadError, LocalProtocolError
from zmqdispatch.testing import mock_argv
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, make_ts_request, tokenspeed_pair


async def drain(group) -> tuple[dict[str, list], dict[str, BaseException], int]:
    """Receive until every request delivered its terminal item; check that nothing
    arrives for a request after it."""
    tokens: dict[str, list] = {}
    errors: dict[str, BaseException] = {}
    done: set[str] = set()
    batches = 0
    while len(group):
        batch = await group.receive()
        batches += bool(batch)
        for member, item in batch:
            rid = member.request_id
            assert rid not in done, f"{rid} delivered after its terminal item"
            if isinstance(item, BaseException):
                errors[rid] = item
                done.add(rid)
            else:
                tokens.setdefault(rid, []).extend(item.token_ids)
                if item.finish_reason is not None:
                    done.add(rid)
    return tokens, errors, batches


async def finished_unread(client, group, rid: str, tokens: int):
    """Add *rid* to *group* and wait until the engine finished it (the connection
    no longer holds it) while the group's reader has not taken its items."""
    member = group.generate(make_ts_request(rid, max_new_tokens=tokens))
    with trio.fail_after(5):
        while client.protocol.is_live(rid):
            await trio.sleep(0.005)
    return member


async def test_one_reader_gets_every_stream_in_batches():
    async with tokenspeed_pair() as (engine, client):
        async with client.stream_group() as group:
            ids = [group.generate(make_ts_request(f"g{i}", max_new_tokens=20)).request_id for i in range(50)]
            assert len(group) == 50
            with trio.fail_after(20):
                tokens, errors, batches = await drain(group)
        assert not errors and sorted(tokens) == sorted(ids)
        assert all(len(t) == 20 for t in tokens.values())
        # 50 requests x 20 ticks = 1,000 deliveries at most; one wake-up per step
        assert batches <= 200, batches
        assert client.protocol.inflight == 0 and not engine.core.running


async def test_vllm_engine_and_request_order_is_kept():
    with trio.fail_after(30):
        async with connect(launch=mock_argv("{handshake_address}", "--step-interval-ms", "1"),
                           config=ClientConfig(handshake_timeout=20)) as client:
            async with client.stream_group() as group:
                for i in range(10):
                    group.generate(make_request(f"v{i}", max_tokens=30))
                tokens, errors, _ = await drain(group)
            assert not errors and all(len(t) == 30 for t in tokens.values())
            # the same requests through RequestStream give the same tokens, in order
            async with client.generate(make_request("v3", max_tokens=30)) as stream:
                solo = [t async for d in stream for t in d.token_ids]
            assert solo == tokens["v3"]


async def test_abort_one_and_leave_aborts_the_rest():
    async with tokenspeed_pair() as (engine, client):
        async with client.stream_group() as group:
            members = [group.generate(make_ts_request(f"a{i}", max_new_tokens=100_000)) for i in range(4)]
            await group.receive()
            members[1].abort()
            members[1].abort()  # idempotent
            assert members[1].finished and not members[0].finished
            assert len(group) == 3 and not client.protocol.is_live("a1")
            with trio.fail_after(5):
                for _ in range(3):
                    batch = await group.receive()
                    assert members[1] not in {m for m, _ in batch}
        assert client.protocol.inflight == 0
        with trio.fail_after(5):
            while engine.core.running:
                await trio.sleep(0.01)
        assert sorted(set(engine.core.aborts_received)) == ["a0", "a1", "a2", "a3"]


async def test_a_failing_request_is_an_item_and_the_others_go_on():
    async with tokenspeed_pair(engine_kw={"enable_output_logprobs": False}) as (engine, client):
        async with client.stream_group() as group:
            group.generate(make_ts_request("bad", return_logprob=True))
            group.generate(make_ts_request("ok", max_new_tokens=5))
            with trio.fail_after(10):
                tokens, errors, _ = await drain(group)
        assert isinstance(errors["bad"], EngineAbortedRequest)
        assert len(tokens["ok"]) == 5 and "bad" not in tokens


async def test_engine_death_is_one_item_per_request():
    async with tokenspeed_pair(engine_kw={"faults": (("sentinel", 3),)}) as (engine, client):
        async with client.stream_group() as group:
            for i in range(5):
                group.generate(make_ts_request(f"d{i}", max_new_tokens=10_000))
            with trio.fail_after(10):
                _, errors, _ = await drain(group)
        assert sorted(errors) == [f"d{i}" for i in range(5)]
        assert all(isinstance(e, EngineDeadError) and e.reason == "sentinel" for e in errors.values()), {
            k: (type(e), getattr(e, "reason", None), str(e)) for k, e in errors.items()
        }


async def test_a_cancelled_receive_loses_nothing_and_misuse_is_refused():
    async with tokenspeed_pair(engine_kw={"step_interval": 0.05}) as (engine, client):
        async with client.stream_group() as group:
            with trio.move_on_after(0.001):
                await group.receive()  # nothing yet: parked, then cancelled
            group.generate(make_ts_request("c", max_new_tokens=3))

            async def second_reader() -> None:
                with pytest.raises(trio.BusyResourceError):
                    await group.receive()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(group.receive)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(second_reader)
            with trio.fail_after(5):
                tokens, errors, _ = await drain(group)
            assert not errors
        with pytest.raises(LocalProtocolError):
            group.generate(make_ts_request("late"))
        with pytest.raises(trio.EndOfChannel):
            await group.receive()


async def test_an_id_is_refused_until_its_terminal_item_was_received():
    # The engine finished "r" (so the connection no longer holds it) but the
    # reader has not taken its last delta: reusing "r" in the group then would
    # mix the two requests' items, or lose the first one's end.
    async with tokenspeed_pair() as (engine, client):
        async with client.stream_group() as group:
            await finished_unread(client, group, "r", 2)
            with pytest.raises(DuplicateRequestIdError, match="'r'") as info:
                group.generate(make_ts_request("r", max_new_tokens=3))
            assert info.value.field == "request_id"
            with trio.fail_after(5):
                tokens, errors, _ = await drain(group)
            assert not errors and len(tokens["r"]) == 2
            # once received, the id may be used again
            group.generate(make_ts_request("r", max_new_tokens=3))
            with trio.fail_after(5):
                tokens, errors, _ = await drain(group)
            assert not errors and len(tokens["r"]) == 3


@pytest.mark.parametrize("group", [False, True])
async def test_reusing_an_id_right_after_an_abort_gets_only_its_own_outputs(group: bool):
    # On the vLLM mock (which, like vLLM, dies on a duplicate live id): abort
    # "X" after its first delta, reuse "X" at once, many times. The old
    # request's late outputs must never reach the new one (that would be wrong
    # tokens, an early finish, then a live duplicate on the engine).
    with trio.fail_after(60):
        async with connect(launch=mock_argv("{handshake_address}", "--step-interval-ms", "1"),
                           config=ClientConfig(handshake_timeout=20)) as client:
            for i in range(50):
                if group:
                    async with client.stream_group() as g:
                        first = g.generate(make_request("X", max_tokens=2))
                        await g.receive()
                        g.abort([first])
                        g.generate(make_request("X", max_tokens=40))
                        tokens, errors, _ = await drain(g)
                    got = tokens.get("X", [])
                    assert not errors, errors
                else:
                    async with client.generate(make_request("X", max_tokens=2)) as s:
                        async for _ in s:
                            break
                    async with client.generate(make_request("X", max_tokens=40)) as s:
                        deltas = [d async for d in s]
                    got = [t for d in deltas for t in d.token_ids]
                    assert deltas[-1].finish_reason is wire.FinishReason.LENGTH
                    assert all(d.request_id == "X" for d in deltas)
                assert len(got) == 40, (i, len(got))
            assert client.is_alive and client.protocol.renamed_requests >= 50
            # the same request under the plain id, on a fresh engine-side id or not,
            # yields the same tokens (the mock's are a function of the prompt)
            async with client.generate(make_request("solo", max_tokens=40)) as s:
                solo = [t async for d in s for t in d.token_ids]
            assert got == solo


async def test_group_abort_never_touches_another_callers_request_with_the_same_id():
    # "x" finished on the engine, unread in the group; another caller then
    # started its own "x". Aborting the group's "x" (or leaving the group) must
    # not abort by id, which would kill the other caller's request.
    async with tokenspeed_pair() as (engine, client):
        async with client.stream_group() as group:
            mine = await finished_unread(client, group, "x", 1)
            async with client.generate(make_ts_request("x", max_new_tokens=5)) as other:
                mine.abort()
                assert client.protocol.is_live("x")
                with trio.fail_after(5):
                    got = [t async for d in other for t in d.token_ids]
            assert len(got) == 5
