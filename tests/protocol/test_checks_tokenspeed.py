"""check_tokenspeed_request: what TokenSpeed would drop silently or abort without a
reason is refused before sending, naming the field."""

from __future__ import annotations

import attrs
import pytest

from zmqdispatch.errors import ContextLengthError, RequestRejected
from zmqdispatch.protocol.checks import TOKENSPEED_CONTEXT_RESERVE, check_tokenspeed_request
from zmqdispatch.wire import tokenspeed as ts

from ..helpers import make_ts_request


def refused(req: ts.TokenizedGenerateReqInput, field: str, match: str | None = None, **kw: object) -> RequestRejected:
    kw.setdefault("max_model_len", 64)
    with pytest.raises(RequestRejected, match=match) as ei:
        check_tokenspeed_request(req, **kw)
    assert ei.value.field == field, ei.value
    return ei.value


def with_sp(**sp: object) -> ts.TokenizedGenerateReqInput:
    return make_ts_request("t", **sp)


def test_a_valid_request_passes():
    check_tokenspeed_request(make_ts_request("t", temperature=0.7, top_k=50, top_p=0.9), max_model_len=64,
                             vocab_size=100)
    check_tokenspeed_request(make_ts_request("t", return_logprob=True), max_model_len=64)


@pytest.mark.parametrize(
    ("sp", "field", "match"),
    [
        ({"top_k": 0, "temperature": 1.0}, "sampling_params.top_k", "-1 .disabled. or at least 1"),
        ({"top_k": 128, "temperature": 1.0}, "sampling_params.top_k", "fused kernel limit"),
        ({"top_k": -2, "temperature": 1.0}, "sampling_params.top_k", None),
        ({"top_p": 0.0, "temperature": 1.0}, "sampling_params.top_p", r"\(0, 1\]"),
        ({"top_p": 1.5}, "sampling_params.top_p", None),
        ({"min_p": 1.5}, "sampling_params.min_p", r"\[0, 1\]"),
        ({"frequency_penalty": 2.5}, "sampling_params.frequency_penalty", r"\[-2, 2\]"),
        ({"presence_penalty": -3.0}, "sampling_params.presence_penalty", None),
        ({"repetition_penalty": 2.5}, "sampling_params.repetition_penalty", r"\[0, 2\]"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "sampling_params.min_new_tokens", "exceeds"),
        ({"max_new_tokens": -1}, "sampling_params.max_new_tokens", ">= 0"),
        ({"logit_bias": {"abc": 1.0}}, "sampling_params.logit_bias", "not a token id"),
        ({"logit_bias": {"500": 1.0}}, "sampling_params.logit_bias", r"\[0, vocab_size\)"),
        ({"logit_bias": {"5": float("nan")}}, "sampling_params.logit_bias", "finite"),
        ({"logprobs": 2}, "sampling_params.logprobs", "only nil or 0"),
        ({"regex": "a", "ebnf": "root ::= 'a'"}, "sampling_params.json_schema", "only one of"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema", "not valid JSON"),
        ({"json_schema": "[" * 70 + "]" * 70}, "sampling_params.json_schema", "64 levels"),
        ({"n": 2}, "sampling_params.n", "generate_samples"),
        ({"stop": ("x",)}, "sampling_params.stop", "matched on the client"),
        ({"seed": -1}, "sampling_params.seed", r"2\*\*64"),
        ({"seed": 2**64}, "sampling_params.seed", None),
        ({"stop_token_ids": (5, 200)}, "sampling_params.stop_token_ids", "not a vocabulary id"),
        ({"temperature": float("inf")}, "sampling_params.temperature", "finite"),
    ],
)
def test_sampling_values_the_engine_would_abort_are_refused(sp, field, match):
    refused(with_sp(**sp), field, match, vocab_size=100)


def test_request_fields_are_checked():
    refused(make_ts_request(""), "request_id")
    refused(make_ts_request("t", prompt=()), "input_ids", "non-empty")
    refused(make_ts_request("t", prompt=(1, 100)), "input_ids", "vocab_size=100", vocab_size=100)
    refused(make_ts_request("t", prompt=(1, -1)), "input_ids", "token id")
    refused(attrs.evolve(make_ts_request("t"), bootstrap_host="10.0.0.1"), "bootstrap_host", "PD")
    refused(attrs.evolve(make_ts_request("t", return_logprob=True), top_logprobs_num=2), "return_logprob",
            "top_logprobs_num")
    refused(attrs.evolve(make_ts_request("t", return_logprob=True), logprob_start_len=0), "return_logprob",
            "prompt logprobs")
    refused(attrs.evolve(make_ts_request("t"), session_params=ts.SessionParams(id="s1")), "session_params")
    refused(attrs.evolve(make_ts_request("t"), validation_error="set by a sender"), "request")


def test_greedy_values_are_checked_as_the_engine_derives_them():
    # temperature 0 makes the engine use top_k 1: an out-of-range top_k is then moot
    check_tokenspeed_request(with_sp(temperature=0.0, top_k=500), max_model_len=64)
    # and any temperature below 1e-6, negatives included, is greedy to TokenSpeed
    check_tokenspeed_request(with_sp(temperature=-1.0), max_model_len=64)


def test_prompt_must_leave_room_for_a_token():
    n = 64 - TOKENSPEED_CONTEXT_RESERVE
    check_tokenspeed_request(make_ts_request("t", prompt=[1] * n), max_model_len=64)
    with pytest.raises(ContextLengthError, match="max_model_len=64") as ei:
        check_tokenspeed_request(make_ts_request("t", prompt=[1] * (n + 1)), max_model_len=64)
    assert (ei.value.prompt_len, ei.value.max_model_len) == (n + 1, 64)
    # a max_new_tokens beyond the context is clamped by TokenSpeed, not refused
    check_tokenspeed_request(make_ts_request("t", max_new_tokens=10_000), max_model_len=64)
