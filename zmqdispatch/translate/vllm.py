"""Gateway proto <-> vLLM wire, sans-IO.

:func:`translate_request` turns a ``vllm.grpc.engine.GenerateRequest``
(``vllm_engine.proto`` of ``smg-grpc-proto``) into a vLLM 0.32
``EngineCoreRequest`` plus what the response side needs
(:class:`Translation`); :class:`ResponseBuilder` turns a stream's
:class:`~zmqdispatch.protocol.mailbox.OutputDelta` objects into
``GenerateResponse`` chunks and one final complete.

**Nothing is dropped silently.** Every field of ``GenerateRequest`` and
``SamplingParams`` is mapped, or has no effect on a token-id stream (said
below), or is rejected with :class:`~zmqdispatch.errors.RequestRejected` naming
it and the limit. The full table is in ``protos/README.md``.

proto3 zero values (a non-optional field cannot tell "unset" from 0), the rule:

- ``top_p`` 0.0 and ``repetition_penalty`` 0.0 mean unset and become vLLM's 1.0
  (both 0.0 are invalid for vLLM; ``top_p`` 0.0 silently kills the engine's
  input thread);
- ``top_k`` 0 means "disabled", as in vLLM; ``n`` 0 means 1;
- ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``min_tokens`` 0 are
  vLLM's own defaults;
- ``skip_special_tokens`` / ``spaces_between_special_tokens`` are taken as
  given (the engine ignores them; they only shape client-side stop-string
  detokenisation, and a gateway builder fills them explicitly; note that
  proto3's false differs from vLLM's default true).

Stop strings need ``TranslationConfig.tokenizer``; they are matched on the
client with vLLM's own detokenizer semantics (:mod:`.stops`), the output is
trimmed as vLLM trims it, and the engine request is aborted once a stop
matches (the caller leaves the stream when ``ResponseBuilder.done``).

EOS, as vLLM's front end sets it (``SamplingParams.update_from_generation_config``):
the primary EOS id rides ``_eos_token_id`` (unless ``ignore_eos``), so an EOS
finish reports no matched stop; further EOS ids of the generation config join
``stop_token_ids`` (unless ``ignore_eos``); every one of them joins
``_all_stop_token_ids`` (which serves ``min_tokens``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from .. import limits
from ..errors import RequestRejected
from ..protocol.checks import json_depth
from ..protocol.mailbox import OutputDelta
from ..wire import vllm as wire
from ..wire import vllm_multimodal as mm_wire
from .multimodal import translate_mm_inputs
from .stops import StopPlan, StopStringMatcher, resolve_stop_strings

__all__ = [
    "FINISH_REASON_STRINGS",
    "ResponseBuilder",
    "Translation",
    "TranslationConfig",
    "pb",
    "responses",
    "shape_top_logprobs",
    "child_request_id",
    "to_engine_core_request",
    "translate_parallel",
    "translate_request",
]

#: Engine ``FinishReason`` -> the proto's ``finish_reason`` string
#: (``docs/reference-gateway-lessons.md`` §1.3). ERROR never gets here: it is raised as an error.
FINISH_REASON_STRINGS = {
    wire.FinishReason.STOP: "stop",
    wire.FinishReason.LENGTH: "length",
    wire.FinishReason.ABORT: "abort",
    wire.FinishReason.REPETITION: "stop",
}

DEFAULT_MAX_LOGPROBS = limits.DEFAULT_MAX_LOGPROBS

#: Below this temperature vLLM samples greedily (``vllm/sampling_params.py`` ``_SAMPLING_EPS``).
_SAMPLING_EPS = 1e-5

#: ``logit_bias`` values outside this range are refused (the OpenAI API range;
#: the proto documents it too).
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _int_tuple(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(ids)


@attrs.frozen(kw_only=True)
class TranslationConfig:
    """What the translation needs to know about the engine and model.

    Attributes:
        max_model_len: the engine's context length (from its ready response).
        eos_token_ids: the model's EOS ids, primary first (the engine has no
            tokenizer: without them it never stops at EOS).
        vocab_size: when known, token ids in ``stop_token_ids`` and
            ``logit_bias`` must be below it.
        max_logprobs: the engine's ``max_logprobs``; larger requests are refused.
        structured_outputs_backend: vLLM's ``_backend`` for constraints:
            ``"auto"`` (vLLM's default: xgrammar, sent with
            ``_backend_was_auto`` true, as vLLM's front end fills it), or
            ``"xgrammar"``, ``"guidance"``, ``"outlines"``,
            ``"lm-format-enforcer"``. The engine needs it set: it fixes its
            backend from the first constrained request it sees.
        engine_index: the connected engine's DP rank; a ``data_parallel_rank``
            naming another engine is refused.
        tokenizer: optional; needed for stop strings (anything with
            ``encode``/``decode``, e.g. a ``tokenizers.Tokenizer``).
        mm_dtype: the engine's model dtype (ready response ``dtype``): float32
            multimodal tensors are cast to it, other floating dtypes must equal it
            (:mod:`.multimodal`); None: sent as the gateway gave them.
        max_mm_bytes: limit on a request's multimodal tensor bytes.
        max_mm_items: limit on a request's multimodal items.
    """

    max_model_len: int
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    vocab_size: int | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    structured_outputs_backend: str = "auto"
    engine_index: int | None = None
    tokenizer: Any = None
    mm_dtype: str | None = None
    max_mm_bytes: int = limits.DEFAULT_MAX_MM_BYTES
    max_mm_items: int = limits.DEFAULT_MAX_MM_ITEMS


@attrs.frozen(kw_only=True)
class Translation:
    """A translated request and what its responses need.

    Attributes:
        request: the ``EngineCoreRequest`` to send.
        prompt_token_ids: the prompt as sent (after ``truncate_prompt_tokens``).
        logprobs: requested top logprobs per output position (``None``: none).
        prompt_logprobs: requested top logprobs per prompt position.
        stream: ``False``: only the complete is emitted.
        index: the completion index (0 unless fanned out).
    """

    request: wire.EngineCoreRequest
    prompt_token_ids: tuple[int, ...]
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stream: bool = True
    index: int = 0
    stop_plan: StopPlan | None = None
    tokenizer: Any = None

    def response_builder(self) -> ResponseBuilder:
        """A fresh :class:`ResponseBuilder` for this request's stream (with a
        stop-string matcher when the request has stop strings)."""
        matcher = None
        if self.stop_plan is not None and self.stop_plan.stops:
            sp = self.request.sampling_params
            assert sp is not None  # translate_request always sets them
            matcher = StopStringMatcher(
                self.tokenizer,
                self.stop_plan.stops,
                include_stop_str_in_output=sp.include_stop_str_in_output,
                min_tokens=sp.min_tokens,
                skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
                prompt_token_ids=self.prompt_token_ids,
                token_stops=self.stop_plan.token_stops,
            )
        return ResponseBuilder(
            len(self.prompt_token_ids),
            index=self.index,
            stream=self.stream,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=self.prompt_token_ids,
            stop_matcher=matcher,
        )


def _reject(rid: str, field: str, why: str) -> RequestRejected:
    return RequestRejected(f"{field}: {why}", request_id=rid, field=field)


def _logprob_count(rid: str, sp: pb.SamplingParams, name: str, cap: int) -> int | None:
    if not sp.HasField(name):
        return None
    k: int = getattr(sp, name)
    field = f"sampling_params.{name}"
    if k == -1:
        raise _reject(rid, field, f"-1 ('whole vocabulary') is not served; ask for at most max_logprobs={cap}")
    if k < 0 or k > cap:
        raise _reject(rid, field, f"must be in [0, {cap}] (max_logprobs), got {k}")
    return k


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_as_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar vLLM's front end sends for a ``choice`` constraint on
    xgrammar: ``root ::= "a" | "b"``, with backslash, quote, LF, CR and TAB
    escaped, other C0 controls and DEL as ``\\uXXXX``
    (``vllm/v1/structured_output/utils.py`` ``choice_as_grammar``, 0.32.0)."""

    def escape(text: str) -> str:
        out = []
        for ch in text:
            if ch in _EBNF_ESCAPES:
                out.append(_EBNF_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return "".join(out)

    return "root ::= " + " | ".join(f'"{escape(c)}"' for c in choices)


_STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def _structured_outputs(rid: str, sp: pb.SamplingParams, backend: str) -> wire.StructuredOutputsParams | None:
    which = sp.WhichOneof("constraint")
    if which is None:
        return None
    if backend not in _STRUCTURED_BACKENDS:
        raise _reject(rid, f"sampling_params.{which}", f"unknown structured outputs backend {backend!r}")
    auto = backend == "auto"
    if auto:
        backend = "xgrammar"  # what vLLM's front end picks in auto mode
    field = f"sampling_params.{which}"
    kw: dict[str, Any] = {}
    if which == "json_schema":
        text = sp.json_schema
        if not text.strip():
            raise _reject(rid, field, "must not be empty")
        try:
            schema = json.loads(text)  # vLLM's OpenAI server passes the schema as an object
        except (ValueError, RecursionError):
            raise _reject(rid, field, "is not valid JSON (or nests too deeply to parse)") from None
        if json_depth(schema) > limits.MAX_JSON_NESTING:
            raise _reject(rid, field, f"nests deeper than {limits.MAX_JSON_NESTING} levels (vLLM's limit)")
        if not isinstance(schema, dict):
            # e.g. "null" would leave no constraint at all, which vLLM's own
            # checks reject in the engine's input thread (killing it).
            raise _reject(rid, field, f"must be a JSON object (a JSON Schema), got {type(schema).__name__}")
        kw["json"] = schema
    elif which == "regex":
        if not sp.regex:
            raise _reject(rid, field, "must not be empty")
        if "\x00" in sp.regex:
            raise _reject(rid, field, "must not contain a NUL character")  # as vLLM's front end
        kw["regex"] = sp.regex
    elif which == "grammar":
        if not sp.grammar.strip():
            raise _reject(rid, field, "must not be empty")
        kw["grammar"] = sp.grammar
    elif which == "structural_tag":
        if not sp.structural_tag.strip():
            raise _reject(rid, field, "must not be empty")
        kw["structural_tag"] = sp.structural_tag
    elif which == "json_object":
        if not sp.json_object:
            return None  # explicitly "no JSON object constraint": nothing to enforce
        kw["json_object"] = True
    elif which == "choice":
        choices = list(sp.choice.choices)
        if not choices:
            raise _reject(rid, field, "needs at least one choice")
        if backend == "xgrammar":
            # The engine's xgrammar backend cannot compile a bare choice: vLLM's
            # front end turns it into an EBNF grammar first (found on the real
            # engine: a raw choice finishes with ERROR).
            kw["grammar"] = choice_as_grammar(choices)
        else:
            kw["choice"] = tuple(choices)
    # structural_tag is only understood by xgrammar (guidance's parser cannot
    # compile the triggered-tags format; docs/reference-gateway-lessons.md §1.2).
    chosen = "xgrammar" if which == "structural_tag" else backend
    return wire.StructuredOutputsParams(backend=chosen, backend_was_auto=auto, **kw)


def translate_request(
    req: pb.GenerateRequest,
    config: TranslationConfig,
    *,
    arrival_time: float | None = None,
) -> Translation:
    """Translate one gateway ``GenerateRequest`` into a vLLM ``EngineCoreRequest``.

    Returns:
        a :class:`Translation` (the request is not yet checked against the
        engine: :func:`zmqdispatch.protocol.checks.check_request` does that,
        and :meth:`zmqdispatch.EngineClient.generate` calls it).

    Raises:
        RequestRejected: a field that cannot be carried or is out of range,
            naming it (``.field``) and the limit.
    """
    rid = req.request_id
    if not rid:
        raise _reject("", "request_id", "must be a non-empty string")
    which = req.WhichOneof("input")
    if which == "text":
        raise _reject(rid, "text", "the ZMQ transport takes token ids: send `tokenized.input_ids`, not text")
    if which is None:
        raise _reject(rid, "tokenized", "no input: set `tokenized.input_ids`")
    prompt = tuple(req.tokenized.input_ids)
    if not prompt:
        raise _reject(rid, "tokenized.input_ids", "must not be empty")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        raise _reject(rid, "kv_transfer_params", "PD disaggregation is not supported over the ZMQ transport")
    dp_rank = None
    if req.HasField("data_parallel_rank"):
        dp_rank = req.data_parallel_rank
        if dp_rank < 0:
            raise _reject(rid, "data_parallel_rank", f"must be >= 0, got {dp_rank}")
        if config.engine_index is not None and dp_rank != config.engine_index:
            raise _reject(
                rid,
                "data_parallel_rank",
                f"{dp_rank} names no connected engine (this client serves engine {config.engine_index})",
            )

    sp = req.sampling_params if req.HasField("sampling_params") else pb.SamplingParams()
    f = "sampling_params."

    if sp.n > 1:
        raise _reject(rid, f + "n", f"n={sp.n}: use translate_parallel() for n > 1 (one request per sample)")
    if len(sp.stop) > 0 and config.tokenizer is None:
        raise _reject(rid, f + "stop", "stop strings need a tokenizer (none configured); send stop_token_ids")

    # truncate_prompt_tokens: vLLM's front end keeps the last k prompt tokens;
    # -1 means max_model_len. The engine never truncates.
    if sp.HasField("truncate_prompt_tokens"):
        k = sp.truncate_prompt_tokens
        if k == -1:
            k = config.max_model_len
        if k < 1:
            raise _reject(rid, f + "truncate_prompt_tokens", f"must be >= 1 or -1 (max_model_len), got {k}")
        if k > config.max_model_len:
            raise _reject(
                rid, f + "truncate_prompt_tokens", f"{k} exceeds max_model_len={config.max_model_len}"
            )
        prompt = prompt[-k:]
    full_prompt = tuple(req.tokenized.input_ids)
    mm_features = translate_mm_inputs(req, full_prompt, mm_dtype=config.mm_dtype,
                                      max_mm_bytes=config.max_mm_bytes, max_mm_items=config.max_mm_items)
    if mm_features is not None and len(prompt) != len(full_prompt):
        raise _reject(rid, f + "truncate_prompt_tokens", "cannot cut a prompt with multimodal placeholders")

    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    if not math.isfinite(temperature):
        raise _reject(rid, f + "temperature", f"must be finite, got {temperature}")
    top_p = sp.top_p if sp.top_p != 0.0 else 1.0
    top_k = sp.top_k
    min_p = sp.min_p
    if temperature < _SAMPLING_EPS:
        # Greedy: vLLM's SamplingParams.__post_init__ resets these (0.32.0).
        top_p, top_k, min_p = 1.0, 0, 0.0
    # vLLM's SamplingParams.__post_init__ maps seed -1 to "no seed".
    seed = sp.seed if sp.HasField("seed") and sp.seed != -1 else None
    repetition_penalty = sp.repetition_penalty if sp.repetition_penalty != 0.0 else 1.0
    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
        if max_tokens == 0:
            raise _reject(rid, f + "max_tokens", "must be >= 1 (0 kills the engine's input thread)")
    else:
        # The context-length check then states both numbers when nothing fits.
        max_tokens = max(1, config.max_model_len - len(prompt))

    logprobs = _logprob_count(rid, sp, "logprobs", config.max_logprobs)
    prompt_logprobs = _logprob_count(rid, sp, "prompt_logprobs", config.max_logprobs)

    logit_bias = None
    if len(sp.logit_bias) > 0:
        logit_bias = {}
        for tok, bias in sorted(sp.logit_bias.items()):
            if tok < 0 or (config.vocab_size is not None and tok >= config.vocab_size):
                limit = f"[0, {config.vocab_size})" if config.vocab_size is not None else ">= 0"
                raise _reject(rid, f + "logit_bias", f"token id {tok} is not a vocabulary id ({limit})")
            if not (LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]):
                raise _reject(rid, f + "logit_bias", f"bias {bias} for token {tok} is outside [-100, 100]")
            logit_bias[tok] = float(bias)

    structured = _structured_outputs(rid, sp, config.structured_outputs_backend)
    if sp.grammar_from_first_token and structured is None:
        raise _reject(rid, f + "grammar_from_first_token", "is only meaningful with a constraint")

    # EOS and stop ids, as vLLM's front end builds them: SamplingParams.__post_init__
    # makes _all_stop_token_ids = set(stop_token_ids); update_from_generation_config
    # adds the primary EOS, then the other EOS ids, which also join stop_token_ids
    # (unless ignore_eos) as list(set(extras) | set(stop_token_ids)).
    user_stop = list(dict.fromkeys(sp.stop_token_ids))
    # Stop strings never go on the wire: the engine does not detokenise, and
    # vLLM's SamplingParams.__post_init__ (run when the engine decodes the
    # ADD) rejects stop strings with detokenize=False, which kills its input
    # thread. They are matched on the client (translate/stops.py); a string
    # that is exactly one token also becomes an engine stop id when that is
    # equivalent (StopPlan).
    stop_plan = None
    if len(sp.stop) > 0:
        stop_plan = resolve_stop_strings(
            config.tokenizer,
            list(sp.stop),
            stop_token_ids=user_stop,
            min_tokens=sp.min_tokens,
            skip_special_tokens=sp.skip_special_tokens,
            constrained=structured is not None,
            request_id=rid,
        )
        user_stop = list(stop_plan.merged_stop_token_ids(user_stop))
    primary = config.eos_token_ids[0] if config.eos_token_ids else None
    extras = [t for t in dict.fromkeys(config.eos_token_ids[1:]) if t != primary]
    all_stop: set[int] = set(user_stop)
    if primary is not None:
        all_stop.add(primary)
    stop_token_ids: Sequence[int] = user_stop
    if extras:
        all_stop.update(extras)
        if not sp.ignore_eos:
            merged = set(extras)
            merged.update(user_stop)
            stop_token_ids = list(merged)

    params = wire.SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        presence_penalty=float(sp.presence_penalty),
        frequency_penalty=float(sp.frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        seed=seed,
        max_tokens=int(max_tokens),
        min_tokens=int(sp.min_tokens),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=bool(sp.ignore_eos),
        eos_token_id=None if (primary is None or sp.ignore_eos) else primary,
        all_stop_token_ids=tuple(all_stop),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=bool(sp.include_stop_str_in_output),
        skip_special_tokens=bool(sp.skip_special_tokens),
        spaces_between_special_tokens=bool(sp.spaces_between_special_tokens),
        logit_bias=logit_bias,
        structured_outputs=structured,
        detokenize=False,
        output_kind=wire.RequestOutputKind.DELTA,
    )
    request = wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        mm_features=None if mm_features is None else mm_wire.features_to_wire(mm_features),
        sampling_params=params,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        data_parallel_rank=dp_rank,
        reasoning_ended=True if sp.grammar_from_first_token else None,
    )
    return Translation(
        request=request,
        prompt_token_ids=prompt,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stream=req.stream,
        stop_plan=stop_plan,
        tokenizer=config.tokenizer,
    )


def child_request_id(request_id: str, index: int) -> str:
    """Engine-side id of sample *index* of a fanned-out request: ``"<request_id>-<index>"``.

    The reference gateway's convention (``docs/reference-gateway-lessons.md`` §1.1;
    vLLM's own front end uses
    ``"<index>_<request_id>"``); a parent whose child ids collide with a live
    request is refused at submission.
    """
    return f"{request_id}-{index}"


def translate_parallel(
    req: pb.GenerateRequest,
    config: TranslationConfig,
    *,
    arrival_time: float | None = None,
) -> list[Translation]:
    """Translate a request with ``n`` samples into ``n`` single-sample requests.

    ``n`` 0 (proto3 unset) and 1 give one request with the original id.
    For ``n > 1``, child ``i`` has id :func:`child_request_id` and ``n = 1``;
    with a seed ``s`` it gets ``s + i``, as vLLM's ``ParentRequest`` does
    (``vllm/v1/engine/parallel_sampling.py``, 0.32): no wrap-around, vLLM seeds
    are plain ints and ``s + i`` stays within int64 for an int32 ``s``. An
    unset seed stays unset on every child; a child whose ``s + i`` is -1 is
    unseeded, as in vLLM (whose ``SamplingParams`` reads seed -1 as none).

    Raises:
        RequestRejected: anything :func:`translate_request` refuses; ``n`` above
            :data:`zmqdispatch.limits.MAX_PARALLEL_SAMPLES`; ``n > 1`` with
            greedy sampling (vLLM: "n must be 1 when using greedy sampling").
    """
    n = max(1, req.sampling_params.n) if req.HasField("sampling_params") else 1
    if n == 1:
        return [translate_request(req, config, arrival_time=arrival_time)]
    rid = req.request_id
    field = "sampling_params.n"
    if n > limits.MAX_PARALLEL_SAMPLES:
        raise _reject(rid, field, f"n={n} exceeds the limit of {limits.MAX_PARALLEL_SAMPLES} samples per request")
    sp = req.sampling_params
    if sp.HasField("temperature") and sp.temperature < _SAMPLING_EPS:
        raise _reject(rid, field, f"n={n}: n must be 1 when using greedy sampling (temperature 0), as in vLLM")
    single = pb.GenerateRequest()
    single.CopyFrom(req)
    single.sampling_params.n = 1
    base = translate_request(single, config, arrival_time=arrival_time)
    base_sp = base.request.sampling_params
    assert base_sp is not None  # translate_request always sets them
    seed = base_sp.seed
    children = []
    for i in range(n):
        child_sp = attrs.evolve(base_sp, seed=None if seed is None else seed + i)
        child = attrs.evolve(base.request, request_id=child_request_id(rid, i), sampling_params=child_sp)
        children.append(attrs.evolve(base, request=child, index=i))
    return children


def to_engine_core_request(
    req: pb.GenerateRequest,
    *,
    max_model_len: int,
    eos_token_id: int | None = None,
    engine_index: int | None = None,
    arrival_time: float | None = None,
) -> wire.EngineCoreRequest:
    """Shorthand for ``translate_request(...).request`` with the common options."""
    config = TranslationConfig(
        max_model_len=max_model_len,
        eos_token_ids=() if eos_token_id is None else (eos_token_id,),
        engine_index=engine_index,
    )
    return translate_request(req, config, arrival_time=arrival_time).request


# --------------------------------------------------------------------------- responses


def shape_top_logprobs(ids: Sequence[int], values: Sequence[float], k: int) -> tuple[list[int], list[float]]:
    """The first *k* distinct token ids of one logprobs row, with their values.

    A row is ``[sampled, rank-1, rank-2, ...]`` (K+1 columns). The engine
    repeats the sampled token among the ranked columns when it is in the top
    K; a naive "take k" lists it twice and loses the last real candidate
    (``docs/reference-gateway-lessons.md`` §1.5 and lesson 7). This reproduces vLLM's own
    dict-of-logprobs view.
    """
    out_ids: list[int] = []
    out_vals: list[float] = []
    for tok, val in zip(ids, values):
        if len(out_ids) >= k:
            break
        if tok in out_ids:
            continue
        out_ids.append(tok)
        out_vals.append(val)
    return out_ids, out_vals


class _LogprobAcc:
    """Cumulative sampled-token logprobs: flat lists extended per delta."""

    __slots__ = ("k", "values", "ids", "tops")

    def __init__(self, k: int) -> None:
        self.k = k
        self.values: list[float] = []
        self.ids: list[int] = []
        self.tops: list[pb.TopLogProbs] = []

    def add(self, lists: wire.LogprobsLists) -> pb.OutputLogProbs:
        """Append one delta's rows; return that delta's ``OutputLogProbs``."""
        vals = [row[0] for row in lists.logprobs]
        ids = [row[0] for row in lists.token_ids]
        tops: list[pb.TopLogProbs] = []
        if self.k > 0:
            for rid_row, val_row in zip(lists.token_ids, lists.logprobs):
                t_ids, t_vals = shape_top_logprobs(rid_row, val_row, self.k)
                tops.append(pb.TopLogProbs(values=t_vals, token_ids=t_ids))
        self.values += vals
        self.ids += ids
        self.tops += tops
        return pb.OutputLogProbs(token_logprobs=vals, token_ids=ids, top_logprobs=tops)

    def message(self) -> pb.OutputLogProbs:
        return pb.OutputLogProbs(token_logprobs=self.values, token_ids=self.ids, top_logprobs=self.tops)


class ResponseBuilder:
    """Map one stream's deltas to ``GenerateResponse`` messages (sans-IO).

    A stream is always ``chunk* complete``: each chunk carries only its new
    ``token_ids`` (delta), running ``completion_tokens`` and that delta's
    ``output_logprobs``; the complete carries the cumulative ``output_ids``
    and ``output_logprobs``, the ``finish_reason`` string and the matched
    stop. When the final delta has tokens they go out as a chunk first, so
    streaming clients see every token in chunks (``docs/reference-gateway-lessons.md`` §1.7).

    ``prompt_tokens`` is the engine's ``prefill_stats.num_prompt_tokens`` when
    sent, else the prompt length; ``cached_tokens`` is
    ``prefill_stats.num_cached_tokens`` or 0.

    Prompt logprobs (``input_logprobs``): the first prompt token has no
    logprob (an entry without ``value``), then one entry per prompt position;
    they accumulate over chunked-prefill deltas and ride the first chunk that
    has tokens, and every complete.

    Cost: O(new data) per delta; the cumulative lists are extended, never
    copied, and the complete's message is built once.

    Args:
        prompt_len: number of prompt tokens.
        index: the completion index (0 unless fanned out).
        stream: ``False`` emits only the complete.
        logprobs: requested top-logprob count per output position, ``None``
            when not requested (0: only the sampled token's logprob).
        prompt_logprobs: the same for prompt positions.
        prompt_token_ids: the prompt (needed with ``prompt_logprobs``).
    """

    __slots__ = (
        "_prompt_tokens",
        "_cached",
        "_output_ids",
        "_index",
        "_stream",
        "_lp",
        "_plp_k",
        "_plp_values",
        "_plp_ids",
        "_plp_tops",
        "_input_sent",
        "_matcher",
        "done",
        "stopped_early",
    )

    def __init__(
        self,
        prompt_len: int,
        *,
        index: int = 0,
        stream: bool = True,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        prompt_token_ids: Sequence[int] = (),
        stop_matcher: StopStringMatcher | None = None,
    ) -> None:
        self._matcher = stop_matcher
        #: True when a client-side stop string ended the stream before the
        #: engine finished: the caller must abort the engine request (leaving
        #: the stream's ``async with`` does; ``SampleStream.abort_sample`` for
        #: a sample).
        self.stopped_early = False
        self._prompt_tokens = prompt_len
        self._cached = 0
        self._output_ids: list[int] = []
        self._index = index
        self._stream = stream
        self._lp = _LogprobAcc(logprobs) if logprobs is not None else None
        self._plp_k = prompt_logprobs
        self._plp_values: list[pb.InputTokenLogProb] = []
        self._plp_ids: list[int] = []
        self._plp_tops: list[pb.TopLogProbs] = []
        if prompt_logprobs is not None and prompt_token_ids:
            # The first prompt token is never scored.
            self._plp_values.append(pb.InputTokenLogProb())
            self._plp_ids.append(prompt_token_ids[0])
            if prompt_logprobs > 0:
                self._plp_tops.append(pb.TopLogProbs())
        self._input_sent = False
        self.done = False

    def _add_prompt_logprobs(self, lists: wire.LogprobsLists) -> None:
        k = self._plp_k or 0
        for ids_row, val_row in zip(lists.token_ids, lists.logprobs):
            self._plp_values.append(pb.InputTokenLogProb(value=val_row[0]))
            self._plp_ids.append(ids_row[0])
            if k > 0:
                t_ids, t_vals = shape_top_logprobs(ids_row, val_row, k)
                self._plp_tops.append(pb.TopLogProbs(values=t_vals, token_ids=t_ids))

    def _input_logprobs(self) -> pb.InputLogProbs | None:
        if self._plp_k is None:
            return None
        return pb.InputLogProbs(token_logprobs=self._plp_values, token_ids=self._plp_ids, top_logprobs=self._plp_tops)

    def feed(self, delta: OutputDelta) -> list[pb.GenerateResponse]:
        """Responses for one delta: ``[]``, ``[chunk]``, ``[complete]`` or ``[chunk, complete]``.

        After the complete (``done``), further deltas give ``[]``.
        """
        if self.done:
            return []
        if self._matcher is not None:
            delta = self._apply_stops(self._matcher, delta)
        if delta.num_prompt_tokens is not None:
            self._prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens is not None:
            self._cached = delta.num_cached_tokens
        if delta.prompt_logprobs is not None and self._plp_k is not None:
            self._add_prompt_logprobs(delta.prompt_logprobs)
        out: list[pb.GenerateResponse] = []
        tokens = delta.token_ids
        self._output_ids += tokens
        chunk_lp = None
        if self._lp is not None and delta.logprobs is not None:
            chunk_lp = self._lp.add(delta.logprobs)
        if tokens and self._stream:
            chunk = pb.GenerateStreamChunk(
                token_ids=tokens,
                prompt_tokens=self._prompt_tokens,
                completion_tokens=len(self._output_ids),
                cached_tokens=self._cached,
                index=self._index,
            )
            if chunk_lp is not None:
                chunk.output_logprobs.CopyFrom(chunk_lp)
            if not self._input_sent:
                self._input_sent = True
                inp = self._input_logprobs()
                if inp is not None:
                    chunk.input_logprobs.CopyFrom(inp)
            out.append(pb.GenerateResponse(chunk=chunk))
        if delta.finish_reason is not None:
            out.append(self._complete(delta))
            self.done = True
        return out

    def _apply_stops(self, matcher: StopStringMatcher, delta: OutputDelta) -> OutputDelta:
        """Client-side stop strings (vLLM's detokenizer semantics, stops.py):
        keep the tokens up to the one that completed a match, finish with
        STOP and the matched string."""
        fed = matcher.feed_delta(delta)
        if fed.matched is None and len(fed.token_ids) == len(delta.token_ids):
            return delta
        kept = len(fed.token_ids)
        logprobs = delta.logprobs
        if logprobs is not None:
            logprobs = wire.LogprobsLists(
                token_ids=logprobs.token_ids[:kept], logprobs=logprobs.logprobs[:kept], ranks=logprobs.ranks[:kept]
            )
        finish, stop_reason = delta.finish_reason, delta.stop_reason
        if fed.matched is not None:
            self.stopped_early = delta.finish_reason is None
            finish, stop_reason = wire.FinishReason.STOP, fed.matched
        return delta.replace(token_ids=fed.token_ids, logprobs=logprobs, finish_reason=finish,
                             stop_reason=stop_reason)

    def _complete(self, delta: OutputDelta) -> pb.GenerateResponse:
        assert delta.finish_reason is not None  # called for the finishing delta only
        complete = pb.GenerateComplete(
            output_ids=self._output_ids,
            finish_reason=FINISH_REASON_STRINGS[delta.finish_reason],
            prompt_tokens=self._prompt_tokens,
            completion_tokens=len(self._output_ids),
            cached_tokens=self._cached,
            index=self._index,
        )
        if self._lp is not None:
            complete.output_logprobs.CopyFrom(self._lp.message())
        inp = self._input_logprobs()
        if inp is not None:
            complete.input_logprobs.CopyFrom(inp)
        stop = delta.stop_reason
        if delta.finish_reason is not wire.FinishReason.STOP:
            pass  # REPETITION carries stop_reason "repetition_detected": not a matched stop
        elif isinstance(stop, int) and not isinstance(stop, bool):
            complete.matched_token_id = stop
        elif isinstance(stop, str):
            complete.matched_stop_str = stop
        return pb.GenerateResponse(complete=complete)


def responses(
    deltas: Iterable[OutputDelta], prompt_len: int, *, stream: bool = True, **kw: Any
) -> list[pb.GenerateResponse]:
    """Convenience for tests: all responses for a finished sequence of deltas."""
    b = ResponseBuilder(prompt_len, stream=stream, **kw)
    out: list[pb.GenerateResponse] = []
    for d in deltas:
        out.extend(b.feed(d))
    return out
