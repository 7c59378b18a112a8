"""What TokenSpeed 0.1.1's ingress refuses in a decoded, finalized ADD (sans-IO).

TokenSpeed answers such a request with one terminal ``"abort"`` frame that carries no
reason (``docs/tokenspeed-wire.md`` §1.9), so these rules are written down once, for
both sides: the client runs them before sending
(:func:`zmqdispatch.protocol.checks.check_tokenspeed_request`, to refuse with a reason),
the mock engine runs them on what it decoded (:mod:`zmqdispatch.mock.tokenspeed_core`,
to abort like the real engine). The vLLM counterpart is :mod:`zmqdispatch.protocol.checks`.
"""

from __future__ import annotations

from ..wire import tokenspeed as ts

__all__ = ["admission_error", "sampling_params_error"]


def sampling_params_error(sp: ts.TokenSpeedSamplingParams, vocab_size: int | None = None) -> str | None:
    """Why TokenSpeed 0.1.1's ``SamplingParams.verify(vocab_size)`` refuses these values, or None.

    Checks run on the values as they are (pass
    :meth:`~zmqdispatch.wire.tokenspeed.TokenSpeedSamplingParams.derive`'d params to see
    what the engine sees). ``vocab_size=None`` skips the ``logit_bias`` range check
    but still requires integer keys >= 0.
    """
    if sp.temperature < 0.0:
        return f"temperature must be non-negative, got {sp.temperature}"
    if not 0.0 < sp.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {sp.top_p}"
    if not 0.0 <= sp.min_p <= 1.0:
        return f"min_p must be in [0, 1], got {sp.min_p}"
    if sp.top_k < -1 or sp.top_k == 0:
        return f"top_k must be -1 (disabled) or at least 1, got {sp.top_k}"
    if sp.top_k != ts.TOP_K_DISABLED and sp.top_k >= ts.TOP_K_FUSED_MAX:
        return f"top_k must be < {ts.TOP_K_FUSED_MAX} (fused kernel limit) or -1, got {sp.top_k}"
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        return f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}"
    if not -2.0 <= sp.presence_penalty <= 2.0:
        return f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}"
    if not 0.0 <= sp.repetition_penalty <= 2.0:
        return f"repetition_penalty must be in [0, 2], got {sp.repetition_penalty}"
    if sp.min_new_tokens < 0:
        return f"min_new_tokens must be >= 0, got {sp.min_new_tokens}"
    if sp.max_new_tokens is not None:
        if sp.max_new_tokens < 0:
            return f"max_new_tokens must be >= 0, got {sp.max_new_tokens}"
        if sp.min_new_tokens > sp.max_new_tokens:
            return f"min_new_tokens ({sp.min_new_tokens}) exceeds max_new_tokens ({sp.max_new_tokens})"
    if sp.logit_bias is not None:
        for key in sp.logit_bias:
            try:
                token = int(key)  # TokenSpeed parses the string key with int()
            except ValueError:
                return f"logit_bias key {key!r} is not a token id"
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                return f"logit_bias keys must be token ids in [0, vocab_size), got {key!r}"
    if sp.logprobs is not None and sp.logprobs != 0:
        return f"logprobs={sp.logprobs} is not supported (only nil or 0)"
    if sum(x is not None for x in (sp.json_schema, sp.regex, sp.ebnf)) > 1:
        return "only one of json_schema, regex and ebnf can be set"
    return None


def admission_error(
    req: ts.TokenizedGenerateReqInput,
    *,
    vocab_size: int | None,
    enable_output_logprobs: bool = False,
    supports_prompt_logprobs: bool = False,
) -> str | None:
    """Why TokenSpeed admits this (finalized) request pre-aborted, or None.

    The checks of its ingress (``docs/tokenspeed-wire.md`` §1.9) in one place, for a mock
    engine (which answers with one terminal ``"abort"`` frame carrying no tokens) and
    for a client that wants a real error message first: a truthy ``validation_error``;
    with ``return_logprob``: the server flag, ``top_logprobs_num != 0``, a non-empty
    ``token_ids_logprob``, nil ``input_ids``, a ``logprob_start_len`` below -1, at or past
    the prompt end, or asking for prompt logprobs (any start before the last prompt
    token); then ``SamplingParams.verify`` (:func:`sampling_params_error`); then a non-nil ``session_params.id``. The
    reason text never reaches the wire.
    """
    if req.validation_error:
        return req.validation_error
    if req.return_logprob:
        if not enable_output_logprobs:
            return "logprobs were requested but the engine runs without --enable-output-logprobs"
        if req.top_logprobs_num:
            return "top_logprobs_num != 0 (top-k output logprobs) is not supported"
        if req.token_ids_logprob:
            return "token_ids_logprob is not supported"
        if req.input_ids is None:
            return "return_logprob requires token inputs"
        n = len(req.input_ids)
        start = req.logprob_start_len
        if start == -1:
            start = max(n - 1, 0)
        elif start < -1:
            return f"logprob_start_len must be -1 or >= 0, got {start}"
        elif start >= n:
            return f"logprob_start_len ({start}) must be smaller than the prompt length ({n})"
        if start < n - 1:
            if not supports_prompt_logprobs:
                return "prompt logprobs are not supported by this engine"
            return "prompt logprobs are not carried on the msgpack output wire; use logprob_start_len=-1"
    reason = sampling_params_error(req.sampling_params, vocab_size)
    if reason is not None:
        return reason
    if req.session_params is not None and req.session_params.id is not None:
        return f"session id {req.session_params.id} does not exist"
    return None


