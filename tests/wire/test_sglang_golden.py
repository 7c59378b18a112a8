"""Golden vectors of SGLang 0.5.21's own encoders, replayed against our codec.

``tests/wire/vectors/sglang_0.5.21.json`` is written by ``scripts/sglang_reference.py
vectors`` with SGLang's own ``SamplingParams`` and ``TokenizedGenerateReqInput``
structs (from the pinned wheel) and the SGLang plugin's output structs
(``smg-grpc-servicer`` 0.14.1), encoded by msgspec. Here, without SGLang: our
encoder must reproduce every request's bytes, our decoder must read every output
to the plugin's field values, and the layout check must accept 0.5.21's layouts
and refuse the later releases' (whose ``SamplingParams`` inserts ``watermark``),
naming the first differing field. ``tests/wire/test_sglang_reference.py``
regenerates the file from the wheel and requires it unchanged.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import vllm_handshake as handshake
from zmqdispatch.wire.schema import _pack

VECTORS = pathlib.Path(__file__).resolve().parent / "vectors" / "sglang_0.5.21.json"
DOC: dict[str, Any] = json.loads(VECTORS.read_text())
CASES = {c["name"]: c for c in DOC["cases"]}


def names(kind: str) -> list[str]:
    return [n for n, c in CASES.items() if c["kind"] == kind]


def frames(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["frames_hex"]]


def build(case: dict[str, Any]) -> sg.TokenizedGenerateReqInput:
    return sg.TokenizedGenerateReqInput(**case["request"], sampling_params=sg.SGLangSamplingParams(**case["sampling"]))


def test_vectors_cover_every_message_kind() -> None:
    kinds = {c["kind"] for c in DOC["cases"]}
    assert kinds == {"add", "abort", "control", "output", "control_reply", "ready_response"}
    assert DOC["sglang"] == sg.SGLANG_VERSION


@pytest.mark.parametrize("name", names("add"))
def test_add_bytes_equal_sglangs_encoder(name: str) -> None:
    case = CASES[name]
    assert [sg.RequestType.ADD.frame.hex(), *(f.hex() for f in sg.encode_add(build(case)))] == case["frames_hex"]


@pytest.mark.parametrize("name", names("add"))
def test_add_decodes_to_what_was_sent(name: str) -> None:
    case = CASES[name]
    kind, req = sg_engine.decode_input(frames(case))
    assert kind is sg.RequestType.ADD
    # the golden bytes carry the derived form; deriving again changes nothing
    sent = build(case)
    assert req == sg.TokenizedGenerateReqInput(**{**_fields(sent), "sampling_params": sent.sampling_params.derive()})
    assert set(req.sampling_params.derive().stop_token_ids or ()) == set(req.sampling_params.stop_token_ids or ())


def _fields(req: sg.TokenizedGenerateReqInput) -> dict[str, Any]:
    return {name: getattr(req, name) for name in sg.REQUEST_LAYOUT}


def test_abort_and_control_bytes() -> None:
    abort = CASES["abort_two"]
    assert [sg.RequestType.ABORT.frame.hex(), sg.encode_abort(abort["rids"]).hex()] == abort["frames_hex"]
    assert sg_engine.decode_input(frames(abort)) == (sg.RequestType.ABORT, ("r-1", "r-2"))
    for name in names("control"):
        case = CASES[name]
        call_id, method, args = case["call"]
        ours = [sg.RequestType.CONTROL.frame.hex(), sg.encode_control(call_id, method, args).hex()]
        assert ours == case["frames_hex"]
        assert sg_engine.decode_input(frames(case)) == (sg.RequestType.CONTROL, (call_id, method, args))


def _batch_view(b: sg.SGLangBatch) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, tuple) else v

    view = {
        "rids": b.rids, "output_ids": b.output_ids, "finished_reasons": b.finished_reasons,
        "finished_messages": b.finished_messages, "finished_matched": b.finished_matched,
        "prompt_tokens": b.prompt_tokens, "completion_tokens": b.completion_tokens, "cached_tokens": b.cached_tokens,
        "output_token_logprobs_val": b.logprob_vals, "output_token_logprobs_idx": b.logprob_ids,
    }
    return {k: plain(v) for k, v in view.items()}


@pytest.mark.parametrize("name", names("output"))
def test_output_decodes_to_the_plugins_fields(name: str) -> None:
    case = CASES[name]
    b = sg.decode_outputs(frames(case))
    assert isinstance(b, sg.SGLangBatch)
    fields = case["fields"]
    assert _batch_view(b) == {k: fields[k] for k in _batch_view(b)}
    for ours, theirs in (("engine_index", "engine_index"), ("kv_used_tokens", "kv_used_tokens"),
                         ("kv_total_tokens", "kv_total_tokens"), ("num_running", "num_running")):
        assert getattr(b, ours) == fields.get(theirs, 0)
    if fields.get("output_top_logprobs_val"):
        assert [[list(s) for s in r] for r in b.top_logprob_vals or ()] == fields["output_top_logprobs_val"]
        assert [[list(s) for s in r] for r in b.top_logprob_ids or ()] == fields["output_top_logprobs_idx"]
    if fields.get("finished_status") is not None:
        assert list(b.finished_status or ()) == fields["finished_status"]


def test_output_re_encoded_decodes_the_same() -> None:
    for name in names("output"):
        b = sg.decode_outputs(frames(CASES[name]))
        assert isinstance(b, sg.SGLangBatch)
        assert sg.decode_outputs(sg_engine.encode_outputs(b)) == b


@pytest.mark.parametrize("name", names("control_reply"))
def test_control_reply(name: str) -> None:
    case = CASES[name]
    reply = sg.decode_outputs(frames(case))
    assert reply == sg.ControlReply(**case["fields"])
    assert sg_engine.encode_control_reply(reply).hex() == case["frames_hex"][0]


def test_ready_response_layouts_pass_the_check() -> None:
    ready = handshake.decode_ready_response(frames(CASES["ready_response_dp_rank1"])[0])
    assert sg.is_sglang(ready) and ready.data_parallel_rank == 1 and ready.block_size == 1
    assert ready.positional_layouts is not None
    assert sg.check_layouts(ready.positional_layouts) is True
    assert list(sg.REQUEST_LAYOUT) == DOC["layouts"]["0.5.21"]["TokenizedGenerateReqInput"]
    assert list(sg.SAMPLING_LAYOUT) == DOC["layouts"]["0.5.21"]["SamplingParams"]


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_later_releases_are_refused_naming_the_field(version: str) -> None:
    layouts = DOC["layouts"][version]
    with pytest.raises(sg.LayoutMismatch) as info:
        sg.check_layouts(layouts)
    exc = info.value
    assert (exc.struct, exc.index, exc.expected, exc.actual) == ("SamplingParams", 26, "stop_strs", "watermark")
    assert "SamplingParams field 26" in str(exc) and "'watermark'" in str(exc)


def test_appended_request_field_is_accepted_and_removed_one_refused() -> None:
    layouts = {"TokenizedGenerateReqInput": [*sg.REQUEST_LAYOUT, "lora_name"], "SamplingParams": sg.SAMPLING_LAYOUT}
    assert sg.check_layouts(layouts) is True
    short = {"TokenizedGenerateReqInput": sg.REQUEST_LAYOUT[:-1], "SamplingParams": sg.SAMPLING_LAYOUT}
    with pytest.raises(sg.LayoutMismatch, match="has only 47 fields"):
        sg.check_layouts(short)
    # a shorter ADD prefix is checked only as far as it goes
    assert sg.check_layouts(short, request_elements=sg.REQUEST_MIN_ELEMENTS) is True
    with pytest.raises(sg.LayoutMismatch, match="declare no SamplingParams"):
        sg.check_layouts({"TokenizedGenerateReqInput": sg.REQUEST_LAYOUT})
    assert sg.check_layouts({}) is False and sg.check_layouts(None) is False


def test_bad_outputs_name_the_column() -> None:
    good = CASES["output_finishes"]
    with pytest.raises(RemoteProtocolError, match="wrong msgspec tag"):
        sg.decode_outputs([b"\x92\xa3bad\x90"])
    with pytest.raises(RemoteProtocolError, match="missing positional field 'output_token_logprobs_idx'"):
        sg.decode_outputs([_pack(["BatchTokenIDSlimOutput", [], [], [], [], [], [], [], [], []])])
    b = sg.decode_outputs(frames(good))
    assert isinstance(b, sg.SGLangBatch)
    ragged = _pack(["BatchTokenIDSlimOutput", ["a"], [[1], [2]], [""], [None], [None], [1], [1], [0], [[]], [[]]])
    with pytest.raises(RemoteProtocolError, match=r"output_ids: expected an array of 1 elements \(ragged"):
        sg.decode_outputs([ragged])
    bad_lp = _pack(["BatchTokenIDSlimOutput", ["a"], [[1]], [""], [None], [None], [1], [1], [0], [[0.5]], [[]]])
    with pytest.raises(RemoteProtocolError, match="1 values for 0 token ids"):
        sg.decode_outputs([bad_lp])
    with pytest.raises(RemoteProtocolError, match="embedding"):
        sg.decode_outputs([_pack(["BatchEmbeddingSlimOutput", [], [], [], [], [], [], []])])
    with pytest.raises(RemoteProtocolError, match=r"ControlReplySlim\.success"):
        sg.decode_outputs([_pack(["ControlReplySlim", 1, 1])])


def test_encoder_refusals_name_the_field() -> None:
    from zmqdispatch.errors import LocalProtocolError

    sp = sg.SGLangSamplingParams()
    with pytest.raises(LocalProtocolError, match=r"TokenizedGenerateReqInput\.mm_inputs: not carried"):
        sg.encode_add(sg.TokenizedGenerateReqInput(rid="r", input_ids=[1], sampling_params=sp,
                                                   mm_inputs={"x": 1}))  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="require_reasoning is set but a 14-element payload"):
        sg.encode_add(sg.TokenizedGenerateReqInput(rid="r", input_ids=[1], sampling_params=sp, require_reasoning=True),
                      elements=14)
    with pytest.raises(LocalProtocolError, match="call_id"):
        sg.encode_control(-1, "flush_cache")
