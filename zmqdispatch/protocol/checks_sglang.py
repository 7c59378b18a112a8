"""What the SGLang plugin refuses on receipt, and the client's check before sending (sans-IO).

The SGLang plugin (``smg-grpc-servicer`` 0.14.1) runs, on every decoded ADD,
SGLang's ``SamplingParams.normalize()`` and ``verify(vocab_size)``, then refuses
``n != 1`` and empty ``input_ids``; a refused request ends in one terminal
``"abort"`` output with the reason and status 400 (``docs/sglang.md``).
:func:`admission_error` is that rule set, written once for the mock scheduler
and for :func:`check_request`, which the client runs before sending so that a bad
request fails with a typed error naming the field, nothing sent.
"""

from __future__ import annotations

import math

from .. import limits
from ..errors import ContextLengthError, RequestRejected
from ..wire import sglang as sg

__all__ = ["MAX_STOP_REGEX_BYTES", "MAX_STOP_STRINGS", "admission_error", "check_request", "sampling_error"]

#: SGLang's ``MAX_STOP_COUNT`` (also the limit for stop regexes).
MAX_STOP_STRINGS = 32
#: SGLang's ``MAX_STOP_REGEX_LEN``: bytes of one stop regex.
MAX_STOP_REGEX_BYTES = 256


def _strs(v: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if v is None:
        return ()
    return (v,) if isinstance(v, str) else tuple(v)


def sampling_error(sp: sg.SGLangSamplingParams, vocab_size: int | None) -> tuple[str, str] | None:
    """``(field, reason)`` for params SGLang's ``normalize()`` / ``verify()`` refuse, on
    their derived form (:meth:`~zmqdispatch.wire.sglang.SGLangSamplingParams.derive`), or None."""
    d = sp.derive()
    f = "sampling_params."
    if len(_strs(d.stop_strs)) > MAX_STOP_STRINGS:
        return f + "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(_strs(d.stop_strs))}"
    regexes = _strs(d.stop_regex_strs)
    if len(regexes) > MAX_STOP_STRINGS:
        return f + "stop_regex", f"at most {MAX_STOP_STRINGS} stop_regex patterns are allowed, got {len(regexes)}"
    for r in regexes:
        if len(r.encode("utf-8")) > MAX_STOP_REGEX_BYTES:
            return f + "stop_regex", f"a stop_regex is over the {MAX_STOP_REGEX_BYTES}-byte limit"
    if d.beam_width is not None and d.beam_width < 1:
        return f + "beam_width", f"must be at least 1, got {d.beam_width}"
    if not math.isfinite(d.temperature) or d.temperature < 0.0:
        return f + "temperature", f"must be a non-negative finite number, got {d.temperature}"
    if not 0.0 < d.top_p <= 1.0:
        return f + "top_p", f"must be in (0, 1], got {d.top_p}"
    if not 0.0 <= d.min_p <= 1.0:
        return f + "min_p", f"must be in [0, 1], got {d.min_p}"
    if d.top_k < 1:
        return f + "top_k", f"must be -1 (disable) or at least 1, got {sp.top_k}"
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(d, name)
        if not -2.0 <= v <= 2.0:
            return f + name, f"must be in [-2, 2], got {v}"
    if not 0.0 < d.repetition_penalty <= 2.0:
        return f + "repetition_penalty", f"must be in (0, 2] (1.0 = no penalty), got {d.repetition_penalty}"
    if d.min_new_tokens < 0:
        return f + "min_new_tokens", f"must be in [0, max_new_tokens], got {d.min_new_tokens}"
    if d.max_new_tokens is not None:
        if d.max_new_tokens < 0:
            return f + "max_new_tokens", f"must be at least 0, got {d.max_new_tokens}"
        if d.min_new_tokens > d.max_new_tokens:
            return f + "min_new_tokens", f"must be in [0, max_new_tokens({d.max_new_tokens})], got {d.min_new_tokens}"
    if d.logit_bias is not None and vocab_size is not None:
        for key in d.logit_bias:
            try:
                ok = 0 <= int(key) < vocab_size
            except ValueError:
                ok = False
            if not ok:
                return f + "logit_bias", f"keys must be in [0, {vocab_size - 1}], got {key!r}"
    if d.sampling_seed is not None and not -(2**63) <= d.sampling_seed <= 2**63 - 1:
        return f + "sampling_seed", f"must be in [-2**63, 2**63 - 1], got {d.sampling_seed}"
    if sum(x is not None for x in (d.json_schema, d.regex, d.ebnf, d.structural_tag)) > 1:
        return f + "json_schema", "only one of json_schema, regex, ebnf, or structural_tag can be set"
    return None


def admission_error(req: sg.TokenizedGenerateReqInput, *, vocab_size: int | None) -> tuple[str, str] | None:
    """``(field, reason)`` when the SGLang plugin refuses this decoded ADD (a terminal
    ``"abort"`` with status 400 and the reason), else None."""
    bad = sampling_error(req.sampling_params, vocab_size)
    if bad is not None:
        return bad
    if req.sampling_params.n != 1:
        return "sampling_params.n", f"n={req.sampling_params.n} is not served on this wire; fan out n > 1 itself"
    if not req.input_ids:
        return "input_ids", "input_ids are required on this wire"
    return None


def check_request(req: sg.TokenizedGenerateReqInput, *, max_model_len: int | None,
                  vocab_size: int | None = None) -> None:
    """Check one SGLang ``TokenizedGenerateReqInput`` before it is sent.

    The plugin's refusals (:func:`admission_error`) plus what the scheduler would
    only refuse later: prompt and stop ids outside the vocabulary (or uint32), a
    prompt that leaves no room to generate.

    Raises:
        RequestRejected: naming the field (``.field``) and the limit.
        ContextLengthError: ``len(input_ids) >= max_model_len``.
    """
    rid = req.rid
    if not rid:
        raise RequestRejected("rid: must be a non-empty string", request_id="", field="rid")
    bad = admission_error(req, vocab_size=vocab_size)
    if bad is not None:
        field, why = bad
        raise RequestRejected(f"{field}: {why} (the SGLang scheduler would refuse it)", request_id=rid, field=field)
    top = limits.MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    for field, ids in (("input_ids", req.input_ids or ()),
                       ("sampling_params.stop_token_ids", req.sampling_params.stop_token_ids or ())):
        for t in ids:
            if not 0 <= t <= top:
                raise RequestRejected(f"{field}: token id {t} is outside [0, {top}]", request_id=rid, field=field)
    if req.top_logprobs_num < 0:
        raise RequestRejected(f"top_logprobs_num: must be >= 0, got {req.top_logprobs_num}", request_id=rid,
                              field="top_logprobs_num")
    prompt = len(req.input_ids or ())
    if max_model_len is not None and prompt >= max_model_len:
        raise ContextLengthError(
            f"input_ids: prompt of {prompt} tokens leaves no room to generate in max_model_len={max_model_len}",
            request_id=rid, prompt_len=prompt, max_tokens=req.sampling_params.max_new_tokens,
            max_model_len=max_model_len, field="input_ids",
        )
