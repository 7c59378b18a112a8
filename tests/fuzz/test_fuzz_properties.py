"""Hypothesis fuzz tests of every decoder of engine bytes and of the translation.

The normal suite's short version of the atheris harnesses in ``fuzz/`` (issue 7,
Fuzzing). What ``tests/wire/test_vllm_roundtrip.py`` and
``tests/wire/test_tokenspeed_roundtrip.py`` already do (arbitrary bytes,
arbitrary msgpack values, mutated encoder outputs, lying tensor headers) is not
repeated; these cover the gaps:

- the golden vectors (bytes of vLLM's and TokenSpeed's own encoders) mutated
  structurally -- a value replaced by a boundary value or by a copy of another
  node, deleted, repeated, truncated, wrapped; aux frames resized, dropped or
  duplicated -- for every decoder family: vLLM outputs (with the lazily decoded
  logprobs and ``EngineCoreOutput.from_row``), control messages (utility output,
  handshake, ready response, INIT, ABORT, UTILITY, START_DP_WAVE), requests as
  the mock engine reads them, TokenSpeed batches and ADD/ABORT inputs;
- routing arbitrary frames through ``EngineProtocol.frames_received`` (never
  raises; every stream ends with a typed error or its tokens; utility calls
  settle with a ``UtilityCallError`` or a result);
- tensors whose header agrees with their bytes (the acceptance path, inline and
  in aux frames, every dtype): ``tolist()`` and re-encoding;
- the translation of arbitrary ``GenerateRequest`` protos (every field, boundary
  values, NaN/inf, text input, PD / multimodal fields, any ``TranslationConfig``)
  and of arbitrary serialized protos.

Contract everywhere: the only exceptions out are ``RemoteProtocolError``
(decoders) and ``RequestRejected`` (translation and request checks). Bounded
memory for hostile headers is pinned by ``test_regressions.py`` (these tests do
not call ``tolist()`` on tensors whose shape would build more than a few
thousand lists).
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
from typing import Any

import attrs
import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    RequestRejected,
    UtilityCallError,
    ZmqDispatchError,
)
from zmqdispatch.mock.core import FatalEngineError, MockEngineCore
from zmqdispatch.protocol import checks_sglang, checks_tokenspeed
from zmqdispatch.protocol.checks import check_request
from zmqdispatch.protocol.engine import EngineProtocol, LinkState
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_parallel
from zmqdispatch.wire import tensors
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import sglang_outputs as sg_out
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine
from zmqdispatch.wire import vllm_handshake as handshake

FUZZ = settings(
    deadline=None,
    max_examples=120,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "wire" / "vectors"
_VLLM = json.loads((VECTORS / "vllm_0.32.0.json").read_text())
_TS = json.loads((VECTORS / "tokenspeed_0.1.1.json").read_text())
_SG = json.loads((VECTORS / "sglang_0.5.21.json").read_text())["cases"]


def _golden(cases: list[dict], *prefixes: str, type_byte: bool = False) -> list[list[bytes]]:
    out = []
    for case in cases:
        if case["name"].startswith(prefixes) and not case["name"].endswith("engine_core_dead"):
            frames = [bytes.fromhex(h) for h in case["frames_hex"]]
            if type_byte:
                frames.insert(0, bytes.fromhex(case.get("type_byte") or "00"))
            out.append(frames)
    assert out, prefixes
    return out


VLLM_OUTPUTS = _golden(_VLLM, "outputs_", "utility_result_")
VLLM_REQUESTS = _golden(_VLLM, "request_", "utility_call_", type_byte=True)
TS_OUTPUTS = _golden(_TS, "outputs_")
TS_INPUTS = _golden(_TS, "add_", "abort_", type_byte=True)
SG_OUTPUTS = _golden(_SG, "output_", "control_reply_")
SG_INPUTS = _golden(_SG, "add_", "abort_", "control_flush", "control_start", "control_stop")
CONTROL = {
    handshake.decode_handshake_status: _golden(_VLLM + _TS, "handshake_hello", "handshake_ready_headless"),
    handshake.decode_ready_response: _golden(_VLLM, "handshake_ready_response"),
    ts.decode_ready_response: _golden(_TS, "ready_response"),
    handshake.decode_init: _golden(_VLLM, "handshake_init_reply"),
    wire_engine.decode_abort: _golden(_VLLM + _TS, "request_abort", "abort_"),
    wire_engine.decode_utility_call: _golden(_VLLM, "utility_call_"),
    wire_engine.decode_start_dp_wave: _golden(_VLLM, "request_start_dp_wave"),
}

# --------------------------------------------------------------------------- structural mutation

_EXT = msgpack.ExtType
BOUNDARY = [
    None, True, False, 0, 1, -1, 2, 255, 256, 4096, 4097, 65536, 2**26, 2**26 + 1, 2**31, 2**32 - 1, 2**32,
    2**63 - 1, 2**64 - 1, -(2**63), 0.0, -0.0, math.nan, math.inf, "", "r", "<i4", "int32", "bfloat16", ">f8",
    "|b1", "BatchTokenIDOutSlim", "TokenizedGenerateReqInput", b"", b"\x00" * 4, _EXT(3, b""), _EXT(3, b"\x00" * 8),
    _EXT(1, b"\x80\x04N."), _EXT(7, b"x"), [], {}, [0], [1, 0], ["", []],
]
leaves = (
    st.sampled_from(BOUNDARY)
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=8)
    | st.builds(_EXT, st.integers(0, 127), st.binary(max_size=8))
)


def _keep_ext(code: int, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, data)


def _slots(value: object) -> list[tuple[object, object]]:
    out: list[tuple[object, object]] = []
    todo = [value]
    while todo and len(out) < 256:
        v = todo.pop(0)
        if type(v) is list:
            out += [(v, i) for i in range(len(v))]
            todo += v
        elif type(v) is dict:
            out += [(v, k) for k in v]
            todo += list(v.values())
    return out


@st.composite
def mutated(draw: st.DrawFn, seeds: list[list[bytes]], payload_index: int = 0) -> list[bytes]:
    """A golden message with a few structural mutations of its msgpack payload
    and of its aux frames."""
    frames = list(draw(st.sampled_from(seeds)))
    root = [msgpack.unpackb(frames[payload_index], ext_hook=_keep_ext, strict_map_key=False)]
    for _ in range(draw(st.integers(0, 4))):
        slots: list[tuple[Any, Any]] = _slots(root[0]) or [(root, 0)]
        box, key = slots[draw(st.integers(0, len(slots) - 1))]
        action = draw(st.integers(0, 5))
        if action == 0:
            box[key] = copy.copy(draw(leaves))
        elif action == 1 and box is not root:
            del box[key]
        elif action == 2 and type(box) is list and box is not root:
            box[key:key + 1] = [copy.deepcopy(box[key]) for _ in range(draw(st.integers(2, 8)))]
        elif action == 3:
            src, skey = slots[draw(st.integers(0, len(slots) - 1))]
            box[key] = copy.deepcopy(src[skey])
        elif action == 4 and type(box[key]) is list:
            del box[key][draw(st.integers(0, len(box[key]))):]
        elif action == 5:
            box[key] = [box[key]]
    try:
        frames[payload_index] = msgpack.packb(root[0], use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        pass  # keep the golden payload
    for _ in range(draw(st.integers(0, 2))):
        aux = len(frames) - payload_index - 1
        action = draw(st.integers(0, 2))
        if action == 0 and aux:
            i = draw(st.integers(payload_index + 1, len(frames) - 1))
            frames[i] = frames[i][: draw(st.integers(0, len(frames[i]) + 8))].ljust(draw(st.integers(0, 600)), b"\0")
        elif action == 1 and aux:
            del frames[draw(st.integers(payload_index + 1, len(frames) - 1))]
        else:
            frames.append(draw(st.binary(max_size=16)) if draw(st.booleans()) else frames[-1])
    return frames


def only(allowed: type[BaseException] | tuple, fn, *args):  # type: ignore[no-untyped-def]
    """``(True, result)`` or ``(False, None)`` for an allowed exception; anything else fails the test."""
    try:
        return True, fn(*args)
    except allowed:
        return False, None


# --------------------------------------------------------------------------- vLLM outputs and routing


@FUZZ
@given(mutated(VLLM_OUTPUTS))
def test_mutated_vllm_outputs_and_their_lazy_parts_raise_only_remote_errors(frames: list[bytes]) -> None:
    ok, msg = only(RemoteProtocolError, wire.decode_outputs, frames)
    if not ok:
        return
    ref_ok, ref = only(RemoteProtocolError, wire._decode_outputs_msgpack, frames)
    if ref_ok:  # the typed decode builds what the msgpack reference builds
        assert repr(attrs.evolve(msg, bad_rows=())) == repr(attrs.evolve(ref, bad_rows=()))
        assert [(r, str(e)) for r, e in msg.bad_rows] == [(r, str(e)) for r, e in ref.bad_rows]
    for row in msg.outputs:
        assert isinstance(row, wire.EngineCoreOutputRow) and type(row.request_id) is str
        for raw, decode in ((row.new_logprobs, wire.decode_logprobs_lists),
                            (row.new_prompt_logprobs_tensors, wire.decode_logprobs_tensors)):
            if raw is not None:
                ok, lp = only(RemoteProtocolError, decode, raw, frames)
                if ok:
                    assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks)
        only(RemoteProtocolError, wire_engine.EngineCoreOutput.from_row, row, frames)


def _registered(frames: list[bytes]) -> list[str]:
    ids = {"r": None}
    try:
        msg = wire.decode_outputs(frames)
    except RemoteProtocolError:
        return list(ids)
    for row in msg.outputs:
        ids[row.request_id] = None
    for rid in msg.finished_requests or ():
        ids[rid] = None
    return [r for r in ids if r][:6]


arbitrary_frames = (
    mutated(VLLM_OUTPUTS)
    | st.lists(st.binary(max_size=64), min_size=1, max_size=3)
    | st.builds(lambda v, aux: [msgpack.packb(v, use_bin_type=True), *aux],
                st.recursive(leaves, lambda c: st.lists(c, max_size=5), max_leaves=20),
                st.lists(st.binary(max_size=32), max_size=2))
)


@FUZZ
@given(st.lists(arbitrary_frames, min_size=1, max_size=3), st.booleans())
def test_routing_arbitrary_frames_never_raises_and_streams_end_typed(messages: list[list[bytes]],
                                                                     tight: bool) -> None:
    p = EngineProtocol(max_decode_errors=2 if tight else 1000, max_pending_tokens=2 if tight else 4096)
    ids: dict[str, None] = {}
    for frames in messages:
        ids.update(dict.fromkeys(_registered(frames)))
    boxes = [p.submit(wire.EngineCoreRequest(request_id=rid, prompt_token_ids=(1,), arrival_time=0.0,
                                             sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=4)))[0]
             for rid in ids]
    calls = [p.start_utility("m") for _ in range(2)]  # call ids 1 and 2
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    for frames in messages:
        p.frames_received(frames)  # must never raise
    for mb in boxes:
        for _ in range(3):
            try:
                d = mb.take()
            except ZmqDispatchError:
                break
            if d is None:
                break
            assert all(type(t) is int for t in d.token_ids)
    for call in calls:
        assert not call.done or call.error is None or isinstance(call.error, (UtilityCallError, ZmqDispatchError))
    if p.state is LinkState.DEAD:
        assert p.inflight == 0 and p.pending_utility_calls == 0


# --------------------------------------------------------------------------- vLLM control and requests


@FUZZ
@given(st.sampled_from(sorted(CONTROL, key=lambda f: f.__module__ + f.__name__)), st.data())
def test_mutated_control_messages_raise_only_remote_errors(decode, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    frames = data.draw(mutated(CONTROL[decode]))
    only(RemoteProtocolError, decode, frames[0])


@FUZZ
@given(mutated(VLLM_OUTPUTS[:1] + _golden(_VLLM, "utility_result_", "outputs_dp_")), st.integers(1, 3))
def test_mutated_utility_outputs_settle_calls_typed(frames: list[bytes], call_id: int) -> None:
    p = EngineProtocol()
    calls = [p.start_utility("m") for _ in range(3)]
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    p.frames_received(frames)
    ok, msg = only(RemoteProtocolError, wire.decode_outputs, frames)
    for call in calls:
        if call.done and ok and msg.utility_output is not None and msg.utility_output.call_id == call.call_id:
            assert (call.error is not None) == (msg.utility_output.failure_message is not None)
            assert call.error is None or isinstance(call.error, UtilityCallError)


@FUZZ
@given(mutated(VLLM_REQUESTS, payload_index=1))
def test_mutated_requests_as_the_mock_engine_reads_them(frames: list[bytes]) -> None:
    kind = frames[0][0]
    if kind == wire.RequestType.ADD:
        ok, req = only(RemoteProtocolError, wire_engine.decode_request, frames[1:])
        if not ok:
            return
        try:
            again = wire.encode_request(req)
        except LocalProtocolError:
            return  # e.g. a big-endian prompt_embeds tensor: decodable, not encodable
        assert wire.encode_request(wire_engine.decode_request(again)) == again
        try:
            MockEngineCore(vocab_size=1000, max_model_len=64).add(req)
        except FatalEngineError:
            pass
    elif kind == wire.RequestType.UTILITY:
        only(RemoteProtocolError, wire_engine.decode_utility_call, frames[1])
    else:
        decode = wire_engine.decode_abort if kind == 1 else wire_engine.decode_start_dp_wave
        only(RemoteProtocolError, decode, frames[1])


# --------------------------------------------------------------------------- tensors

_DTYPES = sorted({"<i4", "<f4", "<i8", "|b1", "|i1", "<f2", ">f8", ">i2", "=u4", "int32", "float32", "bfloat16",
                  "float16", "bool", "uint8", "int64", "float64", "uint64"})


@st.composite
def consistent_tensors(draw: st.DrawFn) -> tuple[list, list[bytes]]:
    """A triple whose byte count matches its shape (sometimes off by one), inline,
    as a plain bin or in an aux frame (sometimes a wrong index)."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=4))
    n = 1
    for d in shape:
        n *= d
    nbytes = n * tensors.dtype_info(dtype).itemsize + draw(st.sampled_from([0, 0, 0, -1, 1]))
    buf = draw(st.binary(min_size=max(nbytes, 0), max_size=max(nbytes, 0)))
    frames = [b""] + draw(st.lists(st.binary(max_size=4), max_size=2))
    how = draw(st.integers(0, 2))
    if how == 0:
        data: object = buf
    elif how == 1:
        data = _EXT(3, buf)
    else:
        frames.append(buf)
        data = len(frames) - 1 + draw(st.sampled_from([0, 0, 0, 1, -1]))
    return [dtype, shape, data], frames


@FUZZ
@given(consistent_tensors(), st.booleans())
def test_consistent_tensors_decode_tolist_and_reencode(case: tuple[list, list[bytes]], keep_ext: bool) -> None:
    value, frames = case
    raw = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), use_list=False,
                          ext_hook=_keep_ext if keep_ext else tensors.ext_hook)
    ok, t = only(RemoteProtocolError, tensors.decode_tensor, raw, frames)
    if not ok:
        return
    assert t.nbytes == t.numel * t.info.itemsize <= sum(map(len, frames)) + len(msgpack.packb(value))
    t.tolist()  # shapes here are at most 5**4 elements
    aux: list = []
    try:
        enc = tensors.encode_tensor(t.dtype, t.shape, t.data, aux, torch=t.is_torch)
    except LocalProtocolError:
        assert t.info.big_endian or (not t.is_torch and t.info.name == "bfloat16")
        return
    again = tensors.decode_tensor([enc[0], enc[1], enc[2].data if type(enc[2]) is _EXT else enc[2]], [b"", *aux])
    assert (again.shape, bytes(again.data), again.info.name) == (t.shape, bytes(t.data), t.info.name)


# --------------------------------------------------------------------------- TokenSpeed


@FUZZ
@given(mutated(TS_OUTPUTS))
def test_mutated_tokenspeed_batches_raise_only_remote_errors(frames: list[bytes]) -> None:
    ok, b = only(RemoteProtocolError, ts.decode_outputs, frames)
    if not ok:
        return
    assert all(len(c) == len(b.rids) for c in (b.output_ids, b.finished_reasons, b.prompt_tokens,
                                                b.completion_tokens, b.cached_tokens, b.logprob_vals,
                                                b.logprob_ids))
    list(b.outputs())
    b.finished_rids()
    if b.load is not None:
        _ = b.load.kv_usage
    canon = ts_engine.encode_outputs(b, elements=min(b.wire_elements, ts.BATCH_ELEMENTS))
    assert ts_engine.encode_outputs(ts.decode_outputs(canon), elements=min(b.wire_elements, ts.BATCH_ELEMENTS)) == canon


@FUZZ
@given(mutated(TS_INPUTS, payload_index=1))
def test_mutated_tokenspeed_inputs_raise_only_remote_errors(frames: list[bytes]) -> None:
    ok, value = only(RemoteProtocolError, ts_engine.decode_input, frames)
    if not ok or value[0] is not ts.RequestType.ADD:
        return
    req = value[1]
    for vocab in (None, 1000):
        reason = checks_tokenspeed.admission_error(req, vocab_size=vocab, enable_output_logprobs=True)
        assert reason is None or type(reason) is str
    try:
        enc = ts.encode_add(req)
    except LocalProtocolError:
        return
    assert ts.encode_add(ts.finalize_add(ts_engine.decode_add(enc))) == enc


# --------------------------------------------------------------------------- SGLang


@FUZZ
@given(mutated(SG_OUTPUTS))
def test_mutated_sglang_outputs_raise_only_remote_errors_and_both_decoders_agree(frames: list[bytes]) -> None:
    ok, b = only(RemoteProtocolError, sg.decode_outputs, frames)
    ref_ok, ref = only(RemoteProtocolError, sg_out._decode_outputs_msgpack, frames)
    assert ok == ref_ok
    if not ok or isinstance(b, sg.ControlReply):
        assert b == ref
        return
    # compared as bytes, so NaN logprob values compare equal
    assert sg_engine.encode_outputs(b) == sg_engine.encode_outputs(ref) and b.wire_elements == ref.wire_elements
    m = len(b.rids)
    assert all(len(c) == m for c in (b.output_ids, b.finished_reasons, b.finished_messages, b.finished_matched,
                                     b.prompt_tokens, b.completion_tokens, b.cached_tokens, b.logprob_vals,
                                     b.logprob_ids))
    if b.load is not None:
        _ = b.load.kv_usage
    canon = sg_engine.encode_outputs(b)
    assert sg_engine.encode_outputs(sg.decode_outputs(canon)) == canon


@FUZZ
@given(mutated(SG_INPUTS, payload_index=1))
def test_mutated_sglang_inputs_raise_only_remote_errors(frames: list[bytes]) -> None:
    ok, value = only(RemoteProtocolError, sg_engine.decode_input, frames)
    if not ok or value[0] is not sg.RequestType.ADD:
        return
    req = value[1]
    for vocab in (None, 1000):
        bad = checks_sglang.admission_error(req, vocab_size=vocab)
        assert bad is None or (type(bad[0]) is str and type(bad[1]) is str)
    try:
        enc = sg.encode_add(req)
    except LocalProtocolError:
        return
    assert sg.encode_add(sg_engine.decode_add(enc)) == enc


# --------------------------------------------------------------------------- translation


class _ByteTokenizer:
    """One id per UTF-8 byte (byte + 3), specials 0..2: enough for stop strings."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # type: ignore[no-untyped-def]
        return bytes(t - 3 for t in ids if 3 <= t < 259).decode("utf-8", errors="replace")


f32 = st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-6, 2.0, 100.0, -100.5, math.nan, math.inf, -math.inf]) | st.floats(
    width=32)
u32 = st.sampled_from([0, 1, 2, 20, 21, 128, 129, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
i32 = st.sampled_from([0, 1, -1, -2, 20, 21, 2**31 - 1, -(2**31)]) | st.integers(-(2**31), 2**31 - 1)
short_text = st.sampled_from(["", " ", "a", "STOP", "\n", "\x00", "{}", '{"type": "object"}', "null"]) | st.text(
    max_size=8)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(sp, name, draw(f32))
    for name in ("top_k", "max_tokens", "min_tokens", "n"):
        if draw(st.booleans()):
            setattr(sp, name, draw(u32 if name != "n" else st.integers(0, 4) | u32))
    for name in ("logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens"):
        if draw(st.booleans()):
            setattr(sp, name, draw(i32))
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "ignore_eos", "include_stop_str_in_output",
                 "grammar_from_first_token"):
        setattr(sp, name, draw(st.booleans()))
    sp.stop.extend(draw(st.lists(short_text, max_size=2)))
    sp.stop_token_ids.extend(draw(st.lists(u32, max_size=3)))
    for k, v in draw(st.dictionaries(i32, f32, max_size=2)).items():
        sp.logit_bias[k] = v
    which = draw(st.sampled_from([None, "json_schema", "regex", "grammar", "structural_tag", "json_object", "choice"]))
    if which == "json_object":
        sp.json_object = draw(st.booleans())
    elif which == "choice":
        sp.choice.choices.extend(draw(st.lists(short_text, max_size=3)))
    elif which is not None:
        setattr(sp, which, draw(short_text))
    return sp


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=draw(short_text), stream=draw(st.booleans()))
    which = draw(st.sampled_from(["tokenized", "tokenized", "tokenized", "text", "empty", None]))
    if which == "tokenized":
        r.tokenized.input_ids.extend(draw(st.lists(st.integers(0, 40) | u32, min_size=1, max_size=12)))
    elif which == "text":
        r.text = draw(short_text)
    elif which == "empty":
        r.tokenized.SetInParent()
    if draw(st.booleans()):
        r.sampling_params.CopyFrom(draw(sampling_params()))
    if draw(st.booleans()):
        r.data_parallel_rank = draw(i32)
    rare = draw(st.sampled_from([None] * 6 + ["kv", "kv_json", "mm", "extra_mm", "media"]))
    if rare == "kv":
        r.kv_transfer_params.remote_host = "h"
    elif rare == "kv_json":
        r.kv_transfer_params_json = "{}"
    elif rare == "mm":
        r.mm_inputs.mm_hashes.append("x")
    elif rare == "extra_mm":
        r.extra_mm_inputs.add()
    elif rare == "media":
        r.media_refs.items.add().url = "u"
    return r


configs = st.builds(
    TranslationConfig,
    max_model_len=st.sampled_from([1, 2, 16, 512, 2**31 - 1]) | st.integers(1, 4096),
    eos_token_ids=st.lists(u32, max_size=3).map(tuple),
    vocab_size=st.none() | st.sampled_from([1, 50, 1000, 2**32]),
    max_logprobs=st.sampled_from([0, 5, 20]),
    structured_outputs_backend=st.sampled_from(["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer",
                                                "bogus"]),
    engine_index=st.none() | st.integers(0, 2),
    tokenizer=st.none() | st.just(_ByteTokenizer()),
)


def _translate_contract(req: pb.GenerateRequest, config: TranslationConfig) -> None:
    before = req.SerializeToString(deterministic=True)
    try:
        children = translate_parallel(req, config, arrival_time=1.0)
    except RequestRejected:
        return
    assert req.SerializeToString(deterministic=True) == before
    assert len({c.request.request_id for c in children}) == len(children)
    for child in children:
        r = child.request
        try:
            check_request(r, max_model_len=config.max_model_len, vocab_size=config.vocab_size,
                          max_logprobs=config.max_logprobs)
        except RequestRejected:
            continue
        sp = r.sampling_params
        assert sp.n == 1 and len(r.prompt_token_ids) + sp.max_tokens <= config.max_model_len
        frames = wire.encode_request(r)  # a checked request always encodes
        assert wire.encode_request(wire_engine.decode_request(frames)) == frames
        child.response_builder()


@FUZZ
@given(generate_requests(), configs)
def test_translation_of_arbitrary_protos_raises_only_request_rejected(req: pb.GenerateRequest,
                                                                      config: TranslationConfig) -> None:
    _translate_contract(req, config)


@FUZZ
@given(st.binary(max_size=120) | generate_requests().map(lambda r: r.SerializeToString()).flatmap(
    lambda b: st.builds(lambda i, x: b[:i] + x + b[i + 1:], st.integers(0, max(len(b) - 1, 0)),
                        st.binary(max_size=3))))
def test_translation_of_arbitrary_serialized_protos(blob: bytes) -> None:
    req = pb.GenerateRequest()
    try:
        req.ParseFromString(blob)
    except Exception:  # the test's own parse of its input (protobuf DecodeError)
        return
    _translate_contract(req, TranslationConfig(max_model_len=512, eos_token_ids=(2,), vocab_size=1000,
                                               tokenizer=_ByteTokenizer()))
