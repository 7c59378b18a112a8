"""The benchmark engine's pre-encoded steps are vLLM's bytes, and its loop runs."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from typing import Any

import msgpack
import pytest
import zmq

from zmqdispatch.bench import _common as common
from zmqdispatch.bench.engine import StepEncoder, token_for_step
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine
from zmqdispatch.wire import vllm_handshake as handshake


def _decode(payload: bytes) -> wire.EngineCoreOutputs:
    msg = wire.decode_outputs([payload])
    assert not msg.bad_rows
    return msg


@pytest.mark.parametrize("k", [1, 3])
def test_steps_decode_like_the_wire_encoder(k: int) -> None:
    enc = StepEncoder(engine_index=2, tokens_per_tick=k)
    enc.add("a", 4, 2 * k + 1)  # three ticks: k, k, 1 tokens
    enc.add("b", 7, None)
    enc.add("c", 2, 1)  # finishes in its first output
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for step in range(5):
        payload, ts, rows, tokens, finished = enc.encode_step(step, clock=lambda s=step: 123.5 + s)
        msg = _decode(payload)
        assert msg.engine_index == 2 and msg.timestamp == ts == 123.5 + step
        assert msg.weight_version == "default" and msg.finished_requests is None
        assert len(msg.outputs) == rows
        assert sum(len(r.new_token_ids) for r in msg.outputs) == tokens
        for row in msg.outputs:
            out = wire_engine.EngineCoreOutput.from_row(row, [payload])
            assert set(out.new_token_ids) == {token_for_step(step)}
            seen[out.request_id] += list(out.new_token_ids)
            if step == 0:
                assert out.prefill_stats is not None
                assert out.prefill_stats.num_prompt_tokens == {"a": 4, "b": 7, "c": 2}[out.request_id]
            else:
                assert out.prefill_stats is None
            if out.finish_reason is not None:
                assert out.finish_reason == wire.FinishReason.LENGTH
                assert out.request_id in finished
        # The same message through the project's encoder decodes identically.
        rebuilt = wire_engine.encode_outputs(
            2, [wire_engine.EngineCoreOutput.from_row(r, [payload]) for r in msg.outputs],
            timestamp=ts, weight_version="default")[0]
        assert rebuilt == payload
    assert len(seen["a"]) == 2 * k + 1 and len(seen["c"]) == 1 and len(seen["b"]) == 5 * k
    assert "a" not in enc and "c" not in enc and enc.running == 1


def test_abort_and_duplicates() -> None:
    enc = StepEncoder()
    enc.add("a", 1, None)
    with pytest.raises(ValueError):
        enc.add("a", 1, None)
    enc.encode_step(0)
    enc.add("b", 1, 3)
    enc.encode_step(1)
    assert enc.remove("b") and not enc.remove("b") and not enc.remove("zzz")
    for step in range(2, 6):  # b's final step passes without it
        msg = _decode(enc.encode_step(step)[0])
        assert [r.request_id for r in msg.outputs] == ["a"]
    enc.clear()
    assert enc.encode_step(6)[2] == 0


def test_engine_process_serves_raw_client(tmp_path) -> None:
    """Direct dial, ADD, steps with timestamps and a step table, window, ABORT, stop."""
    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    inp, outp, ctl_addr = (f"ipc://{tmp_path}/{n}" for n in ("in", "out", "ctl"))
    router.bind(inp)
    pull.bind(outp)
    proc = subprocess.Popen(common.engine_argv(sys.executable, control=ctl_addr, input_address=inp,
                                               output_address=outp))
    ctl = common.Control(ctx, ctl_addr)
    try:
        assert router.poll(30_000)
        identity, ready = router.recv_multipart()
        assert handshake.decode_ready_response(ready).max_model_len > 0
        cfg = ctl.request("cfg", {"mode": "run", "step_interval_ms": 1.0, "window": 6, "tokens_per_tick": 2})
        req = wire.EngineCoreRequest(request_id="x", prompt_token_ids=(1, 2, 3),
                                     sampling_params=wire.SamplingParams(max_tokens=1000), arrival_time=0.0)
        ctl.request("mark")
        router.send_multipart([identity, bytes([wire.RequestType.ADD]), *wire.encode_request(req)])
        msgs: list[Any] = []
        while len(msgs) < 6:
            assert pull.poll(5000)
            msgs.append(_decode(pull.recv()))
        # Window of 6 request-ticks and nothing acked: the engine waits.
        assert not pull.poll(200)
        acker = common.Acker(ctl_addr)
        acker.start(cfg["epoch"], 6)
        acker.delivered(6)
        assert pull.poll(5000)
        msgs.append(_decode(pull.recv()))
        stats = ctl.request("stats")
        assert stats["rows"] >= 7 and stats["running"] == 1 and stats["window_stalls"] >= 1
        header, table = ctl.request("table")
        for m in msgs:
            (row,) = m.outputs
            assert len(row.new_token_ids) == 2
            assert table[row.new_token_ids[0] - header["first_step"]] == m.timestamp
        assert all(b.timestamp > a.timestamp for a, b in itertools.pairwise(msgs))
        assert msgs[0].timestamp <= time.monotonic()
        router.send_multipart([identity, bytes([wire.RequestType.ABORT]), wire.encode_abort(["x"])])
        assert ctl.wait_idle(10)["aborts"] == 1
        assert ctl.request("stop") == {}
        assert proc.wait(10) == 0
        acker.close()
    finally:
        proc.kill()
        ctl.close()
        router.close(0)
        pull.close(0)


def test_percentiles_and_helpers() -> None:
    p = common.percentiles([i / 1000 for i in range(1, 1001)])
    assert p["p50"] == pytest.approx(500) and p["p99"] == pytest.approx(990) and p["p999"] == pytest.approx(999)
    assert p["samples"] == 1000
    assert common.percentiles([])["p50"] is None
    assert [common.is_slow(i, 0.1) for i in range(20)].count(True) == 2
    assert common.ack_every(4096) == 1024 and common.ack_every(0) > 10**15
    assert json.loads(json.dumps(common.cell_settings({"name": "x"})))["kind"] == "throughput"
    assert msgpack.packb(common.prompt_tokens(4, 1)) == msgpack.packb(common.prompt_tokens(4, 1))
