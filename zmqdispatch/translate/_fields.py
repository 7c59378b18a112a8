"""Checks of gateway proto fields that the TokenSpeed and SGLang schedulers'
``GenerateRequest`` messages share (the same field names and meaning in
``tokenspeed_scheduler.proto`` and ``sglang_scheduler.proto``), for
:mod:`.tokenspeed` and :mod:`.sglang`. Sans-IO; *sp* / *req* are either
package's messages."""

from __future__ import annotations

from typing import Any

from .. import limits
from ..errors import RequestRejected
from ..protocol.checks import check_json_text

#: ``logit_bias`` values outside this range are refused (the OpenAI API range).
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def reject(rid: str, field: str, why: str) -> RequestRejected:
    """The refusal of *field* of request *rid* (message ``"<field>: <why>"``)."""
    return RequestRejected(f"{field}: {why}", request_id=rid, field=field)


def structured_constraint(rid: str, sp: Any) -> dict[str, Any]:
    """The ``constraint`` oneof as the schedulers' ``SamplingParams`` keyword
    (``json_schema``, ``regex``, ``ebnf`` for ``ebnf_grammar``, ...); ``{}`` unset.

    Raises:
        RequestRejected: an empty value, a ``json_schema`` that is not JSON or
            nests deeper than :data:`zmqdispatch.limits.MAX_JSON_NESTING`.
    """
    which = sp.WhichOneof("constraint")
    if which is None:
        return {}
    value = getattr(sp, which)
    field = f"sampling_params.{which}"
    if not value:
        raise reject(rid, field, "must not be empty")
    if which == "json_schema":
        check_json_text(rid, field, value)
    return {"ebnf" if which == "ebnf_grammar" else which: value}


def logit_bias(rid: str, sp: Any, vocab_size: int | None) -> dict[str, float] | None:
    """``logit_bias`` as the schedulers take it (token id strings, sorted), None
    when empty.

    Raises:
        RequestRejected: a key that is not a token id below *vocab_size* (when
            known), a bias outside :data:`LOGIT_BIAS_RANGE`.
    """
    if len(sp.logit_bias) == 0:
        return None
    out = {}
    for key, bias in sorted(sp.logit_bias.items()):
        try:
            tok = int(key)
        except ValueError:
            raise reject(rid, "sampling_params.logit_bias", f"key {key!r} is not a token id") from None
        if tok < 0 or str(tok) != key.strip() or (vocab_size is not None and tok >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise reject(rid, "sampling_params.logit_bias", f"key {key!r} is not a vocabulary id ({limit})")
        if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
            raise reject(rid, "sampling_params.logit_bias", f"bias {bias} for token {key} is outside [-100, 100]")
        out[str(tok)] = float(bias)
    return out


def sample_count(req: Any) -> int:
    """``sampling_params.n`` of *req*, 1 when unset or 0 (proto3).

    Raises:
        RequestRejected: above :data:`zmqdispatch.limits.MAX_PARALLEL_SAMPLES`.
    """
    n = max(1, req.sampling_params.n) if req.HasField("sampling_params") else 1
    if n > limits.MAX_PARALLEL_SAMPLES:
        raise reject(req.request_id, "sampling_params.n",
                     f"n={n} exceeds the limit of {limits.MAX_PARALLEL_SAMPLES} samples per request")
    return n
