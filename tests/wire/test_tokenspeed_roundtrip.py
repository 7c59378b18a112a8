"""Property tests of the TokenSpeed wire codec: round trips, decoder tolerance, hostile input.

- encode -> decode round trips for ADD (every field of ``TokenizedGenerateReqInput`` and
  all 29 sampling positions) and for output batches (14-, 10- and 9-element forms);
- tolerance like TokenSpeed's msgspec decoding: missing trailing elements take the
  defaults, extra trailing elements are ignored (request, sampling array, batch);
- TokenSpeed's derivation, normalization and ingress validation rules;
- hostile bytes and msgpack values into every decoder raise only RemoteProtocolError.
"""

from __future__ import annotations

import zlib

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch import limits
from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
from zmqdispatch.protocol import checks_tokenspeed
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm_handshake as handshake

SETTINGS = settings(deadline=None, max_examples=100, database=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------- strategies

int64 = st.integers(-(2**63), 2**63 - 1)
uint = st.integers(0, 2**32 - 1)
token = st.integers(0, 2**31 - 1)
floats = st.floats(allow_nan=False)
text = st.text(max_size=8)


def opt(s: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | s


# Opaque values come back from msgpack with arrays as tuples.
json_values = st.recursive(
    st.none() | st.booleans() | int64 | floats | text,
    lambda c: st.lists(c, max_size=3).map(tuple) | st.dictionaries(text, c, max_size=3),
    max_leaves=8,
)
str_maps = st.dictionaries(text, json_values, max_size=3)
str_or_strs = text | st.lists(text, max_size=3).map(tuple)
token_seq = st.lists(token, max_size=8).map(tuple)

sampling_params = st.builds(
    ts.TokenSpeedSamplingParams,
    max_new_tokens=opt(uint),
    stop=opt(str_or_strs),
    stop_token_ids=opt(st.lists(token, max_size=5, unique=True).map(tuple)),
    temperature=floats,
    top_p=floats,
    top_k=int64,
    min_p=floats,
    frequency_penalty=floats,
    presence_penalty=floats,
    repetition_penalty=floats,
    min_new_tokens=int64,
    json_schema=opt(text),
    regex=opt(text),
    ebnf=opt(text),
    structural_tag=opt(text),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(),
    no_stop_trim=st.booleans(),
    thinking_budget=opt(int64),
    custom_params=opt(str_maps),
    stream_interval=opt(int64),
    logit_bias=opt(st.dictionaries(st.integers(0, 10**6).map(str) | text, floats, max_size=3)),
    seed=opt(st.integers(-(2**63), 2**64 - 1)),
    logprobs=opt(int64),
    n=int64,
    stop_strs=opt(str_or_strs),
    stop_str_max_len=int64,
    is_normalized=st.booleans(),
)

session_params = st.builds(
    ts.SessionParams, id=opt(text), rid=opt(text), offset=opt(int64), replace=opt(st.booleans())
)

requests = st.builds(
    ts.TokenizedGenerateReqInput,
    rid=text,
    http_worker_ipc=opt(text),
    input_text=opt(text),
    input_ids=opt(token_seq),
    sampling_params=sampling_params,
    return_logprob=st.booleans(),
    logprob_start_len=int64,
    top_logprobs_num=int64,
    token_ids_logprob=opt(token_seq),
    stream=st.booleans(),
    input_embeds=opt(st.lists(json_values, max_size=3).map(tuple)),
    session_params=opt(session_params),
    custom_logit_processor=opt(text),
    return_hidden_states=st.booleans(),
    created_time=floats,
    bootstrap_host=opt(text),
    bootstrap_port=opt(int64),
    bootstrap_room=opt(st.integers(0, 2**64 - 1)),
    input_multi_ids=opt(st.lists(token_seq, max_size=3).map(tuple)),
    input_extra_infos=opt(st.lists(str_maps, max_size=2).map(tuple)),
    input_ids_unpadded=opt(token_seq),
    multimodal_inputs=opt(st.lists(json_values, min_size=1, max_size=3).map(tuple)),
    validation_error=opt(text),
    data_parallel_rank=opt(int64),
)


@st.composite
def batches(draw: st.DrawFn, elements: int = 14) -> ts.TokenSpeedBatch:
    m = draw(st.integers(0, 6))
    rids = tuple(draw(st.lists(text, min_size=m, max_size=m)))
    out_ids = tuple(draw(st.lists(token_seq, min_size=m, max_size=m)))
    lps = []
    for toks in out_ids:
        if draw(st.booleans()):
            k = draw(st.integers(0, len(toks)))  # may be shorter than output_ids
            lps.append((tuple(draw(st.lists(floats, min_size=k, max_size=k))), toks[:k]))
        else:
            lps.append(((), ()))
    counts = st.lists(uint, min_size=m, max_size=m).map(tuple)
    tail = st.integers(0, 2**16)
    return ts.TokenSpeedBatch(
        engine_index=draw(tail) if elements >= 10 else 0,
        rids=rids,
        output_ids=out_ids,
        finished_reasons=tuple(
            draw(st.lists(st.sampled_from(["", "stop", "length", "abort"]) | text, min_size=m, max_size=m))
        ),
        prompt_tokens=draw(counts),
        completion_tokens=draw(counts),
        cached_tokens=draw(counts),
        logprob_vals=tuple(v for v, _ in lps),
        logprob_ids=tuple(i for _, i in lps),
        num_running=draw(tail) if elements >= 11 else 0,
        num_waiting=draw(tail) if elements >= 12 else 0,
        kv_active_pages=draw(tail) if elements >= 13 else 0,
        kv_total_pages=draw(tail) if elements >= 14 else 0,
    )


def expected_decode(req: ts.TokenizedGenerateReqInput) -> ts.TokenizedGenerateReqInput:
    """What TokenSpeed's decoder makes of ``req``: its sampling params derived."""
    return attrs.evolve(req, sampling_params=req.sampling_params.derive())


def base_add(**changes: object) -> ts.TokenizedGenerateReqInput:
    kwargs: dict = {"rid": "r1", "input_ids": (5, 6, 7),
                    "sampling_params": ts.TokenSpeedSamplingParams(max_new_tokens=16)}
    return ts.TokenizedGenerateReqInput(**{**kwargs, **changes})


def raw_add(req: ts.TokenizedGenerateReqInput) -> list:
    return msgpack.unpackb(ts.encode_add(req)[0])


# ----------------------------------------------------------------- ADD round trips


@SETTINGS
@given(requests)
def test_add_roundtrip(req: ts.TokenizedGenerateReqInput) -> None:
    frames = ts.encode_add(req)
    assert len(frames) == 1
    assert ts_engine.decode_add(frames) == expected_decode(req)


@SETTINGS
@given(requests)
def test_add_wire_shape(req: ts.TokenizedGenerateReqInput) -> None:
    raw = raw_add(req)
    assert len(raw) == ts.REQUEST_ELEMENTS and raw[0] == ts.REQUEST_TAG
    assert raw[1] == req.rid and len(raw[5]) == ts.SAMPLING_PARAMS_LEN
    payload = ts.encode_add(req)[0]
    assert payload[:3] == b"\xdc\x00\x19"
    for pos in (3, 4, 6, 7, 8, 9):  # float positions are always float64
        assert type(raw[5][pos]) is float


@SETTINGS
@given(sampling_params)
def test_derive_and_normalize_are_idempotent(sp: ts.TokenSpeedSamplingParams) -> None:
    d = sp.derive()
    assert d.derive() == d
    n = sp.normalize()
    assert n.is_normalized and n.normalize() == n and n.derive() == n
    if not sp.is_normalized:
        assert d.top_k != -1 and d.temperature >= ts.SAMPLING_EPS
        assert d.stop_strs == sp.stop
        if d.top_k == 1:
            assert d.seed == 0
    else:
        assert d == sp


@SETTINGS
@given(requests, st.integers(ts.REQUEST_MIN_ELEMENTS, ts.REQUEST_ELEMENTS))
def test_add_prefix_encoding(req: ts.TokenizedGenerateReqInput, elements: int) -> None:
    # Reset the fields a shorter payload drops; then it must decode to the same thing.
    defaults = {f.name: f.default for f in attrs.fields(ts.TokenizedGenerateReqInput)[elements - 1 :]}
    short = attrs.evolve(req, **defaults)
    frames = ts.encode_add(short, elements=elements)
    assert len(msgpack.unpackb(frames[0])) == elements
    assert ts_engine.decode_add(frames) == expected_decode(short)


def test_add_prefix_refuses_to_drop_a_set_field() -> None:
    req = base_add(stream=True)
    with pytest.raises(LocalProtocolError, match="stream"):
        ts.encode_add(req, elements=10)
    assert len(msgpack.unpackb(ts.encode_add(req, elements=11)[0])) == 11
    for bad in (5, 26, 0):
        with pytest.raises(LocalProtocolError):
            ts.encode_add(req, elements=bad)


@SETTINGS
@given(requests, st.lists(json_values, min_size=1, max_size=3), st.lists(json_values, min_size=1, max_size=3))
def test_add_extra_trailing_elements_are_ignored(
    req: ts.TokenizedGenerateReqInput, extra: list, extra_sp: list
) -> None:
    raw = raw_add(req)
    raw[5] = raw[5] + extra_sp
    assert ts_engine.decode_add([msgpack.packb(raw + extra)]) == expected_decode(req)


@SETTINGS
@given(requests, st.integers(ts.REQUEST_MIN_ELEMENTS, ts.REQUEST_ELEMENTS), st.integers(0, ts.SAMPLING_PARAMS_LEN))
def test_add_truncated_arrays_take_defaults(req: ts.TokenizedGenerateReqInput, keep: int, keep_sp: int) -> None:
    raw = raw_add(req)
    raw[5] = raw[5][:keep_sp]
    got = ts_engine.decode_add([msgpack.packb(raw[:keep])])
    names = [f.name for f in attrs.fields(ts.TokenizedGenerateReqInput)]
    sp_names = [f.name for f in attrs.fields(ts.TokenSpeedSamplingParams)]
    want_sp = ts.TokenSpeedSamplingParams(**{k: getattr(req.sampling_params, k) for k in sp_names[:keep_sp]})
    want = ts.TokenizedGenerateReqInput(
        **{k: getattr(req, k) for k in names[: keep - 1] if k != "sampling_params"}, sampling_params=want_sp
    )
    assert got == expected_decode(want)


def test_minimum_add_and_defaults() -> None:
    # The shortest payload TokenSpeed takes: tag .. sampling_params (even an empty array).
    req = ts_engine.decode_add([msgpack.packb([ts.REQUEST_TAG, "r", None, None, None, []])])
    assert req == ts.TokenizedGenerateReqInput(rid="r", sampling_params=ts.TokenSpeedSamplingParams().derive())
    sp = req.sampling_params
    assert (sp.top_k, sp.temperature, sp.n, sp.is_normalized, sp.stop_strs) == (ts.TOP_K_DISABLED, 1.0, 1, False, None)
    assert (req.logprob_start_len, req.top_logprobs_num, req.created_time) == (-1, 0, 0.0)
    for short in ([ts.REQUEST_TAG, "r", None, None, [1]], [ts.REQUEST_TAG], []):
        with pytest.raises(RemoteProtocolError, match=r"missing positional field|tagged array"):
            ts_engine.decode_add([msgpack.packb(short)])


# ----------------------------------------------------------------- TokenSpeed's rules


def test_derivation_rules() -> None:
    sp = ts.TokenSpeedSamplingParams
    # greedy collapse, for any temperature below 1e-6 (negatives too), and the pinned seed
    for t in (0.0, 1e-7, -1.0):
        d = sp(temperature=t, seed=7).derive()
        assert (d.temperature, d.top_k, d.seed) == (1.0, 1, 0)
    assert sp(top_k=1, seed=7).derive().seed == 0
    assert sp(top_k=-1).derive().top_k == ts.TOP_K_DISABLED
    assert sp(top_k=5, seed=7).derive() == sp(top_k=5, seed=7)
    # stop ids: set semantics, empty -> nil; stop copied to stop_strs
    assert sp(stop_token_ids=[3, 1, 3]).derive().stop_token_ids == (3, 1)
    assert sp(stop_token_ids=()).derive().stop_token_ids is None
    assert sp(stop="x").derive().stop_strs == "x"
    # already normalized: nothing is re-derived (a normalized top_k -1 stays -1)
    assert sp(top_k=-1, temperature=0.0, is_normalized=True).derive().top_k == -1
    # normalize: stop_strs listified, max length in characters
    n = sp(stop="héllo").normalize()
    assert (n.stop_strs, n.stop_str_max_len, n.is_normalized) == (("héllo",), 5, True)
    assert sp().normalize().stop_strs == ()
    # seed from the rid
    assert sp().resolve_seed("vec-1").seed == zlib.crc32(b"vec-1")
    assert sp(seed=3).resolve_seed("vec-1").seed == 3
    assert sp(temperature=0.0).derive().resolve_seed("x").seed == 0


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({}, None),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 128}, "fused"),
        ({"top_k": 127}, None),
        ({"top_k": ts.TOP_K_DISABLED}, None),
        ({"top_k": -1}, None),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, None),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2, "min_new_tokens": 3}, "min_new_tokens"),
        ({"logit_bias": {"5": 1.0}}, None),
        ({"logit_bias": {"100": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logprobs": 0}, None),
        ({"logprobs": 1}, "logprobs"),
        ({"json_schema": "{}", "regex": "a"}, "only one"),
        ({"json_schema": "{}", "structural_tag": "t"}, None),
    ],
)
def test_verify_rules(changes: dict, fragment: str | None) -> None:
    err = checks_tokenspeed.sampling_params_error(ts.TokenSpeedSamplingParams(**changes), vocab_size=100)
    if fragment is None:
        assert err is None
    else:
        assert err is not None and fragment in err


@pytest.mark.parametrize(
    ("changes", "kwargs", "fragment"),
    [
        ({}, {}, None),
        ({"return_logprob": True}, {}, "enable-output-logprobs"),
        ({"return_logprob": True}, {"enable_output_logprobs": True}, None),
        ({"return_logprob": True, "top_logprobs_num": 2}, {"enable_output_logprobs": True}, "top_logprobs_num"),
        ({"return_logprob": True, "token_ids_logprob": (1,)}, {"enable_output_logprobs": True}, "token_ids_logprob"),
        ({"return_logprob": True, "input_ids": None}, {"enable_output_logprobs": True}, "token inputs"),
        ({"return_logprob": True, "logprob_start_len": 0}, {"enable_output_logprobs": True}, "prompt logprobs"),
        ({"return_logprob": True, "logprob_start_len": 2}, {"enable_output_logprobs": True}, None),
        ({"return_logprob": True, "logprob_start_len": 3}, {"enable_output_logprobs": True}, "smaller than"),
        ({"return_logprob": True, "logprob_start_len": -2}, {"enable_output_logprobs": True}, "-1 or >= 0"),
        ({"logprob_start_len": 0, "top_logprobs_num": 5}, {}, None),  # not looked at without return_logprob
        ({"session_params": ts.SessionParams(id="s")}, {}, "session id"),
        ({"session_params": ts.SessionParams(rid="p")}, {}, None),
        ({"validation_error": "boom"}, {}, "boom"),
        ({"validation_error": ""}, {}, None),
        ({"sampling_params": ts.TokenSpeedSamplingParams(top_k=200)}, {}, "top_k"),
        ({"sampling_params": ts.TokenSpeedSamplingParams(n=2)}, {}, "n=2"),
    ],
)
def test_admission_rules(changes: dict, kwargs: dict, fragment: str | None) -> None:
    _, req = ts_engine.decode_input([b"\x00", *ts.encode_add(base_add(**changes))])
    err = checks_tokenspeed.admission_error(req, vocab_size=100, **kwargs)
    if fragment is None:
        assert err is None
    else:
        assert err is not None and fragment in err


def test_finalize_mirrors_the_engine() -> None:
    sp = ts.TokenSpeedSamplingParams(stop=["ab", "c"], temperature=0.5)
    req = ts.finalize_add(ts_engine.decode_add(ts.encode_add(base_add(sampling_params=sp))))
    fsp = req.sampling_params
    assert fsp.is_normalized and fsp.seed == zlib.crc32(b"r1") and fsp.stop_strs == ("ab", "c")
    assert fsp.stop_str_max_len == 2 and fsp.top_k == ts.TOP_K_DISABLED
    # n != 1 overwrites a sender's validation_error
    req = ts.finalize_add(base_add(sampling_params=ts.TokenSpeedSamplingParams(n=3), validation_error="x"))
    assert "n=3" in req.validation_error


# ----------------------------------------------------------------- outputs round trips and tolerance


@SETTINGS
@given(batches())
def test_outputs_roundtrip(batch: ts.TokenSpeedBatch) -> None:
    frames = ts_engine.encode_outputs(batch)
    assert len(frames) == 1
    got = ts.decode_outputs(frames)
    assert got == batch and got.wire_elements == 14
    assert list(got.outputs()) == list(batch.outputs())
    assert got.finished_rids() == tuple(r for r, f in zip(batch.rids, batch.finished_reasons) if f)
    assert (got.load is None) == (batch.kv_total_pages == 0)


@SETTINGS
@given(st.sampled_from([9, 10]).flatmap(lambda n: st.tuples(st.just(n), batches(elements=n))))
def test_outputs_legacy_roundtrip(case: tuple[int, ts.TokenSpeedBatch]) -> None:
    elements, batch = case
    frames = ts_engine.encode_outputs(batch, elements=elements)
    assert len(msgpack.unpackb(frames[0])) == elements
    got = ts.decode_outputs(frames)
    assert got == batch and got.wire_elements == elements and got.load is None


@SETTINGS
@given(batches(), st.integers(ts.BATCH_MIN_ELEMENTS, ts.BATCH_ELEMENTS))
def test_outputs_missing_tail_defaults_to_zero(batch: ts.TokenSpeedBatch, keep: int) -> None:
    raw = msgpack.unpackb(ts_engine.encode_outputs(batch)[0])
    got = ts.decode_outputs([msgpack.packb(raw[:keep])])
    names = ("engine_index", "num_running", "num_waiting", "kv_active_pages", "kv_total_pages")
    zeros = {name: 0 for name in names[keep - 9 :]}
    assert got == attrs.evolve(batch, **zeros)


@SETTINGS
@given(batches(), st.lists(json_values, min_size=1, max_size=3), st.lists(st.binary(max_size=8), max_size=2))
def test_outputs_extra_trailing_elements_and_aux_frames_are_ignored(
    batch: ts.TokenSpeedBatch, extra: list, aux: list
) -> None:
    raw = msgpack.unpackb(ts_engine.encode_outputs(batch)[0])
    got = ts.decode_outputs([msgpack.packb(raw + extra), *aux])
    assert got == batch and got.wire_elements == 14 + len(extra)


def _two() -> list:
    return [ts.BATCH_TAG, ["a", "b"], [[1], [2, 3]], ["", "stop"], [3, 4], [1, 2], [0, 0], [[], [-0.5, -0.25]],
            [[], [2, 3]], 0, 1, 0, 2, 10]


@pytest.mark.parametrize("col", range(1, 9))
def test_ragged_columns_are_refused(col: int) -> None:
    raw = _two()
    raw[col] = raw[col][:1]
    with pytest.raises(RemoteProtocolError, match=r"ragged|values for"):
        ts.decode_outputs([msgpack.packb(raw)])


@pytest.mark.parametrize(
    ("pos", "value", "field"),
    [
        (1, None, "rids"),
        (1, ["a", 5], r"rids\[1\]"),
        (1, ["a", b"b"], r"rids\[1\]"),
        (2, [[1], [2, -3]], r"output_ids\[1\]"),
        (2, [[1], [2, 2**32]], r"output_ids\[1\]: a token id outside 0..4294967295"),
        (2, [[1], [2, 3.0]], r"output_ids\[1\]"),
        (2, [[1], 5], r"output_ids\[1\]"),
        (3, ["", None], r"finished_reasons\[1\]"),
        (4, [3, -4], r"prompt_tokens\[1\]"),
        (4, [3, 2**63], r"prompt_tokens\[1\]"),
        (5, [1, True], r"completion_tokens\[1\]"),
        (6, [0, 0.0], r"cached_tokens\[1\]"),
        (7, [[], ["x", 1.0]], r"output_token_logprobs_val\[1\]"),
        (7, [[], [-0.5]], r"output_token_logprobs_val\[1\]: 1 values for 2"),
        (8, [[], [2, None]], r"output_token_logprobs_idx\[1\]"),
        (8, [[], [2, 2**40]], r"output_token_logprobs_idx\[1\]"),
        (9, None, "engine_index"),
        (10, -1, "num_running"),
        (13, 1.5, "kv_total_pages"),
        (0, "BatchTokenIDOut", "wrong msgspec tag"),
        (0, b"BatchTokenIDOutSlim", "wrong msgspec tag"),
    ],
)
def test_bad_batches_name_the_field(pos: int, value: object, field: str) -> None:
    raw = _two()
    raw[pos] = value
    with pytest.raises(RemoteProtocolError, match=field):
        ts.decode_outputs([msgpack.packb(raw, use_bin_type=True)])


def test_empty_logprob_fast_path_still_checks_lengths() -> None:
    raw = _two()
    raw[7], raw[8] = [[], [], None], [[], []]
    with pytest.raises(RemoteProtocolError, match="ragged"):
        ts.decode_outputs([msgpack.packb(raw)])
    raw[7], raw[8] = [[], []], [[], [], []]
    with pytest.raises(RemoteProtocolError, match="ragged"):
        ts.decode_outputs([msgpack.packb(raw)])


def test_logprob_ints_and_short_logprobs_are_accepted() -> None:
    raw = _two()
    raw[7], raw[8] = [[0], [-1]], [[1], [2]]  # int logprob values (msgspec accepts), fewer than tokens
    batch = ts.decode_outputs([msgpack.packb(raw)])
    assert batch.logprob_vals == ((0,), (-1,)) and batch.output_ids == ((1,), (2, 3))


def test_short_and_non_batch_messages_are_refused() -> None:
    raw: object
    for raw in (_two()[:8], [ts.BATCH_TAG], [], {"rids": []}, "BatchTokenIDOutSlim", 5):
        with pytest.raises(RemoteProtocolError):
            ts.decode_outputs([msgpack.packb(raw)])
    with pytest.raises(RemoteProtocolError):
        ts.decode_outputs([])
    with pytest.raises(RemoteProtocolError, match="ENGINE_CORE_DEAD"):
        ts.decode_outputs([ts.ENGINE_CORE_DEAD])
    assert ts.is_dead_sentinel([ts.ENGINE_CORE_DEAD]) and not ts.is_dead_sentinel([ts.ENGINE_CORE_DEAD, b""])


def test_limits_are_enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _two()
    monkeypatch.setattr(limits, "MAX_OUTPUTS_PER_MESSAGE", 1)
    with pytest.raises(RemoteProtocolError, match="MAX_OUTPUTS_PER_MESSAGE"):
        ts.decode_outputs([msgpack.packb(raw)])
    monkeypatch.setattr(limits, "MAX_OUTPUTS_PER_MESSAGE", 10)
    monkeypatch.setattr(limits, "MAX_TOKENS_PER_TICK", 1)
    with pytest.raises(RemoteProtocolError, match="MAX_TOKENS_PER_TICK"):
        ts.decode_outputs([msgpack.packb(raw)])
    monkeypatch.setattr(limits, "MAX_TOKENS_PER_TICK", 10)
    monkeypatch.setattr(limits, "MAX_TOKEN_ID", 2, raising=False)  # generic (non-uint32) bound
    with pytest.raises(RemoteProtocolError, match=r"output_ids\[1\]: a token id outside 0..2"):
        ts.decode_outputs([msgpack.packb(raw)])
    monkeypatch.setattr(limits, "MAX_TOKEN_ID", 4, raising=False)
    with pytest.raises(RemoteProtocolError, match=r"cached_tokens\[0\]|prompt_tokens\[1\]|completion"):
        ts.decode_outputs([msgpack.packb(raw[:6] + [[5, 0]] + raw[7:])])
    assert ts.decode_outputs([msgpack.packb(raw)]).rids == ("a", "b")
    monkeypatch.setattr(limits, "MAX_TOKEN_ID", 2**32 - 1, raising=False)
    payload = msgpack.packb(raw)
    monkeypatch.setattr(limits, "MAX_FRAME_BYTES", len(payload) - 1)
    for decode in (ts.decode_outputs, ts_engine.decode_add):
        with pytest.raises(RemoteProtocolError, match="MAX_FRAME_BYTES"):
            decode([payload])
    with pytest.raises(RemoteProtocolError, match="MAX_FRAME_BYTES"):
        ts.decode_outputs([msgpack.packb(raw[:9]), payload])


# ----------------------------------------------------------------- hostile input


def _all_decoders(payload: bytes) -> None:
    for call in (
        lambda: ts.decode_outputs([payload]),
        lambda: ts_engine.decode_add([payload]),
        lambda: ts_engine.decode_abort(payload),
        lambda: ts_engine.decode_input([b"\x00", payload]),
        lambda: ts_engine.decode_input([b"\x01", payload]),
        lambda: ts_engine.decode_input([payload, payload]),
        lambda: ts.decode_ready_response(payload),
        lambda: handshake.decode_handshake_status(payload),
        lambda: handshake.decode_init(payload),
        lambda: ts_engine.parse_request_type(payload),
    ):
        try:
            call()
        except RemoteProtocolError:
            pass


@settings(deadline=None, max_examples=300, database=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_remote_protocol_error(payload: bytes) -> None:
    _all_decoders(payload)
    _all_decoders(b"\x9e\xb3BatchTokenIDOutSlim" + payload)
    _all_decoders(b"\xdc\x00\x19\xb9TokenizedGenerateReqInput" + payload)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6) | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    lambda c: st.lists(c, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(-(2**63), 2**64 - 1), c, max_size=3),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn) -> object:
    """A valid-looking ADD or batch with one element (or nested element) replaced."""
    if draw(st.booleans()):
        raw = msgpack.unpackb(ts.encode_add(draw(requests))[0])
        if draw(st.booleans()):
            raw[5][draw(st.integers(0, 28))] = draw(msgpack_values)
            return raw
    else:
        raw = msgpack.unpackb(ts_engine.encode_outputs(draw(batches()))[0])
    i = draw(st.integers(0, len(raw)))
    value = draw(msgpack_values)
    return raw[:i] + [value] + raw[i + 1 :] if draw(st.booleans()) else raw[:i]


@settings(deadline=None, max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values | mutated())
def test_arbitrary_msgpack_raises_only_remote_protocol_error(value: object) -> None:
    _all_decoders(msgpack.packb(value, use_bin_type=True))


@settings(deadline=None, max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_whatever_decodes_is_a_well_formed_batch(value: object) -> None:
    """Accepted batches keep the documented invariants (parallel columns, types, bounds)."""
    try:
        b = ts.decode_outputs([msgpack.packb(value, use_bin_type=True)])
    except RemoteProtocolError:
        return
    m = len(b.rids)
    cols = (b.output_ids, b.finished_reasons, b.prompt_tokens, b.completion_tokens, b.cached_tokens, b.logprob_vals,
            b.logprob_ids)
    assert all(type(c) is tuple and len(c) == m for c in cols)
    assert all(type(r) is str for r in b.rids + b.finished_reasons)
    assert all(type(x) is int and 0 <= x < 2**32 for x in b.prompt_tokens + b.completion_tokens + b.cached_tokens)
    for toks, vals, lids in zip(b.output_ids, b.logprob_vals, b.logprob_ids):
        assert all(type(t) is int and 0 <= t < 2**32 for t in toks + lids)
        assert all(type(v) in (int, float) for v in vals) and len(vals) == len(lids)
    scalars = (b.engine_index, b.num_running, b.num_waiting, b.kv_active_pages, b.kv_total_pages)
    assert all(type(x) is int and x >= 0 for x in scalars)


@settings(deadline=None, max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values | mutated())
def test_typed_decode_agrees_with_the_msgpack_reference(value: object) -> None:
    """decode_outputs (msgspec typed, falling back to the reference for what it refuses)
    accepts what ``_decode_outputs_msgpack`` accepts, with the same batch, and nothing else."""
    frames = [msgpack.packb(value, use_bin_type=True)]
    try:
        ref = ts._decode_outputs_msgpack(frames)
    except RemoteProtocolError as exc:
        with pytest.raises(RemoteProtocolError) as got:
            ts.decode_outputs(frames)
        assert str(got.value) == str(exc)
        return
    b = ts.decode_outputs(frames)
    assert ts_engine.encode_outputs(b, elements=min(b.wire_elements, ts.BATCH_ELEMENTS)) == ts_engine.encode_outputs(
        ref, elements=min(ref.wire_elements, ts.BATCH_ELEMENTS))
    assert b.wire_elements == ref.wire_elements


@pytest.mark.parametrize("code", [1, 2, 4])
def test_pickle_and_unknown_ext_types_are_refused(code: int) -> None:
    ext = msgpack.ExtType(code, b"\x80\x04N.")
    raw = _two()
    raw[1] = ["a", ext]
    with pytest.raises(RemoteProtocolError, match="ext type"):
        ts.decode_outputs([msgpack.packb(raw)])
    add = raw_add(base_add())
    add[22] = [ext]
    with pytest.raises(RemoteProtocolError, match="ext type"):
        ts_engine.decode_add([msgpack.packb(add)])


@pytest.mark.parametrize(
    ("pos", "value", "field"),
    [
        (0, "GenerateReqInput", "wrong msgspec tag"),
        (1, None, "rid"),
        (1, ["a"], "rid"),
        (1, b"r1", "rid"),
        (4, ["a"], "input_ids"),
        (5, None, "sampling_params"),
        (5, {"temperature": 1.0}, "sampling_params"),
        (6, 1, "return_logprob"),
        (7, 1.0, "logprob_start_len"),
        (10, None, "stream"),
        (12, {"id": "s"}, "session_params"),
        (15, "now", "created_time"),
        (20, [[1]], "input_extra_infos"),
        (22, [], "multimodal_inputs"),
    ],
)
def test_malformed_adds_name_the_field(pos: int, value: object, field: str) -> None:
    raw = raw_add(base_add())
    raw[pos] = value
    with pytest.raises(RemoteProtocolError, match=field):
        ts_engine.decode_add([msgpack.packb(raw, use_bin_type=True)])


@pytest.mark.parametrize(
    ("pos", "value", "field"),
    [
        (3, True, "temperature"),
        (3, None, "temperature"),
        (5, 5.0, "top_k"),
        (15, 0, "ignore_eos"),
        (1, [1], "stop"),
        (2, ["a"], "stop_token_ids"),
        (20, {1: 2}, "custom_params"),
        (22, {5: 1.0}, "logit_bias"),
        (22, {"5": "x"}, "logit_bias"),
        (25, None, "n"),
    ],
)
def test_malformed_sampling_params_name_the_field(pos: int, value: object, field: str) -> None:
    raw = raw_add(base_add())
    raw[5][pos] = value
    with pytest.raises(RemoteProtocolError, match=f"sampling_params.{field}"):
        ts_engine.decode_add([msgpack.packb(raw, use_bin_type=True)])


def test_decoder_accepts_what_msgspec_accepts() -> None:
    raw = raw_add(base_add())
    raw[5][3] = 1  # int for a float
    raw[5][1] = "stop-here"  # a lone str
    raw[5][2] = [4, 4, 2]  # duplicates collapse
    raw[15] = 5  # int created_time
    raw[12] = ["s"]  # short session_params
    req = ts_engine.decode_add([msgpack.packb(raw)])
    sp = req.sampling_params
    assert sp.temperature == 1.0 and type(sp.temperature) is float
    assert sp.stop == sp.stop_strs == "stop-here" and sp.stop_token_ids == (4, 2)
    assert req.created_time == 5.0 and req.session_params == ts.SessionParams(id="s")
    # float32 on the wire (SMG's f32 widened) is fine
    raw = raw_add(base_add(sampling_params=ts.TokenSpeedSamplingParams(temperature=0.7)))
    req = ts_engine.decode_add([msgpack.packb(raw, use_single_float=True)])
    assert req.sampling_params.temperature == pytest.approx(0.7, abs=1e-7)


# ----------------------------------------------------------------- framing, abort, encoders


def test_request_type_frames() -> None:
    assert ts.RequestType.ADD.frame == b"\x00" and ts.RequestType.ABORT.frame == b"\x01"
    assert ts_engine.parse_request_type(b"\x01") is ts.RequestType.ABORT
    for bad in (b"", b"\x02", b"\x03", b"\x00\x00"):
        with pytest.raises(RemoteProtocolError):
            ts_engine.parse_request_type(bad)
    with pytest.raises(RemoteProtocolError, match=">= 2 frames"):
        ts_engine.decode_input([b"\x00"])


@SETTINGS
@given(st.lists(text, max_size=5))
def test_abort_roundtrip(ids: list[str]) -> None:
    assert ts_engine.decode_abort(ts.encode_abort(ids)) == tuple(ids)
    assert ts_engine.decode_input([b"\x01", ts.encode_abort(ids)]) == (ts.RequestType.ABORT, tuple(ids))


def test_encoders_refuse_what_the_wire_cannot_carry() -> None:
    sp = ts.TokenSpeedSamplingParams
    bad_adds = [
        base_add(stream=1),
        base_add(sampling_params=sp(top_k=1.5)),
        base_add(sampling_params=sp(ignore_eos=0)),
        base_add(sampling_params=sp(logit_bias={5: 1.0})),
        base_add(sampling_params=sp(stop=[1])),
        base_add(sampling_params=sp(seed=2**64)),
        base_add(input_ids=(1, "2")),
        base_add(sampling_params={"temperature": 1.0}),
        ts.TokenizedGenerateReqInput(rid=None, sampling_params=sp()),
    ]
    for req in bad_adds:
        with pytest.raises(LocalProtocolError):
            ts.encode_add(req)
    with pytest.raises(LocalProtocolError):
        ts.encode_add({"rid": "x"})  # type: ignore[arg-type]
    for ids in ("r1", [1], [b"r1"]):
        with pytest.raises(LocalProtocolError):
            ts.encode_abort(ids)  # type: ignore[arg-type]
    good = ts.decode_outputs([msgpack.packb(_two())])
    bad_batches = [
        attrs.evolve(good, rids=("a",)),
        attrs.evolve(good, output_ids=((1,), (-2,))),
        attrs.evolve(good, logprob_vals=((), (1.0,))),
        attrs.evolve(good, finished_reasons=("", None)),
        attrs.evolve(good, engine_index=-1),
        attrs.evolve(good, cached_tokens=(0, 1.0)),
    ]
    for batch in bad_batches:
        with pytest.raises(LocalProtocolError):
            ts_engine.encode_outputs(batch)
    with pytest.raises(LocalProtocolError, match="does not carry"):
        ts_engine.encode_outputs(good, elements=10)  # load would be lost
    for bad in (8, 15):
        with pytest.raises(LocalProtocolError):
            ts_engine.encode_outputs(good, elements=bad)


def test_ready_response_encoder_checks() -> None:
    resp = handshake.EngineCoreReadyResponse(max_model_len=4096, dtype="bfloat16", vllm_version="tokenspeed-0.1.1",
                                      block_size=16)
    raw = msgpack.unpackb(ts_engine.encode_ready_response(resp))
    assert list(raw)[:3] == ["max_model_len", "num_gpu_blocks", "prefix_granularity"] and len(raw) == 19
    assert "block_size" not in raw and raw["prefix_granularity"] == 16
    assert ts.decode_ready_response(ts_engine.encode_ready_response(resp)) == resp
    assert raw["multimodal_encoder_dtype"] is None and resp.multimodal_encoder_dtype is None
    mm = attrs.evolve(resp, multimodal_encoder_dtype="bfloat16")
    assert msgpack.unpackb(ts_engine.encode_ready_response(mm))["multimodal_encoder_dtype"] == "bfloat16"
    assert ts.decode_ready_response(ts_engine.encode_ready_response(mm)) == mm
    # vLLM's encoder writes no such key (vLLM sends none), unless it is set
    assert "multimodal_encoder_dtype" not in msgpack.unpackb(handshake.encode_ready_response(resp))
    with pytest.raises(RemoteProtocolError, match="multimodal_encoder_dtype"):
        ts.decode_ready_response(msgpack.packb({"max_model_len": 8, "multimodal_encoder_dtype": 16}))
    for bad in (attrs.evolve(resp, dtype="float8"), attrs.evolve(resp, max_num_batched_tokens=-1)):
        with pytest.raises(LocalProtocolError):
            ts_engine.encode_ready_response(bad)
