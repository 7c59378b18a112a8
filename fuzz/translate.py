#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the gateway-request translation.

Target: arbitrary ``vllm.grpc.engine.GenerateRequest`` protos (and arbitrary
``TranslationConfig``) through ``zmqdispatch.translate.vllm.translate_parallel``
(which calls ``translate_request`` per sample), then
``zmqdispatch.protocol.checks.check_request`` and ``wire.encode_request``, as
``EngineClient.generate`` does.

Input: byte 0 picks how the proto is built:

- even: field by field from the input with ``atheris.FuzzedDataProvider`` (every
  field of ``GenerateRequest`` and ``SamplingParams``, each set or unset, with
  boundary values: NaN/inf/-0.0 floats, 0/-1/2**31/2**32-1 ints, empty and
  odd strings, every constraint of the oneof, multimodal / PD / media fields),
  plus the config (``max_model_len``, EOS ids, ``vocab_size``, ``max_logprobs``,
  structured-outputs backend, ``engine_index``, optional byte tokenizer for
  stop strings);
- odd: the rest of the input parsed as a serialized ``GenerateRequest``
  (``ParseFromString``; unknown fields included), with a fixed config.

Contract: ``translate_parallel`` raises only ``RequestRejected``; so does
``check_request`` (``ContextLengthError`` is one); a request that passes both
encodes without error, decodes back (``decode_request``) and re-encodes to the
same bytes; it honours what the checks promise (n = 1 on the wire, a non-empty
prompt that fits ``max_model_len`` with ``max_tokens``, at most one
structured-output constraint *and at least one when ``structured_outputs`` is
set*); fan-out children have distinct ids; the input proto is not modified.

    python fuzz/seed_corpus.py translate fuzz/corpus/translate
    python fuzz/translate.py fuzz/corpus/translate -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import math
import sys
from typing import ClassVar

import atheris

with atheris.instrument_imports():
    from zmqdispatch.errors import RequestRejected
    from zmqdispatch.protocol.checks import check_request
    from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_parallel
    from zmqdispatch.wire import vllm as wire
    from zmqdispatch.wire import vllm_engine as wire_engine

from google.protobuf.message import DecodeError

import _common as C

U32 = 2**32 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
FLOATS = [0.0, -0.0, 1.0, 0.5, 2.0, 2.5, 1e-6, 1e-5, 1.5e-5, -1.0, -2.0, 100.0, -100.0, 100.5, 1e38, 3.4e38,
          1e-45, math.nan, math.inf, -math.inf]
U32S = [0, 1, 2, 3, 16, 20, 21, 64, 127, 128, 129, 1000, 2**31 - 1, 2**31, U32]
I32S = [0, 1, -1, -2, 20, 21, 2**31 - 1, -(2**31)]
TEXTS = ["", " ", "a", "ab", "STOP", "\n", "\x00", "é", "日", "🙂", "<s>"]
JSONS = ['{"type": "object"}', "{}", "null", "5", "true", '"x"', "[1]", "{", "", " ", '{"a": NaN}',
         '{"type": "string", "maxLength": 1e400}']
BACKENDS = ["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer", "bogus"]
CONSTRAINTS = ("json_schema", "regex", "grammar", "structural_tag", "json_object", "choice")


class ByteTokenizer:
    """A tiny deterministic tokenizer for stop strings: one id per UTF-8 byte
    (id = byte + 3), a few multi-byte tokens, specials 0..2; unknown ids decode
    to nothing, invalid UTF-8 to U+FFFD (what real tokenizers do)."""

    SPECIAL: ClassVar[dict[int, str]] = {0: "<s>", 1: "</s>", 2: "<tool>"}
    MULTI: ClassVar[dict[bytes, int]] = {b"ab": 300, b"STOP": 301, b"\n\n": 302, "é".encode(): 303}

    def __init__(self) -> None:
        self._by_id = {v: k for k, v in self.MULTI.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        out: list[int] = []
        i = 0
        while i < len(data):
            for raw, tid in self.MULTI.items():
                if data.startswith(raw, i):
                    out.append(tid)
                    i += len(raw)
                    break
            else:
                out.append(data[i] + 3)
                i += 1
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        parts: list[bytes] = []
        for t in ids:
            if t in self.SPECIAL:
                if not skip_special_tokens:
                    parts.append(self.SPECIAL[t].encode())
            elif 3 <= t < 259:
                parts.append(bytes([t - 3]))
            else:
                parts.append(self._by_id.get(t, b""))
        return b"".join(parts).decode("utf-8", errors="replace")

    @property
    def added_tokens_decoder(self) -> dict[int, str]:
        return dict(self.SPECIAL)


TOKENIZER = ByteTokenizer()


# --------------------------------------------------------------------------- building protos


def _f32(fdp: atheris.FuzzedDataProvider) -> float:
    k = fdp.ConsumeIntInRange(0, 2)
    if k == 0:
        return fdp.PickValueInList(FLOATS)
    if k == 1:
        return fdp.ConsumeFloatInRange(-3.0, 3.0)
    return fdp.ConsumeFloat()


def _u32(fdp: atheris.FuzzedDataProvider) -> int:
    k = fdp.ConsumeIntInRange(0, 2)
    if k == 0:
        return fdp.PickValueInList(U32S)
    if k == 1:
        return fdp.ConsumeIntInRange(0, 64)
    return fdp.ConsumeIntInRange(0, U32)


def _i32(fdp: atheris.FuzzedDataProvider) -> int:
    k = fdp.ConsumeIntInRange(0, 2)
    if k == 0:
        return fdp.PickValueInList(I32S)
    if k == 1:
        return fdp.ConsumeIntInRange(-4, 64)
    return fdp.ConsumeIntInRange(I32_MIN, I32_MAX)


def _text(fdp: atheris.FuzzedDataProvider, max_len: int = 16) -> str:
    if fdp.ConsumeBool():
        return fdp.PickValueInList(TEXTS)
    return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, max_len))


def _ids(fdp: atheris.FuzzedDataProvider, max_n: int) -> list[int]:
    n = fdp.ConsumeIntInRange(0, max_n)
    if fdp.ConsumeBool():
        return fdp.ConsumeIntListInRange(n, 0, 1100)
    return [_u32(fdp) for _ in range(n)]


def _json_text(fdp: atheris.FuzzedDataProvider) -> str:
    """A JSON-schema text: a boundary case, random text, or nesting of a
    chosen depth (deep nesting is where JSON parsers stop raising ValueError)."""
    k = fdp.ConsumeIntInRange(0, 3)
    if k == 0:
        return fdp.PickValueInList(JSONS)
    if k == 1:
        return _text(fdp, 64)
    depth = fdp.PickValueInList([1, 2, 10, 100, 500, 999, 1000, 5000]) if fdp.ConsumeBool() else \
        fdp.ConsumeIntInRange(0, 3000)
    opener, closer = ("[", "]") if fdp.ConsumeBool() else ('{"a":', "}")
    return '{"type": "object", "x": ' + opener * depth + "1" + closer * depth + "}"


def build_sampling_params(fdp: atheris.FuzzedDataProvider) -> pb.SamplingParams:
    """Every field set or not; the constraint first (an exhausted provider
    answers 0 / False / empty, which must leave a plausible request)."""
    sp = pb.SamplingParams()
    which = fdp.ConsumeIntInRange(0, len(CONSTRAINTS))
    if which < len(CONSTRAINTS):
        name = CONSTRAINTS[which]
        if name == "json_object":
            sp.json_object = fdp.ConsumeBool()
        elif name == "choice":
            sp.choice.choices.extend(_text(fdp, 6) for _ in range(fdp.ConsumeIntInRange(0, 3)))
        elif name == "json_schema":
            sp.json_schema = _json_text(fdp)
        else:
            setattr(sp, name, _text(fdp, 32))
    if fdp.ConsumeBool():
        sp.n = _u32(fdp) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 4)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if fdp.ConsumeBool():
            setattr(sp, name, _f32(fdp))
    for name in ("top_k", "max_tokens", "min_tokens"):
        if fdp.ConsumeBool():
            setattr(sp, name, _u32(fdp))
    for name in ("logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens"):
        if fdp.ConsumeBool():
            setattr(sp, name, _i32(fdp))
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "ignore_eos", "include_stop_str_in_output",
                 "grammar_from_first_token"):
        if fdp.ConsumeBool():
            setattr(sp, name, fdp.ConsumeBool())
    if fdp.ConsumeBool():
        sp.stop.extend(_text(fdp, 6) for _ in range(fdp.ConsumeIntInRange(0, 3)))
    if fdp.ConsumeBool():
        sp.stop_token_ids.extend(_ids(fdp, 4))
    if fdp.ConsumeBool():
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            sp.logit_bias[_i32(fdp)] = _f32(fdp)
    return sp


def build_request(fdp: atheris.FuzzedDataProvider) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    if fdp.ConsumeProbability() < 0.97:
        r.request_id = _text(fdp, 12) or "r"
    which = fdp.ConsumeIntInRange(0, 9)
    if which <= 6:
        r.tokenized.input_ids.extend(_ids(fdp, 48) or [1])
        if fdp.ConsumeBool():
            r.tokenized.original_text = _text(fdp)
    elif which == 7:
        r.text = _text(fdp)
    elif which == 8:
        r.tokenized.SetInParent()
    r.stream = fdp.ConsumeBool()
    if not fdp.ConsumeBool():
        r.sampling_params.CopyFrom(build_sampling_params(fdp))
    if fdp.ConsumeProbability() > 0.8:
        r.data_parallel_rank = _i32(fdp)
    rare = fdp.ConsumeIntInRange(0, 19)
    if rare == 15:
        r.kv_transfer_params.remote_host = _text(fdp)
    elif rare == 16:
        r.kv_transfer_params_json = _text(fdp)
    elif rare == 17:
        r.mm_inputs.mm_hashes.append(_text(fdp))
    elif rare == 18:
        r.extra_mm_inputs.add()
    elif rare == 19:
        r.media_refs.items.add().url = _text(fdp)
    return r


def build_config(fdp: atheris.FuzzedDataProvider) -> TranslationConfig:
    mml = (fdp.PickValueInList([1, 2, 8, 64, 512, 4096, 2**31 - 1]) if fdp.ConsumeBool()
           else fdp.ConsumeIntInRange(1, 2**20))
    return TranslationConfig(
        max_model_len=mml,
        eos_token_ids=tuple(_ids(fdp, 3)),
        vocab_size=None if fdp.ConsumeBool() else fdp.PickValueInList([1, 3, 260, 1000, 32000, 2**32]),
        max_logprobs=fdp.PickValueInList([0, 1, 5, 20, 100]),
        structured_outputs_backend=fdp.PickValueInList(BACKENDS),
        engine_index=None if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 3),
        tokenizer=TOKENIZER if fdp.ConsumeBool() else None,
    )


RAW_CONFIG = TranslationConfig(max_model_len=4096, eos_token_ids=(2, 7), vocab_size=32000, tokenizer=TOKENIZER)


# --------------------------------------------------------------------------- the checks


def _constraints(so: wire.StructuredOutputsParams) -> int:
    return sum(v is not None for v in (so.json, so.regex, so.choice, so.grammar, so.json_object, so.structural_tag))


def check(req: pb.GenerateRequest, config: TranslationConfig) -> None:
    before = req.SerializeToString(deterministic=True)
    try:
        translations = translate_parallel(req, config, arrival_time=1.0)
    except RequestRejected:
        return
    except RecursionError:
        if C.known("json-recursion"):
            return
        raise
    assert req.SerializeToString(deterministic=True) == before, "translation modified its input"
    assert translations
    assert len({t.request.request_id for t in translations}) == len(translations), "fan-out ids collide"
    for t in translations:
        r = t.request
        try:
            check_request(r, max_model_len=config.max_model_len, vocab_size=config.vocab_size,
                          max_logprobs=config.max_logprobs)
        except RequestRejected:
            continue
        sp = r.sampling_params
        assert sp.n == 1 and r.prompt_token_ids and len(r.prompt_token_ids) + sp.max_tokens <= config.max_model_len
        so = sp.structured_outputs
        assert so is None or _constraints(so) == 1, f"structured_outputs carries {_constraints(so)} constraints"
        try:
            frames = wire.encode_request(r)
        except RecursionError:
            if C.known("encode-recursion"):
                continue
            raise
        back = wire_engine.decode_request(frames)
        assert wire.encode_request(back) == frames, "decode(encode(request)) does not encode to the same bytes"
        assert back.request_id == r.request_id and back.prompt_token_ids == r.prompt_token_ids
        t.response_builder()


def test_one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] & 1:
        req = pb.GenerateRequest()
        try:
            req.ParseFromString(data[1:])
        except DecodeError:
            return  # the harness's own parse of its input
        check(req, RAW_CONFIG)
        return
    fdp = atheris.FuzzedDataProvider(data[1:])
    config = build_config(fdp)
    check(build_request(fdp), config)


if __name__ == "__main__":
    sys.setrecursionlimit(1000)  # what a gateway process has
    C.setup_and_fuzz(test_one_input, dict_file=None)
