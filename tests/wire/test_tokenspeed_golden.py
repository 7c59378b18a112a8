"""Golden vectors of TokenSpeed 0.1.1's own encoder, replayed against our codec.

For every case of ``tokenspeed_0.1.1.json`` (``docs/tokenspeed-wire.md`` §1.15: TokenSpeed's
own encoder, the reference gateway's pinned vectors, and a few more cases produced with
TokenSpeed 0.1.1's encoder; each case names its ``source``): build the message from the
case's decoded view with our encoder and require byte equality; decode the golden bytes
with our decoder and require the decoded view TokenSpeed's own decoder produced; for ADD
also require TokenSpeed's finalized view (seed, normalization, ``n`` check).

The vectors file is found via ``$ZMQD_TOKENSPEED_VECTORS``, else the copy next to this
test (``tests/wire/vectors/``).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import attrs
import pytest

from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.protocol import checks_tokenspeed
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm_handshake as handshake

HERE = pathlib.Path(__file__).resolve().parent
_LOCAL = HERE / "vectors" / "tokenspeed_0.1.1.json"


def _vectors_path() -> pathlib.Path:
    env = os.environ.get("ZMQD_TOKENSPEED_VECTORS")
    return pathlib.Path(env) if env else _LOCAL


CASES: list[dict[str, Any]] = json.loads(_vectors_path().read_text())
BY_NAME = {c["name"]: c for c in CASES}


def golden(case: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["frames_hex"]]


def ids(kind: str) -> list[str]:
    return [c["name"] for c in CASES if c["kind"] == kind]


# ----------------------------------------------------------------- views (TokenSpeed's field names)


def plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v


def sampling_view(sp: ts.TokenSpeedSamplingParams) -> dict[str, Any]:
    out = {f.name: plain(getattr(sp, f.name)) for f in attrs.fields(type(sp))}
    if out["stop_token_ids"] is not None:
        out["stop_token_ids"] = sorted(out["stop_token_ids"])  # a set in TokenSpeed
    return out


def request_view(req: ts.TokenizedGenerateReqInput) -> dict[str, Any]:
    out = {}
    for f in attrs.fields(type(req)):
        v = getattr(req, f.name)
        if f.name == "sampling_params":
            v = sampling_view(v)
        elif f.name == "session_params" and v is not None:
            v = [v.id, v.rid, v.offset, v.replace]
        out[f.name] = plain(v)
    return out


def request_from_view(view: dict[str, Any]) -> ts.TokenizedGenerateReqInput:
    kwargs = dict(view)
    kwargs["sampling_params"] = ts.TokenSpeedSamplingParams(**view["sampling_params"])
    if view["session_params"] is not None:
        session = dict(zip(("id", "rid", "offset", "replace"), view["session_params"]))
        kwargs["session_params"] = ts.SessionParams(**session)
    return ts.TokenizedGenerateReqInput(**kwargs)


_OUT_NAMES = {
    "output_token_logprobs_val": "logprob_vals",
    "output_token_logprobs_idx": "logprob_ids",
}


def batch_from_view(view: dict[str, Any]) -> ts.TokenSpeedBatch:
    kwargs = {_OUT_NAMES.get(k, k): v for k, v in view.items()}
    for k in ("rids", "finished_reasons", "prompt_tokens", "completion_tokens", "cached_tokens"):
        kwargs[k] = tuple(kwargs[k])
    for k in ("output_ids", "logprob_vals", "logprob_ids"):
        kwargs[k] = tuple(tuple(x) for x in kwargs[k])
    return ts.TokenSpeedBatch(**kwargs)


def batch_view(b: ts.TokenSpeedBatch) -> dict[str, Any]:
    inv = {v: k for k, v in _OUT_NAMES.items()}
    return {
        inv.get(f.name, f.name): plain(getattr(b, f.name))
        for f in attrs.fields(type(b))
        if f.name != "wire_elements"
    }


# ----------------------------------------------------------------- the vectors file itself


def test_vectors_cover_spec_section_1_15() -> None:
    section_1_15 = {c["name"] for c in CASES if c["source"].startswith("docs/tokenspeed-wire.md §1.15 (TokenSpeed")}
    assert section_1_15 == {
        "handshake_hello",
        "abort_r1",
        "add_full_normalized",
        "outputs_length_logprobs_load",
        "outputs_validation_abort",
        "outputs_two_rids",
    }
    for c in CASES:
        assert c["description"] and c["frames_hex"], c["name"]


# ----------------------------------------------------------------- ADD


@pytest.mark.parametrize("name", ids("add"))
def test_add_encodes_byte_for_byte(name: str) -> None:
    case = BY_NAME[name]
    req = request_from_view(case["decoded"])
    assert ts.encode_add(req, elements=case["elements"]) == golden(case)
    assert case["type_byte"] == ts.RequestType.ADD.frame.hex()


@pytest.mark.parametrize("name", ids("add"))
def test_add_decodes_like_tokenspeed(name: str) -> None:
    case = BY_NAME[name]
    req = ts_engine.decode_add(golden(case))
    assert request_view(req) == case["decoded"]
    # re-encoding what we decoded gives the golden bytes back
    assert ts.encode_add(req, elements=case["elements"]) == golden(case)


@pytest.mark.parametrize("name", ids("add"))
def test_add_finalizes_like_tokenspeed(name: str) -> None:
    case = BY_NAME[name]
    rtype, req = ts_engine.decode_input([ts.RequestType.ADD.frame, *golden(case)])
    assert rtype is ts.RequestType.ADD
    got, want = request_view(req), dict(case["finalized"])
    # The reason text never travels; only whether the request is marked.
    assert (got.pop("validation_error") is None) == (want.pop("validation_error") is None)
    assert got == want


def test_smg_24_element_vector_is_the_full_vector_minus_one_nil() -> None:
    full, smg = golden(BY_NAME["add_full_normalized"])[0], golden(BY_NAME["add_smg_24_elements"])[0]
    assert full[:3] == b"\xdc\x00\x19" and smg[:3] == b"\xdc\x00\x18"
    assert full[3:] == smg[3:] + b"\xc0"
    assert ts_engine.decode_add([smg]) == ts_engine.decode_add([full])


def test_add_vector_positions() -> None:
    req = ts_engine.decode_add(golden(BY_NAME["add_full_normalized"]))
    sp = req.sampling_params
    assert sp.top_k == ts.TOP_K_DISABLED == 1 << 30
    assert (sp.seed, sp.stop_token_ids, sp.stop_strs, sp.is_normalized) == (42, (2,), (), True)
    assert (req.return_logprob, req.logprob_start_len, req.stream) == (True, -1, True)
    # 11-element SMG prefix: tag .. stream, nested sampling always 29
    smg = ts.encode_add(req, elements=11)[0]
    assert smg[0] == 0x9B and ts_engine.decode_add([smg]) == req


def test_greedy_vector_pins_seed_zero() -> None:
    req = ts_engine.decode_add(golden(BY_NAME["add_greedy_stop_strings"]))
    sp = req.sampling_params
    assert (sp.temperature, sp.top_k, sp.seed) == (1.0, 1, 0)
    assert sp.stop_strs == ("ab", "abcd") and sp.stop_str_max_len == 4
    # the same values, derived by us from the API form
    api = ts.TokenSpeedSamplingParams(
        max_new_tokens=32, stop=["ab", "abcd"], temperature=0.0, stop_token_ids=[], min_new_tokens=2,
        ignore_eos=True, json_schema='{"type":"object"}',
    )
    assert api.normalize() == sp


def test_n2_vector_is_marked_for_a_terminal_abort() -> None:
    _, req = ts_engine.decode_input([b"\x00", *golden(BY_NAME["add_n2_pd_fields"])])
    assert req.validation_error is not None and "n=2" in req.validation_error
    assert checks_tokenspeed.admission_error(req, vocab_size=100) == req.validation_error
    assert req.sampling_params.seed == 0xFFFFFFFF & __import__("zlib").crc32(b"req-n2")


# ----------------------------------------------------------------- ABORT


def test_abort_vector() -> None:
    case = BY_NAME["abort_r1"]
    assert [ts.encode_abort(["r1"])] == golden(case)
    assert ts_engine.decode_abort(golden(case)[0]) == ("r1",)
    assert ts_engine.decode_input([bytes.fromhex(case["type_byte"]), *golden(case)]) == (ts.RequestType.ABORT, ("r1",))


# ----------------------------------------------------------------- outputs


@pytest.mark.parametrize("name", ids("outputs"))
def test_outputs_encode_byte_for_byte(name: str) -> None:
    case = BY_NAME[name]
    batch = batch_from_view(case["decoded"])  # legacy forms: TokenSpeed decoded the tail as zeros
    assert ts_engine.encode_outputs(batch, elements=case["elements"]) == golden(case)


@pytest.mark.parametrize("name", ids("outputs"))
def test_outputs_decode_like_tokenspeed(name: str) -> None:
    case = BY_NAME[name]
    batch = ts.decode_outputs(golden(case))
    assert batch_view(batch) == case["decoded"]
    assert batch.wire_elements == case["elements"]
    assert batch == batch_from_view(case["decoded"])


def test_output_vector_split_and_load() -> None:
    batch = ts.decode_outputs(golden(BY_NAME["outputs_length_logprobs_load"]))
    (out,) = batch.outputs()
    assert out == ts.TokenSpeedOutput("vec-1", (10, 11), "length", 3, 2, 1, (-0.5, -0.25), (10, 11))
    assert batch.load == ts.LoadSnapshot(1, 2, 5, 100, 400) and batch.load.kv_usage == 0.25
    assert batch.finished_rids() == ("vec-1",)

    two = ts.decode_outputs(golden(BY_NAME["outputs_two_rids"]))
    assert [o.finish_reason for o in two.outputs()] == [None, "stop"]
    assert two.finished_rids() == ("b",) and two.load == ts.LoadSnapshot(0, 1, 0, 2, 1000)

    abort = ts.decode_outputs(golden(BY_NAME["outputs_validation_abort"]))
    assert abort.load is None and abort.finished_reasons == (ts.FINISH_ABORT,)
    assert abort.output_ids == ((),) and abort.completion_tokens == (0,) and abort.prompt_tokens == (3,)


def test_legacy_vectors_default_the_tail() -> None:
    full = ts.decode_outputs(golden(BY_NAME["outputs_length_logprobs_load"]))
    ten = ts.decode_outputs(golden(BY_NAME["outputs_legacy_10_elements"]))
    nine = ts.decode_outputs(golden(BY_NAME["outputs_legacy_9_elements"]))
    assert ten == attrs.evolve(full, num_running=0, num_waiting=0, kv_active_pages=0, kv_total_pages=0)
    assert nine == attrs.evolve(ten, engine_index=0)
    assert ten.load is None and nine.load is None
    # aux frames after the payload are ignored
    assert ts.decode_outputs([*golden(BY_NAME["outputs_two_rids"]), b"junk"]) == ts.decode_outputs(
        golden(BY_NAME["outputs_two_rids"])
    )


def test_corrupted_output_tag_is_refused() -> None:
    payload = bytearray(golden(BY_NAME["outputs_two_rids"])[0])
    payload[2] ^= 0x20  # "BatchTokenIDOutSlim" -> "batchTokenIDOutSlim"
    with pytest.raises(RemoteProtocolError, match="wrong msgspec tag"):
        ts.decode_outputs([bytes(payload)])


# ----------------------------------------------------------------- handshake


def test_hello_and_ready_vectors() -> None:
    assert [ts_engine.encode_hello()] == golden(BY_NAME["handshake_hello"])
    assert [ts_engine.encode_ready()] == golden(BY_NAME["handshake_ready"])
    for name, status in (("handshake_hello", "HELLO"), ("handshake_ready", "READY")):
        st = handshake.decode_handshake_status(golden(BY_NAME[name])[0])
        assert st == handshake.HandshakeStatus(status=status, local=True, headless=True, parallel_config_hash=None)


def test_ready_response_vector() -> None:
    case = BY_NAME["ready_response_dp_rank1"]
    view = case["decoded"]
    resp = ts.decode_ready_response(golden(case)[0])
    assert ts.is_tokenspeed(resp)
    assert resp.block_size == view["prefix_granularity"] == 64
    for key, value in view.items():
        if key != "prefix_granularity":
            assert getattr(resp, key) == value, key
    encoded = ts_engine.encode_ready_response(resp)
    assert [encoded] == golden(case)
    assert not ts.is_tokenspeed(attrs.evolve(resp, vllm_version="0.32.0"))
