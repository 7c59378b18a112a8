#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the TokenSpeed request translation.

Target: arbitrary ``tokenspeed.grpc.scheduler.GenerateRequest`` protos (and an
arbitrary ``TranslationConfig``) through
``zmqdispatch.translate.tokenspeed.translate_parallel``, then
``zmqdispatch.protocol.checks.check_tokenspeed_request`` and
``wire.tokenspeed.encode_add``, as ``EngineClient.generate`` does on a
TokenSpeed connection; then the response side (``ResponseBuilder``) over a
fuzzed tick sequence.

Input: byte 0 picks how the proto is built: even, field by field with
``atheris.FuzzedDataProvider`` (every field, each set or unset, boundary
values); odd, the rest parsed as a serialized proto with a fixed config.

Contract: translation and checks raise only ``RequestRejected``; a request that
passes both encodes, decodes back (``decode_add``) to the same values, and is
one TokenSpeed 0.1.1's ingress admits (``admission_error`` is None: nothing
the engine would drop or abort without a reason gets out); fan-out children
have distinct ids and the parent's response id; the input proto is unchanged;
the responses are ``chunk* complete`` whose chunk ids add up to the complete's.

    python fuzz/tokenspeed_translate.py fuzz/corpus/tokenspeed_translate -atheris_runs=1000000
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from zmqdispatch.errors import RequestRejected
    from zmqdispatch.protocol.checks import check_tokenspeed_request
    from zmqdispatch.protocol.mailbox import OutputDelta
    from zmqdispatch.translate.tokenspeed import TranslationConfig, pb, translate_parallel
    from zmqdispatch.wire import tokenspeed as ts
    from zmqdispatch.wire import tokenspeed_engine as ts_engine
    from zmqdispatch.protocol import checks_tokenspeed
    from zmqdispatch.wire import vllm as wire

from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

import _common as C
from translate import TOKENIZER, _f32, _i32, _ids, _json_text, _text, _u32

CONSTRAINTS = ("regex", "json_schema", "ebnf_grammar", "structural_tag")
FINISHES = (None, wire.FinishReason.STOP, wire.FinishReason.LENGTH)


def build_sampling_params(fdp: atheris.FuzzedDataProvider) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    which = fdp.ConsumeIntInRange(0, len(CONSTRAINTS))
    if which < len(CONSTRAINTS):
        name = CONSTRAINTS[which]
        setattr(sp, name, _json_text(fdp) if name == "json_schema" else _text(fdp, 32))
    if fdp.ConsumeBool():
        sp.n = _u32(fdp) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 4)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if fdp.ConsumeBool():
            setattr(sp, name, _f32(fdp))
    if fdp.ConsumeBool():
        sp.top_k = _i32(fdp)
    for name in ("max_new_tokens", "min_new_tokens"):
        if fdp.ConsumeBool():
            setattr(sp, name, _u32(fdp))
    if fdp.ConsumeBool():
        sp.sampling_seed = fdp.PickValueInList([0, 1, 2**32, 2**64 - 1]) if fdp.ConsumeBool() else \
            fdp.ConsumeIntInRange(0, 2**64 - 1)
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if fdp.ConsumeBool():
            setattr(sp, name, fdp.ConsumeBool())
    if fdp.ConsumeBool():
        sp.stop.extend(_text(fdp, 6) for _ in range(fdp.ConsumeIntInRange(0, 3)))
    if fdp.ConsumeBool():
        sp.stop_token_ids.extend(_ids(fdp, 4))
    if fdp.ConsumeBool():
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            key = str(_i32(fdp)) if fdp.ConsumeBool() else _text(fdp, 6)
            sp.logit_bias[key] = _f32(fdp)
    if fdp.ConsumeProbability() > 0.9:
        sp.custom_params.CopyFrom(struct_pb2.Struct())
        if fdp.ConsumeBool():
            sp.custom_params.fields["k"].number_value = _f32(fdp)
    return sp


def build_request(fdp: atheris.FuzzedDataProvider) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    if fdp.ConsumeProbability() < 0.97:
        r.request_id = _text(fdp, 12) or "r"
    if fdp.ConsumeIntInRange(0, 9) <= 7:
        r.tokenized.input_ids.extend(_ids(fdp, 48) or [1])
        if fdp.ConsumeBool():
            r.tokenized.original_text = _text(fdp)
    r.stream = fdp.ConsumeBool()
    r.return_logprob = fdp.ConsumeBool()
    if fdp.ConsumeBool():
        r.top_logprobs_num = fdp.ConsumeIntInRange(-2, 3)
    if fdp.ConsumeBool():
        r.logprob_start_len = fdp.ConsumeIntInRange(-3, 50)
    if not fdp.ConsumeBool():
        r.sampling_params.CopyFrom(build_sampling_params(fdp))
    if fdp.ConsumeProbability() > 0.8:
        r.data_parallel_rank = _i32(fdp)
    rare = fdp.ConsumeIntInRange(0, 19)
    if rare == 16:
        r.token_ids_logprob.extend(_ids(fdp, 3) or [1])
    elif rare == 17:
        r.mm_inputs.SetInParent()
    elif rare == 18:
        r.kv_bootstrap_info.bootstrap_host = _text(fdp)
    elif rare == 19:
        r.encode_bootstrap_info.SetInParent()
    return r


def build_config(fdp: atheris.FuzzedDataProvider) -> TranslationConfig:
    mml = fdp.PickValueInList([1, 2, 3, 8, 64, 4096, 2**31 - 1]) if fdp.ConsumeBool() else \
        fdp.ConsumeIntInRange(1, 2**20)
    return TranslationConfig(
        max_model_len=mml,
        vocab_size=None if fdp.ConsumeBool() else fdp.PickValueInList([1, 3, 260, 1000, 32000, 2**32]),
        engine_index=None if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 3),
        tokenizer=TOKENIZER if fdp.ConsumeBool() else None,
    )


RAW_CONFIG = TranslationConfig(max_model_len=4096, vocab_size=32000, tokenizer=TOKENIZER)


def check_responses(t, fdp: atheris.FuzzedDataProvider | None) -> None:
    builder = t.response_builder()
    out = []
    ticks = fdp.ConsumeIntInRange(1, 5) if fdp else 2
    for i in range(ticks):
        last = i == ticks - 1
        tokens = _ids(fdp, 3) if fdp else [5]
        finish = (fdp.PickValueInList(list(FINISHES[1:])) if fdp else wire.FinishReason.LENGTH) if last else None
        if finish is wire.FinishReason.STOP and not tokens:
            tokens = [2]
        lp = None
        if t.return_logprob:
            lp = wire.LogprobsLists(token_ids=[[x] for x in tokens], logprobs=[[-0.5] for _ in tokens], ranks=[])
        out += builder.feed(OutputDelta(t.request.rid, tokens, finish_reason=finish, logprobs=lp))
        if builder.done:
            break
    assert builder.done and out and out[-1].HasField("complete")
    assert all(r.request_id == t.response_request_id for r in out)
    if t.stream:
        chunk_ids = [x for r in out[:-1] for x in r.chunk.token_ids]
        assert chunk_ids == list(out[-1].complete.output_ids), "chunks do not add up to the complete"


def check(req: pb.GenerateRequest, config: TranslationConfig, fdp: atheris.FuzzedDataProvider | None) -> None:
    before = req.SerializeToString(deterministic=True)
    try:
        translations = translate_parallel(req, config)
    except RequestRejected:
        return
    assert req.SerializeToString(deterministic=True) == before, "translation modified its input"
    assert len({t.request.rid for t in translations}) == len(translations), "fan-out ids collide"
    for t in translations:
        r = t.request
        assert t.response_request_id == req.request_id
        try:
            check_tokenspeed_request(r, max_model_len=config.max_model_len, vocab_size=config.vocab_size)
        except RequestRejected:
            continue
        frames = ts.encode_add(r)
        back = ts_engine.decode_add(frames)
        assert back.rid == r.rid and back.input_ids == r.input_ids
        assert back.sampling_params == r.sampling_params.derive()
        assert checks_tokenspeed.admission_error(ts.finalize_add(back), vocab_size=config.vocab_size,
                                  enable_output_logprobs=True) is None, "a request the engine would abort got out"
        assert len(r.input_ids) <= config.max_model_len - 2
        check_responses(t, fdp)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] & 1:
        req = pb.GenerateRequest()
        try:
            req.ParseFromString(data[1:])
        except DecodeError:
            return
        check(req, RAW_CONFIG, None)
        return
    fdp = atheris.FuzzedDataProvider(data[1:])
    config = build_config(fdp)
    check(build_request(fdp), config, fdp)


if __name__ == "__main__":
    sys.setrecursionlimit(1000)
    C.setup_and_fuzz(test_one_input, dict_file=None)
