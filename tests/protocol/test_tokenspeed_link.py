"""EngineProtocol on a TokenSpeed link: routing of column batches, the engine's quirks,
runtime mismatches -- no sockets, no trio."""

from __future__ import annotations

import pytest

from zmqdispatch import limits
from zmqdispatch.errors import (
    EngineAbortedRequest,
    EngineDeadError,
    EngineHandshakeError,
    EngineRequestError,
    RemoteProtocolError,
    RequestStreamClosed,
    RuntimeMismatchError,
    SlowConsumerError,
    UnsupportedByRuntimeError,
)
from zmqdispatch.protocol.engine import EngineProtocol, SendState
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_handshake as handshake

from ..helpers import make_request, make_ts_request, outputs_frames, out, ts_batch_frames


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def link(**kw: object) -> EngineProtocol:
    kw.setdefault("runtime", Runtime.TOKENSPEED)
    return EngineProtocol(**kw)


def sent(p: EngineProtocol) -> list[list[bytes]]:
    frames = []
    while (o := p.pop_send()) is not None:
        p.send_done(o)
        frames.append(o.frames)
    return frames


def ready(version: str) -> handshake.EngineCoreReadyResponse:
    return handshake.EngineCoreReadyResponse(max_model_len=64, num_gpu_blocks=1, block_size=16, vllm_version=version)


# ------------------------------------------------------------------ runtime choice


def test_runtime_is_read_from_the_ready_response():
    assert Runtime.of_ready_response(ready("tokenspeed-0.1.1")) is Runtime.TOKENSPEED
    assert Runtime.of_ready_response(ready("0.32.0")) is Runtime.VLLM
    assert Runtime.resolve(None, ready("tokenspeed-0.1.1")) is Runtime.TOKENSPEED
    assert Runtime.resolve("vllm", ready("0.33.0")) is Runtime.VLLM


def test_a_required_runtime_that_did_not_dial_in_is_a_handshake_error():
    with pytest.raises(EngineHandshakeError, match=r"expected a vLLM EngineCore.*TokenSpeed scheduler"):
        Runtime.resolve("vllm", ready("tokenspeed-0.1.1"))
    with pytest.raises(EngineHandshakeError, match="expected a TokenSpeed scheduler"):
        Runtime.resolve(Runtime.TOKENSPEED, ready("0.32.0"))


@pytest.mark.parametrize(
    ("runtime", "request_"),
    [(Runtime.TOKENSPEED, make_request("v1")), (Runtime.VLLM, make_ts_request("t1"))],
)
def test_a_request_built_for_the_other_runtime_is_refused(runtime, request_):
    p = EngineProtocol(runtime=runtime)
    with pytest.raises(RuntimeMismatchError, match="built for the") as ei:
        p.submit(request_)
    assert ei.value.runtime == runtime.value and ei.value.field == "request"
    assert not p.wants_send and p.inflight == 0
    with pytest.raises(RuntimeMismatchError):
        runtime.check_request(request_, max_model_len=64)


def test_utility_calls_do_not_exist_on_tokenspeed():
    p = link()
    with pytest.raises(UnsupportedByRuntimeError, match="no utility calls") as ei:
        p.start_utility("get_supported_tasks")
    assert ei.value.runtime == "tokenspeed" and not p.wants_send


# ------------------------------------------------------------------ wire


def test_add_and_abort_frames_are_tokenspeed_bytes():
    p = link(identity=b"\x02\x00", engine_index=2)
    p.submit(make_ts_request("t1"))
    ((ident, kind, payload),) = sent(p)
    assert (ident, kind) == (b"\x02\x00", b"\x00")
    assert payload.startswith(b"\xdc\x00\x19\xb9TokenizedGenerateReqInput")
    assert ts_engine.decode_add([payload]).rid == "t1"
    p.abort(["t1"])
    ((_, kind, payload),) = sent(p)
    assert kind == b"\x01" and ts_engine.decode_abort(payload) == ("t1",)


def test_batch_columns_route_to_their_streams():
    p = link()
    a, _ = p.submit(make_ts_request("a"))
    b, _ = p.submit(make_ts_request("b", return_logprob=True))
    sent(p)
    p.frames_received(ts_batch_frames([("a", [5], "", 3, 1), ("b", [7, 8], "", 3, 2, [-0.5, -0.25])],
                                      load=(2, 1, 3, 100)))
    da = a.take()
    db = b.take()
    assert da.token_ids == [5] and da.finish_reason is None and da.num_prompt_tokens == 3
    assert db.token_ids == [7, 8]
    assert db.logprobs.logprobs == [[-0.5], [-0.25]] and db.logprobs.token_ids == [[7], [8]]
    assert p.load == ts.LoadSnapshot(0, 2, 1, 3, 100)
    p.frames_received(ts_batch_frames([("a", [6], "stop", 3, 2), ("b", [9], "length", 3, 3, [-1.0])]))
    assert a.take().finish_reason is wire.FinishReason.STOP
    assert b.take().finish_reason is wire.FinishReason.LENGTH
    assert p.inflight == 0
    assert p.load == ts.LoadSnapshot(0, 2, 1, 3, 100)  # a batch without a snapshot keeps the last one


def test_ticks_merge_while_the_consumer_lags():
    p = link()
    mb, _ = p.submit(make_ts_request("a"))
    sent(p)
    for i in range(3):
        p.frames_received(ts_batch_frames([("a", [10 + i], "", 3, i + 1)]))
    d = mb.take()
    assert d.token_ids == [10, 11, 12] and d.ticks == 3


def test_unrequested_abort_without_tokens_is_an_admission_refusal():
    p = link()
    mb, _ = p.submit(make_ts_request("a"))
    sent(p)
    p.frames_received(ts_batch_frames([("a", [], "abort", 3, 0)]))
    assert p.inflight == 0
    with pytest.raises(EngineAbortedRequest, match="refused the request at admission") as ei:
        mb.take()
    assert ei.value.tokens_before_abort == 0 and ei.value.code == "abort"
    assert not p.wants_send  # nothing to abort: the engine already dropped it


def test_unrequested_abort_after_tokens_delivers_them_then_fails():
    p = link()
    mb, _ = p.submit(make_ts_request("a"))
    sent(p)
    p.frames_received(ts_batch_frames([("a", [4, 5], "", 3, 2)]))
    p.frames_received(ts_batch_frames([("a", [6], "abort", 3, 3)]))
    assert mb.take().token_ids == [4, 5, 6]
    with pytest.raises(EngineAbortedRequest, match="after 3 tokens") as ei:
        mb.take()
    assert ei.value.tokens_before_abort == 3


def test_error_finish_is_an_engine_request_error_and_unknown_reasons_stop():
    p = link()
    a, _ = p.submit(make_ts_request("a"))
    b, _ = p.submit(make_ts_request("b"))
    sent(p)
    p.frames_received(ts_batch_frames([("a", [], "error", 3, 0), ("b", [9], "repetition", 3, 1)]))
    with pytest.raises(EngineRequestError):
        a.take()
    assert b.take().finish_reason is wire.FinishReason.STOP
    assert p.unknown_finish_reasons == 1 and p.inflight == 0


def test_logprob_count_not_matching_tokens_fails_that_request_only():
    p = link()
    a, _ = p.submit(make_ts_request("a", return_logprob=True))
    b, _ = p.submit(make_ts_request("b"))
    sent(p)
    frames = ts_engine.encode_outputs(ts.TokenSpeedBatch(
        rids=("a", "b"), output_ids=((1, 2), (3,)), finished_reasons=("", ""), prompt_tokens=(3, 3),
        completion_tokens=(2, 1), cached_tokens=(0, 0), logprob_vals=((-0.1,), ()), logprob_ids=((1,), ()),
    ))
    p.frames_received(frames)
    with pytest.raises(RemoteProtocolError, match="1 logprobs for 2 new tokens"):
        a.take()
    assert b.take().token_ids == [3]
    assert [ts_engine.decode_abort(f[2]) for f in sent(p)] == [("a",)]


def test_slow_consumer_is_failed_and_aborted():
    p = link(max_pending_tokens=4)
    mb, _ = p.submit(make_ts_request("a"))
    sent(p)
    for i in range(5):
        p.frames_received(ts_batch_frames([("a", [i + 3], "", 3, i + 1)]))
    with pytest.raises(SlowConsumerError):
        mb.take()
    assert [ts_engine.decode_abort(f[2]) for f in sent(p)] == [("a",)]


def test_client_abort_retires_locally_since_tokenspeed_sends_no_terminal_frame():
    p = link()
    mb, add = p.submit(make_ts_request("a"))
    sent(p)
    p.abort(["a"])
    assert p.inflight == 0
    with pytest.raises(RequestStreamClosed):
        mb.take()
    assert [ts_engine.decode_abort(f[2]) for f in sent(p)] == [("a",)]
    # a late frame of the old request is counted and dropped
    p.frames_received(ts_batch_frames([("a", [5], "", 3, 1)]))
    assert p.unknown_outputs == 1


# ------------------------------------------------------------------ parked aborts


def test_abort_that_raced_the_finish_sends_a_reuse_of_the_id_under_a_fresh_one():
    clock = Clock()
    p = link(clock=clock)
    p.submit(make_ts_request("a"))
    sent(p)
    p.abort(["a"])  # the engine had already finished "a": its terminal frame is in flight
    sent(p)
    p.frames_received(ts_batch_frames([("a", [5], "stop", 3, 1)]))
    assert "a" in p._parked
    # TokenSpeed parks that ABORT and would apply it, silently, to the next "a"
    mb, _ = p.submit(make_ts_request("a"))
    assert mb.wire_id == "a~1" and [ts_engine.decode_add(f[2:]).rid for f in sent(p)] == ["a~1"]
    p.frames_received(ts_batch_frames([("a~1", [6], "length", 3, 1)]))
    d = mb.take()
    assert d.request_id == "a" and d.token_ids == [6] and not p.is_live("a")


def test_a_parked_abort_renames_reuses_only_for_the_park_window():
    clock = Clock()
    p = link(clock=clock)
    # "b" finished after an ABORT sent by an earlier link (a resumed session's orphan)
    p.frames_received(ts_batch_frames([("b", [], "stop", 3, 0)]))
    clock.now += limits.TOKENSPEED_ABORT_PARK_SECONDS - 1
    assert p.submit(make_ts_request("b"))[0].wire_id == "b~1"
    p.abort(["b"])
    clock.now += 1  # the engine's parked abort has expired
    assert p.submit(make_ts_request("b"))[0].wire_id == "b"


def test_an_abort_that_reached_a_running_request_parks_nothing():
    clock = Clock()
    p = link(clock=clock)
    p.submit(make_ts_request("a"))
    sent(p)
    p.abort(["a"])
    sent(p)
    p.frames_received(ts_batch_frames([("a", [5], "", 3, 1)]))  # a tick still in flight, not terminal
    p.submit(make_ts_request("a"))
    assert p.inflight == 1


def test_parked_ids_are_bounded(monkeypatch):
    monkeypatch.setattr(limits, "MAX_PARKED_ABORT_IDS", 3)
    p = link(clock=Clock())
    for i in range(5):
        p.frames_received(ts_batch_frames([(f"x{i}", [], "stop", 3, 0)]))
    assert list(p._parked) == ["x2", "x3", "x4"]
    assert p.submit(make_ts_request("x0"))[0].wire_id == "x0"  # forgotten (oldest first)
    assert p.submit(make_ts_request("x4"))[0].wire_id == "x4~1"


# ------------------------------------------------------------------ death


def test_sentinel_and_undecodable_streak_kill_a_tokenspeed_link():
    p = link()
    mb, _ = p.submit(make_ts_request("a"))
    p.frames_received([ts.ENGINE_CORE_DEAD])
    with pytest.raises(EngineDeadError) as ei:
        mb.take()
    assert ei.value.reason == "sentinel"

    p = link(max_decode_errors=2)
    mb, _ = p.submit(make_ts_request("a"))
    sent(p)
    # a vLLM output message is not a TokenSpeed batch
    p.frames_received(outputs_frames([out("a", [1])]))
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        mb.take()
    assert p.decode_errors == 1
    p.frames_received([b"\xc1"])
    assert p.death is not None and p.death.reason == "decode_errors"
    with pytest.raises(EngineDeadError):
        p.submit(make_ts_request("b"))


def test_a_queued_add_aborted_before_sending_never_reaches_the_engine():
    p = link()
    _, add = p.submit(make_ts_request("a"))
    p.abort(["a"])
    assert add.state is SendState.CANCELLED and sent(p) == []


def test_orphans_aborted_on_a_resumed_tokenspeed_link_are_never_reused_as_is():
    clock = Clock()
    p = link(clock=clock)
    p.abort_stale(["old-1"])
    assert [ts_engine.decode_abort(f[2]) for f in sent(p)] == [("old-1",)]
    assert p.submit(make_ts_request("old-1"))[0].wire_id == "old-1~1"
    p.abort(["old-1"])
    clock.now += limits.TOKENSPEED_ABORT_PARK_SECONDS
    # past the park window, but still remembered as aborted here (late outputs)
    assert p.submit(make_ts_request("old-1"))[0].wire_id == "old-1~2"
