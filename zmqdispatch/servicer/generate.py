"""One Generate call of the servicer, sans-IO: the proto request translated
into one engine request per sample (``n > 1`` fans out as
:func:`zmqdispatch.translate.vllm.translate_parallel` does), each sample's
:class:`~zmqdispatch.translate.vllm.ResponseBuilder`, and the completes an
``Abort`` ends the open samples with.

The shell (:mod:`.server`) opens the samples on the client, feeds each
``(index, delta)`` to :meth:`GenerateCall.feed` and writes what it returns;
nothing here awaits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from ..protocol.mailbox import OutputDelta
from ..translate import sglang as sg_translate
from ..translate import tokenspeed as ts_translate
from ..translate import vllm as vllm_translate
from ..wire.vllm import FinishReason

__all__ = ["GenerateCall", "TranslateOptions", "translate"]


def _int_tuple(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(ids)


@attrs.frozen(kw_only=True)
class TranslateOptions:
    """What the translation of every request of the servicer shares.

    Attributes:
        runtime: ``"vllm"``, ``"tokenspeed"`` or ``"sglang"`` (which proto package and wire).
        eos_token_ids: the model's EOS ids, primary first (vLLM: the engine has
            no tokenizer; without them it never stops at EOS).
        vocab_size: token ids at or past it are refused (``None``: not checked).
        max_logprobs: the engines' ``max_logprobs`` (vLLM).
        tokenizer: for stop strings (a ``tokenizers.Tokenizer``); ``None``:
            requests with stop strings are refused (``sampling_params.stop``).
    """

    runtime: str = "vllm"
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    vocab_size: int | None = None
    max_logprobs: int = vllm_translate.DEFAULT_MAX_LOGPROBS
    tokenizer: Any = None


def translate(req: Any, options: TranslateOptions, *, max_model_len: int, engine_index: int | None,
              mm_dtype: str | None = None
              ) -> list[vllm_translate.Translation] | list[ts_translate.Translation] | list[sg_translate.Translation]:
    """One translation per sample of *req* (a ``GenerateRequest`` of the runtime's package).
    *mm_dtype*: the dtype float32 multimodal tensors are cast to (vLLM: the engine's
    model dtype, its ready response's ``dtype``; TokenSpeed: its encoder's,
    :meth:`~.server.ServicerCore.mm_dtype`); None sends them as they are.

    Raises:
        RequestRejected: a field the wire cannot carry or out of range, named.
    """
    if options.runtime == "sglang":  # the scheduler matches stop strings itself: no tokenizer needed
        return sg_translate.translate_parallel(req, sg_translate.TranslationConfig(
            max_model_len=max_model_len, vocab_size=options.vocab_size, engine_index=engine_index))
    if options.runtime == "tokenspeed":
        return ts_translate.translate_parallel(req, ts_translate.TranslationConfig(
            max_model_len=max_model_len, vocab_size=options.vocab_size, engine_index=engine_index,
            tokenizer=options.tokenizer, mm_dtype=mm_dtype))
    return vllm_translate.translate_parallel(req, vllm_translate.TranslationConfig(
        max_model_len=max_model_len, eos_token_ids=options.eos_token_ids, vocab_size=options.vocab_size,
        max_logprobs=options.max_logprobs, engine_index=engine_index, tokenizer=options.tokenizer,
        mm_dtype=mm_dtype))


class GenerateCall:
    """The response side of one Generate: a builder per sample.

    Attributes:
        request_id: the proto request's id (what ``Abort`` names).
        requests: the engine requests, one per sample, by index.
        builders: their response builders, by index.
    """

    __slots__ = ("builders", "request_id", "requests")

    def __init__(self, request_id: str, translations: list[Any]) -> None:
        self.request_id = request_id
        self.requests = [t.request for t in translations]
        self.builders = [t.response_builder() for t in translations]

    def feed(self, index: int, delta: OutputDelta) -> list[Any]:
        """The ``GenerateResponse`` messages of sample *index*'s delta (``[]``
        after its complete)."""
        out: list[Any] = self.builders[index].feed(delta)
        return out

    def stopped_early(self, index: int) -> bool:
        """A client-side stop string ended sample *index* before the engine did
        (the shell aborts it on the engine)."""
        return bool(self.builders[index].stopped_early)

    @property
    def done(self) -> bool:
        """Every sample has had its complete."""
        return all(b.done for b in self.builders)

    def abort_responses(self) -> list[Any]:
        """The responses that end every open sample with ``finish_reason``
        ``"abort"`` (what an ``Abort`` of this request answers on its stream):
        the complete carries the tokens the sample had, as the engine's own
        abort finish would."""
        out: list[Any] = []
        for b in self.builders:
            if not b.done:
                out += b.feed(OutputDelta(request_id=self.request_id, token_ids=[], finish_reason=FinishReason.ABORT))
        return out
