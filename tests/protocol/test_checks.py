"""check_request repeats every check vLLM 0.32's SamplingParams runs when the
engine decodes an ADD (a failure there kills the engine's input thread), plus
the values that crash the engine later. Each refusal names the field."""

from __future__ import annotations

import math

import attrs
import pytest

from zmqdispatch.errors import ContextLengthError, RequestRejected
from zmqdispatch.protocol.checks import check_request

from ..helpers import make_request


def check(req, **kw):
    kw.setdefault("max_model_len", 100)
    kw.setdefault("vocab_size", 1000)
    check_request(req, **kw)


@pytest.mark.parametrize(
    "field, sp",
    [
        ("n", {"n": 4}),
        ("n", {"n": 0}),
        ("temperature", {"temperature": 2.5}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -2}),
        ("min_p", {"min_p": 1.5}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -3.0}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": math.inf}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": None}),
        ("min_tokens", {"min_tokens": 20}),
        ("logprobs", {"logprobs": 21}),
        ("logprobs", {"logprobs": -1}),
        ("logprobs", {"logprobs": 10**6}),
        ("prompt_logprobs", {"prompt_logprobs": 10**6}),
        ("seed", {"seed": 2**64}),
        ("stream_interval", {"stream_interval": 0}),
        ("stop", {"stop": ("x",)}),
        ("bad_words", {"bad_words": ("",)}),
        ("thinking_token_budget", {"thinking_token_budget": -5}),
        ("logit_bias", {"logit_bias": {10**6: 5.0}}),
        ("logit_bias", {"logit_bias": {5: math.nan}}),
        ("allowed_token_ids", {"allowed_token_ids": (10**6,)}),
        ("allowed_token_ids", {"allowed_token_ids": ()}),
        ("stop_token_ids", {"stop_token_ids": (1000,)}),
        ("eos_token_id", {"eos_token_id": -1}),
    ],
)
def test_each_vllm_check_is_repeated_and_names_the_field(field, sp):
    with pytest.raises(RequestRejected) as ei:
        check(make_request("r", **sp))
    assert ei.value.field == f"sampling_params.{field}" and ei.value.request_id == "r"
    assert field in str(ei.value)


def test_valid_requests_pass():
    check(make_request("r", temperature=2.0, logprobs=20, prompt_logprobs=0, seed=2**63, logit_bias={5: -100.0},
                       allowed_token_ids=(1, 2), stream_interval=1, thinking_token_budget=-1))


def test_request_level_checks():
    with pytest.raises(RequestRejected) as ei:
        check(make_request("bad\udcff"))
    assert ei.value.field == "request_id"
    with pytest.raises(RequestRejected) as ei:
        check(make_request("r", prompt=[1, 1000]))
    assert ei.value.field == "prompt_token_ids" and "vocab_size=1000" in str(ei.value)
    with pytest.raises(RequestRejected) as ei:
        check(make_request("r", prompt=[]))
    assert ei.value.field == "prompt_token_ids"
    with pytest.raises(RequestRejected) as ei:
        check(attrs.evolve(make_request("r"), data_parallel_rank=-1))
    assert ei.value.field == "data_parallel_rank"
    with pytest.raises(ContextLengthError) as ei:
        check(make_request("r", prompt=range(100), max_tokens=1))
    assert (ei.value.prompt_len, ei.value.max_model_len, ei.value.max_tokens) == (100, 100, None)


def test_max_logprobs_follows_the_engine_setting():
    check(make_request("r", logprobs=50), max_logprobs=64)
    with pytest.raises(RequestRejected):
        check(make_request("r", logprobs=50))
