"""n > 1: sibling sub-requests merged into one stream and cancelled together
(docs/known-failures.md K6), against the scripted fake engine over real sockets."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch import DuplicateRequestIdError, EngineDeadError, EngineRequestError, RequestRejected
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_parallel
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out
from zmqdispatch.testing import open_fake_engine_pair as fake_pair

GUARD = 20


def children(n: int, seed: int | None = 7, rid: str = "p") -> list[wire.EngineCoreRequest]:
    sp = pb.SamplingParams(n=n, max_tokens=50, temperature=0.8)
    if seed is not None:
        sp.seed = seed
    r = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), sampling_params=sp)
    return [t.request for t in translate_parallel(r, TranslationConfig(max_model_len=1024))]


def test_child_ids_and_seeds_follow_the_documented_rule():
    reqs = children(3, seed=2**31 - 1)
    assert [r.request_id for r in reqs] == ["p-0", "p-1", "p-2"]
    assert [r.sampling_params.seed for r in reqs] == [2**31 - 1, 2**31, 2**31 + 1]  # no wrap: vLLM seeds are ints
    assert all(r.sampling_params.n == 1 for r in reqs)
    assert [r.sampling_params.seed for r in children(2, seed=None)] == [None, None]
    with pytest.raises(RequestRejected, match="greedy"):
        r = pb.GenerateRequest(request_id="g", tokenized=pb.TokenizedInput(input_ids=[1]),
                               sampling_params=pb.SamplingParams(n=2, temperature=0.0))
        translate_parallel(r, TranslationConfig(max_model_len=64))
    with pytest.raises(RequestRejected, match="limit"):
        r = pb.GenerateRequest(request_id="g", tokenized=pb.TokenizedInput(input_ids=[1]),
                               sampling_params=pb.SamplingParams(n=129, temperature=1.0))
        translate_parallel(r, TranslationConfig(max_model_len=64))


async def test_children_merge_tagged_in_order_and_the_parent_waits_for_all():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate_samples(children(3)) as ps:
                adds = [await engine.receive_add() for _ in range(3)]
                assert [a.request_id for a in adds] == ["p-0", "p-1", "p-2"]
                assert [a.sampling_params.seed for a in adds] == [7, 8, 9]
                await engine.send_outputs([out("p-1", [10]), out("p-0", [20])])
                await engine.send_outputs([out("p-1", [11], wire.FinishReason.STOP, stop_reason=11)])  # early finish
                await engine.send_outputs([out("p-2", [30], wire.FinishReason.LENGTH), out("p-0", [21])])
                await engine.send_outputs([out("p-0", [22], wire.FinishReason.LENGTH)])
                got: dict[int, list[int]] = {0: [], 1: [], 2: []}
                finishes = []
                async for index, delta in ps:
                    got[index] += delta.token_ids
                    if delta.finish_reason is not None:
                        finishes.append(index)
            assert got == {0: [20, 21, 22], 1: [10, 11], 2: [30]}
            assert sorted(finishes) == [0, 1, 2]
            assert client.protocol.inflight == 0


@pytest.mark.parametrize("finished_first", [None, 2])
async def test_leaving_the_parent_sends_one_abort_for_the_live_children(finished_first):  # K6
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate_samples(children(4)) as ps:
                for _ in range(4):
                    await engine.receive_add()
                if finished_first is not None:
                    await engine.send_outputs([out(f"p-{finished_first}", [5], wire.FinishReason.LENGTH)])
                    while True:
                        i, d = await ps.receive()
                        if i == finished_first and d.finish_reason is not None:
                            break
                await engine.send_outputs([out("p-0", [1])])
                await ps.receive()
            expected = tuple(f"p-{i}" for i in range(4) if i != finished_first)
            assert await engine.receive_abort() == expected
            assert client.protocol.inflight == 0
            # late ticks for aborted children are dropped
            await engine.send_outputs([out("p-0", [9]), out("p-3", [9])])
            async with client.generate(make_request("after")) as s:
                await engine.receive_add()  # the next message is not a second ABORT
                await engine.send_tokens("after", [1], wire.FinishReason.STOP)
                await s.receive()


async def test_cancelling_the_parent_aborts_every_child_once():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with trio.CancelScope() as scope:
                async with client.generate_samples(children(3)) as ps:
                    for _ in range(3):
                        await engine.receive_add()
                    async with trio.open_nursery() as n:
                        n.start_soon(ps.receive)
                        await trio.testing.wait_all_tasks_blocked()
                        scope.cancel()
            assert scope.cancelled_caught
            assert await engine.receive_abort() == ("p-0", "p-1", "p-2")
            assert client.protocol.inflight == 0


async def test_a_failing_child_aborts_its_siblings_and_the_parent_raises_one_error():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with pytest.raises(EngineRequestError) as ei:
                async with client.generate_samples(children(3)) as ps:
                    for _ in range(3):
                        await engine.receive_add()
                    await engine.send_outputs([out("p-0", [1]), out("p-1", [], wire.FinishReason.ERROR)])
                    async for _ in ps:
                        pass
            assert ei.value.request_id == "p-1"
            assert await engine.receive_abort() == ("p-0", "p-2")
            assert client.protocol.inflight == 0


async def test_a_child_failing_mid_stream_on_virtual_time(mock_clock):
    """Deterministic with MockClock: children stream for 10 virtual seconds, then
    child 2 fails (engine ERROR); its siblings are aborted in one frame and the
    parent raises that one error at t = 10 s."""
    async with fake_pair() as (engine, client):
        t0 = trio.current_time()
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        with pytest.raises(EngineRequestError) as ei:
            async with client.generate_samples(children(3)) as ps:
                for _ in range(3):
                    await engine.receive_add()

                async def engine_steps():
                    for step in range(10):
                        await trio.sleep(1.0)
                        await engine.send_outputs([out(f"p-{i}", [step]) for i in range(3)])
                    await trio.sleep(1.0)
                    await engine.send_outputs([out("p-2", [], wire.FinishReason.ERROR)])

                async with trio.open_nursery() as n:
                    n.start_soon(engine_steps)
                    async for index, delta in ps:
                        got[index] += delta.token_ids
        assert ei.value.request_id == "p-2"
        assert trio.current_time() - t0 == pytest.approx(11.0, abs=0.5)
        assert got == {i: list(range(10)) for i in range(3)}
        assert await engine.receive_abort() == ("p-0", "p-1")
        assert client.protocol.inflight == 0


async def test_engine_silence_mid_stream_fails_the_parent_once_on_virtual_time(mock_clock):
    async with fake_pair(silence_timeout=30.0) as (engine, client):
        t0 = trio.current_time()
        with pytest.raises(EngineDeadError) as ei:
            async with client.generate_samples(children(3)) as ps:
                for _ in range(3):
                    await engine.receive_add()
                await engine.send_outputs([out(f"p-{i}", [1]) for i in range(3)])
                async for _ in ps:
                    pass
        assert ei.value.reason == "silence"
        assert 30.0 <= trio.current_time() - t0 < 31.0


async def test_engine_death_fails_the_parent_with_one_typed_error():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with pytest.raises(EngineDeadError):
                async with client.generate_samples(children(2)) as ps:
                    for _ in range(2):
                        await engine.receive_add()
                    await engine.send_sentinel()
                    async for _ in ps:
                        pass


async def test_a_sample_that_finished_right_before_a_death_still_delivers_its_final_delta():
    # Nothing lost: sample 0 finished in the engine's last step, then the
    # engine died. The consumer reads only after the death was declared.
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            got: list[tuple[int, list[int], object]] = []
            with pytest.raises(EngineDeadError) as ei:
                async with client.generate_samples(children(3)) as ps:
                    for _ in range(3):
                        await engine.receive_add()
                    await engine.send_outputs([out("p-0", [7, 8], wire.FinishReason.STOP), out("p-1", [9])])
                    await engine.send_sentinel()
                    await client.wait_dead()
                    await trio.testing.wait_all_tasks_blocked()  # every child has seen its end
                    async for index, delta in ps:
                        got.append((index, list(delta.token_ids), delta.finish_reason))
            assert ei.value.reason == "sentinel"
            assert (0, [7, 8], wire.FinishReason.STOP) in got
            # the failing sample's tokens from before the death are delivered too
            assert [g for g in got if g[0] == 1] == [(1, [9], None)] and not [g for g in got if g[0] == 2]


async def test_a_failing_sample_never_drops_what_its_siblings_had_received():
    # The consumer lags: p-0 has tokens queued when p-1 fails. They are
    # delivered (p-0 is aborted on the engine, not cancelled), then the error.
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            got: dict[int, list[int]] = {0: [], 1: [], 2: []}
            with pytest.raises(EngineRequestError):
                async with client.generate_samples(children(3)) as ps:
                    for _ in range(3):
                        await engine.receive_add()
                    await engine.send_outputs([out("p-0", [1]), out("p-2", [5])])
                    await engine.send_outputs([out("p-0", [2])])
                    await engine.send_outputs([out("p-0", [3]), out("p-1", [], wire.FinishReason.ERROR)])
                    assert await engine.receive_abort() == ("p-0", "p-2")  # one frame, before any read
                    async for index, delta in ps:
                        got[index] += delta.token_ids
            assert got == {0: [1, 2, 3], 1: [], 2: [5]}
            assert client.protocol.inflight == 0


async def test_colliding_child_ids_are_refused_before_anything_is_sent():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(make_request("p-1")):
                await engine.receive_add()
                with pytest.raises(DuplicateRequestIdError) as ei:
                    async with client.generate_samples(children(3)):
                        pass  # pragma: no cover
                assert ei.value.request_id == "p-1"
                assert client.protocol.inflight == 1
            assert await engine.receive_abort() == ("p-1",)  # only the other request's own abort
            with pytest.raises(RequestRejected):
                async with client.generate_samples([]):
                    pass  # pragma: no cover


@st.composite
def fanout_script(draw):
    n = draw(st.integers(2, 5))
    ticks = {i: draw(st.integers(1, 6)) for i in range(n)}
    order = draw(st.permutations([i for i in range(n) for _ in range(ticks[i])]))
    cancel_after = draw(st.integers(0, len(order)))
    grouping = draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
    return n, ticks, order, cancel_after, grouping


@settings(max_examples=30, deadline=None)
@given(fanout_script())
def test_any_interleaving_and_cancellation_point(script):
    n, ticks, order, cancel_after, grouping = script

    async def main():
        async with fake_pair() as (engine, client):
            with trio.fail_after(GUARD):
                sent = {i: 0 for i in range(n)}
                got: dict[int, list[int]] = {i: [] for i in range(n)}
                finished = set()
                async with client.generate_samples(children(n)) as ps:
                    for _ in range(n):
                        await engine.receive_add()
                    batch = []
                    for k, i in enumerate(order[:cancel_after]):
                        sent[i] += 1
                        fin = wire.FinishReason.LENGTH if sent[i] == ticks[i] else None
                        batch.append(out(f"p-{i}", [100 * i + sent[i]], fin))
                        if grouping[k] or k == cancel_after - 1:
                            await engine.send_outputs(batch)
                            batch = []
                    # consume exactly what was sent
                    expected_total = sum(sent.values())
                    while sum(len(v) for v in got.values()) < expected_total:
                        i, d = await ps.receive()
                        got[i] += d.token_ids
                        if d.finish_reason is not None:
                            finished.add(i)
                    live_at_cancel = [i for i in range(n) if i not in finished]
                for i in range(n):
                    assert got[i] == [100 * i + k for k in range(1, sent[i] + 1)]
                if live_at_cancel:
                    assert await engine.receive_abort() == tuple(f"p-{i}" for i in live_at_cancel)
                assert client.protocol.inflight == 0
                # nothing else was sent: the next message is this utility call
                call = client.protocol.start_utility("is_sleeping")
                assert (await engine.receive()).kind == wire.RequestType.UTILITY
                client.protocol.forget_utility(call)

    trio.run(main)


async def test_closing_one_sample_never_aborts_its_siblings_even_when_it_is_blocked():
    """A sample closed with abort_sample (e.g. its stop string matched) while its
    task is blocked handing a delta to a lagging parent aborts only itself."""
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate_samples(children(3)) as ps:
                for _ in range(3):
                    await engine.receive_add()
                for step in range(4):  # more deltas than the merged channel holds: children block
                    await engine.send_outputs([out(f"p-{i}", [step]) for i in range(3)])
                await trio.testing.wait_all_tasks_blocked()
                ps.abort_sample(0)
                assert await engine.receive_abort() == ("p-0",)
                await engine.send_outputs([out(f"p-{i}", [9], wire.FinishReason.LENGTH) for i in (1, 2)])
                finished = set()
                async for index, delta in ps:
                    assert index != 0 or delta.finish_reason is None
                    if delta.finish_reason is not None:
                        finished.add(index)
            assert finished == {1, 2}
            assert client.protocol.inflight == 0


async def test_an_outer_cancellation_surfaces_as_a_bare_cancelled():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            caught = []
            with trio.CancelScope() as scope:
                try:
                    async with client.generate_samples(children(2)) as ps:
                        for _ in range(2):
                            await engine.receive_add()
                        scope.cancel()
                        await ps.receive()
                except trio.Cancelled:
                    caught.append(True)
                    raise
            assert caught == [True] and scope.cancelled_caught


async def test_closing_a_sample_that_finished_unread_never_aborts_a_newer_request_with_its_id():
    # Sample p-0 finished on the engine, its last delta not read yet; another
    # caller started its own "p-0". abort_sample (and leaving the parent) must not
    # abort by id, which would kill that request.
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate_samples(children(2)) as ps:
                for _ in range(2):
                    await engine.receive_add()
                # The caller reads nothing: sample 0's task fills the merged
                # channel (2 slots) and blocks on a third send ...
                def forwarded() -> int:
                    st = ps._send.statistics()
                    return st.current_buffer_used + st.tasks_waiting_send

                for t in (1, 2, 3):
                    await engine.send_outputs([out("p-0", [t])])
                    while forwarded() < t:  # one delivery per output (no merging)
                        await trio.sleep(0.005)
                # ... so its final output stays unread, though the engine is done with p-0
                await engine.send_outputs([out("p-0", [5], wire.FinishReason.LENGTH)])
                while client.protocol.is_live("p-0"):
                    await trio.sleep(0.005)
                assert ps.live_indices == [0, 1]
                async with client.generate(make_request("p-0")) as other:
                    assert (await engine.receive_add()).request_id == "p-0"
                    ps.abort_sample(0)
                    assert client.protocol.is_live("p-0")
                    await engine.send_tokens("p-0", [7], wire.FinishReason.STOP)
                    assert [d.token_ids async for d in other] == [[7]]
            # leaving the parent aborted only the live sample p-1
            assert await engine.receive_abort() == ("p-1",)


async def test_reading_a_sample_stream_after_abort_raises_even_with_deltas_buffered():
    from zmqdispatch import RequestStreamClosed

    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate_samples(children(3)) as ps:
                for _ in range(3):
                    await engine.receive_add()
                await engine.send_outputs([out("p-0", [1]), out("p-1", [2]), out("p-2", [3])])
                while ps._recv.statistics().current_buffer_used < 3:  # the three deltas wait, unread
                    await trio.sleep(0.001)
                ps.abort()
                with pytest.raises(RequestStreamClosed, match="aborted"):
                    await ps.receive()
                with pytest.raises(RequestStreamClosed):
                    async for _ in ps:
                        pass  # pragma: no cover
            assert sorted(await engine.receive_abort()) == ["p-0", "p-1", "p-2"]


async def test_abort_after_every_final_delta_is_a_no_op_and_iteration_just_ends():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate_samples(children(2)) as ps:
                for _ in range(2):
                    await engine.receive_add()
                await engine.send_outputs([out("p-0", [1], wire.FinishReason.LENGTH),
                                           out("p-1", [2], wire.FinishReason.LENGTH)])
                got = [index async for index, _ in ps]
                ps.abort()
                assert sorted(got) == [0, 1]
                with pytest.raises(trio.EndOfChannel):
                    await ps.receive()
