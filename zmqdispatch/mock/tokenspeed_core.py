"""Sans-IO model of a TokenSpeed 0.1.1 scheduler on its direct msgpack wire.

What it reproduces of the real engine (``docs/tokenspeed-wire.md`` §1.8-§1.13 and
the mock checklist of §2), so clients can be tested against its quirks:

- admission as TokenSpeed's msgpack receiver does it: the ADD is finalized
  (``seed = crc32(rid)`` when nil, normalization, ``n != 1`` marked invalid)
  and checked (:func:`zmqdispatch.protocol.checks_tokenspeed.admission_error`); a refused
  request gets **one immediate terminal ``"abort"`` batch** with no tokens,
  ``completion_tokens`` 0 and no reason text;
- a client ABORT removes the request and produces **no frame at all**; an
  ABORT for an unknown rid is parked for 300 s and kills, silently, the next
  request with that rid;
- the engine does not check prompt length, empty prompts or duplicate rids (a
  duplicate replaces the running request here);
- one ``BatchTokenIDOutSlim`` per step holding every rid that emits; emission
  cadence: streaming requests every ``stream_interval`` tokens (tokens 1,
  k+1, 2k+1, ...), non-streaming ones at the first token and every 50; the
  terminal frame carries whatever was unsent; ``completion_tokens`` is
  cumulative; the stop / EOS token is included in ``output_ids`` and the
  finish is just ``"stop"``; ``ignore_eos`` disables token-based stops;
  ``max_new_tokens`` nil fills the context;
- logprob columns (one value per emitted token) only for ``return_logprob``,
  and only when the engine runs with output logprobs enabled (else the
  request is refused at admission);
- every batch carries ``engine_index`` and the load tail (running, waiting,
  KV pages used / total);
- multimodal ADDs (``multimodal_inputs``, :func:`typed_multimodal`): the payload is
  decoded as TokenSpeed's typed decoder does (a malformed one, a truncated or missing
  tensor frame, drops the whole message), and the pad ids the items' ranges hold are
  not token ids (:func:`embedding_fault` skips them, as the engine's embedder
  overwrites those positions); the prompt's pad ids feed the mock's tokens, so two
  images with different hashes give different outputs, as on the real engine.

Tokens are deterministic (:func:`zmqdispatch.mock.core.mock_token` of the
prompt, position and the resolved seed), so an unseeded request's tokens
depend on its rid, as on the real engine.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from .. import limits
from ..protocol import checks_tokenspeed
from ..wire import tokenspeed as ts
from ..wire import tokenspeed_multimodal as tsmm
from .core import mock_token

__all__ = ["MockTokenSpeedScheduler", "KV_PAGE_TOKENS", "embedding_fault", "typed_multimodal"]

#: Tokens per KV page in the mock's load snapshot.
KV_PAGE_TOKENS = 16


def _logprob(token: int) -> float:
    """The mock's logprob for a sampled token: deterministic, in (-1, 0)."""
    return -((token % 997) + 1) / 1000.0


def typed_multimodal(request: ts.TokenizedGenerateReqInput, frames: Sequence[Any]) -> ts.TokenizedGenerateReqInput:
    """*request* with its raw ``multimodal_inputs`` read as TokenSpeed's typed decoder
    reads them (*frames*: the ADD's ``[payload, *aux]``); unchanged without any.

    Raises:
        RemoteProtocolError: what that decoder refuses (the engine drops the message).
    """
    if request.multimodal_inputs is None or isinstance(request.multimodal_inputs, ts.MultimodalInputs):
        return request
    return attrs.evolve(request, multimodal_inputs=tsmm.decode_multimodal_inputs(request.multimodal_inputs, frames))


def embedding_fault(request: ts.TokenizedGenerateReqInput, vocab_size: int) -> int | None:
    """The first prompt position whose id is past the embedding table (a device fault
    that kills the engine), or None. Positions inside a multimodal item's ranges hold
    pad ids the embedder overwrites with the item's encoder output: skipped."""
    ids = request.input_ids or ()
    mm = request.multimodal_inputs
    covered: set[int] = set()
    if isinstance(mm, ts.MultimodalInputs):
        for it in mm.mm_items:
            for start, end in it.offsets or ():
                covered.update(range(start, end + 1))
    for i, t in enumerate(ids):
        if t >= vocab_size and i not in covered:
            return i
    return None


@attrs.define(slots=True, eq=False)
class _Running:
    request: ts.TokenizedGenerateReqInput
    prompt_hash: int
    seed: int
    max_new_tokens: int
    interval: int
    generated: int = 0
    unsent: list[int] = attrs.field(factory=list)
    unsent_lp: list[float] = attrs.field(factory=list)


class MockTokenSpeedScheduler:
    """Per-step state of the mock TokenSpeed engine.

    Args:
        engine_index: identity index reported in every batch.
        max_model_len: context length; ``max_new_tokens`` nil fills it.
        vocab_size: token ids are drawn below it; ``logit_bias`` keys checked.
        tokens_per_step: tokens per request per step (speculative decoding > 1).
        eos_token_ids: ids that end a request with ``"stop"`` (the model's EOS).
        stream_interval: the server's ``--stream-interval``.
        enable_output_logprobs: the server's ``--enable-output-logprobs``.
        clock: monotonic seconds (parked-abort expiry).
    """

    def __init__(
        self,
        *,
        engine_index: int = 0,
        max_model_len: int = 4096,
        vocab_size: int = 32_000,
        tokens_per_step: int = 1,
        eos_token_ids: tuple[int, ...] = (),
        stream_interval: int = 1,
        enable_output_logprobs: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_index = engine_index
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokens_per_step = tokens_per_step
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stream_interval = stream_interval
        self.enable_output_logprobs = enable_output_logprobs
        self._clock = clock
        self.running: dict[str, _Running] = {}
        self.parked: OrderedDict[str, float] = OrderedDict()
        #: rid -> why admission refused it (newest 10,000), for tests.
        self.refused: OrderedDict[str, str] = OrderedDict()
        self.aborts_received: deque[str] = deque(maxlen=10_000)
        self.requests_received = 0
        #: multimodal items and their feature bytes received (admitted or not)
        self.mm_items_received = 0
        self.mm_feature_bytes_received = 0
        #: ``(rid, feature dtype, feature shape)`` of each multimodal item received
        #: (newest 10,000), for tests
        self.mm_features_received: deque[tuple[str, str, tuple[int, ...]]] = deque(maxlen=10_000)
        self.killed_by_parked_abort = 0
        self.steps = 0

    # ------------------------------------------------------------------ input

    def add(self, request: ts.TokenizedGenerateReqInput) -> ts.TokenSpeedBatch | None:
        """Admit a finalized ADD (:func:`zmqdispatch.wire.tokenspeed_engine.decode_input`).

        Returns:
            the immediate terminal ``"abort"`` batch for a refused request, else
            ``None`` (also when a parked abort kills the request: no frame).
        """
        self.requests_received += 1
        rid = request.rid
        mm = request.multimodal_inputs
        if isinstance(mm, ts.MultimodalInputs):
            self.mm_items_received += len(mm.mm_items)
            self.mm_feature_bytes_received += sum(it.feature.nbytes for it in mm.mm_items if it.feature is not None)
            self.mm_features_received.extend((rid, it.feature.dtype, tuple(it.feature.shape))
                                             for it in mm.mm_items if it.feature is not None)
        reason = checks_tokenspeed.admission_error(
            request, vocab_size=self.vocab_size, enable_output_logprobs=self.enable_output_logprobs
        )
        if reason is not None:
            self.refused[rid] = reason
            if len(self.refused) > 10_000:
                self.refused.popitem(last=False)
            return self._batch(
                [(rid, (), "abort", len(request.input_ids or ()), 0, ())]
            )
        self._expire_parked()
        if self.parked.pop(rid, None) is not None:
            self.killed_by_parked_abort += 1
            return None
        sp = request.sampling_params
        prompt = request.input_ids or ()
        h = 0
        for t in prompt:
            h = (h * 31 + t) & 0xFFFFFFFF
        room = max(self.max_model_len - len(prompt) - 1, 0)
        max_new = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        if request.stream:
            interval = sp.stream_interval or self.stream_interval
        else:
            interval = ts.FORCE_STREAM_INTERVAL
        self.running[rid] = _Running(request, h, sp.seed or 0, max_new, max(interval, 1))
        return None

    def abort(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Client ABORT: drop running requests silently; park unknown rids."""
        for rid in request_ids:
            self.aborts_received.append(rid)
            if self.running.pop(rid, None) is None:
                self.parked.pop(rid, None)
                self.parked[rid] = self._clock() + limits.TOKENSPEED_ABORT_PARK_SECONDS

    def _expire_parked(self) -> None:
        now = self._clock()
        while self.parked:
            rid, until = next(iter(self.parked.items()))
            if until > now:
                break
            del self.parked[rid]

    # ------------------------------------------------------------------ stepping

    def step(self) -> ts.TokenSpeedBatch | None:
        """Advance every running request; the batch of those that emit (or None)."""
        self.steps += 1
        rows = []
        finished = []
        for rid, r in self.running.items():
            req = r.request
            sp = req.sampling_params
            finish = ""
            for _ in range(self.tokens_per_step):
                if r.generated >= r.max_new_tokens:
                    finish = "length"
                    break
                tok = mock_token(r.prompt_hash, r.generated, r.seed, self.vocab_size)
                r.generated += 1
                r.unsent.append(tok)
                if req.return_logprob:
                    r.unsent_lp.append(_logprob(tok))
                if not sp.ignore_eos and r.generated > sp.min_new_tokens:
                    if tok in self.eos_token_ids or (sp.stop_token_ids and tok in sp.stop_token_ids):
                        finish = "stop"
                        break
                if r.generated >= r.max_new_tokens:
                    finish = "length"
                    break
            emit = bool(finish) or (
                r.unsent and (r.interval == 1 or r.generated % r.interval == 1)
            )
            if emit:
                rows.append((rid, tuple(r.unsent), finish, len(req.input_ids or ()), r.generated,
                             tuple(r.unsent_lp)))
                r.unsent = []
                r.unsent_lp = []
            if finish:
                finished.append(rid)
        for rid in finished:
            del self.running[rid]
        return self._batch(rows) if rows else None

    def _batch(self, rows: list[tuple[Any, ...]]) -> ts.TokenSpeedBatch:
        used = 0
        for r in self.running.values():
            used += -(-(len(r.request.input_ids or ()) + r.generated) // KV_PAGE_TOKENS)
        return ts.TokenSpeedBatch(
            engine_index=self.engine_index,
            rids=tuple(row[0] for row in rows),
            output_ids=tuple(row[1] for row in rows),
            finished_reasons=tuple(row[2] for row in rows),
            prompt_tokens=tuple(row[3] for row in rows),
            completion_tokens=tuple(row[4] for row in rows),
            cached_tokens=tuple(0 for _ in rows),
            logprob_vals=tuple(row[5] for row in rows),
            logprob_ids=tuple(row[1] if row[5] else () for row in rows),
            num_running=len(self.running),
            num_waiting=0,
            kv_active_pages=used,
            kv_total_pages=max(1, self.max_model_len // KV_PAGE_TOKENS) * 64,
        )

    def stats(self) -> dict[str, int]:
        """Counters for leak checks and tests."""
        return {
            "live": len(self.running),
            "requests_received": self.requests_received,
            "aborts_received": len(self.aborts_received),
            "parked_aborts": len(self.parked),
            "steps": self.steps,
            "mm_items_received": self.mm_items_received,
            "mm_feature_bytes_received": self.mm_feature_bytes_received,
        }
