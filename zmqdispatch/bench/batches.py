"""The benchmark engine's step encoders for TokenSpeed and SGLang (sans-IO).

Both runtimes send one column-major batch per step (TokenSpeed 0.1.1's 14-element
``BatchTokenIDOutSlim``, :func:`zmqdispatch.wire.tokenspeed_engine.encode_outputs`;
SGLang 0.5.21's 16-element ``BatchTokenIDSlimOutput``,
:func:`zmqdispatch.wire.sglang_engine.encode_outputs`): every column is an array
parallel to ``rids``. The encoders here write the same bytes (checked at
construction and in ``tests/bench``) without building the batch objects:

- the rows of requests past their first output ("steady" rows) come first
  in admission order; their ``rids`` and ``prompt_tokens`` columns and their
  constant entries (``""`` finish, 0 cached, ``[]`` logprobs, nil messages) are
  encoded once and cached until the steady set changes;
- their ``output_ids`` entries are all this step's ``[tok] * k``: one packed
  piece, repeated;
- their cumulative ``completion_tokens`` differ by admission step: requests
  admitted in the same step share a cohort, and a cohort's entries are one
  packed count repeated (``(step - first_step + 1) * k``), so a step costs one
  pack per cohort, not per request;
- new requests' first rows and final LENGTH rows are packed one by one, in
  front of the steady rows.

Lifecycle and token ids as :class:`zmqdispatch.bench.engine.StepEncoder`: a
request's first row goes out in the step after :meth:`add`; with
``max_tokens`` it ends with a LENGTH row holding exactly ``max_tokens`` tokens
in all; :meth:`remove` (ABORT) drops it with no further row. Every batch
carries the load tail: running requests after the step, 0 waiting, KV in use
(TokenSpeed: the running requests' prompt and generated tokens / 16, rounded
up, in pages; SGLang: in tokens) and the *kv_total* given.
"""

from __future__ import annotations

from collections.abc import Mapping

import time
from collections.abc import Callable
from typing import ClassVar

from ._admitted import RunningRequests
from ..wire import sglang as sg
from ..wire import sglang_engine as sg_engine
from ..wire import tokenspeed as ts
from ..wire import tokenspeed_engine as ts_engine
from ..wire.schema import _pack, msgpack_array_header

__all__ = ["BatchStepEncoder", "TokenSpeedStepEncoder", "SGLangStepEncoder", "make_step_encoder", "TOKEN_MODULUS",
           "token_for_step", "KV_PAGE_TOKENS"]

#: Token ids are ``step % TOKEN_MODULUS`` (as the vLLM encoder's).
TOKEN_MODULUS = 2**31
#: Tokens per KV page in TokenSpeed's load tail.
KV_PAGE_TOKENS = 16

_EMPTY_STR = _pack("")
_NIL = _pack(None)
_ZERO = _pack(0)
_EMPTY_ARRAY = _pack([])

#: One row of a batch: (rid, tokens, finish reason or "", prompt tokens, completion tokens so far)
Row = tuple[str, tuple[int, ...], str, int, int]


def token_for_step(step: int) -> int:
    """The token id every request gets in step *step*."""
    return step % TOKEN_MODULUS


class BatchStepEncoder(RunningRequests):
    """The running requests and the bytes of their next batch (one runtime's layout).

    Args:
        engine_index: the batch's ``engine_index``.
        tokens_per_tick: new tokens per request per step.
        kv_total: the load tail's KV capacity (TokenSpeed: pages; SGLang: tokens).

    Raises:
        ValueError: ``tokens_per_tick`` below 1.
        AssertionError: the runtime's encoder no longer writes the layout spliced here.
    """

    runtime: ClassVar[str]

    def __init__(self, *, engine_index: int = 0, tokens_per_tick: int = 1, kv_total: int = 0) -> None:
        if tokens_per_tick < 1:
            raise ValueError("tokens_per_tick must be >= 1")
        self.engine_index = engine_index
        self.tokens_per_tick = tokens_per_tick
        self.kv_total = kv_total
        #: requests waiting for their first row: rid -> (prompt_len, max_tokens)
        self._new: dict[str, tuple[int, int | None]] = {}
        #: steady rows by cohort: first step -> {rid: prompt_len}, in admission order
        self._cohorts: dict[int, dict[str, int]] = {}
        #: steady rid -> its cohort's first step
        self._cohort_of: dict[str, int] = {}
        self._steady_prompt = 0
        #: rid -> (final step, tokens in the final row)
        self._final: dict[str, tuple[int, int]] = {}
        self._final_at: dict[int, list[str]] = {}
        self._cache: dict[str, bytes] | None = None
        self._check_layout()

    # ------------------------------------------------------------------ state

    @property
    def _started(self) -> Mapping[str, object]:
        return self._cohort_of

    def remove(self, request_id: str) -> bool:
        """Drop a request (ABORT: no more rows). False when unknown."""
        if self._new.pop(request_id, None) is not None:
            return True
        if request_id in self._cohort_of:
            self._drop_steady(request_id)
            self._final.pop(request_id, None)
            return True
        return False

    def clear(self) -> None:
        """Drop every request."""
        self._new.clear()
        self._cohorts.clear()
        self._cohort_of.clear()
        self._steady_prompt = 0
        self._final.clear()
        self._final_at.clear()
        self._cache = None

    def _drop_steady(self, request_id: str) -> int:
        first = self._cohort_of.pop(request_id)
        cohort = self._cohorts[first]
        prompt = cohort.pop(request_id)
        if not cohort:
            del self._cohorts[first]
        self._steady_prompt -= prompt
        self._cache = None
        return first

    # ------------------------------------------------------------------ encoding

    def encode_step(self, step: int, clock: Callable[[], float] = time.monotonic
                    ) -> tuple[bytes, float, int, int, list[str]]:
        """Advance every running request by one tick and encode the batch.

        Args:
            step: the step number (its tokens are ``token_for_step(step)``).
            clock: called once, right before the bytes are joined (the send
                time the engine's step table records; these batches carry none).

        Returns:
            ``(payload, send_time, rows, tokens, finished_ids)``; ``rows`` is 0
            (and the payload empty) when nothing is running.
        """
        k = self.tokens_per_tick
        tok = token_for_step(step)
        fixed: list[Row] = []
        finished: list[str] = []
        due = self._final_at.pop(step, None)
        if due:
            for rid in due:
                final = self._final.pop(rid, None)
                if final is None or final[0] != step or rid not in self._cohort_of:
                    continue  # aborted meanwhile
                prompt = self._cohorts[self._cohort_of[rid]][rid]
                first = self._drop_steady(rid)
                n = final[1]
                fixed.append((rid, (tok,) * n, "length", prompt, (step - first) * k + n))
                finished.append(rid)
        promoted: list[tuple[str, int]] = []
        if self._new:
            new, self._new = self._new, {}
            for rid, (prompt, max_tokens) in new.items():
                if max_tokens is not None and max_tokens <= k:
                    fixed.append((rid, (tok,) * max_tokens, "length", prompt, max_tokens))
                    finished.append(rid)
                    continue
                fixed.append((rid, (tok,) * k, "", prompt, k))
                promoted.append((rid, prompt))
                if max_tokens is not None:
                    ticks = -(-max_tokens // k)
                    last = step + ticks - 1
                    self._final[rid] = (last, max_tokens - (ticks - 1) * k)
                    self._final_at.setdefault(last, []).append(rid)
        n_steady = len(self._cohort_of)
        rows = len(fixed) + n_steady
        if rows == 0:
            self._promote(step, promoted)
            return b"", 0.0, 0, 0, finished
        cache = self._cache if self._cache is not None else self._rebuild()
        head = msgpack_array_header(rows)
        completion = b"".join([_pack((step - first + 1) * k) * len(cohort)
                               for first, cohort in self._cohorts.items()])
        # load after this step: the steady rows (a tick more), the promoted ones
        generated = sum((step - first + 1) * k * len(cohort) for first, cohort in self._cohorts.items())
        used = self._steady_prompt + generated + sum(p + k for _, p in promoted)
        columns = {
            "rids": head + b"".join([_pack(r[0]) for r in fixed]) + cache["rids"],
            "output_ids": head + b"".join([_pack(r[1]) for r in fixed])
                          + (msgpack_array_header(k) + _pack(tok) * k) * n_steady,
            "finished_reasons": head + b"".join([_pack(r[2]) for r in fixed]) + cache["reasons"],
            "prompt_tokens": head + b"".join([_pack(r[3]) for r in fixed]) + cache["prompts"],
            "completion_tokens": head + b"".join([_pack(r[4]) for r in fixed]) + completion,
            "nils": head + _NIL * rows,
            "zeros": head + _ZERO * rows,
            "empties": head + _EMPTY_ARRAY * rows,
        }
        running = n_steady + len(promoted)
        self._promote(step, promoted)
        parts = self._layout(columns, running, used)
        t = clock()
        return b"".join(parts), t, rows, sum(len(r[1]) for r in fixed) + n_steady * k, finished

    def _promote(self, step: int, promoted: list[tuple[str, int]]) -> None:
        if not promoted:
            return
        cohort = self._cohorts.setdefault(step, {})
        for rid, prompt in promoted:
            cohort[rid] = prompt
            self._cohort_of[rid] = step
            self._steady_prompt += prompt
        self._cache = None

    def _rebuild(self) -> dict[str, bytes]:
        rids: list[bytes] = []
        prompts: list[bytes] = []
        for cohort in self._cohorts.values():
            for rid, prompt in cohort.items():
                rids.append(_pack(rid))
                prompts.append(_pack(prompt))
        self._cache = {"rids": b"".join(rids), "prompts": b"".join(prompts),
                       "reasons": _EMPTY_STR * len(rids)}
        return self._cache

    def _layout(self, columns: dict[str, bytes], running: int, kv_used_tokens: int) -> list[bytes]:
        """The batch's elements in wire order (the runtime's encoder)."""
        raise NotImplementedError

    def _reference(self, rows: list[Row], running: int, kv_used_tokens: int) -> bytes:
        """The same batch through the runtime's own encoder."""
        raise NotImplementedError

    def _check_layout(self) -> None:
        """Once per class: a probe's spliced batch must equal the runtime encoder's bytes."""
        cls = type(self)
        if cls._layout_checked:
            return
        cls._layout_checked = True  # before the probe, which is an instance too
        try:
            probe = cls(engine_index=self.engine_index, tokens_per_tick=1, kv_total=self.kv_total)
            probe.add("probe-a", 3, None)
            probe.add("probe-b", 5, 2)
            probe.encode_step(7)
            payload = probe.encode_step(8)[0]
            # step 8: b's final row (in front), then a's steady row; a runs on (3 + 2 tokens)
            want = probe._reference([("probe-b", (8,), "length", 5, 2), ("probe-a", (8,), "", 3, 2)], 1, 5)
        except BaseException:
            cls._layout_checked = False
            raise
        if payload != want:
            cls._layout_checked = False
            raise AssertionError(f"unexpected {cls.runtime} batch layout: {payload.hex()} != {want.hex()}")

    _layout_checked: ClassVar[bool] = False


class TokenSpeedStepEncoder(BatchStepEncoder):
    """TokenSpeed 0.1.1's ``BatchTokenIDOutSlim`` (14 elements) per step."""

    runtime = "tokenspeed"
    _layout_checked: ClassVar[bool] = False
    _HEAD = msgpack_array_header(ts.BATCH_ELEMENTS) + _pack(ts.BATCH_TAG)

    def _layout(self, columns: dict[str, bytes], running: int, kv_used_tokens: int) -> list[bytes]:
        pages = -(-kv_used_tokens // KV_PAGE_TOKENS)
        return [self._HEAD, columns["rids"], columns["output_ids"], columns["finished_reasons"],
                columns["prompt_tokens"], columns["completion_tokens"], columns["zeros"], columns["empties"],
                columns["empties"], _pack(self.engine_index), _pack(running), _ZERO, _pack(pages),
                _pack(self.kv_total)]

    def _reference(self, rows: list[Row], running: int, kv_used_tokens: int) -> bytes:
        return ts_engine.encode_outputs(ts.TokenSpeedBatch(
            engine_index=self.engine_index, rids=tuple(r[0] for r in rows), output_ids=tuple(r[1] for r in rows),
            finished_reasons=tuple(r[2] for r in rows), prompt_tokens=tuple(r[3] for r in rows),
            completion_tokens=tuple(r[4] for r in rows), cached_tokens=(0,) * len(rows),
            logprob_vals=((),) * len(rows), logprob_ids=((),) * len(rows), num_running=running, num_waiting=0,
            kv_active_pages=-(-kv_used_tokens // KV_PAGE_TOKENS), kv_total_pages=self.kv_total))[0]


class SGLangStepEncoder(BatchStepEncoder):
    """SGLang 0.5.21's ``BatchTokenIDSlimOutput`` (16 elements: no optional column) per step."""

    runtime = "sglang"
    _layout_checked: ClassVar[bool] = False
    _HEAD = msgpack_array_header(16) + _pack(sg.BATCH_TAG)

    def _layout(self, columns: dict[str, bytes], running: int, kv_used_tokens: int) -> list[bytes]:
        return [self._HEAD, columns["rids"], columns["output_ids"], columns["finished_reasons"], columns["nils"],
                columns["nils"], columns["prompt_tokens"], columns["completion_tokens"], columns["zeros"],
                columns["empties"], columns["empties"], _pack(self.engine_index), _pack(running), _ZERO,
                _pack(kv_used_tokens), _pack(self.kv_total)]

    def _reference(self, rows: list[Row], running: int, kv_used_tokens: int) -> bytes:
        m = len(rows)
        return sg_engine.encode_outputs(sg.SGLangBatch(
            rids=tuple(r[0] for r in rows), output_ids=tuple(r[1] for r in rows),
            finished_reasons=tuple(r[2] for r in rows), finished_messages=(None,) * m,
            finished_matched=(None,) * m, prompt_tokens=tuple(r[3] for r in rows),
            completion_tokens=tuple(r[4] for r in rows), cached_tokens=(0,) * m, logprob_vals=((),) * m,
            logprob_ids=((),) * m, engine_index=self.engine_index, num_running=running, num_waiting=0,
            kv_used_tokens=kv_used_tokens, kv_total_tokens=self.kv_total))[0]


def make_step_encoder(runtime: str, *, engine_index: int = 0, tokens_per_tick: int = 1,
                      kv_total: int = 0) -> BatchStepEncoder:
    """The step encoder of *runtime* (``"tokenspeed"`` or ``"sglang"``).

    Raises:
        ValueError: another runtime (vLLM's is :class:`zmqdispatch.bench.engine.StepEncoder`).
    """
    cls: dict[str, type[BatchStepEncoder]] = {"tokenspeed": TokenSpeedStepEncoder, "sglang": SGLangStepEncoder}
    if runtime not in cls:
        raise ValueError(f"no batch step encoder for runtime {runtime!r}; expected tokenspeed or sglang")
    return cls[runtime](engine_index=engine_index, tokens_per_tick=tokens_per_tick, kv_total=kv_total)

