"""Gateway proto <-> vLLM wire, sans-IO.

:func:`to_engine_core_request` turns a ``vllm.grpc.engine.GenerateRequest``
(``vllm_engine.proto`` of ``smg-grpc-proto``) into a vLLM 0.32
``EngineCoreRequest``; :class:`ResponseBuilder` turns a stream's
:class:`~zmqdispatch.protocol.mailbox.OutputDelta` objects into
``GenerateResponse`` chunks and one final complete.

**Nothing is dropped silently.** Every field is either mapped, or has no effect
on a token-id stream (documented below), or is rejected with a
:class:`~zmqdispatch.errors.RequestRejected` naming it. Fields mapped here:
``request_id``, ``tokenized.input_ids``, ``data_parallel_rank``, and in
``sampling_params``: ``temperature``, ``top_p``, ``top_k``, ``max_tokens``,
``seed``, ``stop_token_ids``, ``ignore_eos``, ``n`` (only 1).

Fields accepted without effect: ``tokenized.original_text`` (for reference
only), ``stream`` (``False`` makes :class:`ResponseBuilder` emit only the
complete), ``skip_special_tokens`` and ``spaces_between_special_tokens``
(detokenisation options; this transport returns token ids).

proto3 zero values (the field cannot tell "unset" from 0):

- ``top_p`` 0.0 means unset and becomes vLLM's 1.0 (0.0 is invalid for vLLM and
  silently kills the engine's input thread);
- ``repetition_penalty`` 0.0 means unset (1.0); any other value is rejected
  until the translation of penalties lands;
- ``top_k`` 0 means "disabled", as in vLLM;
- ``n`` 0 means 1.

``max_tokens`` unset becomes ``max_model_len - prompt_len``; an explicit 0 is
rejected (the engine's input thread dies on it). EOS: with ``eos_token_id``
known (a client option; the engine has no tokenizer), it rides
``_eos_token_id`` and ``_all_stop_token_ids`` exactly as vLLM's front end sets
them, and ``ignore_eos`` leaves ``_eos_token_id`` unset.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from ..errors import RequestRejected
from ..protocol.mailbox import OutputDelta
from ..wire import vllm as wire

__all__ = ["to_engine_core_request", "ResponseBuilder", "FINISH_REASON_STRINGS", "pb"]

#: Engine ``FinishReason`` -> the proto's ``finish_reason`` string (reference
#: gateway section 2.11). ERROR never gets here: it is raised as an error.
FINISH_REASON_STRINGS = {
    wire.FinishReason.STOP: "stop",
    wire.FinishReason.LENGTH: "length",
    wire.FinishReason.ABORT: "abort",
    wire.FinishReason.REPETITION: "stop",
}

# SamplingParams fields that the next translation step maps; until then a set
# value is refused rather than dropped. Value: how to tell "set".
_NOT_YET_MAPPED_SCALARS = (
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
    "include_stop_str_in_output",
    "grammar_from_first_token",
)
_NOT_YET_MAPPED_OPTIONAL = ("logprobs", "prompt_logprobs", "truncate_prompt_tokens")


def _reject(rid: str, field: str, why: str) -> RequestRejected:
    return RequestRejected(f"{field}: {why}", request_id=rid, field=field)


def to_engine_core_request(
    req: pb.GenerateRequest,
    *,
    max_model_len: int,
    eos_token_id: int | None = None,
    engine_index: int | None = None,
    arrival_time: float | None = None,
) -> wire.EngineCoreRequest:
    """Translate one gateway ``GenerateRequest`` into a vLLM ``EngineCoreRequest``.

    Args:
        req: ``vllm.grpc.engine.GenerateRequest`` (smg-grpc-proto).
        max_model_len: the engine's context length; unset ``max_tokens``
            defaults to ``max_model_len - len(prompt)``.
        eos_token_id: the model's EOS id, when known.
        engine_index: the connected engine's DP rank; a
            ``data_parallel_rank`` naming another engine is rejected.
        arrival_time: wall-clock seconds (default ``time.time()``).

    Returns:
        an ``EngineCoreRequest`` (not yet validated against the engine:
        :func:`zmqdispatch.protocol.checks.check_request` does that).

    Raises:
        RequestRejected: a field that cannot be carried, naming it.
    """
    rid = req.request_id
    if not rid:
        raise _reject("", "request_id", "must be a non-empty string")
    which = req.WhichOneof("input")
    if which == "text":
        raise _reject(rid, "text", "the ZMQ transport takes token ids: send `tokenized.input_ids`, not text")
    if which is None:
        raise _reject(rid, "tokenized", "no input: set `tokenized.input_ids`")
    prompt = list(req.tokenized.input_ids)
    if not prompt:
        raise _reject(rid, "tokenized.input_ids", "must not be empty")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        raise _reject(rid, "kv_transfer_params", "PD disaggregation is not supported over the ZMQ transport")
    if req.HasField("mm_inputs") or len(req.extra_mm_inputs) > 0:
        raise _reject(rid, "mm_inputs", "multimodal input is not supported yet")
    if req.HasField("media_refs"):
        raise _reject(rid, "media_refs", "multimodal input is not supported yet")
    dp_rank = None
    if req.HasField("data_parallel_rank"):
        dp_rank = req.data_parallel_rank
        if dp_rank < 0:
            raise _reject(rid, "data_parallel_rank", f"must be >= 0, got {dp_rank}")
        if engine_index is not None and dp_rank != engine_index:
            raise _reject(
                rid, "data_parallel_rank", f"{dp_rank} names no connected engine (this client serves engine {engine_index})"
            )

    sp = req.sampling_params if req.HasField("sampling_params") else pb.SamplingParams()
    f = "sampling_params."
    for name in _NOT_YET_MAPPED_SCALARS:
        if getattr(sp, name):
            raise _reject(rid, f + name, "is not supported by this transport yet")
    for name in _NOT_YET_MAPPED_OPTIONAL:
        if sp.HasField(name):
            raise _reject(rid, f + name, "is not supported by this transport yet")
    if sp.repetition_penalty not in (0.0, 1.0):
        raise _reject(rid, f + "repetition_penalty", "is not supported by this transport yet")
    if len(sp.stop) > 0:
        raise _reject(rid, f + "stop", "stop strings need a tokenizer; send stop_token_ids instead")
    if len(sp.logit_bias) > 0:
        raise _reject(rid, f + "logit_bias", "is not supported by this transport yet")
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        raise _reject(rid, f + constraint, "structured outputs are not supported by this transport yet")
    if sp.n > 1:
        raise _reject(rid, f + "n", f"n={sp.n}: parallel sampling (n > 1) is not supported yet")

    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    top_p = sp.top_p if sp.top_p != 0.0 else 1.0
    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
        if max_tokens == 0:
            raise _reject(rid, f + "max_tokens", "must be >= 1 (0 kills the engine's input thread)")
    else:
        max_tokens = max_model_len - len(prompt)
        if max_tokens < 1:
            # check_request states both numbers in a ContextLengthError.
            max_tokens = 1
    stop_token_ids = tuple(dict.fromkeys(sp.stop_token_ids))
    # vLLM's SamplingParams.__post_init__ builds _all_stop_token_ids as a set
    # of stop_token_ids, and its front end then adds the EOS id (even with
    # ignore_eos: the set serves min_tokens masking).
    all_stop: set[int] = set(stop_token_ids)
    if eos_token_id is not None:
        all_stop.add(eos_token_id)
    params = wire.SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(sp.top_k),
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=int(max_tokens),
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(sp.ignore_eos),
        eos_token_id=None if (eos_token_id is None or sp.ignore_eos) else eos_token_id,
        all_stop_token_ids=tuple(all_stop),
        detokenize=False,
        output_kind=1,  # DELTA
    )
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling_params=params,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        data_parallel_rank=dp_rank,
    )


class ResponseBuilder:
    """Map one stream's deltas to ``GenerateResponse`` messages (sans-IO).

    A stream is always ``chunk* complete``: each chunk carries only its new
    ``token_ids`` (delta) with running ``completion_tokens``; the complete
    carries the cumulative ``output_ids``, the ``finish_reason`` string and the
    matched stop. When the final delta has tokens, they go out as a chunk
    first, so streaming clients always see every token in chunks (reference
    gateway section 5.2).

    ``prompt_tokens`` is the engine's ``prefill_stats.num_prompt_tokens`` when
    sent, else the prompt length (the engine sends no stats in some modes);
    ``cached_tokens`` is ``prefill_stats.num_cached_tokens`` or 0.

    Args:
        prompt_len: number of prompt tokens.
        index: the completion index (0 unless fanned out).
        stream: ``False`` emits only the complete.
    """

    __slots__ = ("_prompt_tokens", "_cached", "_output_ids", "_index", "_stream", "done")

    def __init__(self, prompt_len: int, *, index: int = 0, stream: bool = True) -> None:
        self._prompt_tokens = prompt_len
        self._cached = 0
        self._output_ids: list[int] = []
        self._index = index
        self._stream = stream
        self.done = False

    def feed(self, delta: OutputDelta) -> list[pb.GenerateResponse]:
        """Responses for one delta: ``[]``, ``[chunk]``, ``[complete]`` or ``[chunk, complete]``."""
        if delta.num_prompt_tokens is not None:
            self._prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens is not None:
            self._cached = delta.num_cached_tokens
        out: list[pb.GenerateResponse] = []
        tokens = delta.token_ids
        self._output_ids += tokens
        if tokens and self._stream:
            out.append(
                pb.GenerateResponse(
                    chunk=pb.GenerateStreamChunk(
                        token_ids=tokens,
                        prompt_tokens=self._prompt_tokens,
                        completion_tokens=len(self._output_ids),
                        cached_tokens=self._cached,
                        index=self._index,
                    )
                )
            )
        if delta.finish_reason is not None:
            out.append(self._complete(delta))
            self.done = True
        return out

    def _complete(self, delta: OutputDelta) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=self._output_ids,
            finish_reason=FINISH_REASON_STRINGS[delta.finish_reason],
            prompt_tokens=self._prompt_tokens,
            completion_tokens=len(self._output_ids),
            cached_tokens=self._cached,
            index=self._index,
        )
        stop = delta.stop_reason
        if isinstance(stop, int) and not isinstance(stop, bool):
            complete.matched_token_id = stop
        elif isinstance(stop, str):
            complete.matched_stop_str = stop
        return pb.GenerateResponse(complete=complete)


def responses(deltas: Iterable[OutputDelta], prompt_len: int, *, stream: bool = True) -> list[pb.GenerateResponse]:
    """Convenience for tests: all responses for a finished sequence of deltas."""
    b = ResponseBuilder(prompt_len, stream=stream)
    out: list[pb.GenerateResponse] = []
    for d in deltas:
        out.extend(b.feed(d))
    return out
