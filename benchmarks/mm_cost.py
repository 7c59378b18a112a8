#!/usr/bin/env python3
"""Client cost of a multimodal request: CPU per MB of tensor, and the copies made.

For one image request of 1, 4 and 16 MB of float32 pixel values (a gateway
``GenerateRequest`` with ``mm_inputs``, built once, as the gRPC servicer holds it after
parsing), measured separately, each repeated for ``--seconds``:

- ``translate``: ``translate_request`` (the split, every check, ``mm_features`` built);
- ``+cast bf16``: the same with ``mm_dtype="bfloat16"`` (the float32 pixels cast to the
  model's dtype, a new buffer);
- ``check``: ``check_request`` (what ``EngineClient.generate`` runs before queueing);
- ``encode``: ``wire.vllm.encode_request`` (the ADD's frames: body + the pixel aux frame);
- ``one copy``: ``bytes(frame)`` of the aux frame: what one copy of the tensor costs here
  (libzmq's copy into its message when the shell sends, ``copy=True``, is one such copy);

and the copies: ``tracemalloc``'s peak of new allocations during translate + check +
encode, in tensor sizes (the only one expected: protobuf handing out the ``inline``
field as a new ``bytes`` when it is read, once per tensor), and whether the aux frame is
that very buffer (``frame.obj is`` the bytes the translated tensor views).

Prints one line per size; never asserted in tests. Figures: ``results/multimodal.md``.

    python benchmarks/mm_cost.py                 # 1, 4, 16 MB, 2 s each
    python benchmarks/mm_cost.py --mb 64 --seconds 5
"""

from __future__ import annotations

import argparse
import struct
import time
import tracemalloc
from collections.abc import Callable

from zmqdispatch.protocol.checks import check_request
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire

MB = 1 << 20


def image_request(nbytes: int) -> pb.GenerateRequest:
    side = int((nbytes / 12) ** 0.5)  # [1, 3, side, side] float32
    # normalized pixels as an image processor leaves them (about -2..2.6), no NaN
    n = 3 * side * side
    data = struct.pack(f"<{n}f", *((k * 7919 % 4601) / 1000 - 2.0 for k in range(n)))
    r = pb.GenerateRequest(request_id="img", tokenized=pb.TokenizedInput(input_ids=[1, *[9] * 64, 2]),
                           sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=16))
    m = r.mm_inputs
    m.pixel_values.CopyFrom(pb.TensorData(shape=[1, 3, side, side], dtype="float32", inline=data))
    m.batched_keys.append("pixel_values")
    m.mm_placeholders.add(offset=1, length=64)
    m.mm_hashes.append("h")
    return r


def cpu_per_call(fn: Callable[[], object], seconds: float) -> float:
    """CPU seconds per call of *fn*, over at least *seconds* of CPU (after a warm-up)."""
    fn()
    n, t0 = 0, time.process_time()
    while True:
        for _ in range(4):
            fn()
        n += 4
        spent = time.process_time() - t0
        if spent >= seconds:
            return spent / n


def calibration() -> float:
    """ns per iteration of a fixed pure-Python loop (compare runs across machines)."""
    t0 = time.process_time()
    x = 0
    for i in range(2_000_000):
        x += i & 7
    return (time.process_time() - t0) / 2_000_000 * 1e9


def measure(nbytes: int, seconds: float) -> dict[str, float | bool]:
    req = image_request(nbytes)
    size = req.mm_inputs.pixel_values.ByteSize() - 20
    config = TranslationConfig(max_model_len=4096, max_mm_bytes=1 << 30)
    t = translate_request(req, config, arrival_time=0.0).request

    def translate() -> object:
        return translate_request(req, config, arrival_time=0.0)

    cast_config = TranslationConfig(max_model_len=4096, max_mm_bytes=1 << 30, mm_dtype="bfloat16")

    def translate_cast() -> object:
        return translate_request(req, cast_config, arrival_time=0.0)

    def check() -> None:
        check_request(t, max_model_len=4096)

    frames = wire.encode_request(t)

    def encode() -> object:
        return wire.encode_request(t)

    def one_copy() -> object:
        return bytes(frames[1])

    out: dict[str, float | bool] = {"mb": nbytes / MB}
    for name, fn in (("translate", translate), ("cast", translate_cast), ("check", check), ("encode", encode),
                     ("one_copy", one_copy)):
        out[name] = cpu_per_call(fn, seconds / 4) / (nbytes / MB) * 1e6  # µs per MB
    # copies: peak new memory while a request goes from the proto to its frames
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    e = translate_request(req, config, arrival_time=0.0).request
    check_request(e, max_model_len=4096)
    fr = wire.encode_request(e)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    src = e.mm_features[0]["data"]["pixel_values"]["data"].data
    out["copies"] = peak / size
    out["aux_is_the_translated_buffer"] = len(fr) == 2 and isinstance(fr[1], memoryview) and fr[1].obj is src.obj
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per size")
    args = ap.parse_args()
    print(f"calibration: {calibration():.1f} ns per loop iteration")
    print("MB  | translate µs/MB | +cast bf16 µs/MB | check µs/MB | encode µs/MB | one copy µs/MB | "
          "copies (tensor sizes) | aux frame = translated buffer")
    for mb in args.mb:
        r = measure(int(mb * MB), args.seconds)
        print(f"{r['mb']:>3.0f} | {r['translate']:15.1f} | {r['cast']:16.1f} | {r['check']:11.2f} | "
              f"{r['encode']:12.2f} | "
              f"{r['one_copy']:14.1f} | {r['copies']:21.2f} | {r['aux_is_the_translated_buffer']}")


if __name__ == "__main__":
    main()
