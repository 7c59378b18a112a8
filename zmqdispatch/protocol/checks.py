"""Validate a request before it is sent (sans-IO): vLLM ``EngineCoreRequest`` and
TokenSpeed ``TokenizedGenerateReqInput`` (:func:`check_tokenspeed_request`).

Why: the real engine does not answer a bad request with an error. A live
duplicate id or a prompt token id >= the vocabulary size makes the engine send
``ENGINE_CORE_DEAD`` and exit; a payload that does not decode, or values that
fail the checks its input thread runs (``top_p`` 0.0, ``max_tokens`` 0, a float
``top_k``), kill that thread silently and the engine never reads input again
(``docs/vllm-wire.md`` §5.8). So every request is checked here against the
wire schema and vLLM 0.32's own ``SamplingParams`` argument checks, and
refused with a :class:`~zmqdispatch.errors.RequestRejected` that names the
field and the limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

from .. import limits
from ..errors import ContextLengthError, LocalProtocolError, RequestRejected
from ..wire import tokenspeed as ts
from ..wire import vllm as wire
from ..wire.tensors import check_tensor
from ..wire.tokenspeed_multimodal import to_wire as _ts_mm_to_wire
from ..wire.vllm_multimodal import check_wire_features
from . import checks_tokenspeed

__all__ = ["check_json_text", "check_request", "check_sampling_params", "check_tokenspeed_request", "json_depth"]

# vLLM's SamplingParams._verify_args bounds (vllm/sampling_params.py, 0.32.0).
_PENALTY_RANGE = (-2.0, 2.0)
_INT64_MIN, _INT64_MAX = -(2**63), 2**64 - 1  # what msgpack and torch.manual_seed take
DEFAULT_MAX_LOGPROBS = limits.DEFAULT_MAX_LOGPROBS
_TEMPERATURE_MAX = 2.0
_INT32_MAX = 2**31 - 1


def json_depth(value: object) -> int:
    """Nesting depth of a decoded JSON value (objects and arrays), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v)
    return depth


def _reject(rid: str, field: str, message: str) -> RequestRejected:
    return RequestRejected(f"{field}: {message}", request_id=rid, field=field)


_INT_ONLY = {int}


def _is_int(v: object) -> TypeGuard[int]:
    return type(v) is int  # bool is not a token id / count


def _is_num(v: object) -> bool:
    return (type(v) is float or type(v) is int) and math.isfinite(v)


def check_sampling_params(
    sp: wire.SamplingParams,
    *,
    request_id: str = "",
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    vocab_size: int | None = None,
) -> None:
    """Apply vLLM's own ``SamplingParams`` checks that the engine enforces.

    The engine runs ``SamplingParams.__post_init__`` / ``_verify_args`` when it
    decodes an ADD (vLLM 0.32.0 ``vllm/sampling_params.py``); any failure
    there kills its input thread, so each of those checks is repeated here,
    plus the values that crash the engine later (logprob counts above
    ``max_logprobs``, token ids outside the vocabulary).

    Raises:
        RequestRejected: with ``field`` = ``"sampling_params.<name>"``.
    """
    rid = request_id

    def bad(name: str, message: str) -> RequestRejected:
        return _reject(rid, f"sampling_params.{name}", message)

    if not _is_int(sp.n) or sp.n < 1:
        raise bad("n", f"must be an int >= 1, got {sp.n!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not _is_num(v) or not _PENALTY_RANGE[0] <= v <= _PENALTY_RANGE[1]:
            raise bad(name, f"must be in [-2, 2], got {v!r}")
    if not _is_num(sp.repetition_penalty) or sp.repetition_penalty <= 0:
        raise bad("repetition_penalty", f"must be > 0, got {sp.repetition_penalty!r}")
    if not _is_num(sp.temperature) or not 0 <= sp.temperature <= _TEMPERATURE_MAX:
        raise bad("temperature", f"must be in [0, {_TEMPERATURE_MAX:g}], got {sp.temperature!r}")
    if not _is_num(sp.top_p) or not 0 < sp.top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {sp.top_p!r} (0.0 kills the engine's input thread)")
    if not _is_int(sp.top_k) or sp.top_k < -1:
        raise bad("top_k", f"must be an int, -1 or 0 (disabled) or >= 1, got {sp.top_k!r}")
    if not _is_num(sp.min_p) or not 0 <= sp.min_p <= 1:
        raise bad("min_p", f"must be in [0, 1], got {sp.min_p!r}")
    if sp.max_tokens is None or not _is_int(sp.max_tokens) or sp.max_tokens < 1:
        raise bad("max_tokens", f"must be an int >= 1, got {sp.max_tokens!r} (0 kills the engine's input thread)")
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0:
        raise bad("min_tokens", f"must be an int >= 0, got {sp.min_tokens!r}")
    if sp.min_tokens > sp.max_tokens:
        raise bad("min_tokens", f"must be <= max_tokens={sp.max_tokens}, got {sp.min_tokens}")
    if sp.seed is not None and not _is_int(sp.seed):
        raise bad("seed", f"must be an int or unset, got {sp.seed!r}")
    if sp.n != 1:
        raise bad("n", f"must be 1 on the wire, got {sp.n!r}: fan n > 1 out with EngineClient.generate_samples")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(sp, name)
        if v is None:
            continue
        if not _is_int(v) or not 0 <= v <= max_logprobs:
            # The engine sends ENGINE_CORE_DEAD for a count above its
            # max_logprobs; -1 ("whole vocabulary") is refused explicitly.
            raise bad(name, f"must be an int in [0, {max_logprobs}] (max_logprobs), got {v!r}")
    if sp.seed is not None and not _INT64_MIN <= sp.seed <= _INT64_MAX:
        raise bad("seed", f"must fit in 64 bits, got {sp.seed}")
    if sp.stream_interval is not None and (not _is_int(sp.stream_interval) or sp.stream_interval < 1):
        raise bad("stream_interval", f"must be an int >= 1, got {sp.stream_interval!r}")
    if sp.stop:
        # The engine never applies stop strings (vLLM's front end does, on
        # detokenised text), and with detokenize=False vLLM's own checks
        # reject them in the engine's input thread: never send them.
        raise bad("stop", "stop strings are matched on the client (translate with a tokenizer), not sent")
    if sp.bad_words and any(not isinstance(x, str) or not x for x in sp.bad_words):
        raise bad("bad_words", "must be non-empty strings")
    tb = sp.thinking_token_budget
    if tb is not None and (not _is_int(tb) or tb < -1):
        raise bad("thinking_token_budget", f"must be an int >= 0, or -1 for unlimited, got {tb!r}")
    if sp.logit_bias is not None:
        for tok, bias in sp.logit_bias.items():
            if not _is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise bad("logit_bias", f"key {tok!r} is not a vocabulary token id")
            if not _is_num(bias):
                raise bad("logit_bias", f"bias for token {tok} must be a finite number, got {bias!r}")
    so = sp.structured_outputs
    if so is not None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(so, k) not in (None, False)]
        if len(kinds) != 1:
            # vLLM's StructuredOutputsParams.__post_init__: exactly one kind.
            raise bad("structured_outputs", f"must set exactly one constraint, got {kinds or 'none'}")
        if so.json is not None and not isinstance(so.json, (str, dict)):
            raise bad("structured_outputs", "json must be a JSON Schema object or its text")
        if isinstance(so.json, dict) and json_depth(so.json) > limits.MAX_JSON_NESTING:
            raise bad("structured_outputs", f"json nests deeper than {limits.MAX_JSON_NESTING} levels")
    if sp.allowed_token_ids is not None:
        if len(sp.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", "must not be empty")
        for t in sp.allowed_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise bad("allowed_token_ids", f"{t!r} is not a vocabulary token id")
    for name in ("stop_token_ids", "all_stop_token_ids"):
        ids = getattr(sp, name)
        if ids and any(not _is_int(t) or t < 0 for t in ids):
            raise bad(name, f"must be non-negative ints, got {list(ids)!r}")
    if sp.eos_token_id is not None and (not _is_int(sp.eos_token_id) or sp.eos_token_id < 0):
        raise bad("eos_token_id", f"must be a non-negative int, got {sp.eos_token_id!r}")


def _check_id_and_prompt(rid: object, prompt: Any, field: str, vocab_size: int | None,
                         *, max_id: int | None = None) -> Sequence[int]:
    """Both runtimes: a non-empty UTF-8 request id, a non-empty prompt of token ids
    (below ``vocab_size`` when known, an id past the embedding table crashes the engine).
    Returns *prompt*, checked."""
    if type(rid) is not str or not rid:
        raise _reject("", "request_id", f"must be a non-empty str, got {rid!r}")
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:
        raise _reject("", "request_id", "must be valid UTF-8 text (no lone surrogates)") from None
    if prompt is None or len(prompt) == 0:
        raise _reject(rid, field, "must be a non-empty list of token ids")
    checked: Sequence[int] = prompt
    # The common case in C loops (a prompt of thousands of ids costs a Python
    # loop ~0.1 µs per id); anything doubtful takes the loop below, which names
    # the offending element.
    if set(map(type, prompt)) == _INT_ONLY:
        hi = max(prompt)
        if min(prompt) >= 0 and (max_id is None or hi <= max_id) and (vocab_size is None or hi < vocab_size):
            return checked
    for i, t in enumerate(prompt):
        if not _is_int(t) or t < 0 or (max_id is not None and t > max_id):
            raise _reject(rid, field, f"element {i} must be a non-negative int token id, got {t!r}")
        if vocab_size is not None and t >= vocab_size:
            raise _reject(rid, field, f"element {i} is {t}, not below vocab_size={vocab_size} (the engine would crash)")
    return checked


def check_request(
    request: wire.EngineCoreRequest,
    *,
    max_model_len: int | None,
    vocab_size: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> None:
    """Check one ``EngineCoreRequest`` against the wire schema, vLLM's
    ``SamplingParams`` checks, the context length and the vocabulary.

    Args:
        max_model_len: the engine's context length (from its ready response);
            ``None`` skips the context checks.
        vocab_size: when known, every prompt and stop token id must be below it
            (an out-of-range prompt id crashes the real engine). Without it,
            token ids cannot be checked: set it for untrusted input.
        max_logprobs: the engine's ``max_logprobs`` (vLLM's default 20).

    Raises:
        RequestRejected: the first problem found, naming the field.
        ContextLengthError: ``prompt_len >= max_model_len`` or
            ``prompt_len + max_tokens > max_model_len``; states both numbers.
    """
    rid = request.request_id
    prompt = _check_id_and_prompt(rid, request.prompt_token_ids, "prompt_token_ids", vocab_size)
    sp = request.sampling_params
    if sp is None:
        raise _reject(rid, "sampling_params", "must be set (vLLM fails a generate request without them)")
    check_sampling_params(sp, request_id=rid, max_logprobs=max_logprobs, vocab_size=vocab_size)
    if vocab_size is not None:
        for name in ("stop_token_ids", "all_stop_token_ids"):
            for t in getattr(sp, name):
                if t >= vocab_size:
                    raise _reject(rid, f"sampling_params.{name}", f"token id {t} is not below vocab_size={vocab_size}")
    if request.prompt_embeds is not None:
        try:
            check_tensor(request.prompt_embeds, torch=True)
        except LocalProtocolError as exc:
            raise _reject(rid, "prompt_embeds", str(exc)) from None
    if request.mm_features is not None:
        try:
            check_wire_features(request.mm_features, len(prompt) if prompt is not None else None)
        except LocalProtocolError as exc:
            raise _reject(rid, "mm_features", str(exc)) from None
    for name in wire.OPAQUE_REQUEST_FIELDS:
        value = getattr(request, name)
        if value is not None:
            try:
                wire.check_opaque_value(value, name)
            except LocalProtocolError as exc:
                raise _reject(rid, name, str(exc)) from None
    if request.data_parallel_rank is not None and (
        not _is_int(request.data_parallel_rank) or request.data_parallel_rank < 0
    ):
        raise _reject(rid, "data_parallel_rank", f"must be a non-negative int, got {request.data_parallel_rank!r}")
    if max_model_len is not None:
        n = len(prompt)
        if n >= max_model_len:
            raise ContextLengthError(
                f"prompt_token_ids: prompt of {n} tokens does not fit max_model_len={max_model_len} "
                "(at least one token must be generated)",
                request_id=rid,
                prompt_len=n,
                max_tokens=None,
                max_model_len=max_model_len,
            )
        assert sp.max_tokens is not None  # check_sampling_params refused None
        if n + sp.max_tokens > max_model_len:
            raise ContextLengthError(
                f"sampling_params.max_tokens: prompt of {n} tokens + max_tokens={sp.max_tokens} "
                f"exceeds max_model_len={max_model_len}",
                request_id=rid,
                prompt_len=n,
                max_tokens=sp.max_tokens,
                max_model_len=max_model_len,
                field="sampling_params.max_tokens",
            )


# --------------------------------------------------------------------------- TokenSpeed

#: TokenSpeed clamps ``max_new_tokens`` to ``max_req_len - len(prompt) - 1``, which
#: goes negative for an over-long prompt (engine behaviour then undefined,
#: ``docs/tokenspeed-wire.md`` §1.9): the prompt must leave room for one token plus that
#: reserve of one.
TOKENSPEED_CONTEXT_RESERVE = 2

_TS_SAMPLING_FIELDS = frozenset(
    {
        "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "min_new_tokens", "max_new_tokens", "logit_bias", "logprobs",
    }
)


def _ts_field(reason: str) -> str:
    """The field a TokenSpeed ``verify`` / admission message is about (its first word)."""
    word = reason.split(" ", 1)[0].split("=", 1)[0]
    if word in _TS_SAMPLING_FIELDS:
        return f"sampling_params.{word}"
    if word == "only":  # "only one of json_schema, regex and ebnf can be set"
        return "sampling_params.json_schema"
    if "logprob" in reason:
        return "return_logprob"
    if reason.startswith("session"):
        return "session_params"
    return "request"


def check_tokenspeed_request(
    request: ts.TokenizedGenerateReqInput,
    *,
    max_model_len: int | None,
    vocab_size: int | None = None,
) -> None:
    """Check one TokenSpeed ``TokenizedGenerateReqInput`` before it is sent.

    Why: TokenSpeed 0.1.1 drops an ADD that does not decode without a word (the
    request would hang), and answers one its ingress refuses with a terminal
    ``"abort"`` that carries no reason (``docs/tokenspeed-wire.md`` §1.9, §1.12). So
    every check of its ingress runs here first, on the values as the engine will
    derive them (:func:`zmqdispatch.wire.tokenspeed.finalize_add`), and what the
    engine does *not* check (prompt length, empty prompt, token ids beyond the
    vocabulary) is checked too.

    Args:
        max_model_len: the ready response's ``max_model_len`` (TokenSpeed reports
            the model's context length); ``None`` skips the context check.
        vocab_size: when known, prompt, stop and ``logit_bias`` ids must be below it.

    Raises:
        RequestRejected: naming the field (``sampling_params.top_k``, ...).
        ContextLengthError: the prompt leaves no room for a token
            (``len(prompt) > max_model_len - 2``). A ``max_new_tokens`` beyond the
            context is *not* refused: TokenSpeed clamps it to the context.
    """
    rid = request.rid
    if isinstance(request.multimodal_inputs, ts.MultimodalInputs):
        prompt = _check_tokenspeed_mm_prompt(request, vocab_size)
    else:
        prompt = _check_id_and_prompt(rid, request.input_ids, "input_ids", vocab_size, max_id=limits.MAX_TOKEN_ID)
    sp = request.sampling_params
    if not isinstance(sp, ts.TokenSpeedSamplingParams):
        raise _reject(rid, "sampling_params", f"must be TokenSpeedSamplingParams, got {type(sp).__name__}")
    if sp.n != 1:
        raise _reject(rid, "sampling_params.n",
                      f"must be 1 on the wire, got {sp.n!r}: fan n > 1 out with EngineClient.generate_samples")
    if sp.stop or sp.stop_strs:
        raise _reject(rid, "sampling_params.stop",
                      "stop strings are matched on the client (translate with a tokenizer), not sent")
    for name, v in (("temperature", sp.temperature), ("top_p", sp.top_p), ("min_p", sp.min_p),
                    ("frequency_penalty", sp.frequency_penalty), ("presence_penalty", sp.presence_penalty),
                    ("repetition_penalty", sp.repetition_penalty)):
        if not _is_num(v):
            raise _reject(rid, f"sampling_params.{name}", f"must be a finite number, got {v!r}")
    if sp.seed is not None and not 0 <= sp.seed < 2**64:
        raise _reject(rid, "sampling_params.seed", f"must be in [0, 2**64), got {sp.seed}")
    if sp.stop_token_ids:
        for t in sp.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise _reject(rid, "sampling_params.stop_token_ids", f"token id {t} is not a vocabulary id")
    if sp.logit_bias:
        for key, bias in sp.logit_bias.items():
            if not _is_num(bias):
                raise _reject(rid, "sampling_params.logit_bias", f"bias for token {key} must be finite, got {bias!r}")
    if sp.json_schema is not None:
        check_json_text(rid, "sampling_params.json_schema", sp.json_schema)
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        if getattr(request, name) is not None:
            raise _reject(rid, name, "PD disaggregation is not supported over the ZMQ transport")
    reason = checks_tokenspeed.admission_error(
        ts.finalize_add(request),
        vocab_size=vocab_size,
        enable_output_logprobs=True,  # unknown here; a refusal comes back as EngineAbortedRequest
    )
    if reason is not None:
        raise _reject(rid, _ts_field(reason), f"{reason} (TokenSpeed would abort the request without a reason)")
    if max_model_len is not None and len(prompt) > max_model_len - TOKENSPEED_CONTEXT_RESERVE:
        raise ContextLengthError(
            f"input_ids: prompt of {len(prompt)} tokens leaves no room to generate in "
            f"max_model_len={max_model_len} (TokenSpeed needs prompt <= max_model_len - {TOKENSPEED_CONTEXT_RESERVE})",
            request_id=rid,
            prompt_len=len(prompt),
            max_tokens=None,
            max_model_len=max_model_len,
            field="input_ids",
        )


def _check_tokenspeed_mm_prompt(request: ts.TokenizedGenerateReqInput, vocab_size: int | None) -> Sequence[int]:
    """A multimodal TokenSpeed prompt: the items encode (``to_wire``), ``input_ids_unpadded``
    holds vocabulary ids and ``input_ids`` is exactly it with each item's ranges set to the
    item's ``pad_value`` (ids past the vocabulary, which the engine's embedder overwrites),
    the ranges inside the prompt and apart. Returns ``input_ids``."""
    rid = request.rid
    mm = request.multimodal_inputs
    unpadded = _check_id_and_prompt(rid, request.input_ids_unpadded, "input_ids_unpadded", vocab_size,
                                    max_id=limits.MAX_TOKEN_ID)
    prompt = _check_id_and_prompt(rid, request.input_ids, "input_ids", None, max_id=limits.MAX_TOKEN_ID)
    if len(prompt) != len(unpadded):
        raise _reject(rid, "input_ids_unpadded", f"{len(unpadded)} ids for an input_ids of {len(prompt)}")
    try:
        _ts_mm_to_wire(mm)  # what the encoder would refuse (hash, pad_value, tensors...), no copy
        expected = ts.pad_input_ids(unpadded, mm)
    except LocalProtocolError as exc:
        field, _, why = str(exc).partition(": ")
        raise RequestRejected(str(exc), request_id=rid, field=field or "multimodal_inputs") from None
    if tuple(prompt) != expected:
        first = next(i for i, (a, b) in enumerate(zip(prompt, expected)) if a != b)
        raise _reject(rid, "input_ids", f"element {first} is {prompt[first]}, expected {expected[first]}: input_ids "
                      "must be input_ids_unpadded with each item's offsets set to its pad_value")
    return prompt


def check_json_text(rid: str, field: str, text: str) -> None:
    """Refuse *text* (the request's *field*) unless it is JSON nesting at most
    :data:`zmqdispatch.limits.MAX_JSON_NESTING` levels (``RequestRejected``)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise _reject(rid, field, "is not valid JSON") from None
    if json_depth(value) > limits.MAX_JSON_NESTING:
        raise _reject(rid, field, f"nests deeper than {limits.MAX_JSON_NESTING} levels")
