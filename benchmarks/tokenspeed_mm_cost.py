#!/usr/bin/env python3
"""Client CPU of one TokenSpeed multimodal request, sans-IO: the gateway proto
translated (``translate_request``: tensor checks, placeholders, padding), checked
(``check_tokenspeed_request``) and encoded (``encode_add``: the ADD's frames), for one
image of each ``--mb`` size; and the copies of the tensor bytes made on the way.

Reads ``time.thread_time`` around ``--repeat`` runs per case and prints the median µs per
request and per MB, with the content hash given (the gateway's), empty (the feature is
hashed on the client), and given with ``mm_dtype`` bfloat16 (float32 cast on the
client). The bytes the proto hands out are read once per request (protobuf copies them
when the field is read: part of the figure); the frame sent is that same buffer (or,
cast, the new one), checked here with ``is``.

    python benchmarks/tokenspeed_mm_cost.py --mb 1 10 --repeat 20
"""

from __future__ import annotations

import argparse
import statistics
import time

from smg_grpc_proto.generated import common_pb2

from zmqdispatch.protocol.checks import check_tokenspeed_request
from zmqdispatch.translate.tokenspeed import TranslationConfig, pb, translate_request
from zmqdispatch.wire import tokenspeed as ts

PROMPT_TOKENS = 2048
IMAGE_TOKENS = 1024


def request(nbytes: int, content_hash: bytes) -> pb.GenerateRequest:
    prompt = [1] * 8 + [9] * IMAGE_TOKENS + [2] * (PROMPT_TOKENS - 8 - IMAGE_TOKENS)
    n = nbytes // 4
    return pb.GenerateRequest(
        request_id="mm",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        mm_inputs=pb.MultimodalInputs(items=[pb.MultimodalItem(
            modality=common_pb2.IMAGE, content_hash=content_hash,
            encoder_input=pb.TensorData(shape=[n // 1176, 1176], dtype="float32", inline=bytes(n // 1176 * 1176 * 4)),
            placeholders=[pb.PlaceholderRange(offset=8, length=IMAGE_TOKENS)], placeholder_token_id=9)]),
    )


def run(nbytes: int, content_hash: bytes, repeat: int, mm_dtype: str | None = None) -> tuple[float, bool]:
    req = request(nbytes, content_hash)
    cfg = TranslationConfig(max_model_len=8192, vocab_size=32_000, mm_dtype=mm_dtype)
    samples = []
    same = True
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        t = translate_request(req, cfg)
        check_tokenspeed_request(t.request, max_model_len=8192, vocab_size=32_000)
        frames = ts.encode_add(t.request)
        samples.append(time.thread_time_ns() - t0)
        same = same and frames[1] is t.request.multimodal_inputs.mm_items[0].feature.data
    return statistics.median(samples) / 1000, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, nargs="+", default=[1, 10])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print(f"prompt {PROMPT_TOKENS} tokens, one image of {IMAGE_TOKENS} placeholder tokens")
    print("| feature MB | content_hash | µs / request | µs / MB | frame is the translated buffer |")
    print("|---|---|---|---|---|")
    for mb in args.mb:
        nbytes = int(mb * 1024 * 1024)
        for label, h, dtype in (("given", b"\x01" * 32, None), ("empty (hashed here)", b"", None),
                                ("given, float32 cast to bfloat16", b"\x01" * 32, "bfloat16")):
            us, same = run(nbytes, h, args.repeat, dtype)
            print(f"| {mb:g} | {label} | {us:.0f} | {us / mb:.0f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
