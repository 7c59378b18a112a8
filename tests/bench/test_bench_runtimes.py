"""The benchmark engine on TokenSpeed's and SGLang's wire: its spliced step batches
decode (with the project's own decoders) to the rows a plain model of the
lifecycle expects, and re-encode to the same bytes; ``zmqdispatch bench
--runtime`` runs end to end at a tiny size (the machinery, never the speed)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqdispatch import cli
from zmqdispatch.bench import _common as common
from zmqdispatch.bench import batches, harness
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire import sglang_outputs
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import tokenspeed_outputs

RUNTIMES = ("tokenspeed", "sglang")
KV_TOTAL = 4096


def _decode(runtime: str, payload: bytes) -> Any:
    if runtime == "tokenspeed":
        ts_batch = tokenspeed_outputs.decode_outputs([payload])
        assert ts_engine.encode_outputs(ts_batch) == [payload]  # the runtime's own encoder writes the same bytes
        assert ts_batch.wire_elements == 14
        return ts_batch
    batch = sglang_outputs.decode_outputs([payload])
    assert isinstance(batch, sglang_outputs.SGLangBatch)
    assert sg_engine.encode_outputs(batch) == [payload]
    assert batch.wire_elements == 16 and batch.finished_status is None
    assert batch.finished_messages == (None,) * len(batch) and batch.finished_matched == (None,) * len(batch)
    return batch


class _Model:
    """The lifecycle, one request at a time: what each step must carry."""

    def __init__(self, k: int) -> None:
        self.k = k
        #: rid -> [prompt_len, max_tokens, tokens sent so far]
        self.running: dict[str, list[Any]] = {}

    def step(self) -> tuple[dict[str, tuple[int, str, int, int]], list[str]]:
        rows: dict[str, tuple[int, str, int, int]] = {}
        finished = []
        for rid, r in list(self.running.items()):
            prompt, max_tokens, sent = r
            n = self.k if max_tokens is None else min(self.k, max_tokens - sent)
            r[2] = sent + n
            reason = "length" if max_tokens is not None and r[2] == max_tokens else ""
            rows[rid] = (n, reason, prompt, r[2])
            if reason:
                finished.append(rid)
                del self.running[rid]
        return rows, finished

    def kv_used(self) -> int:
        return sum(prompt + sent for prompt, _, sent in self.running.values())


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.one_of(st.none(), st.integers(1, 9))),
        st.tuples(st.just("remove"), st.integers(0, 30)),
        st.tuples(st.just("step")),
    ),
    max_size=60,
)


@pytest.mark.parametrize("runtime", RUNTIMES)
@settings(deadline=None, max_examples=60, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 3), ops=_OPS)
def test_step_batches_decode_to_the_lifecycle_across_adds_removes_and_finishes(
        runtime: str, k: int, ops: list[tuple[Any, ...]]) -> None:
    enc = batches.make_step_encoder(runtime, engine_index=3, tokens_per_tick=k, kv_total=KV_TOTAL)
    model = _Model(k)
    added: list[str] = []
    step = 0
    for op in [*ops, ("step",), ("step",)]:
        if op[0] == "add":
            rid = f"r{len(added)}"
            added.append(rid)
            enc.add(rid, op[1], op[2])
            model.running[rid] = [op[1], op[2], 0]
        elif op[0] == "remove":
            rid = added[op[1] % len(added)] if added else "none"
            assert enc.remove(rid) == (rid in model.running)
            model.running.pop(rid, None)
        else:
            want, want_finished = model.step()
            payload, sent_at, rows, tokens, finished = enc.encode_step(step, clock=lambda: 42.0)
            assert sorted(finished) == sorted(want_finished)
            assert rows == len(want) and tokens == sum(n for n, *_ in want.values())
            if not want:
                assert payload == b"" and enc.running == 0
                continue
            assert sent_at == 42.0
            batch = _decode(runtime, payload)
            assert len(set(batch.rids)) == len(batch.rids) == rows
            tok = batches.token_for_step(step)
            got = {rid: (len(ids), reason, prompt, done) for rid, ids, reason, prompt, done in zip(
                batch.rids, batch.output_ids, batch.finished_reasons, batch.prompt_tokens, batch.completion_tokens)}
            assert got == want
            assert all(set(ids) == {tok} for ids in batch.output_ids)
            assert batch.cached_tokens == (0,) * rows
            assert batch.logprob_vals == batch.logprob_ids == ((),) * rows
            assert batch.engine_index == 3 and batch.num_running == len(model.running) == enc.running
            assert batch.num_waiting == 0
            if runtime == "tokenspeed":
                assert batch.kv_active_pages == -(-model.kv_used() // batches.KV_PAGE_TOKENS)
                assert batch.kv_total_pages == KV_TOTAL
            else:
                assert batch.kv_used_tokens == model.kv_used() and batch.kv_total_tokens == KV_TOTAL
            step += 1
        assert enc.running == len(model.running)
        assert all(rid in enc for rid in model.running)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_cohorts_keep_their_own_completion_counts(runtime: str) -> None:
    """Requests admitted in different steps share a batch with different cumulative counts."""
    enc = batches.make_step_encoder(runtime, tokens_per_tick=2, kv_total=KV_TOTAL)
    for i in range(20):
        enc.add(f"a{i}", 5, None)
    enc.encode_step(0)
    enc.encode_step(1)
    for i in range(20):
        enc.add(f"b{i}", 7, None)
    enc.encode_step(2)
    assert enc.remove("a3") and not enc.remove("a3")
    batch = _decode(runtime, enc.encode_step(3)[0])
    counts = dict(zip(batch.rids, batch.completion_tokens))
    assert len(counts) == 39
    assert {counts[f"a{i}"] for i in range(20) if i != 3} == {8}
    assert {counts[f"b{i}"] for i in range(20)} == {4}
    with pytest.raises(ValueError, match="duplicate"):
        enc.add("b1", 1, None)
    enc.clear()
    assert enc.encode_step(4)[2] == 0 and enc.running == 0


def test_no_batch_encoder_for_vllm_and_one_token_modulus() -> None:
    from zmqdispatch.bench import engine

    with pytest.raises(ValueError, match="vllm"):
        batches.make_step_encoder("vllm")
    # the runners map token ids back to steps with the modulus the engine wraps them at
    assert common.TOKEN_MODULUS == batches.TOKEN_MODULUS == engine.TOKEN_MODULUS
    assert batches.token_for_step(2**31 + 5) == engine.token_for_step(2**31 + 5) == 5


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_bench_runs_on_the_runtime_and_records_the_vllm_only_clients_as_skipped(tmp_path, runtime: str) -> None:
    args = cli._build_parser().parse_args([
        "bench", "--runtime", runtime, "--cells", "sat-c1", "burst-c100-1ms", "--seconds", "0.3", "--warmup",
        "0.05", "--rounds", "1", "--idle-streams", "0", "--no-plot", "--no-progress",
        "--output-dir", str(tmp_path / "out"),
    ])
    settings = harness.BenchSettings(args)
    # A paced cell with slow consumers: latency through the engine's step table.
    settings.cells.append(common.cell_settings({
        "name": "slowmix-c6-2ms", "concurrency": 6, "step_interval_ms": 2.0, "slow_fraction": 0.5,
        "slow_delay_ms": 5.0, "seconds": 0.3, "warmup_s": 0.05, "window": harness.window_for(6),
    }))
    lines: list[str] = []
    harness.run(settings, out=lines.append)
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["settings"]["runtime"] == runtime
    assert set(doc["skipped"]) == {"raw", "vllm"}
    assert all("speaks the vLLM wire only" in why for why in doc["skipped"].values())
    assert sum("speaks the vLLM wire only" in line for line in lines) >= 2
    clients = set(harness.ALL_RUNTIME_CLIENTS)
    assert set(doc["runners"]) == clients and {r["runtime"] for r in doc["runners"].values()} == {runtime}
    for cell in doc["cells"]:
        assert set(cell["results"]) == clients
        for client, r in cell["results"].items():
            m = r["median"]
            assert "error" not in m, m
            if cell["kind"] == "burst":
                assert "vLLM wire only" in m["skipped"]
                continue
            if client == "zmqdispatch-group" and cell["slow_fraction"]:
                assert "skipped" in m
                continue
            assert m["ticks"] > 0 and m["tokens"] == m["ticks"]
            assert _is_number(m["request_ticks_per_s"]) and _is_number(m["cpu_us_per_tick"])
            assert 0 < m["deliveries_per_tick"] <= 1.0 + 1e-9
            assert _is_number(m["engine"]["max_request_ticks_per_s"])
            lat = m["latency_ms"]
            assert lat["samples"] > 0 and 0 <= lat["p50"] <= lat["p99"] <= lat["p999"]
            if cell["slow_fraction"]:
                assert m["latency_slow_ms"]["samples"] > 0
                assert lat["p999"] < 1000  # mapped to its step's send time, not to a zero timestamp
    md = (tmp_path / "out" / "bench.md").read_text()
    assert f"Runtime: {runtime}" in md and "raw skipped" in md and "vllm skipped" in md
    assert "| sat-c1 | zmqdispatch-asyncio |" in md


def test_real_engine_is_refused_with_another_runtime(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--runtime", "tokenspeed", "--real-engine"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--real-engine" in err and "--runtime tokenspeed" in err


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_engine_decodes_the_runtimes_input_and_answers_sglang_control(runtime: str) -> None:
    """ADD, ABORT, a bad message (counted, not fatal) and SGLang's CONTROL, through
    the engine's input handler; its batches go out on the output socket."""
    import zmq

    from zmqdispatch.bench.engine import BenchEngine
    from zmqdispatch.wire import sglang as sg
    from zmqdispatch.wire import tokenspeed as ts

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://bench-out")
    push.connect("inproc://bench-out")
    try:
        eng = BenchEngine(push, push, None, runtime=runtime, kv_total=KV_TOTAL, max_model_len=100)
        if runtime == "tokenspeed":
            def add(rid: str, max_new: int | None) -> list[bytes]:
                req = ts.TokenizedGenerateReqInput(rid=rid, input_ids=(1, 2, 3), stream=True,
                                                   sampling_params=ts.TokenSpeedSamplingParams(max_new_tokens=max_new))
                return [ts.RequestType.ADD.frame, *ts.encode_add(req)]
            abort = [ts.RequestType.ABORT.frame, ts.encode_abort(["b"])]
        else:
            def add(rid: str, max_new: int | None) -> list[bytes]:
                req = sg.TokenizedGenerateReqInput(rid=rid, input_ids=(1, 2, 3), stream=True,
                                                   sampling_params=sg.SGLangSamplingParams(max_new_tokens=max_new))
                return [sg.RequestType.ADD.frame, *sg.encode_add(req)]
            abort = [sg.RequestType.ABORT.frame, sg.encode_abort(["b"])]
        eng._on_input(add("a", 2))
        eng._on_input(add("b", None))
        eng._on_input([b"\x00", b"\xc1"])  # not msgpack
        assert eng.adds == 2 and eng.errors == 1 and eng.encoder.running == 2
        eng._do_step(0.0)
        eng._on_input(abort)
        assert eng.aborts == 1 and eng.encoder.running == 1
        eng._do_step(0.0)
        first, second = (_decode(runtime, pull.recv()) for _ in range(2))
        assert set(first.rids) == {"a", "b"} and second.rids == ("a",) and second.finished_reasons == ("length",)
        assert eng.encoder.running == 0 and eng.table[1] >= eng.table[0] > 0
        if runtime == "sglang":
            eng._on_input([sg.RequestType.CONTROL.frame, sg.encode_control(7, "flush_cache", [1.0])])
            reply = sglang_outputs.decode_outputs([pull.recv()])
            assert isinstance(reply, sglang_outputs.ControlReply) and reply.call_id == 7 and reply.success
        # nil max_new_tokens: TokenSpeed fills the context (100 - 3 - 1), SGLang takes its default
        eng._on_input(add("c", None))
        first_step = eng.step
        eng._do_step(0.0)
        assert _decode(runtime, pull.recv()).rids == ("c",)
        max_new = 100 - 3 - 1 if runtime == "tokenspeed" else 128
        assert eng.encoder._final["c"] == (first_step + max_new - 1, 1)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
