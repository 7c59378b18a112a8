"""Sans-IO model of an SGLang 0.5.21 scheduler behind the SGLang plugin (``docs/sglang.md``).

What it reproduces, so clients can be tested against the real wire's rules:

- admission as the plugin does it (:func:`zmqdispatch.protocol.checks_sglang.admission_error`:
  SGLang's ``normalize()`` / ``verify()``, ``n != 1``, empty ``input_ids``); a refused
  request gets **one immediate terminal ``"abort"``** with the reason in
  ``finished_messages`` and status 400;
- a client ABORT produces **no output**, and stops every running request whose rid
  *starts with* the aborted one (SGLang matches rids by prefix);
- one ``BatchTokenIDSlimOutput`` per step for every request that emits: streaming
  requests every ``stream_interval`` tokens, the others only at the end; the stop
  token is in ``output_ids`` and named in ``finished_matched`` (a stop id or an EOS
  id); ``ignore_eos`` disables token stops; ``max_new_tokens`` nil means SGLang's
  default of 128 (never beyond the context);
- stop strings (``stop_strs``) matched as SGLang's scheduler matches them, on the text of
  the last ``stop_str_max_len + 1`` tokens after each token (the mock's detokenizer,
  :func:`zmqdispatch.mock.core.mock_text`: one letter per token, so ``stop_str_max_len``
  is the longest stop's length), the first stop in request order found in it wins; the
  request finishes ``"stop"`` with that string in ``finished_matched`` and the token that
  completed it in ``output_ids`` (tokens are never trimmed; the text is not sent);
  ``ignore_eos`` and ``min_new_tokens`` do not delay them (they gate token stops only);
  a token stop on the same token wins;
- logprobs (``return_logprob``): one per token, and ``top_logprobs_num`` ranked
  candidates per token (the sampled token first);
- every batch carries ``engine_index`` and the load tail in **tokens**;
- CONTROL calls: ``flush_cache`` (refused while requests run, as SGLang does),
  ``start_profile`` / ``stop_profile``; any other method is answered ``success=False``.

Tokens come from :func:`zmqdispatch.mock.core.mock_token` of the prompt, position and
``sampling_seed`` (0 when unset).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import attrs
import msgpack

from ..errors import RemoteProtocolError
from ..protocol import checks_sglang
from ..wire import sglang as sg
from ..wire import sglang_engine as sg_engine
from .core import mock_text, mock_token

__all__ = ["MockSGLangScheduler"]

#: KV tokens the mock reports as its cache size, per token of context.
KV_TOKENS_PER_CONTEXT_TOKEN = 16


def _logprob(token: int) -> float:
    """The mock's logprob of a sampled token: deterministic, in (-1, 0)."""
    return -((token % 997) + 1) / 1000.0


@attrs.define(slots=True, eq=False)
class _Running:
    request: sg.TokenizedGenerateReqInput
    params: sg.SGLangSamplingParams  # derived, as the scheduler holds them
    prompt_hash: int
    max_new_tokens: int
    interval: int
    generated: int = 0
    unsent: list[int] = attrs.field(factory=list)
    #: the stop strings, in request order, and the last ``stop_str_max_len + 1``
    #: tokens, the text they are matched in
    stops: tuple[str, ...] = ()
    tail: deque[int] = attrs.field(factory=deque)


class MockSGLangScheduler:
    """Per-step state of the mock SGLang scheduler.

    Args:
        engine_index: the rank reported in every batch (``engine_index``).
        max_model_len: context length.
        vocab_size: token ids are drawn below it; ``logit_bias`` keys checked.
        tokens_per_step: tokens per request per step.
        eos_token_ids: the model's EOS ids (a ``"stop"`` unless ``ignore_eos``).
        stream_interval: the server's ``--stream-interval``.
    """

    def __init__(self, *, engine_index: int = 0, max_model_len: int = 4096, vocab_size: int = 32_000,
                 tokens_per_step: int = 1, eos_token_ids: tuple[int, ...] = (), stream_interval: int = 1) -> None:
        self.engine_index = engine_index
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokens_per_step = tokens_per_step
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stream_interval = stream_interval
        self.running: dict[str, _Running] = {}
        #: rid -> why admission refused it (newest 10,000), for tests.
        self.refused: dict[str, str] = {}
        self.aborts_received: deque[str] = deque(maxlen=10_000)
        #: control calls received, ``(call_id, method, args)``, for tests.
        self.control_calls: deque[tuple[int, str, list[Any]]] = deque(maxlen=10_000)
        self.profiling = False
        #: input messages dropped as undecodable (the plugin logs and goes on)
        self.dropped = 0
        self.requests_received = 0
        self.steps = 0

    # ------------------------------------------------------------------ input

    def receive(self, frames: Sequence[bytes]) -> list[list[bytes]]:
        """One input message ``[type, payload, *aux]``, as the plugin's receiver takes
        it; the output messages it answers with at once (a control reply, a refused
        request's terminal abort). An ADD that does not decode is answered with a
        terminal ``"abort"`` (status 400) when its rid can be read; any other bad
        message is dropped (counted in ``dropped``)."""
        try:
            kind, body = sg_engine.decode_input(frames)
        except RemoteProtocolError as exc:
            rid = _loose_rid(frames)
            if rid is None:
                self.dropped += 1
                return []
            message = f"the scheduler could not decode the request: {exc}"
            return [sg_engine.encode_outputs(self._batch([(rid, (), "abort", message, None, 0, 0)], status=400))]
        if kind is sg.RequestType.ABORT:
            self.abort(cast(tuple[str, ...], body))
            return []
        if kind is sg.RequestType.CONTROL:
            call_id, method, args = cast(sg_engine.ControlCall, body)
            return [[sg_engine.encode_control_reply(self.control(call_id, method, args))]]
        immediate = self.add(cast(sg.TokenizedGenerateReqInput, body))
        return [] if immediate is None else [sg_engine.encode_outputs(immediate)]

    def add(self, request: sg.TokenizedGenerateReqInput) -> sg.SGLangBatch | None:
        """Admit a decoded ADD; the immediate terminal ``"abort"`` batch of a refused
        request, else None. A running request with the same rid is replaced."""
        self.requests_received += 1
        rid = request.rid
        bad = checks_sglang.admission_error(request, vocab_size=self.vocab_size)
        if bad is not None:
            message = f"{bad[0]}: {bad[1]}"
            self.refused[rid] = message
            if len(self.refused) > 10_000:
                del self.refused[next(iter(self.refused))]
            return self._batch([(rid, (), "abort", message, None, 0, 0)], status=400)
        sp = request.sampling_params.derive()
        prompt = request.input_ids or ()
        h = 0
        for t in prompt:
            h = (h * 31 + t) & 0xFFFFFFFF
        room = max(self.max_model_len - len(prompt), 0)
        max_new = min(128 if sp.max_new_tokens is None else sp.max_new_tokens, room)
        interval = sp.stream_interval or self.stream_interval
        stops = (sp.stop_strs,) if isinstance(sp.stop_strs, str) else tuple(sp.stop_strs or ())
        # SGLang's normalize(): stop_str_max_len = the longest stop in tokens (one per letter here)
        tail: deque[int] = deque(maxlen=max((len(s) for s in stops), default=0) + 1)
        self.running[rid] = _Running(request, sp, h, max_new, max(interval, 1), stops=stops, tail=tail)
        return None

    def abort(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Client ABORT: stop, silently, every running rid that starts with one of these."""
        prefixes = tuple(request_ids)
        self.aborts_received.extend(prefixes)
        if prefixes:
            for rid in [r for r in self.running if r.startswith(prefixes)]:
                del self.running[rid]

    def control(self, call_id: int, method: str, args: list[Any]) -> sg.ControlReply:
        """Answer one CONTROL call as the plugin and the scheduler do."""
        self.control_calls.append((call_id, method, args))
        ok, message = True, ""
        if method == "flush_cache":
            if self.running:
                ok, message = False, f"cache not flushed: {len(self.running)} requests are running"
        elif method == "start_profile":
            if self.profiling:
                ok, message = False, "profiling is already in progress"
            self.profiling = True
        elif method == "stop_profile":
            if not self.profiling:
                ok, message = False, "profiling is not in progress"
            self.profiling = False
        else:
            ok, message = False, f"unknown control method {method!r}"
        return sg.ControlReply(call_id, ok, message, self.engine_index)

    # ------------------------------------------------------------------ stepping

    def step(self) -> sg.SGLangBatch | None:
        """Advance every running request; the batch of those that emit (or None)."""
        self.steps += 1
        rows = []
        finished = []
        for rid, r in self.running.items():
            sp = r.params
            finish: str = ""
            matched: int | str | None = None
            for _ in range(self.tokens_per_step):
                if r.generated >= r.max_new_tokens:
                    finish = "length"
                    break
                tok = mock_token(r.prompt_hash, r.generated, sp.sampling_seed or 0, self.vocab_size)
                r.generated += 1
                r.unsent.append(tok)
                if not sp.ignore_eos and r.generated > sp.min_new_tokens:
                    if tok in self.eos_token_ids or (sp.stop_token_ids and tok in sp.stop_token_ids):
                        finish, matched = "stop", tok
                        break
                if r.stops:
                    r.tail.append(tok)
                    text = mock_text(r.tail)
                    hit = next((s for s in r.stops if s in text), None)
                    if hit is not None:
                        finish, matched = "stop", hit
                        break
                if r.generated >= r.max_new_tokens:
                    finish = "length"
                    break
            if finish or (r.request.stream and r.unsent and (r.interval == 1 or r.generated % r.interval == 1)):
                rows.append((rid, tuple(r.unsent), finish, None, matched, len(r.request.input_ids or ()),
                             r.generated))
                r.unsent = []
            if finish:
                finished.append(rid)
        batch = self._batch(rows) if rows else None
        for rid in finished:
            del self.running[rid]
        return batch

    def _batch(self, rows: list[tuple[Any, ...]], *, status: int | None = None) -> sg.SGLangBatch:
        lp_vals, lp_ids, top_vals, top_ids = [], [], [], []
        for rid, toks, *_ in rows:
            r = self.running.get(rid)
            req = r.request if r is not None else None
            if req is not None and req.return_logprob:
                lp_vals.append(tuple(_logprob(t) for t in toks))
                lp_ids.append(toks)
                k = req.top_logprobs_num
                top_ids.append(tuple((t, *((t + j) % self.vocab_size for j in range(1, k)))[:k] for t in toks)
                               if k else ())
                top_vals.append(tuple(tuple(_logprob(t) - j for j in range(k)) for t in toks) if k else ())
            else:
                lp_vals.append(())
                lp_ids.append(())
                top_vals.append(())
                top_ids.append(())
        used = sum(len(r.request.input_ids or ()) + r.generated for r in self.running.values())
        return sg.SGLangBatch(
            rids=tuple(row[0] for row in rows), output_ids=tuple(row[1] for row in rows),
            finished_reasons=tuple(row[2] for row in rows), finished_messages=tuple(row[3] for row in rows),
            finished_matched=tuple(row[4] for row in rows), prompt_tokens=tuple(row[5] for row in rows),
            completion_tokens=tuple(row[6] for row in rows), cached_tokens=tuple(0 for _ in rows),
            logprob_vals=tuple(lp_vals), logprob_ids=tuple(lp_ids), engine_index=self.engine_index,
            num_running=len(self.running), num_waiting=0, kv_used_tokens=used,
            kv_total_tokens=self.max_model_len * KV_TOKENS_PER_CONTEXT_TOKEN,
            finished_status=tuple(status if row[2] == "abort" else None for row in rows),
            top_logprob_vals=tuple(top_vals), top_logprob_ids=tuple(top_ids),
        )

    def stats(self) -> dict[str, int]:
        """Counters for leak checks and tests."""
        return {"live": len(self.running), "requests_received": self.requests_received,
                "aborts_received": len(self.aborts_received), "steps": self.steps}


def _loose_rid(frames: Sequence[bytes]) -> str | None:
    """Element 1 of an ADD payload that did not decode, read loosely (the plugin's rule)."""
    if len(frames) < 2 or bytes(frames[0]) != sg.RequestType.ADD.frame:
        return None
    try:
        obj = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except Exception:  # not even msgpack: nothing to answer
        return None
    return obj[1] if isinstance(obj, list) and len(obj) > 1 and isinstance(obj[1], str) else None
