#!/usr/bin/env python3
"""Write seed corpora for the harnesses in ``fuzz/`` from the golden vectors.

    python fuzz/seed_corpus.py all                          # every target -> fuzz/corpus/<target>/
    python fuzz/seed_corpus.py tensors [fuzz/corpus/tensors]
    python fuzz/seed_corpus.py fuzz/corpus/vllm_outputs     # (old form) the vllm_outputs seeds

Sources: ``tests/wire/vectors/vllm_0.32.0.json`` and ``tokenspeed_0.1.1.json``
(bytes of the engines' own encoders), plus a few hand-made values per target
(refused huge tensor shapes, every dtype spelling, serialized gateway requests).
Each seed is laid out as its harness reads it: a mode byte where the harness
has modes, frames joined with ``b"|FRAME|"``.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Iterator

import msgpack

ROOT = pathlib.Path(__file__).resolve().parents[1]
VECTORS = ROOT / "tests" / "wire" / "vectors"
SEP = b"|FRAME|"

TARGETS = ("vllm_outputs", "vllm_control", "tensors", "vllm_requests", "tokenspeed_outputs", "tokenspeed_requests",
           "translate", "tokenspeed_translate")

Seed = tuple[str, bytes]


def _vectors(name: str) -> list[dict]:
    return json.loads((VECTORS / name).read_text())


def _frames(case: dict) -> list[bytes]:
    return [bytes.fromhex(h) for h in case["frames_hex"]]


def _join(frames: list[bytes]) -> bytes:
    return SEP.join(frames)


def _vllm() -> list[dict]:
    return _vectors("vllm_0.32.0.json")


def _ts() -> list[dict]:
    return _vectors("tokenspeed_0.1.1.json")


# --------------------------------------------------------------------------- per target


def vllm_outputs() -> Iterator[Seed]:
    for case in _vllm():
        if case["direction"] == "from_engine" and case["kind"] in ("outputs", "utility"):
            for mode in (0, 1, 2):
                yield f"{case['name']}-{mode}", bytes([mode]) + _join(_frames(case))
    for mode in (3, 4, 5, 6, 7, 8):
        yield from _structured(mode)


def vllm_control() -> Iterator[Seed]:
    modes = {
        "utility_result_": 0, "outputs_dp_": 0,
        "handshake_hello": 1, "handshake_ready_headless": 1, "handshake_ready": 1,
        "handshake_ready_response": 2, "ready_response": 2,
        "handshake_init_reply": 3,
        "request_abort": 4, "abort_r1": 4,
        "utility_call_": 5,
        "request_start_dp_wave": 6,
    }
    for case in _vllm() + _ts():
        name = case["name"]
        mode = next((m for prefix, m in modes.items() if name.startswith(prefix)), None)
        if name == "handshake_ready_response" or name.startswith("ready_response"):
            mode = 2
        if mode is None:
            continue
        body = _join(_frames(case)) if mode == 0 else _frames(case)[0]
        yield f"{name}-{mode}", bytes([mode]) + body
    for t in range(5):
        yield f"type-{t}", bytes([7, t])
    for mode in range(8, 15):
        yield from _structured(mode, 8)


def _keep_ext(code: int, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, data)


def _is_tensor(v: object) -> bool:
    return isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and isinstance(v[1], list)


def tensors() -> Iterator[Seed]:
    for case in _vllm():
        frames = _frames(case)
        if case["kind"] == "outputs" and case["name"] != "outputs_engine_core_dead":
            env = msgpack.unpackb(frames[0], ext_hook=_keep_ext, strict_map_key=False)
            for i, row in enumerate(env[1]):
                for pos in (2, 3):
                    lp = row[pos] if len(row) > pos else None
                    if not lp:
                        continue
                    yield f"{case['name']}-{i}-{pos}-lp", b"\x02" + _join([msgpack.packb(lp), *frames[1:]])
                    for j, t in enumerate(lp[:3]):
                        if _is_tensor(t):
                            packed = msgpack.packb(t)
                            yield f"{case['name']}-{i}-{pos}-{j}", b"\x00" + _join([packed, *frames[1:]])
                            yield f"{case['name']}-{i}-{pos}-{j}-x", b"\x01" + _join([packed, *frames[1:]])
        elif case["name"] == "request_prompt_embeds_aux":
            req = msgpack.unpackb(frames[0], ext_hook=_keep_ext, strict_map_key=False)
            yield "prompt_embeds_aux", b"\x00" + _join([msgpack.packb(req[9]), *frames[1:]])
    ext = msgpack.ExtType
    hand = {
        "huge-1d": ["int32", [2**40], ext(3, b"\0" * 4)],
        "huge-2d": ["float32", [2**20, 2**20], 1],
        "huge-u64-zero": ["int64", [2**64 - 1, 0], ext(3, b"")],
        "zero-u64": ["int64", [0, 2**64 - 1], ext(3, b"")],
        "scalar-bf16": ["bfloat16", [], ext(3, b"\x80\x3f")],
        "be-f8": [">f8", [1], ext(3, b"\x3f\xf0" + b"\0" * 6)],
        "bool": ["|b1", [2], ext(3, b"\x01\x00")],
        "f16": ["<f2", [1, 1], ext(3, b"\x00\x3c")],
        "u8-plain-bin": ["uint8", [3], b"abc"],
        "pickle": ["int32", [1], ext(1, b"\x80\x04N.")],
        "rank64": ["uint8", [1] * 64, ext(3, b"\x07")],
        "aux-0": ["int32", [1], 0],
    }
    for name, value in hand.items():
        yield f"hand-{name}", b"\x00" + msgpack.packb(value)
        yield f"hand-{name}-x", b"\x01" + msgpack.packb(value) + SEP + b"\0" * 8
    for mode in (3, 4):
        yield from _structured(mode)


def vllm_requests() -> Iterator[Seed]:
    for case in _vllm():
        if case["direction"] == "to_engine" and case.get("type_byte") is not None:
            yield case["name"], b"\x00" + _join([bytes.fromhex(case["type_byte"]), *_frames(case)])
    yield from _structured(1)


def _structured(mode: int, n: int = 16) -> Iterator[Seed]:
    """Inputs for a harness's structure-aware mode: the mode byte and bytes
    that drive ``_common.mutate_message`` (any bytes are valid)."""
    for i in range(n):
        yield f"structured-{mode}-{i}", bytes([mode]) + bytes(((i * 53 + k * 29) & 0xFF) for k in range(64))


def tokenspeed_outputs() -> Iterator[Seed]:
    for case in _ts():
        if case["kind"] == "outputs":
            yield case["name"], b"\x00" + _join(_frames(case))
    yield from _structured(1)


def tokenspeed_requests() -> Iterator[Seed]:
    for case in _ts():
        if case["kind"] in ("add", "abort"):
            yield case["name"], b"\x00" + _join([bytes.fromhex(case["type_byte"]), *_frames(case)])
    yield from _structured(1)


def translate() -> Iterator[Seed]:
    sys.path.insert(0, str(ROOT))
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb

    sp = pb.SamplingParams
    reqs = {
        "greedy": pb.GenerateRequest(request_id="g", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                                     sampling_params=sp(temperature=0.0, max_tokens=8)),
        "full": pb.GenerateRequest(
            request_id="full", stream=True, tokenized=pb.TokenizedInput(input_ids=list(range(3, 40))),
            sampling_params=sp(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, frequency_penalty=0.5,
                               presence_penalty=-0.5, repetition_penalty=1.1, max_tokens=32, min_tokens=2,
                               stop_token_ids=[5, 6], logprobs=3, prompt_logprobs=2, seed=7,
                               truncate_prompt_tokens=16, logit_bias={4: 1.5, 9: -100.0}, n=3,
                               include_stop_str_in_output=True, stop=["STOP", "\n\n"])),
        "json": pb.GenerateRequest(request_id="j", tokenized=pb.TokenizedInput(input_ids=[9]),
                                   sampling_params=sp(json_schema='{"type": "object"}', max_tokens=4)),
        "choice": pb.GenerateRequest(request_id="c", tokenized=pb.TokenizedInput(input_ids=[9]),
                                     sampling_params=sp(choice=pb.ChoiceConstraint(choices=["yes", "no"]))),
        "regex": pb.GenerateRequest(request_id="re", tokenized=pb.TokenizedInput(input_ids=[9]),
                                    sampling_params=sp(regex="[a-z]+", grammar_from_first_token=True)),
        "dp-rank": pb.GenerateRequest(request_id="dp", tokenized=pb.TokenizedInput(input_ids=[9]),
                                      data_parallel_rank=1),
        "text": pb.GenerateRequest(request_id="t", text="hello"),
    }
    for name, r in reqs.items():
        yield f"proto-{name}", b"\x01" + r.SerializeToString()
    # FuzzedDataProvider-built inputs: any bytes are a request; a few spreads.
    for i, blob in enumerate((bytes(range(256)), bytes(range(255, -1, -1)), b"\x01" * 200, b"\xff" * 200,
                              bytes((i * 37) & 0xFF for i in range(400)))):
        yield f"fdp-{i}", b"\x00" + blob


def tokenspeed_translate() -> Iterator[Seed]:
    sys.path.insert(0, str(ROOT))
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

    sp = pb.SamplingParams
    reqs = {
        "greedy": pb.GenerateRequest(request_id="g", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                                     sampling_params=sp(temperature=0.0, max_new_tokens=8)),
        "full": pb.GenerateRequest(
            request_id="full", stream=True, return_logprob=True, tokenized=pb.TokenizedInput(input_ids=[3, 4, 5]),
            sampling_params=sp(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, frequency_penalty=0.5,
                               presence_penalty=-0.5, repetition_penalty=1.1, max_new_tokens=32, min_new_tokens=2,
                               stop_token_ids=[5, 6], sampling_seed=7, logit_bias={"4": 1.5}, n=3,
                               no_stop_trim=True, stop=["STOP", "\n\n"])),
        "json": pb.GenerateRequest(request_id="j", tokenized=pb.TokenizedInput(input_ids=[9]),
                                   sampling_params=sp(json_schema='{"type": "object"}', max_new_tokens=4)),
        "top1": pb.GenerateRequest(request_id="t1", tokenized=pb.TokenizedInput(input_ids=[9]), return_logprob=True,
                                   top_logprobs_num=1, sampling_params=sp(temperature=0.0)),
        "no-input": pb.GenerateRequest(request_id="n"),
    }
    for name, r in reqs.items():
        yield f"proto-{name}", b"\x01" + r.SerializeToString()
    for i, blob in enumerate((bytes(range(256)), bytes(range(255, -1, -1)), b"\x01" * 200, b"\xff" * 200)):
        yield f"fdp-{i}", b"\x00" + blob


GENERATORS = {
    "vllm_outputs": vllm_outputs,
    "vllm_control": vllm_control,
    "tensors": tensors,
    "vllm_requests": vllm_requests,
    "tokenspeed_outputs": tokenspeed_outputs,
    "tokenspeed_requests": tokenspeed_requests,
    "translate": translate,
    "tokenspeed_translate": tokenspeed_translate,
}


def write(target: str, out: pathlib.Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, data in GENERATORS[target]():
        (out / name).write_bytes(data)
        n += 1
    print(f"{target}: wrote {n} seeds to {out}")
    return n


def main(argv: list[str]) -> None:
    if not argv or argv[0] == "all":
        for target in TARGETS:
            write(target, ROOT / "fuzz" / "corpus" / target)
    elif argv[0] in GENERATORS:
        write(argv[0], pathlib.Path(argv[1]) if len(argv) > 1 else ROOT / "fuzz" / "corpus" / argv[0])
    else:  # the original form: a directory for the vllm_outputs seeds
        write("vllm_outputs", pathlib.Path(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
