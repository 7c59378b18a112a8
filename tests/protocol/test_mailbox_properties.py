"""Known failure K5 (docs/known-failures.md): no token lost or duplicated, whatever the batching and the
consumer's pace; the finish is delivered exactly once, last."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out, outputs_frames


@st.composite
def scenario(draw):
    n_req = draw(st.integers(1, 8))
    ticks = {
        f"r{i}": draw(st.lists(st.lists(st.integers(0, 50_000), max_size=3), min_size=1, max_size=50))
        for i in range(n_req)
    }
    # Interleave: a random global order of (rid, tick index) preserving per-request order.
    events = [(rid, k) for rid, ts in ticks.items() for k in range(len(ts))]
    order = draw(st.permutations(events))
    seen: dict[str, int] = {rid: 0 for rid in ticks}
    ordered = []
    for rid, _ in order:
        ordered.append((rid, seen[rid]))
        seen[rid] += 1
    # Group consecutive events into messages, and decide where the consumer takes.
    cuts = draw(st.lists(st.booleans(), min_size=len(ordered), max_size=len(ordered)))
    takes = draw(st.lists(st.booleans(), min_size=len(ordered), max_size=len(ordered)))
    return ticks, ordered, cuts, takes


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_any_batching_and_consumer_pace_delivers_every_token_once(s):
    ticks, ordered, cuts, takes = s
    p = EngineProtocol(max_pending_tokens=10**9)
    boxes = {rid: p.submit(make_request(rid))[0] for rid in ticks}
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    got: dict[str, list[int]] = {rid: [] for rid in ticks}
    finishes: dict[str, list[int]] = {rid: [] for rid in ticks}

    def take_all():
        for rid, mb in boxes.items():
            d = mb.take()
            if d is not None:
                assert not finishes[rid], "delivery after the finish"
                got[rid] += d.token_ids
                if d.finish_reason is not None:
                    finishes[rid].append(len(got[rid]))

    batch = []
    for (rid, k), cut, take in zip(ordered, cuts, takes):
        last = k == len(ticks[rid]) - 1
        batch.append(out(rid, ticks[rid][k], finish=wire.FinishReason.LENGTH if last else None))
        if cut:
            p.frames_received(outputs_frames(batch))
            batch = []
        if take:
            take_all()
    if batch:
        p.frames_received(outputs_frames(batch))
    take_all()
    for rid, ts in ticks.items():
        assert got[rid] == [t for tick in ts for t in tick]
        assert finishes[rid] == [len(got[rid])]
    assert p.inflight == 0 and p.decode_errors == 0
