"""EngineProtocol: admission, routing, aborts, death -- no sockets, no trio."""

from __future__ import annotations

import pytest

import msgpack

from zmqdispatch.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineRequestError,
    RemoteProtocolError,
    SlowConsumerError,
    UtilityCallError,
)
from zmqdispatch.protocol.engine import EngineProtocol, SendState
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine

from ..helpers import make_request, outputs_frames, out


def sent(p: EngineProtocol) -> list[list[bytes]]:
    """Drain the protocol's outbox as the input pump would."""
    frames = []
    while (o := p.pop_send()) is not None:
        p.send_done(o)
        frames.append(o.frames)
    return frames


def kinds(frames: list[list[bytes]]) -> list[tuple[int, object]]:
    res: list[tuple[int, object]] = []
    for f in frames:
        t = f[1][0]
        if t == wire.RequestType.ABORT:
            res.append((t, wire_engine.decode_abort(f[2])))
        elif t == wire.RequestType.ADD:
            res.append((t, wire_engine.decode_request(f[2:]).request_id))
        else:
            res.append((t, None))
    return res


def test_submit_queues_add_with_identity_and_type_byte():
    p = EngineProtocol(identity=b"\x01\x00", engine_index=1)
    mb, add = p.submit(make_request("r1"))
    assert add.state is SendState.QUEUED and p.wants_send
    (frames,) = sent(p)
    assert frames[0] == b"\x01\x00" and frames[1] == b"\x00"
    assert wire_engine.decode_request(frames[2:]).request_id == "r1"
    assert add.state is SendState.SENT and p.inflight == 1


def test_duplicate_live_request_id_is_rejected_locally():
    p = EngineProtocol()
    p.submit(make_request("r1"))
    with pytest.raises(DuplicateRequestIdError) as ei:
        p.submit(make_request("r1"))
    assert ei.value.field == "request_id" and ei.value.request_id == "r1"
    assert p.inflight == 1 and len(sent(p)) == 1


def test_id_can_be_reused_after_finish():
    p = EngineProtocol()
    mb, _ = p.submit(make_request("r1"))
    sent(p)
    p.frames_received(outputs_frames([out("r1", [5], finish=wire.FinishReason.LENGTH)]))
    assert p.inflight == 0
    p.submit(make_request("r1"))
    assert p.inflight == 1


def test_abort_before_send_never_sends_the_add():
    p = EngineProtocol()
    _, add = p.submit(make_request("r1"))
    p.abort(["r1"])
    assert add.state is SendState.CANCELLED
    assert sent(p) == [] and p.inflight == 0


def test_abort_after_send_is_one_batched_idempotent_frame():
    p = EngineProtocol()
    for rid in ("a", "b", "c"):
        p.submit(make_request(rid))
    sent(p)
    p.abort(["a", "b"])
    p.abort(["a", "b", "zzz"])  # idempotent; unknown ids ignored
    p.abort(["c"])
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("a", "b", "c"))]
    assert p.inflight == 0 and p.aborts_sent == 3


def test_abort_while_add_is_being_sent_follows_the_add():
    p = EngineProtocol()
    p.submit(make_request("r1"))
    add = p.pop_send()  # the pump took it; the send is in progress
    p.abort(["r1"])
    p.send_done(add)
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("r1",))]


def test_abort_then_resubmit_of_the_same_id_sends_the_abort_first():
    # Found on the real engine: ADD(r1) ABORT(r1) ADD(r1) must not become
    # ADD ADD ABORT, or the ABORT kills the new request.
    p = EngineProtocol()
    p.submit(make_request("r1"))
    sent(p)
    p.abort(["r1"])
    p.submit(make_request("r1"))
    frames = sent(p)
    # the resubmission travels under a fresh engine-side id (see the next test)
    assert kinds(frames) == [(wire.RequestType.ABORT, ("r1",)), (wire.RequestType.ADD, "r1~1")]
    assert wire_engine.decode_request(frames[1][2:]).external_req_id == "r1"


def test_late_outputs_of_an_aborted_request_never_reach_a_reuse_of_its_id():
    # Outputs the engine sent before it saw the ABORT are still on their way;
    # under the same engine-side id they would reach the new request (wrong
    # tokens; its old final output would end the new stream early, and the next
    # reuse would be a live duplicate on the engine).
    p = EngineProtocol()
    p.submit(make_request("x"))
    sent(p)
    p.abort(["x"])
    new, _ = p.submit(make_request("x"))
    assert new.request_id == "x" and new.wire_id == "x~1" and p.wire_id("x") == "x~1"
    sent(p)
    unknown = p.unknown_outputs
    p.frames_received(outputs_frames([out("x", [7], finish=wire.FinishReason.LENGTH)]))  # the old one's
    assert new.take() is None and p.unknown_outputs == unknown + 1 and p.is_live("x")
    p.frames_received(outputs_frames([out("x~1", [8])]))
    d = new.take()
    assert d.request_id == "x" and d.token_ids == [8]
    assert p.live_request_ids() == ["x"]
    # aborting by the caller's id reaches the engine-side id
    p.abort(["x"])
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("x~1",))] and not p.is_live("x")
    # the next reuse: "x" is still remembered as aborted, "x~1" too: a third id
    third, _ = p.submit(make_request("x"))
    assert third.wire_id == "x~2" and p.renamed_requests == 2


def test_an_id_never_sent_is_reused_as_is_and_wire_ids_never_collide():
    p = EngineProtocol()
    p.submit(make_request("q"))
    p.abort(["q"])  # the ADD was still queued: the engine never saw "q"
    assert p.submit(make_request("q"))[0].wire_id == "q"
    sent(p)
    p.abort(["q"])
    p.submit(make_request("q"))  # -> "q~1"
    # a caller id equal to a live engine-side id is itself renamed
    other, _ = p.submit(make_request("q~1"))
    assert other.wire_id not in ("q", "q~1") and p.is_live("q~1") and p.is_live("q")
    ids = [w for _, w in kinds(sent(p)) if isinstance(w, str)]
    assert len(ids) == len(set(ids)) == 2


def test_routing_merges_ticks_and_retires_on_finish():
    p = EngineProtocol()
    mb, _ = p.submit(make_request("r1"))
    sent(p)
    p.frames_received(outputs_frames([out("r1", [1])]))
    p.frames_received(outputs_frames([out("r1", [2, 3])]))
    p.frames_received(outputs_frames([out("r1", [4], finish=wire.FinishReason.STOP, stop_reason=4)]))
    d = mb.take()
    assert d.token_ids == [1, 2, 3, 4] and d.ticks == 3
    assert d.finish_reason is wire.FinishReason.STOP and d.stop_reason == 4
    assert p.inflight == 0


def test_outputs_for_unknown_ids_are_counted_and_dropped():
    p = EngineProtocol()
    p.submit(make_request("r1"))
    sent(p)
    p.abort(["r1"])
    p.frames_received(outputs_frames([out("r1", [9]), out("ghost", [1])]))
    assert p.unknown_outputs == 2 and p.inflight == 0


def test_engine_error_finish_fails_only_that_request():
    p = EngineProtocol()
    mb1, _ = p.submit(make_request("r1"))
    mb2, _ = p.submit(make_request("r2"))
    sent(p)
    p.frames_received(outputs_frames([out("r1", [7]), out("r2", [], finish=wire.FinishReason.ERROR)]))
    with pytest.raises(EngineRequestError) as ei:
        mb2.take()
    assert ei.value.request_id == "r2"
    assert mb1.take().token_ids == [7] and p.inflight == 1


def test_finished_requests_without_terminal_row_are_retired():
    p = EngineProtocol()
    mb, _ = p.submit(make_request("r1"))
    sent(p)
    p.frames_received(outputs_frames([], finished_requests=("r1",)))
    d = mb.take()
    assert d.finish_reason is wire.FinishReason.ABORT and p.inflight == 0


def test_a_death_sign_refuses_new_requests_but_routes_outputs_until_the_death():
    p = EngineProtocol()
    done, other = (p.submit(make_request(f"r{i}"))[0] for i in range(2))
    sent(p)
    sign = EngineDeadError("input connection closed", reason="disconnected")
    p.engine_gone(sign)
    p.engine_gone(EngineDeadError("later", reason="process_exit"))  # the first sign wins
    assert not p.accepts_requests and p.gone is sign and p.death is None
    with pytest.raises(EngineDeadError) as ei:
        p.submit(make_request("new"))
    assert ei.value.reason == "disconnected" and not p.is_live("new")
    with pytest.raises(EngineDeadError):
        p.check_alive()
    # the engine's last outputs still reach their streams ...
    p.frames_received(outputs_frames([out("r0", [5, 6], wire.FinishReason.STOP)]))
    d = done.take()
    assert list(d.token_ids) == [5, 6] and d.finish_reason is wire.FinishReason.STOP
    # ... and a sentinel among them is the declared cause
    p.frames_received([wire.ENGINE_CORE_DEAD])
    with pytest.raises(EngineDeadError) as ei:
        other.take()
    assert ei.value.reason == "sentinel" and p.death.reason == "sentinel"


def test_sentinel_fails_every_stream_and_refuses_new_requests():
    p = EngineProtocol()
    mbs = [p.submit(make_request(f"r{i}"))[0] for i in range(3)]
    sent(p)
    p.abort(["r0"])  # pending abort must be dropped: the engine is gone
    p.frames_received([wire.ENGINE_CORE_DEAD])
    for mb in mbs[1:]:
        with pytest.raises(EngineDeadError) as ei:
            mb.take()
        assert ei.value.reason == "sentinel"
    assert p.pop_send() is None and p.inflight == 0
    with pytest.raises(EngineDeadError):
        p.submit(make_request("new"))
    with pytest.raises(EngineDeadError):
        p.start_utility("is_sleeping")


def test_tokens_before_death_are_delivered_then_the_error():
    p = EngineProtocol()
    mb, _ = p.submit(make_request("r1"))
    sent(p)
    p.frames_received(outputs_frames([out("r1", [1, 2])]))
    p.frames_received([wire.ENGINE_CORE_DEAD])
    assert mb.take().token_ids == [1, 2]
    with pytest.raises(EngineDeadError):
        mb.take()


def test_an_undecodable_message_fails_live_requests_and_a_streak_kills_the_link():
    p = EngineProtocol(max_decode_errors=3)
    mb, _ = p.submit(make_request("r1"))
    sent(p)
    p.frames_received(outputs_frames([out("r1", [1])]))
    p.frames_received([b"\xc1"])  # it may have carried r1's next tokens or its finish
    assert mb.take().token_ids == [1]
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        mb.take()
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("r1",))]
    assert p.state.value == "READY" and p.inflight == 0
    mb2, _ = p.submit(make_request("r2"))
    sent(p)
    p.frames_received(outputs_frames([out("r2", [5])]))  # a good message resets the streak
    p.frames_received([b"\xc1"])
    p.frames_received([b"not msgpack at all \xc1"])
    assert p.decode_errors == 3 and p.state.value == "READY"
    p.frames_received([b"\x93\x01"])  # third in a row: truncated array
    assert p.state.value == "DEAD" and p.death.reason == "decode_errors"
    with pytest.raises(EngineDeadError):
        p.submit(make_request("r3"))


def test_a_bad_row_fails_only_its_request_and_the_others_keep_their_tokens():
    p = EngineProtocol()
    a, _ = p.submit(make_request("a"))
    b, _ = p.submit(make_request("b"))
    sent(p)
    raw = msgpack.packb([0, [["a", [1, 2]] + [None] * 16, ["b", [-7]] + [None] * 16], None, 1.0])
    p.frames_received([raw])
    assert a.take().token_ids == [1, 2]
    with pytest.raises(RemoteProtocolError, match="new_token_ids"):
        b.take()
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("b",))]
    assert p.inflight == 1 and p.bad_rows == 1 and p.state.value == "READY"


def test_a_bad_row_without_an_id_fails_every_request_missing_from_the_message():
    p = EngineProtocol()
    boxes = {rid: p.submit(make_request(rid))[0] for rid in ("a", "b", "c")}
    sent(p)
    raw = msgpack.packb([0, [["a", [1]] + [None] * 16, [None, [2]] + [None] * 16], None, 1.0])
    p.frames_received([raw])
    assert boxes["a"].take().token_ids == [1]
    for rid in ("b", "c"):
        with pytest.raises(RemoteProtocolError):
            boxes[rid].take()
    assert p.inflight == 1


def test_slow_consumer_is_failed_and_aborted_alone():
    p = EngineProtocol(max_pending_tokens=10)
    slow, _ = p.submit(make_request("slow"))
    fast, _ = p.submit(make_request("fast"))
    sent(p)
    for _ in range(6):
        p.frames_received(outputs_frames([out("slow", [1, 2]), out("fast", [3, 4])]))
        assert fast.take().token_ids == [3, 4]
    with pytest.raises(SlowConsumerError) as ei:
        slow.take()
    assert ei.value.limit == 10 and ei.value.pending_tokens > 10
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("slow",))]
    assert p.inflight == 1


def test_utility_call_resolves_by_call_id_and_failure_is_typed():
    p = EngineProtocol()
    c1 = p.start_utility("get_supported_tasks")
    c2 = p.start_utility("bogus", [1, "x"])
    frames = sent(p)
    assert [f[1] for f in frames] == [b"\x03", b"\x03"]
    call = wire_engine.decode_utility_call(frames[1][2])
    assert (call.method, list(call.args)) == ("bogus", [1, "x"])
    p.frames_received(outputs_frames([], utility_output=wire.UtilityOutput(call_id=c1.call_id, failure_message=None,
                                                                            result=wire.UtilityResult(["generate"]))))
    p.frames_received(outputs_frames([], utility_output=wire.UtilityOutput(call_id=c2.call_id,
                                                                            failure_message="no such method",
                                                                            result=None)))
    assert c1.done and list(c1.result) == ["generate"]
    assert c2.done and isinstance(c2.error, UtilityCallError) and "no such method" in str(c2.error)
    assert p.pending_utility_calls == 0


def test_repr_shows_state():
    p = EngineProtocol(engine_index=2)
    p.submit(make_request("r1"))
    assert repr(p) == "<EngineProtocol engine=2 READY inflight=1 dead=False>"


def test_the_renamed_id_map_stays_bounded_by_the_live_requests():
    # Renamed requests that retire are dropped from the caller-id map, whether or
    # not their id is ever looked up again.
    p = EngineProtocol()
    for i in range(500):
        rid = f"u{i}"
        p.submit(make_request(rid))
        sent(p)
        p.abort([rid])
        p.submit(make_request(rid))  # renamed: "u<i>" was just aborted
        wire_id = p.wire_id(rid)
        assert wire_id != rid
        sent(p)
        p.frames_received(outputs_frames([out(wire_id, [1], finish=wire.FinishReason.LENGTH)]))
        assert p.inflight == 0  # (no lookup by the caller's id, which would drop the entry itself)
    assert p.renamed_requests == 500 and len(p._renamed) <= 64


# --------------------------------------------------------------------------- ADD encoding at pop_send


def _count_encodes(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = wire.encode_request  # the module protocol.runtime encodes with

    def counting(req):
        calls.append(req.request_id)
        return real(req)

    monkeypatch.setattr(wire, "encode_request", counting)
    return calls


def test_submit_registers_without_encoding_and_pop_send_encodes(monkeypatch):
    # A thousand requests entering at once must not encode a thousand ADDs in
    # one go in the callers' tasks: the input pump encodes them, in slices.
    calls = _count_encodes(monkeypatch)
    p = EngineProtocol(identity=b"\x01\x00")
    mb1, add1 = p.submit(make_request("r1"))
    mb2, add2 = p.submit(make_request("r2"))
    assert calls == [] and p.inflight == 2 and p.is_live("r1")
    assert add1.frames == [b"\x01\x00", b"\x00"] and add1.request is not None
    first = p.pop_send()
    assert first is add1 and calls == ["r1"] and add1.state is SendState.SENDING and add1.request is None
    assert wire_engine.decode_request(add1.frames[2:]).request_id == "r1"
    p.send_done(add1)
    assert kinds(sent(p)) == [(wire.RequestType.ADD, "r2")] and calls == ["r1", "r2"]


def test_an_add_aborted_before_the_pump_took_it_is_never_encoded(monkeypatch):
    calls = _count_encodes(monkeypatch)
    p = EngineProtocol()
    mb, add = p.submit(make_request("r1"))
    p.abort(["r1"])
    assert add.state is SendState.CANCELLED and add.request is None
    assert sent(p) == [] and calls == []


def test_a_request_that_cannot_be_encoded_fails_alone_and_sends_nothing():
    from zmqdispatch.errors import RequestRejected

    p = EngineProtocol()
    # The protocol does not validate (generate() does): an id beyond 64 bits
    # reaches the encoder, which refuses it.
    bad_mb, bad_add = p.submit(make_request("bad", prompt=(1, 2**70)))
    ok_mb, ok_add = p.submit(make_request("ok"))
    assert kinds(sent(p)) == [(wire.RequestType.ADD, "ok")]
    assert bad_add.state is SendState.REJECTED and isinstance(bad_add.error, RequestRejected)
    assert bad_add.error.request_id == "bad" and "encoded" in str(bad_add.error)
    with pytest.raises(RequestRejected) as ei:
        bad_mb.take()
    assert ei.value is bad_add.error
    # retired without an ABORT (the engine never heard of it); its id is free
    assert not p.is_live("bad") and p.inflight == 1 and p.pending_abort_ids == []
    assert "bad" not in p.possibly_live_ids()
    p.submit(make_request("bad"))
    assert kinds(sent(p)) == [(wire.RequestType.ADD, "bad")]


def test_a_renamed_request_that_cannot_be_encoded_reports_the_callers_id():
    from zmqdispatch.errors import RequestRejected

    p = EngineProtocol()
    p.submit(make_request("r1"))
    sent(p)
    p.abort(["r1"])  # its late outputs may come: a reuse travels as r1~1
    mb, add = p.submit(make_request("r1", prompt=(2**70,)))
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("r1",))]
    assert add.state is SendState.REJECTED and add.error.request_id == "r1"
    with pytest.raises(RequestRejected):
        mb.take()
    assert not p.is_live("r1") and p.inflight == 0


def test_encoding_at_pop_send_keeps_aborts_first_and_submission_order():
    p = EngineProtocol()
    for rid in ("a", "b"):
        p.submit(make_request(rid))
    sent(p)
    p.submit(make_request("c"))
    p.abort(["a"])
    p.submit(make_request("d"))
    p.abort(["b", "c"])  # c is still queued: dropped, never encoded
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("a", "b")), (wire.RequestType.ADD, "d")]


def test_an_undecodable_message_leaves_requests_whose_add_is_still_queued_alone():
    # The input pump sends queued ADDs in slices: a request not sent yet cannot
    # have had outputs in the bad message. Failing it would also have left its
    # ADD in the outbox, to run on the engine for nobody.
    p = EngineProtocol()
    sent_mb, _ = p.submit(make_request("sent"))
    sent(p)
    queued_mb, queued_add = p.submit(make_request("queued"))
    p.frames_received([b"\xc1"])
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        sent_mb.take()
    assert queued_mb.take() is None and p.is_live("queued") and queued_add.state is SendState.QUEUED
    assert kinds(sent(p)) == [(wire.RequestType.ABORT, ("sent",)), (wire.RequestType.ADD, "queued")]
