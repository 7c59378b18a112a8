"""Invariants of the SGLang codec (hypothesis): what the client encodes the scheduler
side decodes to the same struct; every batch the scheduler side encodes decodes to
itself, the typed fast path and the msgpack reference agree on every message, and
the plugin's golden outputs take the fast path."""

from __future__ import annotations

import json
import pathlib

import attrs
import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import sglang_outputs as sg_out

SETTINGS = settings(deadline=None, max_examples=150, database=None)
ids = st.integers(0, 2**32 - 1)
text = st.text(max_size=6)


@st.composite
def sampling(draw: st.DrawFn) -> sg.SGLangSamplingParams:
    return sg.SGLangSamplingParams(
        max_new_tokens=draw(st.none() | st.integers(0, 2**20)),
        stop=draw(st.none() | text | st.lists(text, max_size=3).map(tuple)),
        stop_token_ids=draw(st.none() | st.lists(ids, max_size=4).map(tuple)),
        temperature=draw(st.floats(0, 3)), top_p=draw(st.floats(0.01, 1)), top_k=draw(st.integers(-1, 100)),
        min_p=draw(st.floats(0, 1)), n=draw(st.integers(1, 3)), ignore_eos=draw(st.booleans()),
        json_schema=draw(st.none() | st.just("{}")),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, 99).map(str), st.floats(-100, 100), max_size=3)),
        sampling_seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        custom_params=draw(st.none() | st.dictionaries(text, st.integers(-(2**63), 2**63 - 1), max_size=2)),
    )


@st.composite
def requests(draw: st.DrawFn) -> sg.TokenizedGenerateReqInput:
    return sg.TokenizedGenerateReqInput(
        rid=draw(st.text(min_size=1, max_size=8)), input_ids=draw(st.lists(ids, max_size=8).map(tuple)),
        sampling_params=draw(sampling()), return_logprob=draw(st.booleans()),
        top_logprobs_num=draw(st.integers(0, 5)), stream=draw(st.booleans()),
        require_reasoning=draw(st.booleans()), priority=draw(st.none() | st.integers(-5, 5)),
        lora_id=draw(st.none() | text), bootstrap_port=draw(st.none() | st.integers(0, 65535)),
    )


@given(requests())
@SETTINGS
def test_an_add_decodes_to_what_was_encoded_in_derived_form(req: sg.TokenizedGenerateReqInput) -> None:
    got = sg_engine.decode_add(sg.encode_add(req))
    sent = req.sampling_params.derive()
    assert got.sampling_params == sent
    # deriving again changes nothing but, at most, the order of the stop id set
    again = sent.derive()
    assert attrs.evolve(again, stop_token_ids=None) == attrs.evolve(sent, stop_token_ids=None)
    assert set(again.stop_token_ids or ()) == set(sent.stop_token_ids or ())
    assert {n: getattr(got, n) for n in sg.REQUEST_LAYOUT if n != "sampling_params"} == \
        {n: getattr(req, n) for n in sg.REQUEST_LAYOUT if n != "sampling_params"}


@st.composite
def batches(draw: st.DrawFn) -> sg.SGLangBatch:
    m = draw(st.integers(0, 5))
    toks = [tuple(draw(st.lists(ids, max_size=4))) for _ in range(m)]
    lp = [draw(st.booleans()) for _ in range(m)]
    k = draw(st.integers(0, 3))
    tops = draw(st.booleans())
    col = lambda s: tuple(draw(s) for _ in range(m))  # noqa: E731
    return sg.SGLangBatch(
        rids=col(st.text(max_size=5)), output_ids=tuple(toks),
        finished_reasons=col(st.sampled_from(["", "stop", "length", "abort"])),
        finished_messages=col(st.none() | text), finished_matched=col(st.none() | ids | text),
        prompt_tokens=col(ids), completion_tokens=col(ids), cached_tokens=col(ids),
        logprob_vals=tuple(tuple(-0.5 for _ in t) if f else () for t, f in zip(toks, lp)),
        logprob_ids=tuple(t if f else () for t, f in zip(toks, lp)),
        engine_index=draw(st.integers(0, 7)), num_running=draw(st.integers(0, 9)),
        kv_used_tokens=draw(st.integers(0, 99)), kv_total_tokens=draw(st.integers(0, 999)),
        finished_status=draw(st.none() | st.just(col(st.none() | st.just(400)))),
        top_logprob_vals=tuple(tuple((-1.0,) * k for _ in t) if f else () for t, f in zip(toks, lp)) if tops else None,
        top_logprob_ids=tuple(tuple((1,) * k for _ in t) if f else () for t, f in zip(toks, lp)) if tops else None,
        reasoning_tokens=draw(st.none() | st.just(col(ids))),
    )


@given(batches())
@SETTINGS
def test_a_batch_decodes_to_itself_on_both_paths(batch: sg.SGLangBatch) -> None:
    frames = sg_engine.encode_outputs(batch)
    assert sg.decode_outputs(frames) == batch
    assert sg_out._decode_outputs_msgpack(frames) == batch


@given(st.lists(st.integers(0, 9) | st.none() | st.text(max_size=2) | st.just([]) | st.just([[1]]), max_size=30))
@SETTINGS
def test_garbage_is_refused_alike_by_both_paths(elements: list[object]) -> None:
    frames = [msgpack.packb([sg.BATCH_TAG, *elements])]
    results = []
    for fn in (sg.decode_outputs, sg_out._decode_outputs_msgpack):
        try:
            results.append(fn(frames))
        except RemoteProtocolError:
            results.append("refused")
    assert results[0] == results[1]


def test_the_plugins_outputs_take_the_typed_path() -> None:
    doc = json.loads((pathlib.Path(__file__).parent / "vectors" / "sglang_0.5.21.json").read_text())
    for case in doc["cases"]:
        if case["kind"] not in ("output", "control_reply"):
            continue
        frames = [bytes.fromhex(h) for h in case["frames_hex"]]
        b = sg_out._typed_decoder(65_536, 4096, 2**32 - 1).decode(frames[0])
        if case["kind"] == "output":
            assert sg_out._checked(b, len(msgpack.unpackb(frames[0]))) == sg_out._decode_outputs_msgpack(frames)
        assert sg.decode_outputs(frames) == sg_out._decode_outputs_msgpack(frames)
