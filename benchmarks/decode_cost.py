#!/usr/bin/env python3
"""Output-message decode cost: the msgpack reference decoders against msgspec typed structs.

Builds realistic output messages with the engine-side encoders (C rows per message,
each a request output with one new token, no logprobs, a few finished rows; for
TokenSpeed the same as one ``BatchTokenIDOutSlim``) and decodes each, side by side in
one run, with:

- ``msgpack``: the msgpack reference decoders (``wire.vllm._decode_outputs_msgpack`` /
  ``wire.tokenspeed._decode_outputs_msgpack``: one ``msgpack.unpackb`` with arrays as tuples plus
  the checks; the vLLM one also builds the ``EngineCoreOutputRow`` structs the client reads);
- ``msgpack-raw``: the bare ``msgpack.unpackb`` those decoders start with (their floor);
- ``msgspec``: ``msgspec.msgpack.Decoder(type=...)`` into ``array_like`` ``msgspec.Struct``
  classes shaped like vLLM's own (``EngineCoreOutputs`` / ``EngineCoreOutput``; TokenSpeed's
  tagged ``BatchTokenIDOutSlim``), the value checks today's decoders make expressed as
  ``msgspec.Meta`` constraints (token ids 0..MAX_TOKEN_ID, at most MAX_TOKENS_PER_TICK
  per row, finish_reason 0..4), the ext hook the same one (``wire.tensors.ext_hook``);
- ``decode_outputs``: the hot path as the client calls it: msgspec typed (vLLM: into
  ``EngineCoreOutputRow`` rows, plus the prefill-stats pass; TokenSpeed: with the
  ragged-column checks), the message built (the msgpack reference is the ``msgpack`` line);
- SGLang (``BatchTokenIDSlimOutput`` with the load tail and ``finished_status``):
  ``msgpack-raw`` and ``decode_outputs`` (the msgpack reference decoder: SGLang's has
  no typed fast path yet);
- ``msgspec+tuples`` (vLLM only): the ``msgspec`` line with each row then turned into a
  tuple (``msgspec.structs.astuple``): what rows indexed by position would cost.

Prints µs per message and ns per row for each, and a calibration line (a fixed pure
Python loop) to compare runs across machines. Never asserted in tests.

    python benchmarks/decode_cost.py            # C = 100 and 1000
    python benchmarks/decode_cost.py --concurrency 100 --seconds 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgpack
import msgspec

from zmqdispatch import limits
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine
from zmqdispatch.wire.tensors import ext_hook

TokenId = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_TOKEN_ID)]
Tokens = Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=limits.MAX_TOKENS_PER_TICK)]
Count = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_TOKEN_ID)]


class PrefillStats(msgspec.Struct, gc=False):
    num_prompt_tokens: Count | None = None
    num_cached_tokens: Count | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """vLLM 0.32.0 ``EngineCoreOutput`` (+ 0.33.0's ``error``), in wire order."""

    request_id: str
    new_token_ids: Tokens
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: Annotated[int, msgspec.Meta(ge=0, le=4)] | None = None
    stop_reason: TokenId | str | None = None
    events: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    trace_headers: Any = None
    prefill_stats: PrefillStats | None = None
    routed_experts: Any = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: Any = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None
    error: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """vLLM 0.32.0 ``EngineCoreOutputs``, in wire order."""

    engine_index: int = 0
    outputs: Annotated[tuple[EngineCoreOutput, ...], msgspec.Meta(max_length=limits.MAX_OUTPUTS_PER_MESSAGE)] = ()
    scheduler_stats: dict[str, Any] | None = None
    timestamp: float = 0.0
    utility_output: Any = None
    finished_requests: tuple[str, ...] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class BatchTokenIDOutSlim(msgspec.Struct, array_like=True, tag=True, gc=False):
    """TokenSpeed 0.1.1 ``BatchTokenIDOutSlim`` (tagged), in wire order."""

    rids: tuple[str, ...]
    output_ids: tuple[Tokens, ...]
    finished_reasons: tuple[str, ...]
    prompt_tokens: tuple[Count, ...]
    completion_tokens: tuple[Count, ...]
    cached_tokens: tuple[Count, ...]
    output_token_logprobs_val: tuple[tuple[float, ...], ...]
    output_token_logprobs_idx: tuple[Tokens, ...]
    engine_index: NonNeg = 0
    num_running: NonNeg = 0
    num_waiting: NonNeg = 0
    kv_active_pages: NonNeg = 0
    kv_total_pages: NonNeg = 0


def _ext_hook(code: int, data: memoryview) -> Any:
    return ext_hook(code, bytes(data))


VLLM_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs, ext_hook=_ext_hook)
TS_DECODER = msgspec.msgpack.Decoder(BatchTokenIDOutSlim, ext_hook=_ext_hook)
_astuple = msgspec.structs.astuple


def vllm_message(c: int, step: int, finished: int) -> list[bytes]:
    outs = [
        wire_engine.EngineCoreOutput(
            request_id=f"req-{step}-{i:06d}",
            new_token_ids=(1000 + (i * 7 + step) % 30000,),
            finish_reason=wire.FinishReason.STOP if i < finished else None,
            stop_reason=None,
        )
        for i in range(c)
    ]
    return wire_engine.encode_outputs(0, outs, timestamp=time.monotonic())


def ts_message(c: int, step: int, finished: int) -> list[bytes]:
    return ts_engine.encode_outputs(ts.TokenSpeedBatch(
        rids=tuple(f"req-{step}-{i:06d}" for i in range(c)),
        output_ids=tuple((1000 + (i * 7 + step) % 30000,) for i in range(c)),
        finished_reasons=tuple("stop" if i < finished else "" for i in range(c)),
        prompt_tokens=(128,) * c, completion_tokens=(step + 1,) * c, cached_tokens=(0,) * c,
        logprob_vals=((),) * c, logprob_ids=((),) * c, num_running=c, kv_active_pages=c, kv_total_pages=4096))


def sg_message(c: int, step: int, finished: int) -> list[bytes]:
    return sg_engine.encode_outputs(sg.SGLangBatch(
        rids=tuple(f"req-{step}-{i:06d}" for i in range(c)),
        output_ids=tuple((1000 + (i * 7 + step) % 30000,) for i in range(c)),
        finished_reasons=tuple("stop" if i < finished else "" for i in range(c)),
        finished_messages=(None,) * c, finished_matched=tuple(2 if i < finished else None for i in range(c)),
        prompt_tokens=(128,) * c, completion_tokens=(step + 1,) * c, cached_tokens=(0,) * c,
        logprob_vals=((),) * c, logprob_ids=((),) * c, num_running=c, kv_used_tokens=c * 130,
        kv_total_tokens=65536, finished_status=(None,) * c))


def _raw(frames: list[bytes]) -> Any:
    return msgpack.unpackb(frames[0], use_list=False, raw=False, strict_map_key=False, ext_hook=ext_hook)


def _vllm_msgspec(frames: list[bytes]) -> Any:
    return VLLM_DECODER.decode(frames[0])


def _vllm_msgspec_tuples(frames: list[bytes]) -> Any:
    out = VLLM_DECODER.decode(frames[0])
    return [_astuple(r) for r in out.outputs]


def _ts_msgspec(frames: list[bytes]) -> Any:
    return TS_DECODER.decode(frames[0])


def _time(fn: Callable[[list[bytes]], Any], messages: list[list[bytes]], seconds: float) -> float:
    """Best-of-5 seconds per message of ``fn`` over ``messages``."""
    for m in messages:
        fn(m)
    reps = 1
    while True:  # calibrate the batch size to ~seconds / 10
        t0 = time.perf_counter()
        for _ in range(reps):
            for m in messages:
                fn(m)
        dt = time.perf_counter() - t0
        if dt > seconds / 10 or reps > 1 << 20:
            break
        reps *= 2
    best = dt
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            for m in messages:
                fn(m)
        best = min(best, time.perf_counter() - t0)
    return best / (reps * len(messages))


def calibration() -> float:
    """ns per iteration of a fixed pure-Python loop (compare machines with it)."""
    def loop() -> int:
        s = 0
        for i in range(200_000):
            s += i & 7
        return s
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        loop()
        best = min(best, time.perf_counter() - t0)
    return best / 200_000 * 1e9


def _check_same(c: int) -> None:
    """The msgspec structs see what the reference decoder sees (same rows, same envelope)."""
    frames = vllm_message(c, 0, 3)
    old = wire._decode_outputs_msgpack(frames)
    assert wire.decode_outputs(frames) == old, "decode_outputs and the msgpack reference differ"
    new = VLLM_DECODER.decode(frames[0])
    rows = tuple(_astuple(r) for r in new.outputs)
    assert rows == tuple(_astuple(r) for r in old.outputs), "vLLM rows differ"
    assert (new.engine_index, new.timestamp, new.weight_version) == (old.engine_index, old.timestamp,
                                                                      old.weight_version)
    frames = ts_message(c, 0, 3)
    old_b = ts._decode_outputs_msgpack(frames)
    new_b = TS_DECODER.decode(frames[0])
    assert new_b.rids == old_b.rids and new_b.output_ids == old_b.output_ids
    assert new_b.finished_reasons == old_b.finished_reasons and new_b.kv_total_pages == old_b.kv_total_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--finished", type=int, default=3, help="finished rows per message")
    ap.add_argument("--seconds", type=float, default=1.0, help="rough time per measurement")
    args = ap.parse_args()
    print(f"msgpack {msgpack.version}, msgspec {msgspec.__version__}")
    print(f"calibration: {calibration():.1f} ns per pure-Python loop iteration")
    print(f"{'runtime':>10} {'C':>5} {'decoder':>15} {'µs / message':>13} {'ns / row':>9} {'vs msgpack':>10}")
    for c in args.concurrency:
        _check_same(c)
        cases = {
            "vllm": ([vllm_message(c, s, args.finished) for s in range(8)], [
                ("msgpack", wire._decode_outputs_msgpack), ("msgpack-raw", _raw),
                ("msgspec", _vllm_msgspec), ("msgspec+tuples", _vllm_msgspec_tuples),
                ("decode_outputs", wire.decode_outputs)]),
            "tokenspeed": ([ts_message(c, s, args.finished) for s in range(8)], [
                ("msgpack", ts._decode_outputs_msgpack), ("msgpack-raw", _raw), ("msgspec", _ts_msgspec),
                ("decode_outputs", ts.decode_outputs)]),
            "sglang": ([sg_message(c, s, args.finished) for s in range(8)], [
                ("msgpack-raw", _raw), ("decode_outputs", sg.decode_outputs)]),
        }
        for runtime, (messages, decoders) in cases.items():
            base = None
            for name, fn in decoders:
                per_msg = _time(fn, messages, args.seconds)
                base = base or per_msg
                print(f"{runtime:>10} {c:>5} {name:>15} {per_msg * 1e6:>13.1f} {per_msg / c * 1e9:>9.0f}"
                      f" {base / per_msg:>9.2f}x")


if __name__ == "__main__":
    main()
