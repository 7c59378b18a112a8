#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the vLLM control-plane decoders.

Targets (byte 0 of the input picks one, the rest is the payload):

====  ==========================================================================
0     ``UtilityOutput`` inside ``decode_outputs`` (``[call_id, failure, [type_info,
      value]]``), then routed through ``EngineProtocol`` with pending utility calls
      1 and 2: a reply settles its call with a result or a ``UtilityCallError``
1     ``decode_handshake_status`` (HELLO / READY maps)
2     ``decode_ready_response`` (vLLM's and TokenSpeed's ready response; cattrs)
3     ``decode_init`` (the INIT map, read by the mock engine)
4     ``decode_abort`` (array of request ids)
5     ``decode_utility_call`` (``[client_index, call_id, method, args]``)
6     ``decode_start_dp_wave`` (``[wave, exclude|nil]``)
7     ``parse_request_type`` (the one-byte type frame)
====  ==========================================================================

Modes 8-14 run targets 0-6 on a golden vector of that target mutated
structurally (``_common.mutate_message``; the rest of the input drives the
mutations).

Contract: only ``RemoteProtocolError`` escapes; a decoded value holds at most one
value per input byte (``count_nodes``); whatever decodes re-encodes and decodes
to the same value (handshake status, INIT, ABORT, UTILITY, START_DP_WAVE).

    python fuzz/seed_corpus.py vllm_control fuzz/corpus/vllm_control
    python fuzz/vllm_control.py fuzz/corpus/vllm_control -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import math

import atheris

with atheris.instrument_imports():
    from zmqdispatch.errors import EngineDeadError, LocalProtocolError, RemoteProtocolError, UtilityCallError
    from zmqdispatch.protocol.engine import EngineProtocol
    from zmqdispatch.wire import tokenspeed as ts
    from zmqdispatch.wire import tokenspeed_engine as ts_engine
    from zmqdispatch.wire import vllm as wire
    from zmqdispatch.wire import vllm_engine as wire_engine
    from zmqdispatch.wire import vllm_handshake as handshake

import _common as C

MODES = 15


def _seeds(*prefixes: str) -> list[list[bytes]]:
    return C.load_vectors("vllm_0.32.0.json", "tokenspeed_0.1.1.json",
                          keep=lambda c: c["name"].startswith(prefixes))


SEEDS = {
    0: _seeds("utility_result_", "outputs_dp_", "outputs_finished_abort"),
    1: _seeds("handshake_hello", "handshake_ready_headless", "handshake_ready"),
    2: _seeds("handshake_ready_response", "ready_response"),
    3: _seeds("handshake_init_reply"),
    4: _seeds("request_abort", "abort_r1"),
    5: _seeds("utility_call_"),
    6: _seeds("request_start_dp_wave"),
}
SEEDS[1] = [f for f in SEEDS[1] if f not in SEEDS[2]]
RPE = RemoteProtocolError


def _same(a: object, b: object) -> bool:
    """Equality where NaN equals NaN (msgpack floats survive a round trip bit for bit)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _utility(frames: list[bytes], budget: int) -> None:
    ok, msg = C.only_typed(RPE, wire.decode_outputs, frames)
    if ok and msg.utility_output is not None:
        uo = msg.utility_output
        assert type(uo.call_id) is int
        assert uo.failure_message is None or type(uo.failure_message) is str
        if uo.result is not None:
            C.assert_bounded("UtilityOutput.result", (uo.result.type_info, uo.result.value), budget + 2)
    p = EngineProtocol(max_decode_errors=10**9)
    calls = [p.start_utility("m", [1]) for _ in range(2)]
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    p.frames_received(frames)  # never raises
    for call in calls:
        if call.done:
            # a reply's failure_message, or the link's death (sentinel) for every pending call
            assert call.error is None or isinstance(call.error, (UtilityCallError, EngineDeadError))
        if call.done and ok and msg.utility_output is not None and msg.utility_output.call_id == call.call_id:
            assert (call.error is not None) == (msg.utility_output.failure_message is not None)


def _handshake_status(body: bytes, budget: int) -> None:
    ok, hs = C.only_typed(RPE, handshake.decode_handshake_status, body)
    if not ok:
        return
    assert type(hs.status) is str and len(hs.status) <= budget
    if hs.status in ("HELLO", "READY") and hs.parallel_config_hash is None:
        enc = handshake.encode_hello if hs.status == "HELLO" else handshake.encode_ready
        again = handshake.decode_handshake_status(enc(hs.local, hs.headless))
        assert again == hs, (again, hs)


def _ready_response(body: bytes, budget: int) -> None:
    ok, resp = C.only_typed(RPE, handshake.decode_ready_response, body)
    ok2, resp2 = C.only_typed(RPE, ts.decode_ready_response, body)
    assert ok == ok2
    if not ok:
        return
    assert type(resp.max_model_len) is int and resp.max_model_len > 0
    C.assert_bounded("EngineCoreReadyResponse.kv_events_config", resp.kv_events_config, budget + 1)
    ts.is_tokenspeed(resp)
    try:
        again = handshake.decode_ready_response(handshake.encode_ready_response(resp))
    except LocalProtocolError:
        return  # e.g. a kv_events_config value msgpack cannot write back
    # cattrs rebuilds the same attrs value (NaN aside: kv_cache_max_concurrency).
    for f in ("max_model_len", "block_size", "data_parallel_size", "max_num_batched_tokens", "vllm_version"):
        assert getattr(again, f) == getattr(resp, f), f
    assert _same(again.kv_cache_max_concurrency, resp.kv_cache_max_concurrency)


def _init(body: bytes, budget: int) -> None:
    ok, init = C.only_typed(RPE, handshake.decode_init, body)
    if not ok:
        return
    C.assert_bounded("HandshakeInit", (init.inputs, init.outputs, init.parallel_config), budget + 3)
    try:
        payload = handshake.encode_init(init.inputs, init.outputs, init.coordinator_input, init.coordinator_output,
                                   init.frontend_stats_publish_address, init.parallel_config)
    except LocalProtocolError:
        return  # parallel_config holds a value msgpack cannot write back
    again = handshake.decode_init(payload)
    assert (again.inputs, again.outputs, again.coordinator_input) == (init.inputs, init.outputs,
                                                                    init.coordinator_input)


def _abort(body: bytes, budget: int) -> None:
    ok, ids = C.only_typed(RPE, wire_engine.decode_abort, body)
    ok2, ids2 = C.only_typed(RPE, ts_engine.decode_abort, body)
    assert ok == ok2
    if ok:
        assert ids == ids2 and len(ids) <= budget
        assert wire_engine.decode_abort(wire.encode_abort(ids)) == ids


def _utility_call(body: bytes, budget: int) -> None:
    ok, call = C.only_typed(RPE, wire_engine.decode_utility_call, body)
    if not ok:
        return
    C.assert_bounded("UtilityCall.args", call.args, budget + 1)
    try:
        payload = wire.encode_utility_call(call.client_index, call.call_id, call.method, call.args)
    except LocalProtocolError:
        return  # an arg the encoder cannot write (e.g. bytes keys)
    again = wire_engine.decode_utility_call(payload)
    assert (again.client_index, again.call_id, again.method) == (call.client_index, call.call_id, call.method)


def _dp_wave(body: bytes, _budget: int) -> None:
    ok, value = C.only_typed(RPE, wire_engine.decode_start_dp_wave, body)
    if ok:
        wave, exclude = value
        try:
            payload = wire.encode_start_dp_wave(wave, exclude)
        except LocalProtocolError:
            return
        assert wire_engine.decode_start_dp_wave(payload) == value


def _request_type(body: bytes, _budget: int) -> None:
    ok, t = C.only_typed(RPE, wire_engine.parse_request_type, body)
    ok2, t2 = C.only_typed(RPE, ts_engine.parse_request_type, body)
    if ok:
        assert t.frame == body
    if ok2:
        assert ok and int(t2) == int(t)


_TARGETS = {1: _handshake_status, 2: _ready_response, 3: _init, 4: _abort, 5: _utility_call, 6: _dp_wave,
            7: _request_type}


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % MODES, data[1:]
    if mode >= 8:
        mode -= 8
        frames = C.mutate_message(atheris.FuzzedDataProvider(body), SEEDS[mode])
        if frames is None:
            return
        if mode == 0:
            _utility(frames, C.total_bytes(frames))
        else:
            _TARGETS[mode](frames[0], len(frames[0]))
        return
    if mode == 0:
        frames = C.split_frames(body)
        _utility(frames, C.total_bytes(frames))
    else:
        _TARGETS[mode](body, len(body))


if __name__ == "__main__":
    C.setup_and_fuzz(test_one_input)
