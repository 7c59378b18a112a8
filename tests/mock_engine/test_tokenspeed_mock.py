"""The TokenSpeed mock engine: its scheduler model (sans-IO) reproduces the engine's
quirks, and the CLI runs TokenSpeed requests end to end against it."""

from __future__ import annotations

import json


from zmqdispatch import limits
from zmqdispatch.mock.core import mock_token
from zmqdispatch.mock.tokenspeed_core import MockTokenSpeedScheduler
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine

from ..helpers import make_ts_request
from .test_cli_and_mock import lines, run_cli


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def admit(core: MockTokenSpeedScheduler, req: ts.TokenizedGenerateReqInput):
    # what the engine's receiver does to an ADD before admission
    return core.add(ts.finalize_add(ts_engine.decode_add(ts.encode_add(req))))


def run_to_end(core: MockTokenSpeedScheduler) -> list[ts.TokenSpeedBatch]:
    batches = []
    while core.running:
        b = core.step()
        if b is not None:
            batches.append(b)
    return batches


def rows(batches, rid):
    out = []
    for b in batches:
        for o in b.outputs():
            if o.rid == rid:
                out.append(o)
    return out


def test_refused_request_gets_one_terminal_abort_without_tokens():
    core = MockTokenSpeedScheduler(enable_output_logprobs=False)
    b = admit(core, make_ts_request("t1", prompt=(1, 2, 3, 4), return_logprob=True))
    assert b.rids == ("t1",) and b.finished_reasons == ("abort",) and b.output_ids == ((),)
    assert b.completion_tokens == (0,) and b.prompt_tokens == (4,) and b.kv_total_pages > 0
    assert not core.running and "--enable-output-logprobs" in core.refused["t1"]
    # n != 1 is refused the same way (the receiver marks it invalid)
    b = admit(core, make_ts_request("t2", n=2))
    assert b.finished_reasons == ("abort",)


def test_stop_token_is_included_and_ignore_eos_disables_token_stops():
    h = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
    eos = mock_token(h, 3, 0, 32_000)
    core = MockTokenSpeedScheduler(eos_token_ids=(eos,))
    admit(core, make_ts_request("t1", max_new_tokens=10))
    (last,) = rows(run_to_end(core), "t1")[-1:]
    assert last.finish_reason == "stop" and last.output_ids[-1] == eos and last.completion_tokens == 4
    admit(core, make_ts_request("t2", max_new_tokens=10, ignore_eos=True))
    assert rows(run_to_end(core), "t2")[-1].finish_reason == "length"


def test_streaming_cadence_and_non_streaming_every_50_tokens():
    core = MockTokenSpeedScheduler(stream_interval=3)
    admit(core, make_ts_request("s", max_new_tokens=8))
    admit(core, make_ts_request("n", max_new_tokens=120, stream=False))
    batches = run_to_end(core)
    s = rows(batches, "s")
    assert [o.completion_tokens for o in s] == [1, 4, 7, 8]  # tokens 1, k+1, 2k+1, then the finish
    assert [len(o.output_ids) for o in s] == [1, 3, 3, 1]
    n = rows(batches, "n")
    assert [o.completion_tokens for o in n] == [1, 51, 101, 120]
    assert sum(len(o.output_ids) for o in n) == 120 and n[-1].finish_reason == "length"


def test_logprobs_one_per_emitted_token():
    core = MockTokenSpeedScheduler()
    admit(core, make_ts_request("t", max_new_tokens=3, return_logprob=True))
    admit(core, make_ts_request("u", max_new_tokens=3))
    batches = run_to_end(core)
    for o in rows(batches, "t"):
        assert len(o.logprob_vals) == len(o.output_ids) and o.logprob_ids == o.output_ids
    assert all(o.logprob_vals == () for o in rows(batches, "u"))


def test_client_abort_sends_nothing_and_a_late_abort_is_parked_for_the_next_request():
    clock = Clock()
    core = MockTokenSpeedScheduler(clock=clock)
    admit(core, make_ts_request("t", max_new_tokens=1000))
    core.step()
    core.abort(["t"])
    assert not core.running and core.step() is None  # no terminal frame for a client abort
    core.abort(["gone"])  # unknown rid: parked
    assert admit(core, make_ts_request("gone")) is None and not core.running  # silently killed
    assert core.killed_by_parked_abort == 1
    core.abort(["later"])
    clock.now += limits.TOKENSPEED_ABORT_PARK_SECONDS + 1
    admit(core, make_ts_request("later"))
    assert "later" in core.running  # the parked abort expired


def test_unseeded_sampling_depends_on_the_request_id():
    core = MockTokenSpeedScheduler()
    for rid in ("a", "b"):
        admit(core, make_ts_request(rid, max_new_tokens=4, temperature=0.8))
    batches = run_to_end(core)
    a = [t for o in rows(batches, "a") for t in o.output_ids]
    b = [t for o in rows(batches, "b") for t in o.output_ids]
    assert a != b  # crc32("a") != crc32("b")


def test_max_new_tokens_unset_fills_the_context():
    core = MockTokenSpeedScheduler(max_model_len=20)
    admit(core, make_ts_request("t", prompt=(1, 2, 3), max_new_tokens=None))
    last = rows(run_to_end(core), "t")[-1]
    assert last.completion_tokens == 20 - 3 - 1 and last.finish_reason == "length"


# ------------------------------------------------------------------ CLI


def test_cli_generate_tokenspeed_prints_the_tokenspeed_package():
    p = run_cli("generate", "--runtime", "tokenspeed", "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "6",
                "--request-id", "cli-1")
    assert p.returncode == 0, p.stderr
    msgs = lines(p.stdout)
    assert all(m["request_id"] == "cli-1" for m in msgs)  # only the TokenSpeed proto has this field
    ids = [t for m in msgs[:-1] for t in m["chunk"]["token_ids"]]
    complete = msgs[-1]["complete"]
    assert complete["output_ids"] == ids and len(ids) == 6 and complete["finish_reason"] == "length"
    assert "spec_accepted_tokens" in complete  # a TokenSpeed GenerateComplete field


def test_cli_tokenspeed_request_file_with_fan_out(tmp_path):
    req = {
        "request_id": "fan",
        "tokenized": {"input_ids": [7, 8, 9]},
        "sampling_params": {"n": 3, "temperature": 0.9, "max_new_tokens": 4, "sampling_seed": "5"},
        "stream": False,
    }
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    p = run_cli("generate", "--runtime", "tokenspeed", "--request", str(path))
    assert p.returncode == 0, p.stderr
    completes = sorted((m["complete"] for m in lines(p.stdout)), key=lambda c: c["index"])
    assert [c["index"] for c in completes] == [0, 1, 2]
    assert len({tuple(c["output_ids"]) for c in completes}) == 3  # seeds 5, 6, 7


def test_cli_tokenspeed_rejection_exits_2_before_starting_an_engine():
    p = run_cli("generate", "--runtime", "tokenspeed", "--prompt-token-ids", "1,2", "--top-k", "200")
    assert p.returncode == 2 and "sampling_params.top_k" in p.stderr and "128" in p.stderr
    assert p.stdout == ""


def test_cli_a_vllm_request_json_is_not_a_tokenspeed_request(tmp_path):
    path = tmp_path / "req.json"
    path.write_text(json.dumps({"request_id": "x", "tokenized": {"input_ids": [1]},
                                "sampling_params": {"max_tokens": 3}}))
    p = run_cli("generate", "--runtime", "tokenspeed", "--request", str(path))
    assert p.returncode == 2 and "tokenspeed.grpc.scheduler.GenerateRequest" in p.stderr


def test_cli_runtime_mismatch_with_the_engine_is_an_engine_error():
    # a vLLM client pointed at a TokenSpeed engine: the handshake says who dialed in
    import sys

    launch = (f"{sys.executable} -m zmqdispatch mock-engine --runtime tokenspeed "
              "--handshake-address {handshake_address}")
    p = run_cli("generate", "--prompt-token-ids", "1,2", "--max-tokens", "2", "--launch", launch)
    assert p.returncode == 3 and "TokenSpeed scheduler" in p.stderr
