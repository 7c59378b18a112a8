"""Gateway proto <-> TokenSpeed wire, sans-IO.

:func:`translate_request` turns a ``tokenspeed.grpc.scheduler.GenerateRequest``
(``tokenspeed_scheduler.proto`` of ``smg-grpc-proto`` 0.4.28; its field numbers
differ from ``vllm_engine.proto``'s, so nothing is shared with
:mod:`.vllm` but the stop-string machinery) into a TokenSpeed 0.1.1
``TokenizedGenerateReqInput``; :class:`ResponseBuilder` turns a stream's
:class:`~zmqdispatch.protocol.mailbox.OutputDelta` objects into that
package's ``GenerateResponse`` chunks and one final complete, shaped as
TokenSpeed's own gRPC servicer shapes them.

**Nothing is dropped silently.** Every field is mapped, has no effect on a
token-id stream (said below), or is refused with
:class:`~zmqdispatch.errors.RequestRejected` naming it and the limit:

=================================  ===============================================================
proto field                        rule
=================================  ===============================================================
``request_id``                     ``rid`` (non-empty); children of ``n > 1`` are ``<id>-<i>``
``tokenized.input_ids``            ``input_ids`` (required, non-empty)
``tokenized.original_text``        no effect (the engine takes ids; it is not sent)
``return_logprob``                 ``return_logprob``: one logprob per sampled token
``logprob_start_len``              -1 or ``len(prompt) - 1`` (no prompt logprobs); else refused:
                                   the wire carries no prompt logprobs
``top_logprobs_num``               0; 1 only for greedy sampling (top-1 is then the sampled
                                   token, the one logprob the wire carries); > 1 refused
``token_ids_logprob``              refused when non-empty (not on the wire)
``stream``                         ``stream`` (cadence only); ``False`` emits only the complete
``mm_inputs``                      ``multimodal_inputs``, ``input_ids`` padded with each item's
                                   ``pad_value``, ``input_ids_unpadded`` the prompt as given
                                   (:mod:`.tokenspeed_multimodal`: its table, its refusals)
``encode_bootstrap_info``,         refused (PD / EPD disaggregation needs a rendezvous this
``kv_bootstrap_info``              transport does not carry)
``data_parallel_rank``             the client's placement pin (a client of several engines sends
                                   the request to that rank; one of one engine refuses another
                                   rank); sent as is (the scheduler ignores it on this wire)
``sampling_params`` absent         TokenSpeed's defaults (special-token flags true)
``temperature`` .. ``repetition``  sent when set (``optional``), else TokenSpeed's default;
                                   ranges as TokenSpeed's ``verify``; ``top_k`` 0 and
                                   ``>= 128`` refused (the fused kernel's limit), -1 = disabled
``max_new_tokens``                 sent when set; unset: the engine fills the context
``min_new_tokens``                 sent; must not exceed ``max_new_tokens``
``stop``                           needs ``tokenizer``: matched on the client (vLLM detokenizer
                                   semantics, :mod:`.stops`); single-token stops also become
                                   engine stop ids; the engine request is aborted on a match
``stop_token_ids``                 sent (deduplicated)
``ignore_eos``, ``no_stop_trim``,  sent; ``no_stop_trim`` also keeps the stop token in the
``skip_special_tokens``,           responses; the special-token flags shape client-side
``spaces_between_special_tokens``  stop-string detokenisation
``n``                              0/1: one request; > 1 (at most ``MAX_PARALLEL_SAMPLES``):
                                   :func:`translate_parallel`
``logit_bias``                     sent (string keys, as TokenSpeed takes them): keys must be
                                   vocabulary ids, biases in [-100, 100]
``regex`` / ``json_schema`` /      ``regex`` / ``json_schema`` / ``ebnf`` / ``structural_tag``
``ebnf_grammar`` /
``structural_tag``
``custom_params``                  refused when non-empty: it only feeds a custom logit
                                   processor, which this proto cannot name
``sampling_seed``                  ``seed``; unset: the engine uses ``crc32(rid)``
=================================  ===============================================================

Sampling values travel un-normalized (``is_normalized`` false): the engine
derives them exactly as its own front end would (greedy below temperature 1e-6
becomes top_k 1 with seed 0; top_k -1 its "disabled" sentinel), and the
client-side checks run on the same derivation
(:func:`zmqdispatch.protocol.checks.check_tokenspeed_request`).

Responses (``tokenspeed.grpc.scheduler.GenerateResponse``), as TokenSpeed's
gRPC servicer builds them: ``request_id`` is the proto request's id (the
parent's for every sample), ``index`` the sample; chunks carry this tick's ids;
the complete carries all ids, the finish reason (``stop`` / ``length``) and the
counts. TokenSpeed includes the token that ended a ``"stop"`` finish (EOS, a
stop id, a grammar's end) in its output without naming it; it is reported as
``matched_token_id`` and left out of ``token_ids`` / ``output_ids`` (and its
logprob) unless ``no_stop_trim``. ``completion_tokens`` counts it, as the
engine does. A converted single-token stop string reports ``matched_stop_str``
and keeps its token, as a text match would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from .. import limits
from ..protocol.mailbox import OutputDelta
from ..wire import tokenspeed as ts
from ..wire import vllm as vllm_wire
from ._fields import LOGIT_BIAS_RANGE, logit_bias, sample_count, structured_constraint
from ._fields import reject as _reject
from .stops import StopPlan, StopStringMatcher, resolve_stop_strings
from .tokenspeed_multimodal import translate_mm_inputs

__all__ = [
    "FINISH_REASON_STRINGS",
    "LOGIT_BIAS_RANGE",
    "ResponseBuilder",
    "Translation",
    "TranslationConfig",
    "child_request_id",
    "pb",
    "translate_parallel",
    "translate_request",
]

#: Stream finish -> the proto's ``finish_reason`` string.
FINISH_REASON_STRINGS = {
    vllm_wire.FinishReason.STOP: "stop",
    vllm_wire.FinishReason.LENGTH: "length",
    vllm_wire.FinishReason.ABORT: "abort",
}


_UINT64 = 2**64


@attrs.frozen(kw_only=True)
class TranslationConfig:
    """What the translation needs to know about the engine and model.

    Attributes:
        max_model_len: the engine's context length (its ready response's
            ``max_model_len``).
        vocab_size: when known, token ids in ``stop_token_ids`` and
            ``logit_bias`` must be below it.
        engine_index: the connected engine's DP rank; a ``data_parallel_rank``
            naming another engine is refused.
        tokenizer: optional; needed for stop strings (anything with
            ``encode``/``decode``, e.g. a ``tokenizers.Tokenizer``).
        mm_dtype: the dtype the engine's encoder takes (its ready response's
            ``multimodal_encoder_dtype``, else its model ``dtype``); when set, a float32 ``encoder_input`` is cast to it
            and another floating dtype refused (:mod:`.tokenspeed_multimodal`).
        max_mm_bytes: limit on a request's multimodal tensor bytes.
        max_mm_items: limit on a request's multimodal items.
    """

    max_model_len: int
    vocab_size: int | None = None
    engine_index: int | None = None
    tokenizer: Any = None
    mm_dtype: str | None = None
    max_mm_bytes: int = limits.DEFAULT_MAX_MM_BYTES
    max_mm_items: int = limits.DEFAULT_MAX_MM_ITEMS


@attrs.frozen(kw_only=True)
class Translation:
    """A translated request and what its responses need.

    Attributes:
        request: the ``TokenizedGenerateReqInput`` to send.
        response_request_id: the proto request's id, stamped on every response.
        prompt_token_ids: the prompt.
        return_logprob: responses carry ``output_logprobs``.
        top_logprobs: responses carry a one-entry ``top_logprobs`` per position
            (``top_logprobs_num`` 1 on greedy sampling).
        stream: ``False``: only the complete is emitted.
        no_stop_trim: keep the stop token in the responses.
        index: the sample index (0 unless fanned out).
        stop_plan: the request's stop strings, when it has any.
    """

    request: ts.TokenizedGenerateReqInput
    response_request_id: str
    prompt_token_ids: tuple[int, ...]
    return_logprob: bool = False
    top_logprobs: bool = False
    stream: bool = True
    no_stop_trim: bool = False
    index: int = 0
    stop_plan: StopPlan | None = None
    tokenizer: Any = None

    def response_builder(self) -> ResponseBuilder:
        """A fresh :class:`ResponseBuilder` for this request's stream."""
        matcher = None
        if self.stop_plan is not None and self.stop_plan.stops:
            sp = self.request.sampling_params
            matcher = StopStringMatcher(
                self.tokenizer,
                self.stop_plan.stops,
                include_stop_str_in_output=self.no_stop_trim,
                min_tokens=sp.min_new_tokens,
                skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
                prompt_token_ids=self.prompt_token_ids,
                token_stops=self.stop_plan.token_stops,
            )
        return ResponseBuilder(
            self.response_request_id,
            len(self.prompt_token_ids),
            index=self.index,
            stream=self.stream,
            return_logprob=self.return_logprob,
            top_logprobs=self.top_logprobs,
            no_stop_trim=self.no_stop_trim,
            stop_matcher=matcher,
        )



def _finite(rid: str, sp: pb.SamplingParams, name: str, default: float) -> float:
    if not sp.HasField(name):
        return default
    v = float(getattr(sp, name))
    if not math.isfinite(v):
        raise _reject(rid, f"sampling_params.{name}", f"must be finite, got {v}")
    return v


def translate_request(req: pb.GenerateRequest, config: TranslationConfig) -> Translation:
    """Translate one ``tokenspeed.grpc.scheduler.GenerateRequest`` (``n`` <= 1).

    Returns:
        a :class:`Translation`. The request is then checked against the
        engine by :meth:`zmqdispatch.EngineClient.generate`
        (:func:`zmqdispatch.protocol.checks.check_tokenspeed_request`); the
        checks that need only the request run here.

    Raises:
        RequestRejected: a field that cannot be carried or is out of range,
            naming it (``.field``) and the limit; ``n > 1`` (use
            :func:`translate_parallel`).
    """
    rid = req.request_id
    if not rid:
        raise _reject("", "request_id", "must be a non-empty string")
    if not req.HasField("tokenized"):
        raise _reject(rid, "tokenized", "no input: set `tokenized.input_ids` (the ZMQ transport takes token ids)")
    prompt = tuple(req.tokenized.input_ids)
    if not prompt:
        raise _reject(rid, "tokenized.input_ids", "must not be empty")
    for name in ("kv_bootstrap_info", "encode_bootstrap_info"):
        if req.HasField(name):
            raise _reject(rid, name, "PD / EPD disaggregation is not supported over the ZMQ transport")
    if req.HasField("data_parallel_rank"):
        dp = req.data_parallel_rank
        if dp < 0:
            raise _reject(rid, "data_parallel_rank", f"must be >= 0, got {dp}")
        if config.engine_index is not None and dp != config.engine_index:
            raise _reject(rid, "data_parallel_rank",
                          f"{dp} names no connected engine (this client serves engine {config.engine_index})")
    if len(req.token_ids_logprob) > 0:
        raise _reject(rid, "token_ids_logprob", "logprobs of chosen token ids are not carried on the TokenSpeed wire")
    if req.HasField("logprob_start_len") and req.logprob_start_len not in (-1, len(prompt) - 1):
        raise _reject(rid, "logprob_start_len",
                      f"{req.logprob_start_len} asks for prompt logprobs, which the TokenSpeed wire does not carry "
                      f"(use -1)")

    if req.HasField("sampling_params"):
        sp = req.sampling_params
    else:  # TokenSpeed's own defaults (proto3's false would differ for the special-token flags)
        sp = pb.SamplingParams(skip_special_tokens=True, spaces_between_special_tokens=True)
    f = "sampling_params."
    if sp.n > 1:
        raise _reject(rid, f + "n", f"n={sp.n}: use translate_parallel() for n > 1 (one request per sample)")
    if len(sp.stop) > 0 and config.tokenizer is None:
        raise _reject(rid, f + "stop", "stop strings need a tokenizer (none configured); send stop_token_ids")
    if sp.HasField("custom_params") and len(sp.custom_params.fields) > 0:
        raise _reject(rid, f + "custom_params",
                      "has no effect: it feeds a custom logit processor, which this request cannot name")

    temperature = _finite(rid, sp, "temperature", 1.0)
    if temperature < 0:
        raise _reject(rid, f + "temperature", f"must be >= 0, got {temperature}")
    top_k = sp.top_k if sp.HasField("top_k") else -1
    if top_k == 0 or top_k < -1:
        raise _reject(rid, f + "top_k", f"must be -1 (disabled) or in [1, {ts.TOP_K_FUSED_MAX}), got {top_k}")
    if top_k >= ts.TOP_K_FUSED_MAX:
        raise _reject(rid, f + "top_k",
                      f"{top_k} is at or above TokenSpeed's fused top-k kernel limit of {ts.TOP_K_FUSED_MAX}; "
                      "use -1 to disable top-k")
    greedy = temperature < ts.SAMPLING_EPS or top_k == 1

    top_logprobs = False
    if req.top_logprobs_num > 1:
        raise _reject(rid, "top_logprobs_num",
                      f"{req.top_logprobs_num}: the TokenSpeed wire carries only the sampled token's logprob")
    if req.top_logprobs_num == 1:
        if not greedy:
            raise _reject(rid, "top_logprobs_num",
                          "1 needs greedy sampling (temperature 0 or top_k 1): the TokenSpeed wire carries only "
                          "the sampled token's logprob, which is the top-1 only when sampling is greedy")
        if not req.return_logprob:
            raise _reject(rid, "top_logprobs_num", "needs return_logprob")
        top_logprobs = True

    seed = None
    if sp.HasField("sampling_seed"):
        seed = int(sp.sampling_seed)
    max_new_tokens = int(sp.max_new_tokens) if sp.HasField("max_new_tokens") else None
    if max_new_tokens is not None and sp.min_new_tokens > max_new_tokens:
        raise _reject(rid, f + "min_new_tokens",
                      f"{sp.min_new_tokens} exceeds max_new_tokens={max_new_tokens}")

    bias = logit_bias(rid, sp, config.vocab_size)
    constraint = structured_constraint(rid, sp)
    mm = translate_mm_inputs(req, prompt, mm_dtype=config.mm_dtype, max_mm_bytes=config.max_mm_bytes,
                             max_mm_items=config.max_mm_items)
    stop_ids = list(dict.fromkeys(sp.stop_token_ids))
    stop_plan = None
    if len(sp.stop) > 0:
        stop_plan = resolve_stop_strings(
            config.tokenizer,
            list(sp.stop),
            stop_token_ids=stop_ids,
            min_tokens=sp.min_new_tokens,
            skip_special_tokens=sp.skip_special_tokens,
            constrained=bool(constraint),
            request_id=rid,
        )
        stop_ids = list(stop_plan.merged_stop_token_ids(stop_ids))

    params = ts.TokenSpeedSamplingParams(
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(stop_ids) or None,
        temperature=temperature,
        top_p=_finite(rid, sp, "top_p", 1.0),
        top_k=top_k,
        min_p=_finite(rid, sp, "min_p", 0.0),
        frequency_penalty=_finite(rid, sp, "frequency_penalty", 0.0),
        presence_penalty=_finite(rid, sp, "presence_penalty", 0.0),
        repetition_penalty=_finite(rid, sp, "repetition_penalty", 1.0),
        min_new_tokens=int(sp.min_new_tokens),
        ignore_eos=bool(sp.ignore_eos),
        skip_special_tokens=bool(sp.skip_special_tokens),
        spaces_between_special_tokens=bool(sp.spaces_between_special_tokens),
        no_stop_trim=bool(sp.no_stop_trim),
        logit_bias=bias,
        seed=seed,
        **constraint,
    )
    request = ts.TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt if mm is None else mm[1],
        sampling_params=params,
        return_logprob=bool(req.return_logprob),
        stream=bool(req.stream),
        input_ids_unpadded=None if mm is None else prompt,
        multimodal_inputs=None if mm is None else mm[0],
        data_parallel_rank=req.data_parallel_rank if req.HasField("data_parallel_rank") else None,
    )
    return Translation(
        request=request,
        response_request_id=rid,
        prompt_token_ids=prompt,
        return_logprob=bool(req.return_logprob),
        top_logprobs=top_logprobs,
        stream=bool(req.stream),
        no_stop_trim=bool(sp.no_stop_trim),
        stop_plan=stop_plan,
        tokenizer=config.tokenizer,
    )


def child_request_id(request_id: str, index: int) -> str:
    """Engine-side id of sample *index*: ``"<request_id>-<index>"`` (the reference
    gateway's convention for its ZMQ fan-out)."""
    return f"{request_id}-{index}"


def translate_parallel(req: pb.GenerateRequest, config: TranslationConfig) -> list[Translation]:
    """Translate a request with ``n`` samples into ``n`` single-sample requests.

    TokenSpeed's direct wire refuses ``n != 1`` (a terminal ``"abort"``), so the
    client fans out, as the reference gateway does
    (``docs/reference-gateway-lessons.md`` §1.1): ``n`` 0 (proto3 unset) and 1 give
    one request with the original id; for ``n > 1`` child ``i`` gets id
    :func:`child_request_id`, ``n = 1``, and with a ``sampling_seed`` ``s`` the
    seed ``(s + i) mod 2**64`` (the seed is a uint64). An unset seed stays unset:
    the engine seeds each child with ``crc32`` of its distinct id. Greedy
    ``n > 1`` is allowed (TokenSpeed's own fan-out allows it; the samples are
    then identical). Every child's responses carry the parent's ``request_id``
    and ``index = i``.

    Raises:
        RequestRejected: anything :func:`translate_request` refuses; ``n`` above
            :data:`zmqdispatch.limits.MAX_PARALLEL_SAMPLES`.
    """
    n = sample_count(req)
    if n == 1:
        return [translate_request(req, config)]
    rid = req.request_id
    single = pb.GenerateRequest()
    single.CopyFrom(req)
    single.sampling_params.n = 1
    base = translate_request(single, config)
    seed = base.request.sampling_params.seed
    children = []
    for i in range(n):
        child_sp = attrs.evolve(base.request.sampling_params, seed=None if seed is None else (seed + i) % _UINT64)
        child = attrs.evolve(base.request, rid=child_request_id(rid, i), sampling_params=child_sp)
        children.append(attrs.evolve(base, request=child, index=i))
    return children


# --------------------------------------------------------------------------- responses


class ResponseBuilder:
    """Map one TokenSpeed stream's deltas to ``GenerateResponse`` messages (sans-IO).

    A stream is ``chunk* complete``: chunks carry their new ``token_ids`` and
    that tick's ``output_logprobs``; the complete carries every id, the
    cumulative logprobs, the finish reason and the matched stop. When the
    final delta has tokens they go out as a chunk first. ``stream=False``
    emits only the complete (TokenSpeed still sends intermediate frames for
    a non-streaming request; they are accumulated).

    Args:
        request_id: stamped on every response (the proto request's id).
        prompt_len: prompt tokens (``prompt_tokens`` until the engine reports it).
        index: the sample index.
        stream: see above.
        return_logprob: emit ``output_logprobs``.
        top_logprobs: also a one-entry ``TopLogProbs`` per position (greedy top-1).
        no_stop_trim: keep the token that ended a ``"stop"`` finish.
        stop_matcher: client-side stop strings (:class:`~.stops.StopStringMatcher`).
    """

    __slots__ = (
        "_rid", "_prompt_tokens", "_cached", "_index", "_stream", "_lp", "_top", "_keep_stop", "_matcher",
        "_output_ids", "_counted", "_values", "_ids", "done", "stopped_early",
    )

    def __init__(
        self,
        request_id: str,
        prompt_len: int,
        *,
        index: int = 0,
        stream: bool = True,
        return_logprob: bool = False,
        top_logprobs: bool = False,
        no_stop_trim: bool = False,
        stop_matcher: StopStringMatcher | None = None,
    ) -> None:
        self._rid = request_id
        self._prompt_tokens = prompt_len
        self._cached = 0
        self._index = index
        self._stream = stream
        self._lp = return_logprob
        self._top = top_logprobs
        self._keep_stop = no_stop_trim
        self._matcher = stop_matcher
        self._output_ids: list[int] = []
        self._counted = 0
        self._values: list[float] = []
        self._ids: list[int] = []
        self.done = False
        #: True when a client-side stop string ended the stream before the engine
        #: finished: the caller must abort the engine request (leaving the stream's
        #: ``async with`` does; ``SampleStream.abort_sample`` for a sample).
        self.stopped_early = False

    def _logprobs(self, values: Sequence[float], ids: Sequence[int]) -> pb.OutputLogProbs:
        tops = [pb.TopLogProbs(values=[v], token_ids=[t]) for v, t in zip(values, ids)] if self._top else []
        return pb.OutputLogProbs(token_logprobs=values, token_ids=ids, top_logprobs=tops)

    def feed(self, delta: OutputDelta) -> list[pb.GenerateResponse]:
        """Responses for one delta: ``[]``, ``[chunk]``, ``[complete]`` or ``[chunk, complete]``."""
        if self.done:
            return []
        if delta.num_prompt_tokens is not None:
            self._prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens is not None:
            self._cached = delta.num_cached_tokens
        tokens = delta.token_ids
        finish = delta.finish_reason
        engine_stop = finish is vllm_wire.FinishReason.STOP and bool(tokens)
        # TokenSpeed's "stop" ends on the stopping token (EOS, stop id, grammar end).
        stop_token = tokens[-1] if engine_stop else None
        matched_str: str | None = None
        kept = list(tokens)
        counted = len(tokens)
        if self._matcher is not None:
            fed = self._matcher.feed(tokens, stop_terminated=engine_stop, stop_reason=stop_token)
            if fed.matched is not None:
                matched_str = fed.matched
                self.stopped_early = finish is None
                finish = vllm_wire.FinishReason.STOP
                kept = fed.token_ids
                counted = len(kept)
                stop_token = None
        if stop_token is not None and not self._keep_stop:
            kept.pop()
        vals: list[float] = []
        ids: list[int] = []
        if self._lp and delta.logprobs is not None:
            n = len(kept)
            vals = [row[0] for row in delta.logprobs.logprobs[:n]]
            ids = [row[0] for row in delta.logprobs.token_ids[:n]]
            self._values += vals
            self._ids += ids
        self._output_ids += kept
        self._counted += counted
        out: list[pb.GenerateResponse] = []
        if kept and self._stream:
            chunk = pb.GenerateStreamChunk(
                token_ids=kept,
                prompt_tokens=self._prompt_tokens,
                completion_tokens=self._counted,
                cached_tokens=self._cached,
                index=self._index,
            )
            if self._lp and vals:
                chunk.output_logprobs.CopyFrom(self._logprobs(vals, ids))
            out.append(pb.GenerateResponse(request_id=self._rid, chunk=chunk))
        if finish is not None:
            complete = pb.GenerateComplete(
                output_ids=self._output_ids,
                finish_reason=FINISH_REASON_STRINGS.get(finish, "stop"),
                prompt_tokens=self._prompt_tokens,
                completion_tokens=self._counted,
                cached_tokens=self._cached,
                index=self._index,
            )
            if self._lp:
                complete.output_logprobs.CopyFrom(self._logprobs(self._values, self._ids))
            if matched_str is not None:
                complete.matched_stop_str = matched_str
            elif stop_token is not None:
                complete.matched_token_id = stop_token
            out.append(pb.GenerateResponse(request_id=self._rid, complete=complete))
            self.done = True
        return out
