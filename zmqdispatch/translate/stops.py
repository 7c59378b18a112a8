"""Client-side stop strings for a vLLM EngineCore that has no detokenizer (sans-IO).

The EngineCore never sees stop *strings*: in vLLM they are a front-end feature,
checked on detokenized text by the output processor. Over this transport the
front end is us, so this module reproduces what vLLM's own front end returns
in ``RequestOutput.outputs[0].token_ids`` / ``finish_reason`` / ``stop_reason``
for the same engine token stream. The facts it is written from (vLLM 0.32.0):

``vllm/v1/engine/detokenizer.py``, ``BaseIncrementalDetokenizer.update``:

- each new token is detokenized one at a time (``decode_next``) and the output
  text's length after every token is recorded;
- when the engine itself finished the request with ``FinishReason.STOP`` (EOS
  or a ``stop_token_ids`` hit: ``update(ids, stop_terminated=True)``) and
  ``include_stop_str_in_output`` is false, the *last* token is not
  detokenized (it stays in ``token_ids``, adds no text);
- stop strings are checked only once the request has more than
  ``min_tokens`` output tokens, and a match must *end* after the text of the
  first ``min_tokens`` tokens (it may start inside it);
- ``check_stop_strings``: among all stops, the occurrence that *ends* earliest
  in the new text wins; ties go to the stop listed first. The same function
  cuts ``output_text`` at the stop's start (excluded) or end (included); that
  only changes text, never token ids;
- tokens are trimmed on the *end of the match* in both modes: every token up
  to and including the first one whose text reaches the match end is kept,
  later tokens of the same step are dropped (``bisect_left`` over the
  per-token text offsets). A token that added no text after the match (a
  partial UTF-8 byte, a skipped special token, the undetokenized engine stop
  token) is therefore dropped too.

``vllm/v1/engine/output_processor.py``, ``OutputProcessor.process_outputs``
and ``_trim_surplus_tokens``: a matched string sets ``finish_reason = STOP``
and ``stop_reason = <the string>`` (overriding the engine's LENGTH, or the
engine's stop token id), the step's ``new_token_ids`` are cut to the kept
tokens (and logprobs with them), and when the engine had not finished the
request its id goes to ``reqs_to_abort``: the engine is told to abort it and
any later output for it is ignored.

``vllm/v1/engine/detokenizer.py``, ``FastIncrementalDetokenizer``: text comes
from ``tokenizers.decoders.DecodeStream`` primed with the prompt ids
(``DecodeStream(ids=prompt_token_ids, ...)``); a stream that raises "Invalid
prefix encountered" is replaced by an unprimed one. ``spaces_between_special_
tokens`` is ``skip_special_tokens or spaces_between_special_tokens``; when it is
false, an added token that follows another added token is rendered as its raw
content. :class:`IncrementalDecoder` reproduces DecodeStream's window
algorithm (tokenizers 0.23: decode ``ids`` since the last emitted chunk, emit
the new suffix unless it ends in U+FFFD, i.e. an incomplete character), so
per-token cost is bounded by the window, not the history. The test suite
checks it against the real ``DecodeStream``. vLLM's slow (non-``tokenizers``)
detokenizer path is not reproduced; its text is the same for ordinary
tokenizers.

``vllm/sampling_params.py``: ``stop`` may be a string or a list;
``_verify_args`` rejects an empty stop string ("stop cannot contain an empty
string"); ``output_text_buffer_length`` (``max(len(stop)) - 1`` when stop
strings are excluded from the output) only holds back *streamed text* until
the end, it never delays or trims token ids, so a token-id transport needs
nothing from it. ``vllm/v1/core/sched/utils.py``, ``check_stop``: EOS first,
then ``stop_token_ids`` (``stop_reason`` = the id), then length; the stop
tokens in ``_all_stop_token_ids`` are *masked out of sampling* while
``num_output_tokens < min_tokens`` (``MinTokensLogitsProcessor``), and a
structured-output grammar masks them until it terminates.

Single-token stop strings as engine ``stop_token_ids`` (the reference gateway
always converts them, ``docs/reference-gateway-lessons.md`` §1.8):
:func:`resolve_stop_strings` converts a stop string to an engine stop id only
when the result is the same as vLLM's text match:

- ``min_tokens == 0`` and no structured-output constraint; otherwise the id
  would join ``_all_stop_token_ids`` and be masked from sampling, which a stop
  *string* never does (or, left out of that set, it would stop the engine
  before ``min_tokens``);
- the string encodes (``add_special_tokens=False``) to exactly one id ``t``
  and ``decode([t])`` with the request's ``skip_special_tokens`` gives back
  the string (so a special token such as ``<|im_end|>`` with
  ``skip_special_tokens=True``, which vLLM can never match on text, is not
  converted either);
- ``t`` is not already a stop id of the request (then the engine stops on it
  anyway, and vLLM's ``stop_terminated`` rule decides what is reported).

``include_stop_str_in_output`` does not change token ids either way (the
token completing the match is kept in both modes; only text differs). What
it changes is whether the engine's final stop token is detokenized; for a
*converted* id vLLM would have detokenized it like any token, so the matcher
does exactly that when ``stop_reason`` is a converted id, and the stop is
reported as the string (``matched_stop_str``), never as ``matched_token_id``:
that is what vLLM returns for a stop string. The reference gateway reports
``matched_token_id`` there; we deliberately do not. The converted stop is
still matched on text too: the same string can arrive split over other tokens.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from ..errors import RequestRejected
from ..protocol.mailbox import OutputDelta
from ..wire import vllm as wire

__all__ = [
    "Tokenizer",
    "TokenizerAdapter",
    "as_tokenizer",
    "StopPlan",
    "resolve_stop_strings",
    "validate_stops",
    "IncrementalDecoder",
    "StopFeed",
    "StopStringMatcher",
]

_REPLACEMENT = "\ufffd"
_STOP_FIELD = "sampling_params.stop"


# --------------------------------------------------------------------------- tokenizers


@runtime_checkable
class Tokenizer(Protocol):
    """What this module needs from a tokenizer.

    ``encode(text, ...)`` returns a list of ids (a transformers tokenizer) or an
    object with ``.ids`` (a Hugging Face ``tokenizers.Tokenizer`` ``Encoding``);
    it is called with ``add_special_tokens=False`` when it accepts that keyword.
    ``decode(ids, skip_special_tokens=...)`` returns text, with the UTF-8 of an
    incomplete character rendered as U+FFFD (what both libraries do).
    """

    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any:
        """Token ids of *text*: a list of ints, or an object with ``.ids``."""
        ...

    def decode(self, ids: Any, /, *args: Any, **kwargs: Any) -> str:
        """Text of *ids* (``skip_special_tokens`` is passed as a keyword)."""
        ...


class TokenizerAdapter:
    """Uniform ``encode`` / ``decode`` / ``added_tokens`` over the tokenizer kinds.

    A transformers fast tokenizer is unwrapped to its ``tokenizers.Tokenizer``
    (``backend_tokenizer`` / ``_tokenizer``), as vLLM's
    ``FastIncrementalDetokenizer`` does: DecodeStream decodes with the backend,
    without transformers' ``clean_up_tokenization_spaces``.
    """

    __slots__ = ("raw", "_added")

    def __init__(self, tokenizer: Tokenizer) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is not None and callable(getattr(backend, "decode", None)):
            tokenizer = backend
        if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"not a tokenizer (needs encode and decode): {type(tokenizer).__name__}")
        self.raw = tokenizer
        self._added: dict[int, str] | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (BOS etc.)."""
        try:
            out = self.raw.encode(text, add_special_tokens=False)
        except TypeError:
            out = self.raw.encode(text)
        ids = getattr(out, "ids", out)
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Text of *ids*, special tokens skipped or kept."""
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def added_tokens(self) -> Mapping[int, str]:
        """``{id: content}`` of every added token (``get_added_tokens_decoder``
        of ``tokenizers``, ``added_tokens_decoder`` of transformers); ``{}``
        when the tokenizer tells none."""
        if self._added is None:
            found: Any = None
            getter = getattr(self.raw, "get_added_tokens_decoder", None)
            if callable(getter):
                found = getter()
            else:
                found = getattr(self.raw, "added_tokens_decoder", None)
            self._added = {int(k): str(getattr(v, "content", v)) for k, v in (found or {}).items()}
        return self._added


def as_tokenizer(tokenizer: Tokenizer | TokenizerAdapter) -> TokenizerAdapter:
    """Wrap ``tokenizer`` in a :class:`TokenizerAdapter` (no-op when it already is one)."""
    return tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)


# --------------------------------------------------------------------------- stop plan


def validate_stops(stops: str | Iterable[str] | None, *, request_id: str = "") -> tuple[str, ...]:
    """Normalise ``stops`` to a tuple (a bare string is one stop, as in vLLM's
    ``SamplingParams.__post_init__``) and reject what vLLM's ``_verify_args``
    rejects.

    Raises:
        RequestRejected: ``field="sampling_params.stop"`` for an empty string or
            a non-string entry.
    """
    if stops is None:
        return ()
    items = (stops,) if isinstance(stops, str) else tuple(stops)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise RequestRejected(
                f"{_STOP_FIELD}[{i}]: must be a string, got {type(s).__name__}",
                request_id=request_id, field=_STOP_FIELD,
            )
        if not s:
            raise RequestRejected(
                f"{_STOP_FIELD}[{i}]: stop cannot contain an empty string", request_id=request_id, field=_STOP_FIELD
            )
    return items


@attrs.frozen
class StopPlan:
    """How a request's stop strings are enforced.

    Attributes:
        stops: every stop string, in request order. The client matches all of
            them on text (:class:`StopStringMatcher`), converted ones included:
            the same text can arrive split over several tokens.
        stop_token_ids: ids to add to the engine's ``stop_token_ids`` (and so
            to ``_all_stop_token_ids``), in stop order, without duplicates and
            without ids the request already stops on.
        token_stops: converted id -> the stop string it stands for. When the
            engine finishes with ``stop_reason`` equal to such an id, the stop
            is the string (report ``matched_stop_str``).
    """

    stops: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    token_stops: Mapping[int, str] = attrs.field(factory=dict)

    def merged_stop_token_ids(self, stop_token_ids: Iterable[int] = ()) -> tuple[int, ...]:
        """``stop_token_ids`` followed by the converted ids (dedup, order kept)."""
        return tuple(dict.fromkeys([*stop_token_ids, *self.stop_token_ids]))

    def stop_string_for(self, stop_reason: int | str | None) -> str | None:
        """The stop string an engine ``stop_reason`` stands for, or ``None``."""
        if isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
            return self.token_stops.get(stop_reason)
        return None


def resolve_stop_strings(
    tokenizer: Tokenizer | TokenizerAdapter,
    stops: str | Iterable[str] | None,
    *,
    stop_token_ids: Iterable[int] = (),
    min_tokens: int = 0,
    skip_special_tokens: bool = True,
    constrained: bool = False,
    convert_single_token: bool = True,
    request_id: str = "",
) -> StopPlan:
    """Split a request's stop strings into engine stop ids and client text matches.

    A stop string becomes an engine stop id only when that gives the result
    vLLM gives for the string (see the module docstring): ``min_tokens == 0``,
    no structured-output constraint (``constrained``), it encodes
    (``add_special_tokens=False``) to exactly one id that decodes back to the
    same string with ``skip_special_tokens``, and the id is not already in
    ``stop_token_ids`` (the request's final list, EOS extras included). A
    string the tokenizer cannot encode is simply matched on text.

    Args:
        tokenizer: see :class:`Tokenizer`.
        stops: ``sampling_params.stop`` (a string or strings).
        stop_token_ids: the ids the request already stops on.
        min_tokens / skip_special_tokens: the request's values.
        constrained: the request carries a structured-output constraint.
        convert_single_token: ``False`` keeps every stop on the client.
        request_id: for the error.

    Raises:
        RequestRejected: ``field="sampling_params.stop"`` for an empty or
            non-string stop.
    """
    items = validate_stops(stops, request_id=request_id)
    if not items:
        return StopPlan()
    if not convert_single_token or min_tokens > 0 or constrained:
        return StopPlan(stops=items)
    tok = as_tokenizer(tokenizer)
    existing = set(stop_token_ids)
    new_ids: dict[int, str] = {}
    for s in items:
        try:
            ids = tok.encode(s)
            if len(ids) != 1:
                continue
            t = ids[0]
            if t in existing or t in new_ids:
                continue
            if tok.decode([t], skip_special_tokens) != s:
                continue
        except Exception:  # unencodable: text match only
            continue
        new_ids[t] = s
    return StopPlan(stops=items, stop_token_ids=tuple(new_ids), token_stops=new_ids)


# --------------------------------------------------------------------------- detokenizer


class IncrementalDecoder:
    """Text of a token stream, one token at a time, as vLLM's fast detokenizer sees it.

    Reproduces ``tokenizers.decoders.DecodeStream`` (tokenizers 0.23,
    ``step_decode_stream``) as used by vLLM's
    ``FastIncrementalDetokenizer.decode_next`` / ``_protected_step``:

    - the stream holds ``ids`` since the previous emitted chunk (the context),
      ``prefix`` = their decoded text and ``prefix_index`` = how many of them
      are context; primed with the prompt ids, the prefix is taken lazily
      (only once it no longer ends in an incomplete character);
    - ``step(id)`` decodes ``ids + [id]``; if that text is longer (in UTF-8
      bytes) than ``prefix`` and does not end in U+FFFD, the new suffix is
      emitted and the window moves; otherwise nothing is emitted yet;
    - a text that does not extend the prefix is DecodeStream's "Invalid prefix"
      error; vLLM then restarts with an unprimed stream and steps the id again;
    - with ``skip_special_tokens`` and ``spaces_between_special_tokens`` both
      false, an added token that follows an added token yields its raw content.

    Cost per token: two decodes of the window (normally 1-3 tokens); the
    prompt is decoded once at the first step. As in DecodeStream, the window
    grows while the text does not (a run of skipped special tokens, a long
    incomplete character), and a prompt whose text ends in an incomplete
    character makes the first emitted chunk carry the prompt's text too (a
    DecodeStream quirk vLLM inherits; reproduced, since stop strings are
    matched on that text).
    """

    __slots__ = ("_tok", "_skip", "_ids", "_prefix", "_prefix_index", "_added", "_last_added")

    def __init__(
        self,
        tokenizer: Tokenizer | TokenizerAdapter,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = as_tokenizer(tokenizer)
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._prefix = ""
        self._prefix_index = 0
        self._added: Mapping[int, str] | None = None
        self._last_added = False
        if not (skip_special_tokens or spaces_between_special_tokens):
            added = self._tok.added_tokens()
            if added:
                self._added = added

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, self._skip)

    def _stream_step(self, token_id: int) -> str | None:
        ids = self._ids
        if not self._prefix and ids:
            text = self._decode(ids)
            if not text.endswith(_REPLACEMENT):
                self._prefix = text
                self._prefix_index = len(ids)
        ids.append(token_id)
        text = self._decode(ids)
        prefix = self._prefix
        if text.endswith(_REPLACEMENT):
            return None
        if text.startswith(prefix):
            if len(text) <= len(prefix):
                return None
        elif len(text.encode()) <= len(prefix.encode()):
            return None
        else:
            raise _InvalidPrefix
        new_text = text[len(prefix) :]
        new_prefix_index = len(ids) - self._prefix_index
        del ids[: self._prefix_index]
        self._prefix = self._decode(ids)
        self._prefix_index = new_prefix_index
        return new_text

    def step(self, token_id: int) -> str:
        """The text this token makes visible (``""`` while a character is incomplete)."""
        try:
            piece = self._stream_step(token_id)
        except _InvalidPrefix:
            self._ids, self._prefix, self._prefix_index = [], "", 0
            piece = self._stream_step(token_id)
        if self._added is not None:
            raw = self._added.get(token_id)
            if raw is not None and self._last_added:
                piece = raw
            self._last_added = raw is not None
        return piece or ""


class _InvalidPrefix(Exception):
    pass


# --------------------------------------------------------------------------- matcher


@attrs.frozen
class StopFeed:
    """What one :meth:`StopStringMatcher.feed` lets through.

    Attributes:
        token_ids: the ids to emit for this step: all fed ids, or the prefix
            up to and including the token that completed a stop string.
            Slice per-token data (logprobs) to ``len(token_ids)``.
        matched: the stop string that ended the request in this step, else
            ``None``. When set, finish with ``"stop"`` / ``matched_stop_str``
            and, if the engine had not finished the request, abort it there.
    """

    token_ids: list[int]
    matched: str | None = None


class StopStringMatcher:
    """One request's stop-string check on the engine's token stream (sans-IO).

    Feed every engine delta in order; emit ``feed(...).token_ids``. Results
    do not depend on how the stream is split into feeds (vLLM's own check
    gives the same answer for one token per step and for many).

    Args:
        tokenizer: see :class:`Tokenizer`.
        stops: the request's stop strings (all of them, converted or not:
            :attr:`StopPlan.stops`).
        include_stop_str_in_output / min_tokens / skip_special_tokens /
            spaces_between_special_tokens: the request's values.
        prompt_token_ids: primes the decoder like vLLM's
            ``DecodeStream(ids=prompt)`` (context for the first tokens, e.g. a
            SentencePiece leading space). Optional; the default decodes the
            first output token without context.
        token_stops: :attr:`StopPlan.token_stops` when single-token stops
            were converted to engine stop ids.

    Raises:
        RequestRejected: an empty stop string, negative ``min_tokens``.
    """

    __slots__ = (
        "_stops",
        "_include",
        "_min_tokens",
        "_token_stops",
        "_decoder",
        "_keep",
        "_tail",
        "_text_len",
        "_count",
        "matched",
        "finished",
    )

    def __init__(
        self,
        tokenizer: Tokenizer | TokenizerAdapter,
        stops: str | Iterable[str] | None,
        *,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
        token_stops: Mapping[int, str] | None = None,
    ) -> None:
        self._stops = validate_stops(stops)
        if min_tokens < 0:
            raise RequestRejected(
                f"sampling_params.min_tokens: must be >= 0, got {min_tokens}", field="sampling_params.min_tokens"
            )
        self._include = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._token_stops = dict(token_stops or {})
        self._decoder = (
            IncrementalDecoder(
                tokenizer,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
                prompt_token_ids=prompt_token_ids,
            )
            if self._stops
            else None
        )
        # Text kept for matches that start before the new text: longest stop - 1.
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""
        self._text_len = 0
        self._count = 0
        #: the stop string that ended the request, once one did.
        self.matched: str | None = None
        #: True once a stop ended the request: later feeds emit nothing.
        self.finished = False

    @property
    def num_output_tokens(self) -> int:
        """Engine tokens fed so far (kept or not); what ``min_tokens`` counts."""
        return self._count

    def feed(
        self,
        token_ids: Sequence[int],
        *,
        stop_terminated: bool = False,
        stop_reason: int | str | None = None,
    ) -> StopFeed:
        """Check one engine step's new tokens.

        Args:
            token_ids: the step's new ids (a delta).
            stop_terminated: the engine finished the request with
                ``FinishReason.STOP`` in this step (EOS or a stop token id is
                the last id). As in vLLM, that last token is then not
                detokenized unless ``include_stop_str_in_output``, except when
                ``stop_reason`` is a converted single-token stop.
            stop_reason: the engine's ``stop_reason`` for that finish.

        Returns:
            the ids to emit, and the stop string when one ended the request here.
        """
        if self.finished or not token_ids:
            return StopFeed([], None)
        ids = list(token_ids)
        converted = (
            stop_terminated
            and isinstance(stop_reason, int)
            and not isinstance(stop_reason, bool)
            and stop_reason in self._token_stops
        )
        if self._decoder is None:
            self._count += len(ids)
            if converted:
                return self._finish(ids, self._token_stops[stop_reason])  # type: ignore[index]
            return StopFeed(ids, None)

        skip_last = stop_terminated and not converted and not self._include
        num_prev = self._count
        start = self._text_len
        tail = self._tail
        decoder = self._decoder
        pieces: list[str] = []
        offsets = [start]
        length = start
        for tid in ids[:-1] if skip_last else ids:
            piece = decoder.step(tid)
            if piece:
                pieces.append(piece)
                length += len(piece)
            offsets.append(length)
        if skip_last:
            offsets.append(length)
        self._count += len(ids)
        window = tail + "".join(pieces) if pieces else tail
        window_start = start - len(tail)
        self._text_len = length
        keep = self._keep
        self._tail = window[len(window) - keep :] if len(window) > keep else window

        hit: tuple[str, int] | None = None
        if self._count > self._min_tokens:
            check_from = offsets[max(self._min_tokens - num_prev, 0)]
            if length > check_from:
                hit = self._earliest_stop(window, window_start, check_from)
        if hit is not None:
            stop, end = hit
            kept = bisect_left(offsets, end, 1)
            return self._finish(ids[:kept], stop)
        if converted:
            return self._finish(ids, self._token_stops[stop_reason])  # type: ignore[index]
        return StopFeed(ids, None)

    def feed_delta(self, delta: OutputDelta) -> StopFeed:
        """:meth:`feed` with the step facts taken from an :class:`OutputDelta`.

        A merged delta is fine: merging never crosses a finish, and the result
        does not depend on how steps are grouped.
        """
        return self.feed(
            delta.token_ids,
            stop_terminated=delta.finish_reason == wire.FinishReason.STOP,
            stop_reason=delta.stop_reason,
        )

    def _finish(self, ids: list[int], stop: str) -> StopFeed:
        self.finished = True
        self.matched = stop
        self._tail = ""
        return StopFeed(ids, stop)

    def _earliest_stop(self, window: str, window_start: int, check_from: int) -> tuple[str, int] | None:
        """vLLM ``check_stop_strings``: the occurrence ending earliest after
        ``check_from`` (absolute char offset) wins; ties go to the earlier stop.

        ``window`` holds the text from absolute offset ``window_start`` to the
        end; it reaches back ``longest stop - 1`` chars before the step's new
        text, enough for any match that ends in the new text.
        """
        best: str | None = None
        best_end = 0
        for stop in self._stops:
            lo = max(check_from + 1 - len(stop), 0) - window_start
            idx = window.find(stop, max(lo, 0))
            if idx == -1:
                continue
            end = window_start + idx + len(stop)
            if best is None or end < best_end:
                best = stop
                best_end = end
        return None if best is None else (best, best_end)
