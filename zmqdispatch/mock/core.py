"""Sans-IO model of a vLLM EngineCore scheduler, faithful where clients can tell.

What it reproduces of the real engine (vLLM 0.32, verified facts in
``docs/vllm-wire.md`` §5.4-§5.9):

- one ``EngineCoreOutputs`` per step listing every running request that made
  progress; ``new_token_ids`` are deltas; the first output of a request
  carries ``prefill_stats``;
- ``check_stop`` order: ``_eos_token_id`` (STOP, ``stop_reason`` nil), then
  ``stop_token_ids`` (STOP, ``stop_reason`` = the id), then ``max_tokens`` or
  ``max_model_len`` (LENGTH); ``min_tokens`` delays the first two; the stop
  token is included in the output;
- a client ABORT removes the request and produces **no** output;
- a duplicate live ``request_id``, a prompt token id >= ``vocab_size``, or a
  prompt of ``max_model_len`` tokens or more is fatal: the engine sends
  ``ENGINE_CORE_DEAD`` and exits (:class:`FatalEngineError`;
  ``docs/mock-engine.md``);
- utility calls: ``get_supported_tasks`` -> ``["generate"]``; the control
  plane of vLLM 0.32 as a CPU engine started without LoRA or a profiler answers
  it (``docs/control-plane.md``): ``sleep(level, mode)`` / ``wake_up(tags)`` /
  ``is_sleeping``, ``pause_scheduler(mode, clear_cache)`` / ``resume_scheduler`` /
  ``is_scheduler_paused`` (while paused nothing steps and new requests wait;
  mode ``"abort"`` finishes the running requests with ABORT outputs before the
  reply, ``"keep"`` freezes them; ``"wait"`` is answered at once when nothing runs
  and refused otherwise: the mock does not defer replies), ``reset_prefix_cache``
  -> ``True``, ``collective_rpc("check_health")`` -> ``[None]``, the LoRA calls and
  ``profile`` fail with the real engine's "not enabled" messages; unknown methods
  -> ``"Call to <m> method failed: ..."``;
  mock-only introspection for leak checks (not vLLM methods):
  ``zmqd_live_requests`` -> the number of running requests, ``zmqd_live_ids``
  -> their ids (first 1,000, sorted), ``zmqd_stats`` ->
  ``{"live", "requests_received", "aborts_received", "steps"}``;
- shutdown aborts running requests with finish ABORT and ``finished_requests``;
- multimodal ADDs (``mm_features``, tensors inline or as aux frames, decoded as vLLM's
  decoder does by the reader: what it fails on stops the input reader): the LRU receiver
  cache of vLLM 0.32 (``mm_cache_bytes``; an item sent with data nil that it does not
  hold is answered with one ERROR output carrying ``mm_cache_miss_hashes``, the engine
  serving on); the items' keys enter the token hash, so another image gives other
  tokens. The mock's own choice (not the real engine's, which fails later in the model
  runner): a placeholder outside the prompt, overlapping another or with an
  ``is_embed`` of another length is answered with an ERROR output.

Tokens are deterministic: a function of the prompt, the position and the
seed, so the same greedy request gives the same ids on every run.

Not reproduced (the real-engine tests cover these): logprobs and prompt
logprobs (the mock sends none, so a request asking for them gets empty
``output_logprobs``), and unseeded sampling (an unseeded request uses seed 0,
so unseeded ``n > 1`` samples are identical here, unlike on a real engine).
"""

from __future__ import annotations

from typing import Any

import attrs

from collections import OrderedDict, deque
from collections.abc import Iterable

from ..wire import vllm as wire
from ..wire import vllm_engine as wire_engine
from ..wire.vllm_multimodal import MultiModalFeatureSpec, cache_item_size

__all__ = ["MockEngineCore", "FatalEngineError", "mock_token"]

_UNKNOWN = object()  # not a control-plane method


class FatalEngineError(Exception):
    """The real engine would send ENGINE_CORE_DEAD and exit on this."""


def mock_token(prompt_hash: int, position: int, seed: int, vocab_size: int) -> int:
    """The mock's token at output *position* (0-based): deterministic, never
    below 3 so it does not collide with the usual special ids 0-2."""
    x = (prompt_hash * 1_000_003 + (position + 1) * 7_919 + seed * 104_729) & 0xFFFFFFFF
    x ^= x >> 13
    return 3 + x % (vocab_size - 3)


def mock_text(token_ids: Iterable[int]) -> str:
    """The mock's detokenizer: each token id is one lowercase letter,
    ``chr(ord("a") + id % 26)``, so a stop string of *n* letters spans *n* tokens.
    The vLLM and TokenSpeed mocks never detokenize (their engines match no stop
    strings); the SGLang mock matches stop strings on this text."""
    return "".join(chr(97 + t % 26) for t in token_ids)


@attrs.define(slots=True, eq=False)
class _Running:
    request: wire.EngineCoreRequest
    prompt_hash: int
    seed: int
    generated: int = 0
    first: bool = True


class MockEngineCore:
    """Per-step scheduler state of the mock engine.

    Args:
        engine_index: DP rank reported in every ``EngineCoreOutputs``.
        max_model_len: context length (LENGTH finish when reached).
        vocab_size: prompt token ids must be below it (else fatal).
        tokens_per_step: new tokens per request per step (1 on a real engine
            without speculative decoding).
        mm_cache_bytes: the multimodal receiver cache's capacity (vLLM's default
            ``mm_processor_cache_gb`` is 4); 0: no cache (an item sent with data nil misses).
    """

    def __init__(self, *, engine_index: int = 0, max_model_len: int = 4096, vocab_size: int = 32_000,
                 tokens_per_step: int = 1, mm_cache_bytes: int = 4 << 30) -> None:
        self.engine_index = engine_index
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokens_per_step = tokens_per_step
        self.running: dict[str, _Running] = {}
        #: the most recent aborted ids (bounded: a soak sends millions)
        self.aborts_received: deque[str] = deque(maxlen=10_000)
        self.aborts_total = 0
        self.requests_received = 0
        self.steps = 0
        #: scheduling paused (pause_scheduler, sleep): nothing steps, new requests wait
        self.paused = False
        #: memory released by a sleep of level >= 1 (until wake_up brings it back)
        self.memory_asleep = False
        #: outputs a utility call produced (pause with mode "abort"), sent before its reply
        self.utility_outputs: list[wire_engine.EngineCoreOutput] = []
        self.mm_cache_bytes = mm_cache_bytes
        #: the receiver cache: key -> charged size, least recently used first
        self.mm_cache: OrderedDict[str, int] = OrderedDict()
        self.mm_cache_used = 0
        self.mm_items_received = 0

    def _mm_receive(self, features: list[MultiModalFeatureSpec]) -> list[str]:
        """vLLM 0.32's ``LruKeyReplicatedReceiverCache.get_and_update_features``: the
        keys missing (data nil and not held)."""
        cache = self.mm_cache
        keys = [f.mm_hash or f.identifier for f in features]
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
        missing = []
        for f, k in zip(features, keys):
            if f.data is None:
                if k in cache:
                    cache.move_to_end(k)
                else:
                    missing.append(k)
                continue
            self.mm_items_received += 1
            old = cache.pop(k, None)
            if old is not None:
                self.mm_cache_used -= old
            size = cache_item_size(f)
            if size > self.mm_cache_bytes:
                continue
            while self.mm_cache_used + size > self.mm_cache_bytes:
                _, evicted = cache.popitem(last=False)
                self.mm_cache_used -= evicted
            cache[k] = size
            self.mm_cache_used += size
        return missing

    @staticmethod
    def _mm_placeholder_error(features: list[MultiModalFeatureSpec], prompt_len: int) -> str | None:
        end = 0
        for f in sorted(features, key=lambda f: f.mm_position.offset):
            p = f.mm_position
            if p.length < 1 or p.offset < 0 or p.offset + p.length > prompt_len:
                return f"placeholder [{p.offset}, {p.offset + p.length}) outside the prompt of {prompt_len} tokens"
            if p.offset < end:
                return f"placeholder at {p.offset} overlaps the one ending at {end}"
            if p.is_embed is not None and p.is_embed.shape != (p.length,):
                return f"is_embed of shape {list(p.is_embed.shape)} for a placeholder of {p.length}"
            end = p.offset + p.length
        return None

    def add(self, request: wire.EngineCoreRequest,
            mm_features: list[MultiModalFeatureSpec] | None = None) -> wire_engine.EngineCoreOutput | None:
        """Admit an ADD (*mm_features*: its ``mm_features`` as decoded by
        :func:`~zmqdispatch.wire.vllm_multimodal.decode_mm_features`). Returns an
        immediate ERROR output for a request the engine's preprocessing refuses
        (``max_tokens`` nil, a receiver-cache miss, a bad placeholder), else ``None``.

        Raises:
            FatalEngineError: duplicate live id, a token id >= vocab_size, or
                a prompt of ``max_model_len`` tokens or more (all kill vLLM 0.32).
        """
        self.requests_received += 1
        rid = request.request_id
        if rid in self.running:
            raise FatalEngineError(f"AssertionError: duplicate request id {rid}")
        if any(t >= self.vocab_size for t in request.prompt_token_ids or ()):
            raise FatalEngineError("IndexError: token id out of range for the embedding table")
        prompt_len = len(request.prompt_token_ids or ())
        if prompt_len >= self.max_model_len:
            # vLLM 0.32's EngineCore does not check the prompt length: its worker
            # fails sampling the first token past max_model_len (docs/mock-engine.md).
            raise FatalEngineError(
                f"RuntimeError: worker failed: a prompt of {prompt_len} tokens with max_model_len "
                f"{self.max_model_len}"
            )
        error = wire.FinishReason.ERROR
        h = 0
        if mm_features:
            missing = self._mm_receive(mm_features)
            if missing:
                return wire_engine.EngineCoreOutput(request_id=rid, new_token_ids=(), finish_reason=error,
                                                    mm_cache_miss_hashes=tuple(missing))
            if self._mm_placeholder_error(mm_features, prompt_len) is not None:
                return wire_engine.EngineCoreOutput(request_id=rid, new_token_ids=(), finish_reason=error)
            for f in mm_features:
                for c in (f.mm_hash or f.identifier).encode():
                    h = (h * 31 + c) & 0xFFFFFFFF
        sp = request.sampling_params
        if sp is None or sp.max_tokens is None:
            return wire_engine.EngineCoreOutput(request_id=rid, new_token_ids=(), finish_reason=error)
        prompt = request.prompt_token_ids or ()
        for t in prompt:
            h = (h * 31 + t) & 0xFFFFFFFF
        self.running[rid] = _Running(request, h, sp.seed if sp.seed is not None else 0)
        return None

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        """Remove requests; unknown ids are ignored; no output is produced."""
        for rid in request_ids:
            self.aborts_received.append(rid)
            self.aborts_total += 1
            self.running.pop(rid, None)

    @property
    def schedulable(self) -> bool:
        """Whether a step would do anything (requests run and scheduling is not paused)."""
        return bool(self.running) and not self.paused

    def step(self) -> list[wire_engine.EngineCoreOutput]:
        """Advance every running request by ``tokens_per_step`` tokens (nothing while paused)."""
        if self.paused:
            return []
        self.steps += 1
        outputs: list[wire_engine.EngineCoreOutput] = []
        finished: list[str] = []
        for rid, r in self.running.items():
            req = r.request
            sp = req.sampling_params
            assert sp is not None and sp.max_tokens is not None  # add() admits only checked requests
            prompt_len = len(req.prompt_token_ids or ())
            new: list[int] = []
            finish = None
            stop_reason = None
            for _ in range(self.tokens_per_step):
                tok = mock_token(r.prompt_hash, r.generated, r.seed, self.vocab_size)
                new.append(tok)
                r.generated += 1
                if r.generated > sp.min_tokens:
                    if sp.eos_token_id is not None and tok == sp.eos_token_id:
                        finish = wire.FinishReason.STOP
                        break
                    if tok in sp.stop_token_ids:
                        finish, stop_reason = wire.FinishReason.STOP, tok
                        break
                if r.generated >= sp.max_tokens or prompt_len + r.generated >= self.max_model_len:
                    finish = wire.FinishReason.LENGTH
                    break
            prefill = None
            if r.first:
                r.first = False
                prefill = wire_engine.PrefillStats(num_prompt_tokens=prompt_len, num_computed_tokens=prompt_len)
            outputs.append(
                wire_engine.EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=tuple(new),
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    prefill_stats=prefill,
                )
            )
            if finish is not None:
                finished.append(rid)
        for rid in finished:
            del self.running[rid]
        return outputs

    def abort_all(self) -> list[wire_engine.EngineCoreOutput]:
        """Shutdown: finish every running request with ABORT."""
        outs = [
            wire_engine.EngineCoreOutput(request_id=rid, new_token_ids=(), finish_reason=wire.FinishReason.ABORT)
            for rid in self.running
        ]
        self.running.clear()
        return outs

    def _pause(self, mode: object) -> str | None:
        """vLLM's pause_scheduler: ``None``, or why the mock refuses it."""
        if mode not in ("abort", "wait", "keep"):
            return f"Invalid pause mode: {mode}"
        if mode == "wait" and self.running:
            return "pause mode 'wait' with running requests is not reproduced by the mock (it answers at once)"
        if mode == "abort":
            self.utility_outputs.extend(self.abort_all())
        self.paused = True
        return None

    def _control(self, method: str, args: tuple[Any, ...]) -> tuple[object, str | None]:
        """The control-plane utility methods (module doc); ``(result, failure_message)``."""
        if method == "is_sleeping":
            return self.paused or self.memory_asleep, None
        if method == "is_scheduler_paused":
            return self.paused, None
        if method == "sleep":
            level = args[0] if args else 1
            why = self._pause(args[1] if len(args) > 1 else "abort")
            if why is None and level >= 1:
                self.memory_asleep = True
            return None, why
        if method == "pause_scheduler":
            return None, self._pause(args[0] if args else "abort")
        if method == "resume_scheduler":
            self.paused = False
            return None, None
        if method == "wake_up":
            tags = args[0] if args else None
            if tags is None or any(t != "scheduling" for t in tags):
                self.memory_asleep = False
            if not self.memory_asleep:
                self.paused = False
            return not self.memory_asleep, None
        if method == "reset_prefix_cache":
            return True, None
        if method == "collective_rpc":
            if args and args[0] == "check_health":
                return [None], None
            return None, f"Worker failed with error ''MockWorker' object has no attribute '{args[0] if args else ''}''"
        if method in ("add_lora", "remove_lora", "pin_lora", "list_loras"):
            return None, "Worker failed with error 'LoRA is not enabled. Use --enable-lora to enable LoRA.'"
        if method == "profile":
            return None, ("Worker failed with error 'Profiling is not enabled. "
                          "Please set --profiler-config to enable profiling.'")
        return _UNKNOWN, None

    def utility(self, method: str, args: tuple[Any, ...]) -> tuple[object, str | None]:
        """Run a utility method: ``(result, failure_message)``. Outputs it
        produced (a pause with mode ``"abort"``) are in :attr:`utility_outputs`."""
        if method == "get_supported_tasks":
            return ("generate",), None
        result, failure = self._control(method, args)
        if result is not _UNKNOWN:
            return result, None if failure is None else f"Call to {method} method failed: {failure}"
        if method == "zmqd_live_requests":
            return len(self.running), None
        if method == "zmqd_live_ids":
            return sorted(self.running)[:1000], None
        if method == "zmqd_stats":
            return {
                "live": len(self.running),
                "requests_received": self.requests_received,
                "aborts_received": self.aborts_total,
                "steps": self.steps,
            }, None
        return None, f"Call to {method} method failed: 'EngineCoreProc' object has no attribute '{method}'"
