"""EngineProtocol on an SGLang link: the runtime read from the ready response, the
wire frames (ADD, ABORT, CONTROL), control replies, routing of slim batches, the
scheduler's refusals, and engine-side ids kept prefix-free (the scheduler aborts by rid prefix) -- no
sockets, no trio."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import (
    EngineAbortedRequest,
    EngineHandshakeError,
    RemoteProtocolError,
    RuntimeMismatchError,
    UtilityCallError,
)
from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.protocol.runtime import Runtime
from zmqdispatch.protocol.versions import check_engine_layouts
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_handshake as handshake

from ..helpers import make_request, make_ts_request


def link(**kw: object) -> EngineProtocol:
    kw.setdefault("runtime", Runtime.SGLANG)
    return EngineProtocol(**kw)


def sent(p: EngineProtocol) -> list[list[bytes]]:
    frames = []
    while (o := p.pop_send()) is not None:
        p.send_done(o)
        frames.append(o.frames)
    return frames


def req(rid: str, **sp: object) -> sg.TokenizedGenerateReqInput:
    return sg.TokenizedGenerateReqInput(rid=rid, input_ids=(1, 2), sampling_params=sg.SGLangSamplingParams(**sp),
                                        stream=True)


def batch(*rows: tuple, **kw: object) -> list[bytes]:
    """rows: (rid, tokens, reason[, message, matched, status])"""
    full = [(r + (None, None, None))[:6] for r in rows]
    return sg_engine.encode_outputs(sg.SGLangBatch(
        rids=tuple(r[0] for r in full), output_ids=tuple(tuple(r[1]) for r in full),
        finished_reasons=tuple(r[2] for r in full), finished_messages=tuple(r[3] for r in full),
        finished_matched=tuple(r[4] for r in full), prompt_tokens=(2,) * len(full),
        completion_tokens=tuple(len(r[1]) for r in full), cached_tokens=(0,) * len(full),
        logprob_vals=((),) * len(full), logprob_ids=((),) * len(full),
        finished_status=tuple(r[5] for r in full), **kw))  # type: ignore[arg-type]


def ready(version: str, **kw: object) -> handshake.EngineCoreReadyResponse:
    return handshake.EngineCoreReadyResponse(max_model_len=64, vllm_version=version, **kw)  # type: ignore[arg-type]


def test_the_runtime_is_told_apart_by_the_version_prefix() -> None:
    assert Runtime.of_ready_response(ready("sglang-0.5.21")) is Runtime.SGLANG
    assert Runtime.of_ready_response(ready("tokenspeed-0.1.1")) is Runtime.TOKENSPEED
    assert Runtime.of_ready_response(ready("0.32.0")) is Runtime.VLLM
    with pytest.raises(EngineHandshakeError, match=r"expected a TokenSpeed scheduler.*SGLang scheduler"):
        Runtime.resolve("tokenspeed", ready("sglang-0.5.21"))


def test_the_layout_guard_runs_for_sglang_only() -> None:
    assert check_engine_layouts(ready("sglang-0.5.21", positional_layouts=sg_engine.ready_layouts())) is True
    assert check_engine_layouts(ready("sglang-0.5.21")) is False
    assert check_engine_layouts(ready("0.32.0", positional_layouts={"SamplingParams": ("x",)})) is False
    bad = sg_engine.ready_layouts(request=("rid", "http_worker_ipc", "input_ids"))
    with pytest.raises(sg.LayoutMismatch, match="TokenizedGenerateReqInput field 2 differs"):
        check_engine_layouts(ready("sglang-0.5.21", positional_layouts=bad))


@pytest.mark.parametrize("other", [make_request("v1"), make_ts_request("t1")])
def test_a_request_of_another_runtime_is_refused(other: object) -> None:
    with pytest.raises(RuntimeMismatchError, match="built for the"):
        link().submit(other)


def test_add_abort_and_control_frames() -> None:
    p = link(identity=b"\x01\x00", engine_index=1)
    p.submit(req("a"))
    ((ident, kind, payload),) = sent(p)
    assert (ident, kind) == (b"\x01\x00", b"\x00") and sg_engine.decode_add([payload]).rid == "a"
    p.abort(["a"])
    ((_, kind, payload),) = sent(p)
    assert kind == b"\x01" and sg_engine.decode_abort(payload) == ("a",)
    call = p.start_utility("flush_cache", [1.5])
    ((_, kind, payload),) = sent(p)
    assert kind == b"\x02" and sg_engine.decode_control(payload) == (call.call_id, "flush_cache", [1.5])


def test_control_replies_settle_their_call_and_a_stray_one_is_dropped() -> None:
    p = link()
    ok = p.start_utility("start_profile", [{}])
    bad = p.start_utility("nope")
    sent(p)
    p.frames_received([sg_engine.encode_control_reply(sg.ControlReply(ok.call_id, True, "started", 0))])
    p.frames_received([sg_engine.encode_control_reply(sg.ControlReply(bad.call_id, False, "unknown", 0))])
    p.frames_received([sg_engine.encode_control_reply(sg.ControlReply(999, True, "", 0))])
    assert ok.done and ok.result == "started" and ok.error is None
    assert bad.done and isinstance(bad.error, UtilityCallError) and "unknown" in str(bad.error)
    assert p.pending_utility_calls == 0 and p.decode_errors == 0


def test_a_batch_routes_tokens_the_named_stop_and_the_load() -> None:
    p = link()
    a, _ = p.submit(req("a"))
    b, _ = p.submit(req("b"))
    sent(p)
    p.frames_received(batch(("a", [5], ""), ("b", [6, 2], "stop", None, 2), ("gone", [1], ""),
                            kv_used_tokens=10, kv_total_tokens=100))
    da, db = a.take(), b.take()
    assert da is not None and da.token_ids == [5] and da.finish_reason is None
    assert db is not None and db.token_ids == [6, 2] and db.finish_reason is wire.FinishReason.STOP
    assert db.stop_reason == 2 and p.unknown_outputs == 1 and p.inflight == 1
    assert p.load is not None and p.load.kv_usage == 0.1
    p.frames_received(batch(("a", [7], "length")))
    last = a.take()
    assert last is not None and last.finish_reason is wire.FinishReason.LENGTH and last.stop_reason is None


def test_an_unrequested_abort_fails_the_stream_with_the_reason_and_status() -> None:
    p = link()
    a, _ = p.submit(req("a"))
    sent(p)
    p.frames_received(batch(("a", [], "abort", "top_p must be in (0, 1], got 0.0.", None, 400)))
    refused = r"refused the request: top_p must be in \(0, 1\].*status 400"
    with pytest.raises(EngineAbortedRequest, match=refused) as info:
        a.take()
    assert info.value.status == 400 and info.value.tokens_before_abort == 0
    assert p.inflight == 0


def test_top_logprob_rows_that_do_not_match_the_tokens_make_the_message_undecodable() -> None:
    p = link()
    a, _ = p.submit(req("a"))
    b, _ = p.submit(req("b"))
    sent(p)
    frames = sg_engine.encode_outputs(sg.SGLangBatch(
        rids=("a", "b"), output_ids=((5, 6), (7,)), finished_reasons=("", ""), finished_messages=(None, None),
        finished_matched=(None, None), prompt_tokens=(2, 2), completion_tokens=(2, 1), cached_tokens=(0, 0),
        logprob_vals=((-0.1, -0.2), (-0.3,)), logprob_ids=((5, 6), (7,)),
        top_logprob_vals=(((-0.1,),), ((-0.3,),)), top_logprob_ids=(((5,),), ((7,),))))
    # a's top rows cover one of its two tokens: the decoder refuses the whole message
    p.frames_received(frames)
    assert p.decode_errors == 1
    for mb in (a, b):
        with pytest.raises(RemoteProtocolError):
            mb.take()


def test_ids_that_prefix_each_other_travel_prefix_free_so_an_abort_stops_one() -> None:
    p = link()
    one, _ = p.submit(req("r-1"))
    ten, _ = p.submit(req("r-10"))  # "r-1" prefixes it: a fresh id
    p.submit(req("r-2"))
    adds = sent(p)
    assert [sg_engine.decode_add(f[2:]).rid for f in adds] == ["r-1", "~1~r-10", "r-2"]
    assert p.wire_id("r-10") == "~1~r-10" and p.renamed_requests == 1
    p.abort(["r-1"])
    (abort,) = sent(p)
    assert abort[1] == b"\x01" and sg_engine.decode_abort(abort[2]) == ("r-1",)
    # the scheduler stops "r-1" only; "r-10"'s outputs still reach its stream, under its own id
    p.frames_received(batch(("~1~r-10", (5, 6), "length")))
    delta = ten.take()
    assert delta is not None and delta.request_id == "r-10" and delta.token_ids == [5, 6]
    assert not p.is_live("r-1") and p.is_live("r-2")


def test_an_id_that_prefixes_a_live_one_travels_under_a_fresh_id() -> None:
    p = link()
    p.submit(req("~1~"))  # a caller's id in the fresh ids' form: the fresh one skips past it
    p.submit(req("r-10"))
    p.submit(req("r-1"))
    assert [p.wire_id(r) for r in ("~1~", "r-10", "r-1")] == ["~1~", "r-10", "~2~r-1"]
    q = link()
    q.submit(req("~"))  # it prefixes every "~<n>~" id: another head
    q.submit(req("a"))
    q.submit(req("ab"))
    assert q.wire_id("ab") == "#1~ab"


def test_vllm_and_tokenspeed_links_keep_ids_that_prefix_each_other() -> None:
    p = EngineProtocol(runtime=Runtime.TOKENSPEED)
    p.submit(make_ts_request("r-1"))
    p.submit(make_ts_request("r-10"))
    assert p.wire_id("r-10") == "r-10" and p.renamed_requests == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "abort", "finish"]),
                          st.text(alphabet="1~-", min_size=1, max_size=4)), max_size=40))
def test_live_engine_side_ids_stay_prefix_free(ops: list[tuple[str, str]]) -> None:
    p = link()
    mailboxes = {}
    for op, rid in ops:
        if op == "submit" and not p.is_live(rid):
            mailboxes[rid], _ = p.submit(req(rid))
        elif op == "abort":
            p.abort([rid])
        elif op == "finish" and p.is_live(rid):
            sent(p)
            p.frames_received(batch((p.wire_id(rid), (5,), "length")))
            assert mailboxes[rid].take().finish_reason is not None
        live = [p.wire_id(r) for r in mailboxes if p.is_live(r)]
        assert len(set(live)) == len(live)
        assert not [(a, b) for a in live for b in live if a != b and b.startswith(a)], live
    sent(p)  # every ADD and ABORT encodes
