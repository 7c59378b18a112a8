#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the TokenSpeed input decoders (mock-engine side).

Targets: ``zmqdispatch.wire.tokenspeed_engine.decode_input`` (``[type, payload, *aux]``:
ADD -> ``decode_add`` + ``finalize_add``, ABORT -> ``decode_abort``), then
``admission_error`` (what the engine's ingress refuses) and the sampling-params
derivations (``derive``/``resolve_seed``/``normalize``/``validation_error``).

Input: byte 0 picks the mode. Even: the rest is one multipart message, frames
separated by ``b"|FRAME|"``; frame 0 is the one-byte request type. Odd: a
golden ADD or ABORT mutated structurally (``_common.mutate_message``; the rest of
the input drives it; the nested 29-element sampling array is reached too).

Contract: the decoders raise only ``RemoteProtocolError``; the checks after a
successful decode (``admission_error`` with and without a vocabulary,
``validation_error``, ``normalize``) raise nothing; a decoded ADD holds at most
one value per input byte; ``finalize_add`` is idempotent; a decoded ADD
re-encodes (``encode_add``) to a fixed point of decode/encode.

    python fuzz/seed_corpus.py tokenspeed_requests fuzz/corpus/tokenspeed_requests
    python fuzz/tokenspeed_requests.py fuzz/corpus/tokenspeed_requests \
        -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports():
    from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
    from zmqdispatch.protocol import checks_tokenspeed
    from zmqdispatch.wire import tokenspeed as ts
    from zmqdispatch.wire import tokenspeed_engine as ts_engine

import _common as C

RPE = RemoteProtocolError
SEEDS = C.load_vectors("tokenspeed_0.1.1.json", keep=lambda c: c["kind"] in ("add", "abort"), with_type_byte=True)


def _values(req: ts.TokenizedGenerateReqInput) -> tuple:
    sp = req.sampling_params
    return (req.input_ids, req.token_ids_logprob, req.input_embeds, req.input_multi_ids, req.input_extra_infos,
            req.input_ids_unpadded, req.multimodal_inputs, sp.stop, sp.stop_token_ids, sp.custom_params,
            sp.logit_bias, sp.stop_strs)


def check_add(req: ts.TokenizedGenerateReqInput, budget: int) -> None:
    assert type(req.rid) is str
    C.assert_bounded("TokenizedGenerateReqInput", _values(req), budget + 64)
    for vocab in (None, 1000):
        for flags in ((False, False), (True, False), (True, True)):
            reason = checks_tokenspeed.admission_error(req, vocab_size=vocab, enable_output_logprobs=flags[0],
                                        supports_prompt_logprobs=flags[1])
            assert reason is None or type(reason) is str
    sp = req.sampling_params
    assert sp.normalize().normalize() == sp.normalize() or _has_nan(sp)
    checks_tokenspeed.sampling_params_error(sp, None)
    again = ts.finalize_add(req)
    assert _same(again, req), "finalize_add is not idempotent"
    try:
        frames = ts.encode_add(req)
    except LocalProtocolError:
        # Only a value msgpack cannot write back (e.g. a map key it refuses).
        return
    req2 = ts.finalize_add(ts_engine.decode_add(frames))
    assert ts.encode_add(req2) == frames, "encode(decode(x)) is not a fixed point"


def _same(a: object, b: object) -> bool:
    """Equal, counting NaN equal to NaN wherever it sits (``created_time``,
    ``input_embeds``, maps of any value): the reprs of the same attrs classes
    then agree field by field (``nan``), while -0.0 and 0.0 still differ."""
    return a == b or repr(a) == repr(b)


def _has_nan(sp: ts.TokenSpeedSamplingParams) -> bool:
    floats = (sp.temperature, sp.top_p, sp.min_p, sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty)
    lb = tuple((sp.logit_bias or {}).values())
    return any(x != x for x in floats + lb)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] & 1:
        frames = C.mutate_message(atheris.FuzzedDataProvider(data[1:]), SEEDS, payload_index=1)
        if frames is None:
            return
    else:
        frames = C.split_frames(data[1:])
    budget = C.total_bytes(frames)
    ok, value = C.only_typed(RPE, ts_engine.decode_input, frames)
    if ok:
        rtype, payload = value
        if rtype is ts.RequestType.ADD:
            check_add(payload, budget)
        else:
            assert all(type(r) is str for r in payload) and len(payload) <= budget
    if len(frames) >= 2:
        # decode_add alone (no finalize): the derive()d values, never finalized.
        ok, req = C.only_typed(RPE, ts_engine.decode_add, frames[1:])
        if ok:
            assert req.sampling_params.derive() == req.sampling_params or _has_nan(req.sampling_params)


if __name__ == "__main__":
    C.setup_and_fuzz(test_one_input)
