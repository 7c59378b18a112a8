"""EngineProtocol: the ids a dead link may have left running on the engine
(``possibly_live_ids`` / ``abort_stale``, carried by ``EngineSession``) and a
lost output connection (``output_lost``) -- no sockets, no trio."""

from __future__ import annotations

import pytest

from zmqdispatch import limits
from zmqdispatch.errors import EngineDeadError, RemoteProtocolError
from zmqdispatch.protocol.engine import EngineProtocol, SendState
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out, outputs_frames
from .test_engine_protocol import kinds, sent

ABORT, ADD = wire.RequestType.ABORT, wire.RequestType.ADD


def dead(reason: str = "send_timeout") -> EngineDeadError:
    return EngineDeadError("gone", engine_index=0, reason=reason)


def test_possibly_live_ids_follow_the_adds_on_the_wire_and_the_aborts_not_yet_accepted():
    p = EngineProtocol()
    for rid in ("r1", "r2", "r3", "r4"):
        p.submit(make_request(rid))
    assert p.possibly_live_ids() == []  # queued ADDs never reached the engine
    for _ in range(2):
        p.send_done(p.pop_send())
    sending = p.pop_send()  # r3 handed to the socket, not yet accepted
    assert p.possibly_live_ids() == ["r1", "r2", "r3"]
    p.send_done(sending)
    p.frames_received(outputs_frames([out("r2", [5], finish=wire.FinishReason.STOP)]))
    assert p.possibly_live_ids() == ["r1", "r3"]
    p.abort(["r1"])  # retired locally; the engine runs it until the ABORT is accepted
    assert not p.is_live("r1") and p.possibly_live_ids() == ["r1", "r3"]
    abort = p.pop_send()
    assert kinds([abort.frames]) == [(ABORT, ("r1",))]
    assert p.possibly_live_ids() == ["r1", "r3"]  # on its way, maybe never sent
    p.send_done(abort)
    assert p.possibly_live_ids() == ["r3"]


def test_death_keeps_a_snapshot_of_the_possibly_live_ids_although_it_drops_the_aborts():
    p = EngineProtocol()
    for rid in ("a", "b", "c", "queued"):
        p.submit(make_request(rid))
    for _ in range(3):
        p.send_done(p.pop_send())
    p.abort(["a"])
    stuck = p.pop_send()  # the ABORT frame [a]: its send times out
    assert stuck.state is SendState.SENDING
    p.abort(["b"])  # pending behind it
    p.engine_died(dead())
    assert p.pending_abort_ids == [] and p.inflight == 0 and not p.wants_send
    assert p.possibly_live_ids() == ["a", "b", "c"]
    # later calls change nothing
    p.abort(["c"])
    p.engine_died(dead("silence"))
    assert p.possibly_live_ids() == ["a", "b", "c"]


def test_a_clean_death_leaves_no_orphans():
    p = EngineProtocol()
    p.submit(make_request("r1"))
    sent(p)
    p.abort(["r1"])
    sent(p)  # the ABORT was accepted before the link closed
    p.engine_died(dead("closed"))
    assert p.possibly_live_ids() == []


def test_possibly_live_ids_are_bounded_keeping_the_most_recent(monkeypatch):
    monkeypatch.setattr(limits, "MAX_ORPHAN_IDS", 3)
    p = EngineProtocol()
    for i in range(5):
        p.submit(make_request(f"r{i}"))
    sent(p)
    assert p.possibly_live_ids() == ["r2", "r3", "r4"]
    p.engine_died(dead())
    assert p.possibly_live_ids() == ["r2", "r3", "r4"]
    fresh = EngineProtocol()
    fresh.abort_stale([f"s{i}" for i in range(5)])
    assert fresh.pending_abort_ids == ["s2", "s3", "s4"]


def test_stale_ids_are_aborted_first_in_one_frame_and_cleared_once_accepted():
    p = EngineProtocol()
    p.abort_stale(["a", "b"])
    assert p.possibly_live_ids() == ["a", "b"]
    p.submit(make_request("new"))
    p.submit(make_request("a"))  # reuses a stale id: a fresh engine-side id, after the ABORT
    p.start_utility("is_sleeping")
    frames = sent(p)
    assert kinds(frames) == [(ABORT, ("a", "b")), (ADD, "new"), (ADD, "a~1"), (wire.RequestType.UTILITY, None)]
    assert p.aborts_sent == 2
    assert p.possibly_live_ids() == ["new", "a~1"]  # only this link's own requests now (engine-side ids)


def test_abort_stale_skips_ids_live_on_this_link_and_does_nothing_after_death():
    p = EngineProtocol()
    p.submit(make_request("mine"))
    p.abort_stale(["mine", "old"])
    assert p.pending_abort_ids == ["old"]
    p.abort_stale([])
    assert p.pending_abort_ids == ["old"]
    p.engine_died(dead())
    p.abort_stale(["other"])
    assert p.pending_abort_ids == [] and not p.wants_send


def test_output_lost_fails_what_may_have_been_on_the_connection_and_aborts_it():
    p = EngineProtocol()
    mb1, _ = p.submit(make_request("r1"))
    mb2, _ = p.submit(make_request("r2"))
    sent(p)
    mb3, add3 = p.submit(make_request("queued"))  # not on the engine yet: unaffected
    call = p.start_utility("is_sleeping")
    p.frames_received(outputs_frames([out("r1", [7])]))
    p.output_lost("the output connection was dropped (MAX_FRAME_BYTES)")
    assert p.output_drops == 1 and p.is_live("queued") and not p.is_live("r1") and not p.is_live("r2")
    assert mb1.take().token_ids == [7]  # delivered before the loss: kept
    for mb, rid in ((mb1, "r1"), (mb2, "r2")):
        with pytest.raises(RemoteProtocolError, match=rf"request '{rid}': .*MAX_FRAME_BYTES"):
            mb.take()
    assert call.done and isinstance(call.error, RemoteProtocolError) and "is_sleeping" in str(call.error)
    assert p.pending_abort_ids == ["r1", "r2"]
    assert kinds(sent(p)) == [(ABORT, ("r1", "r2")), (ADD, "queued"), (wire.RequestType.UTILITY, None)]
    assert add3.state is SendState.SENT and p.state.value == "READY"
    # late outputs for the failed ids are unknown now
    p.frames_received(outputs_frames([out("r1", [8], finish=wire.FinishReason.STOP)]))
    assert p.unknown_outputs == 1


def test_output_lost_with_nothing_in_flight_only_counts_and_is_a_no_op_after_death():
    p = EngineProtocol()
    p.output_lost("dropped")
    assert p.output_drops == 1 and not p.wants_send
    p.submit(make_request("r1"))
    sent(p)
    p.engine_died(dead("disconnected"))
    p.output_lost("dropped")
    assert p.output_drops == 1
