#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the vLLM input decoders as the mock engine uses them.

Target: the mock engine's input thread (``zmqdispatch/mock/server.py``), which
reads ``[type, payload, *aux]`` and calls ``decode_request`` (ADD, with
``prompt_embeds`` tensors inline or in aux frames), ``decode_abort``,
``decode_utility_call`` or ``decode_start_dp_wave``; an admitted ADD then goes
to ``MockEngineCore.add`` and one scheduler step.

Input: byte 0 picks the mode. Even: the rest is one multipart message, frames
separated by ``b"|FRAME|"``; frame 0 is the one-byte request type, as on the
wire. Odd: a golden input message (ADD, ABORT, UTILITY, START_DP_WAVE) mutated
structurally (``_common.mutate_message``; the rest of the input drives it).

Contract: the decoders raise only ``RemoteProtocolError`` (the mock's only
other outcome is its own ``FatalEngineError``, the real engine's death);
a decoded request holds at most one value per input byte; a decoded request
that re-encodes (``encode_request``) is a fixed point: decoding the re-encoded
frames and encoding again gives the same bytes. The encoder may refuse
(``LocalProtocolError``) only what it documents: big-endian or numpy-spelled
bfloat16 ``prompt_embeds`` and values msgpack cannot write.

    python fuzz/seed_corpus.py vllm_requests fuzz/corpus/vllm_requests
    python fuzz/vllm_requests.py fuzz/corpus/vllm_requests -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports():
    from zmqdispatch.errors import LocalProtocolError, RemoteProtocolError
    from zmqdispatch.mock.core import FatalEngineError, MockEngineCore
    from zmqdispatch.mock.server import _input_thread_would_die
    from zmqdispatch.wire import vllm as wire
    from zmqdispatch.wire import vllm_engine as wire_engine

import _common as C

RPE = RemoteProtocolError
SEEDS = C.load_vectors("vllm_0.32.0.json", keep=lambda c: c["direction"] == "to_engine" and c.get("type_byte"),
                       with_type_byte=True)


def _nodes_of_request(req: wire.EngineCoreRequest) -> tuple:
    sp = req.sampling_params
    parts: list = [req.prompt_token_ids, req.mm_features, req.pooling_params, req.lora_request,
                   req.trace_headers, req.reasoning_parser_kwargs, req.kv_hints, req.prompt_is_token_ids]
    if sp is not None:
        parts += [sp.stop, sp.stop_token_ids, sp.all_stop_token_ids, sp.logit_bias, sp.allowed_token_ids,
                  sp.extra_args, sp.bad_words, sp.bad_words_token_ids, sp.logprob_token_ids,
                  sp.prompt_logprob_token_ids, sp.watermarking, sp.trace_decode_token_ids]
    return tuple(parts)


def _encodable_refusal(req: wire.EngineCoreRequest, exc: LocalProtocolError) -> bool:
    t = req.prompt_embeds
    if t is not None and (t.info.big_endian or (not t.is_torch and t.info.name == "bfloat16")):
        return True
    return "msgpack" in str(exc)


def _add(frames: list[bytes], budget: int) -> None:
    ok, req = C.only_typed(RPE, wire_engine.decode_request, frames)
    if not ok:
        return
    C.assert_bounded("EngineCoreRequest", _nodes_of_request(req), budget + 64)
    if req.prompt_embeds is not None:
        assert req.prompt_embeds.nbytes == req.prompt_embeds.numel * req.prompt_embeds.info.itemsize
        assert req.prompt_embeds.nbytes <= budget
    try:
        again = wire.encode_request(req)
    except LocalProtocolError as exc:
        if not _encodable_refusal(req, exc):
            raise
        again = None
    if again is not None:
        req2 = wire_engine.decode_request(again)  # what we write, we read back
        assert wire.encode_request(req2) == again, "encode(decode(x)) is not a fixed point"
    # The mock engine's admission and one step (FatalEngineError = the real
    # engine's ENGINE_CORE_DEAD, a modelled outcome).
    if _input_thread_would_die(req):
        return
    core = MockEngineCore(vocab_size=1000, max_model_len=64, tokens_per_step=2)
    try:
        err = core.add(req)
    except FatalEngineError:
        return
    if err is None:
        outs = core.step()
        wire_engine.encode_outputs(0, outs, timestamp=0.0)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] & 1:
        frames = C.mutate_message(atheris.FuzzedDataProvider(data[1:]), SEEDS, payload_index=1)
        if frames is None:
            return
    else:
        frames = C.split_frames(data[1:])
    # The mock's input thread: anything but [1-byte type, payload, ...] ends it.
    if len(frames) < 2 or len(frames[0]) != 1:
        return
    kind, payload = frames[0][0], frames[1]
    budget = C.total_bytes(frames[1:])
    if kind == wire.RequestType.ADD:
        _add(frames[1:], budget)
    elif kind == wire.RequestType.ABORT:
        ok, ids = C.only_typed(RPE, wire_engine.decode_abort, payload)
        if ok:
            assert len(ids) <= budget
    elif kind == wire.RequestType.UTILITY:
        ok, call = C.only_typed(RPE, wire_engine.decode_utility_call, payload)
        if ok:
            C.assert_bounded("UtilityCall.args", call.args, budget + 1)
            MockEngineCore().utility(call.method, tuple(call.args))
    elif kind == wire.RequestType.START_DP_WAVE:
        C.only_typed(RPE, wire_engine.decode_start_dp_wave, payload)
    else:
        C.only_typed(RPE, wire_engine.parse_request_type, frames[0])


if __name__ == "__main__":
    C.setup_and_fuzz(test_one_input)
