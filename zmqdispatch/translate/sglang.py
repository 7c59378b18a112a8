"""Gateway proto <-> SGLang scheduler wire, sans-IO.

:func:`translate_request` turns a ``sglang.grpc.scheduler.GenerateRequest``
(``sglang_scheduler.proto`` of ``smg-grpc-proto``) into an SGLang 0.5.21
``TokenizedGenerateReqInput`` (:mod:`zmqdispatch.wire.sglang`);
:func:`translate_parallel` fans ``n > 1`` out; :class:`ResponseBuilder` turns a
stream's :class:`~zmqdispatch.protocol.mailbox.OutputDelta` objects into that
package's ``GenerateResponse`` chunks and one complete.

**Nothing is dropped silently.** Every field is mapped, has no effect on a token-id
stream (said below), or is refused with :class:`~zmqdispatch.errors.RequestRejected`
naming it (``.field``) and the limit:

=================================  ===============================================================
proto field                        rule
=================================  ===============================================================
``request_id``                     ``rid`` (non-empty); children of ``n > 1`` are ``<id>-<i>``
``tokenized.input_ids``            ``input_ids`` (required, non-empty); ``original_text`` no effect
``sampling_params`` absent         SGLang's defaults (temperature 1.0, special-token flags true)
``temperature``                    sent; 0 is greedy (SGLang's ``__post_init__``)
``temperature``, ``top_p``,        sent; proto3 cannot tell unset from 0, so ``top_p`` 0 means 1.0
``top_k``, ``min_p``,              and ``top_k`` 0 means -1 (disabled), as the scheduler would refuse
``frequency_penalty``,             both; ``repetition_penalty`` 0 means 1.0; ranges as SGLang's
``presence_penalty``,              ``SamplingParams.verify`` (temperature >= 0 and finite, top_p in
``repetition_penalty``             (0, 1], min_p in [0, 1], penalties in [-2, 2], repetition in (0, 2])
``max_new_tokens``                 sent when set, else SGLang's default (128); set, prompt +
                                   ``max_new_tokens`` must be below ``max_model_len``
                                   (``ContextLengthError``, as SGLang's front end refuses)
``min_new_tokens``                 sent; must not exceed ``max_new_tokens``
``stop``                           sent: the scheduler matches stop strings itself (it keeps its
                                   tokenizer) and names the matched one; at most 32
``stop_token_ids``                 sent (deduplicated)
``skip_special_tokens``, ...       ``spaces_between_special_tokens``, ``ignore_eos``,
                                   ``no_stop_trim``: sent
``regex`` / ``json_schema`` /      ``regex`` / ``json_schema`` (valid JSON) / ``ebnf`` /
``ebnf_grammar`` / ``structural``  ``structural_tag``
``n``                              0/1 one request; > 1 (at most ``MAX_PARALLEL_SAMPLES``):
                                   :func:`translate_parallel` (the scheduler refuses ``n != 1``)
``stream_interval``                sent when set (>= 1)
``logit_bias``                     sent: keys vocabulary ids, biases in [-100, 100]
``custom_params``                  refused when non-empty (it feeds a custom logit processor)
``return_logprob``,                sent: sampled-token logprobs, ``top_logprobs_num`` ranked
``top_logprobs_num``               candidates per token (at most ``MAX_TOP_LOGPROBS``)
``logprob_start_len``              must be -1 with ``return_logprob`` (proto3's 0 asks for prompt
                                   logprobs, which are refused); any value without it
``token_ids_logprob``              refused when non-empty
``return_hidden_states``           refused
``mm_inputs``, ``input_embeds``    refused (this client sends token ids only)
``disaggregated_params``           refused (PD disaggregation needs a rendezvous this transport
                                   does not carry)
``custom_logit_processor``,        refused (the client cannot check what the scheduler runs;
``lora_id``                        a LoRA id the scheduler does not know would abort)
``data_parallel_rank``             the client's placement pin (``data_parallel_rank`` of the
                                   request: the scheduler rank, an engine of the client); not
                                   sent; with ``engine_index`` configured it must name it
``timestamp``, ``log_metrics``     no effect
``require_reasoning``              sent (the scheduler then counts ``reasoning_tokens``)
``stream``                         ``stream`` (cadence only); ``False`` emits only the complete
=================================  ===============================================================

Responses: chunks carry this tick's ``token_ids``, the cumulative counts and that
tick's ``output_logprobs`` (sampled token and its ranked candidates); the complete
carries every id, the finish reason (``stop`` / ``length``), the counts, the
cumulative logprobs and the matched stop (token id or string) the scheduler named.
A scheduler ``"abort"`` never becomes a complete: the stream raises
:class:`~zmqdispatch.errors.EngineAbortedRequest` (or ``RequestRejected`` for a
refusal with status 400).
"""

from __future__ import annotations

import math

import attrs
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from ..errors import ContextLengthError
from ..protocol.mailbox import OutputDelta
from ..wire import sglang as sg
from ..wire import vllm as vllm_wire
from ._fields import logit_bias, sample_count, structured_constraint
from ._fields import reject as _reject

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "ResponseBuilder",
    "Translation",
    "TranslationConfig",
    "child_request_id",
    "pb",
    "translate_parallel",
    "translate_request",
]

#: SGLang's ``MAX_STOP_COUNT``: more stop strings are refused by ``normalize()``.
MAX_STOP_STRINGS = 32
#: ``top_logprobs_num`` above this is refused (the per-token rows would dominate a message).
MAX_TOP_LOGPROBS = 20
_FINISH = {vllm_wire.FinishReason.STOP: "stop", vllm_wire.FinishReason.LENGTH: "length",
           vllm_wire.FinishReason.ABORT: "abort"}


@attrs.frozen(kw_only=True)
class TranslationConfig:
    """What the translation needs to know about the scheduler.

    Attributes:
        max_model_len: the scheduler's context length (ready response).
        vocab_size: when known, ``stop_token_ids`` and ``logit_bias`` keys must be below it.
        engine_index: the connected scheduler rank; a ``data_parallel_rank`` naming
            another one is refused.
    """

    max_model_len: int
    vocab_size: int | None = None
    engine_index: int | None = None


@attrs.frozen(kw_only=True)
class Translation:
    """A translated request and what its responses need."""

    request: sg.TokenizedGenerateReqInput
    response_request_id: str
    prompt_token_ids: tuple[int, ...]
    return_logprob: bool = False
    stream: bool = True
    index: int = 0

    def response_builder(self) -> ResponseBuilder:
        """A fresh :class:`ResponseBuilder` for this request's stream."""
        return ResponseBuilder(self.response_request_id, len(self.prompt_token_ids), index=self.index,
                               stream=self.stream, return_logprob=self.return_logprob)



def _value(rid: str, sp: pb.SamplingParams, name: str, unset: float, lo: float, hi: float, *,
           lo_open: bool = False) -> float:
    v = float(getattr(sp, name))
    if v == 0.0 and unset != 0.0:
        return unset
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _reject(rid, f"sampling_params.{name}", f"must be in {rng}, got {v}")
    return v


def _sampling(rid: str, sp: pb.SamplingParams, config: TranslationConfig) -> sg.SGLangSamplingParams:
    f = "sampling_params."
    if sp.n > 1:
        raise _reject(rid, f + "n", f"n={sp.n}: use translate_parallel() for n > 1 (one request per sample)")
    if sp.HasField("custom_params") and len(sp.custom_params.fields) > 0:
        raise _reject(rid, f + "custom_params", "is not carried: it feeds a custom logit processor")
    temperature = float(sp.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise _reject(rid, f + "temperature", f"must be a finite number >= 0, got {temperature}")
    top_k = int(sp.top_k) or -1
    if top_k < -1:
        raise _reject(rid, f + "top_k", f"must be -1 (disabled) or >= 1, got {top_k}")
    max_new = int(sp.max_new_tokens) if sp.HasField("max_new_tokens") else None
    if max_new is not None and sp.min_new_tokens > max_new:
        raise _reject(rid, f + "min_new_tokens", f"{sp.min_new_tokens} exceeds max_new_tokens={max_new}")
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise _reject(rid, f + "stop", f"{len(sp.stop)} stop strings exceed SGLang's limit of {MAX_STOP_STRINGS}")
    if any(not s for s in sp.stop):
        raise _reject(rid, f + "stop", "stop strings must not be empty")
    stop_ids = tuple(dict.fromkeys(sp.stop_token_ids))
    if config.vocab_size is not None and any(t >= config.vocab_size for t in stop_ids):
        raise _reject(rid, f + "stop_token_ids", f"token ids must be below vocab_size={config.vocab_size}")
    interval = None
    if sp.HasField("stream_interval"):
        interval = int(sp.stream_interval)
        if interval < 1:
            raise _reject(rid, f + "stream_interval", f"must be >= 1, got {interval}")
    return sg.SGLangSamplingParams(
        max_new_tokens=max_new if max_new is not None else 128,
        stop=tuple(sp.stop) or None,
        stop_token_ids=stop_ids or None,
        temperature=temperature,
        top_p=_value(rid, sp, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        min_p=_value(rid, sp, "min_p", 0.0, 0.0, 1.0),
        frequency_penalty=_value(rid, sp, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_value(rid, sp, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_value(rid, sp, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        min_new_tokens=int(sp.min_new_tokens),
        ignore_eos=bool(sp.ignore_eos),
        skip_special_tokens=bool(sp.skip_special_tokens),
        spaces_between_special_tokens=bool(sp.spaces_between_special_tokens),
        no_stop_trim=bool(sp.no_stop_trim),
        stream_interval=interval,
        logit_bias=logit_bias(rid, sp, config.vocab_size),
        **structured_constraint(rid, sp),
    )


def translate_request(req: pb.GenerateRequest, config: TranslationConfig) -> Translation:
    """Translate one ``sglang.grpc.scheduler.GenerateRequest`` (``n`` <= 1).

    Raises:
        RequestRejected: a field that cannot be carried or is out of range, naming it
            (``.field``) and the limit; ``n > 1`` (use :func:`translate_parallel`).
    """
    rid = req.request_id
    if not rid:
        raise _reject("", "request_id", "must be a non-empty string")
    if not req.HasField("tokenized"):
        raise _reject(rid, "tokenized", "no input: set `tokenized.input_ids` (the ZMQ transport takes token ids)")
    prompt = tuple(req.tokenized.input_ids)
    if not prompt:
        raise _reject(rid, "tokenized.input_ids", "must not be empty")
    if len(prompt) >= config.max_model_len:
        raise ContextLengthError(
            f"tokenized.input_ids: {len(prompt)} prompt tokens leave no room under max_model_len="
            f"{config.max_model_len}", request_id=rid, prompt_len=len(prompt), max_tokens=None,
            max_model_len=config.max_model_len, field="tokenized.input_ids")
    for name, why in (("mm_inputs", "multimodal input is not supported over the SGLang ZMQ transport"),
                      ("disaggregated_params", "PD disaggregation is not supported over the ZMQ transport")):
        if req.HasField(name):
            raise _reject(rid, name, why)
    for name, present, why in (
        ("input_embeds", len(req.input_embeds) > 0, "input embeddings are not carried (send token ids)"),
        ("token_ids_logprob", len(req.token_ids_logprob) > 0, "logprobs of chosen token ids are not carried"),
        ("return_hidden_states", req.return_hidden_states, "hidden states are not carried"),
        ("custom_logit_processor", bool(req.custom_logit_processor), "custom logit processors are not carried"),
        ("lora_id", bool(req.lora_id), "LoRA adapters are not carried over the SGLang ZMQ transport"),
    ):
        if present:
            raise _reject(rid, name, why)
    if req.HasField("data_parallel_rank"):
        dp = req.data_parallel_rank
        if dp < 0:
            raise _reject(rid, "data_parallel_rank", f"must be >= 0, got {dp}")
        if config.engine_index is not None and dp != config.engine_index:
            raise _reject(rid, "data_parallel_rank",
                          f"{dp} names no connected scheduler (this client serves rank {config.engine_index})")
    if req.return_logprob and req.logprob_start_len != -1:
        raise _reject(rid, "logprob_start_len",
                      f"{req.logprob_start_len} asks for prompt logprobs, which this client does not carry (use -1)")
    if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise _reject(rid, "top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs_num}")
    if req.top_logprobs_num and not req.return_logprob:
        raise _reject(rid, "top_logprobs_num", "needs return_logprob")
    if req.HasField("sampling_params"):
        sp = req.sampling_params
    else:  # SGLang's defaults (proto3's false would differ for the special-token flags)
        sp = pb.SamplingParams(temperature=1.0, skip_special_tokens=True, spaces_between_special_tokens=True)
    params = _sampling(rid, sp, config)
    asked = params.max_new_tokens if sp.HasField("max_new_tokens") else None
    if asked is not None and len(prompt) + asked >= config.max_model_len:
        # what SGLang's own front end refuses (its scheduler would clamp instead)
        raise ContextLengthError(
            f"sampling_params.max_new_tokens: prompt of {len(prompt)} tokens + max_new_tokens="
            f"{asked} does not fit max_model_len={config.max_model_len} (their sum must be below it)",
            request_id=rid, prompt_len=len(prompt), max_tokens=asked,
            max_model_len=config.max_model_len, field="sampling_params.max_new_tokens")
    request = sg.TokenizedGenerateReqInput(
        rid=rid,
        input_ids=prompt,
        sampling_params=params,
        return_logprob=bool(req.return_logprob),
        logprob_start_len=-1,
        top_logprobs_num=int(req.top_logprobs_num),
        stream=bool(req.stream),
        require_reasoning=bool(req.require_reasoning),
        data_parallel_rank=req.data_parallel_rank if req.HasField("data_parallel_rank") else None,
    )
    return Translation(request=request, response_request_id=rid, prompt_token_ids=prompt,
                       return_logprob=bool(req.return_logprob), stream=bool(req.stream))


def child_request_id(request_id: str, index: int) -> str:
    """Engine-side id of sample *index*: ``"<request_id>-<index>"``."""
    return f"{request_id}-{index}"


def translate_parallel(req: pb.GenerateRequest, config: TranslationConfig) -> list[Translation]:
    """Translate a request with ``n`` samples into ``n`` single-sample requests.

    The scheduler refuses ``n != 1``, so the client fans out: ``n`` 0 / 1 give one
    request under the original id; for ``n > 1`` child ``i`` is
    :func:`child_request_id` with ``n = 1`` (the proto carries no seed: the samples
    are independent). Every child's responses carry the parent's ``request_id`` and
    ``index = i``. The scheduler aborts by rid prefix; the link keeps its live rids
    prefix-free (child ``10`` travels under a fresh rid while child ``1`` runs), so
    an abort of one sample stops that sample only.

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
    return [attrs.evolve(base, request=attrs.evolve(base.request, rid=child_request_id(rid, i)), index=i)
            for i in range(n)]


# --------------------------------------------------------------------------- responses


class ResponseBuilder:
    """Map one SGLang stream's deltas to ``GenerateResponse`` messages (sans-IO).

    A stream is ``chunk* complete``. A delta with tokens becomes a chunk (unless
    ``stream=False``, which emits only the complete); the final delta's tokens go out
    as a chunk before the complete. Logprobs (when asked): each chunk carries its
    tokens' sampled logprobs and ranked candidates (the delta's rows: column 0 the
    sampled token, then the candidates), the complete all of them.
    """

    __slots__ = ("_rid", "_prompt", "_cached", "_index", "_stream", "_lp", "_ids", "_values", "_tok", "_top",
                 "done", "stopped_early")

    def __init__(self, request_id: str, prompt_len: int, *, index: int = 0, stream: bool = True,
                 return_logprob: bool = False) -> None:
        self._rid = request_id
        self._prompt = prompt_len
        self._cached = 0
        self._index = index
        self._stream = stream
        self._lp = return_logprob
        self._ids: list[int] = []
        self._values: list[float] = []
        self._tok: list[int] = []
        self._top: list[pb.TopLogProbs] = []
        self.done = False
        #: always False: the scheduler matches stop strings itself (the other
        #: builders set it when the client matched one and the engine must be stopped)
        self.stopped_early = False

    def _logprobs(self, delta: OutputDelta) -> pb.OutputLogProbs | None:
        if not self._lp or delta.logprobs is None:
            return None
        rows_v, rows_i = delta.logprobs.logprobs, delta.logprobs.token_ids
        out = pb.OutputLogProbs(token_logprobs=[r[0] for r in rows_v], token_ids=[r[0] for r in rows_i],
                                top_logprobs=[pb.TopLogProbs(values=v[1:], token_ids=t[1:])
                                              for v, t in zip(rows_v, rows_i)] if any(len(r) > 1 for r in rows_v)
                                else [])
        self._values += out.token_logprobs
        self._tok += out.token_ids
        self._top += out.top_logprobs
        return out

    def feed(self, delta: OutputDelta) -> list[pb.GenerateResponse]:
        """The responses for one delta (zero, one or two). Raises RuntimeError after the complete."""
        if self.done:
            raise RuntimeError("the stream already completed")
        if delta.num_prompt_tokens is not None:
            self._prompt = delta.num_prompt_tokens
        if delta.num_cached_tokens is not None:
            self._cached = delta.num_cached_tokens
        self._ids += delta.token_ids
        lp = self._logprobs(delta)
        out: list[pb.GenerateResponse] = []
        if delta.token_ids and self._stream:
            chunk = pb.GenerateStreamChunk(token_ids=delta.token_ids, prompt_tokens=self._prompt,
                                           completion_tokens=len(self._ids), cached_tokens=self._cached,
                                           index=self._index)
            if lp is not None:
                chunk.output_logprobs.CopyFrom(lp)
            out.append(pb.GenerateResponse(request_id=self._rid, chunk=chunk))
        if delta.finish_reason is not None:
            self.done = True
            complete = pb.GenerateComplete(output_ids=self._ids, finish_reason=_FINISH[delta.finish_reason],
                                           prompt_tokens=self._prompt, completion_tokens=len(self._ids),
                                           cached_tokens=self._cached, index=self._index)
            if self._lp:
                complete.output_logprobs.CopyFrom(pb.OutputLogProbs(
                    token_logprobs=self._values, token_ids=self._tok, top_logprobs=self._top))
            stop = delta.stop_reason
            if type(stop) is int:
                complete.matched_token_id = stop
            elif type(stop) is str:
                complete.matched_stop_str = stop
            out.append(pb.GenerateResponse(request_id=self._rid, complete=complete))
        return out
