"""The SGLang mock scheduler: its sans-IO model follows the SGLang plugin's rules, the
mock program speaks the wire (an ADD it cannot decode is answered, the sentinel on
shutdown), and the CLI runs SGLang requests end to end against it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from zmqdispatch import ClientConfig, connect
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.mock.core import mock_token
from zmqdispatch.mock.sglang_core import MockSGLangScheduler
from zmqdispatch.testing import external_mock
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire import sglang_engine as sg_engine
from zmqdispatch.wire.schema import _pack

from ..helpers import GUARD
from .test_cli_and_mock import lines, run_cli

H = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF


def req(rid: str = "r", *, stream: bool = True, return_logprob: bool = False, top_logprobs_num: int = 0,
        **sp: object) -> sg.TokenizedGenerateReqInput:
    sp.setdefault("max_new_tokens", 8)
    return sg.TokenizedGenerateReqInput(rid=rid, input_ids=(1, 2, 3), sampling_params=sg.SGLangSamplingParams(**sp),
                                        stream=stream, return_logprob=return_logprob,
                                        top_logprobs_num=top_logprobs_num)


def admit(core: MockSGLangScheduler, r: sg.TokenizedGenerateReqInput) -> sg.SGLangBatch | None:
    return core.add(sg_engine.decode_add(sg.encode_add(r)))


def run(core: MockSGLangScheduler) -> list[sg.SGLangBatch]:
    out = []
    while core.running:
        b = core.step()
        if b is not None:
            out.append(b)
    return out


def test_refusals_are_one_terminal_abort_with_reason_and_status_400() -> None:
    core = MockSGLangScheduler()
    for r, field in ((req("a", top_p=0.0), "sampling_params.top_p"), (req("b", n=2), "sampling_params.n"),
                     (req("c", max_new_tokens=1, min_new_tokens=2), "sampling_params.min_new_tokens")):
        b = admit(core, r)
        assert b is not None and b.finished_reasons == ("abort",) and b.finished_status == (400,)
        assert b.output_ids == ((),) and (b.finished_messages[0] or "").startswith(field)
    empty = sg.TokenizedGenerateReqInput(rid="e", input_ids=(), sampling_params=sg.SGLangSamplingParams())
    b = admit(core, empty)
    assert b is not None and "input_ids are required" in (b.finished_messages[0] or "")
    assert not core.running


def test_streaming_cadence_finish_and_load_in_tokens() -> None:
    core = MockSGLangScheduler(stream_interval=3)
    admit(core, req("s", max_new_tokens=7))
    admit(core, req("n", max_new_tokens=5, stream=False))
    batches = run(core)
    s = [(b.output_ids[i], b.completion_tokens[i]) for b in batches for i, rid in enumerate(b.rids) if rid == "s"]
    assert [c for _, c in s] == [1, 4, 7] and [len(t) for t, _ in s] == [1, 3, 3]
    n = [b.output_ids[i] for b in batches for i, rid in enumerate(b.rids) if rid == "n"]
    assert len(n) == 1 and n[0] == tuple(mock_token(H, k, 0, 32_000) for k in range(5))
    assert batches[0].kv_total_tokens > 0 and batches[0].kv_used_tokens == 2 * 3 + 2


def test_stop_token_is_included_and_named() -> None:
    eos = mock_token(H, 2, 0, 32_000)
    core = MockSGLangScheduler(eos_token_ids=(eos,))
    admit(core, req("r"))
    last = run(core)[-1]
    assert last.finished_reasons == ("stop",) and last.finished_matched == (eos,) and last.output_ids[0][-1] == eos


def test_logprobs_and_ranked_candidates_per_token() -> None:
    core = MockSGLangScheduler()
    admit(core, req("lp", return_logprob=True, top_logprobs_num=2, max_new_tokens=3))
    batches = run(core)
    vals = [v for b in batches for v in b.logprob_vals[0]]
    tops = [t for b in batches for t in (b.top_logprob_ids or ((),))[0]]
    toks = [t for b in batches for t in b.output_ids[0]]
    assert len(vals) == 3 and [t[0] for t in tops] == toks and all(len(t) == 2 for t in tops)
    decoded = sg.decode_outputs(sg_engine.encode_outputs(batches[0]))
    assert decoded == batches[0]


def test_abort_is_silent_and_matches_rid_prefixes() -> None:
    core = MockSGLangScheduler()
    for rid in ("r-1", "r-10", "r-2"):
        admit(core, req(rid, max_new_tokens=100))
    core.abort(["r-1"])
    assert sorted(core.running) == ["r-2"]


def test_control_calls() -> None:
    core = MockSGLangScheduler(engine_index=3)
    assert core.control(1, "flush_cache", [0.0]) == sg.ControlReply(1, True, "", 3)
    assert core.control(2, "stop_profile", []).success is False
    assert core.control(3, "start_profile", [{}]).success is True
    assert core.control(4, "stop_profile", []).success is True
    assert "unknown control method" in (core.control(5, "nope", []).message or "")
    admit(core, req("busy", max_new_tokens=100))
    assert core.control(6, "flush_cache", [0.0]).success is False


def test_an_undecodable_add_is_answered_when_its_rid_can_be_read() -> None:
    core = MockSGLangScheduler()
    bad = [sg.RequestType.ADD.frame, _pack([sg.REQUEST_TAG, "odd", *([None] * 6), "not params", False, -1, 0,
                                            None, False])]
    (answer,) = core.receive(bad)
    b = sg.decode_outputs(answer)
    assert isinstance(b, sg.SGLangBatch) and b.rids == ("odd",) and b.finished_reasons == ("abort",)
    assert b.finished_status == (400,) and "could not decode" in (b.finished_messages[0] or "")
    assert core.receive([sg.RequestType.ADD.frame, b"\xc1"]) == [] and core.dropped == 1
    assert core.receive([b"\x07", b"\x90"]) == [] and core.dropped == 2
    (reply,) = core.receive([sg.RequestType.CONTROL.frame, sg.encode_control(9, "flush_cache", [0.0])])
    assert sg.decode_outputs(reply) == sg.ControlReply(9, True, "", 0)


async def test_the_program_sends_the_sentinel_when_it_stops(tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/hs.sock"
    with trio.fail_after(GUARD):
        async with external_mock(addr, "--runtime", "sglang") as proc, \
                connect(addr, runtime="sglang", config=ClientConfig(handshake_timeout=GUARD)) as client:
            engine = client.engine()
            assert engine.is_alive
            proc.terminate()
            death = await engine.wait_dead()
            assert death.reason == "sentinel"


def test_cli_generate_sglang_prints_the_sglang_package() -> None:
    p = run_cli("generate", "--runtime", "sglang", "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "6",
                "--request-id", "cli-1", "--temperature", "0.7")
    assert p.returncode == 0, p.stderr
    msgs = lines(p.stdout)
    assert all(m["request_id"] == "cli-1" for m in msgs)
    ids = [t for m in msgs[:-1] for t in m["chunk"]["token_ids"]]
    complete = msgs[-1]["complete"]
    assert complete["output_ids"] == ids and len(ids) == 6 and complete["finish_reason"] == "length"


def test_cli_sglang_request_file_with_fan_out_and_a_named_stop(tmp_path: Path) -> None:
    path = tmp_path / "req.json"
    eos = mock_token(((7 * 31 + 8) * 31 + 9) & 0xFFFFFFFF, 1, 0, 32_000)
    path.write_text(json.dumps({"request_id": "fan", "tokenized": {"input_ids": [7, 8, 9]}, "stream": False,
                                "sampling_params": {"n": 2, "temperature": 0.9, "max_new_tokens": 4,
                                                    "stop_token_ids": [eos]}}))
    p = run_cli("generate", "--runtime", "sglang", "--request", str(path))
    assert p.returncode == 0, p.stderr
    completes = sorted((m["complete"] for m in lines(p.stdout)), key=lambda c: c["index"])
    assert [c["index"] for c in completes] == [0, 1]
    assert all(c["finish_reason"] == "stop" and c["matched_token_id"] == eos for c in completes)


def test_cli_sglang_rejection_exits_2_naming_the_field() -> None:
    p = run_cli("generate", "--runtime", "sglang", "--prompt-token-ids", "1,2", "--top-p", "1.5")
    assert p.returncode == 2 and "sampling_params.top_p" in p.stderr and "(0, 1]" in p.stderr
    p = run_cli("generate", "--runtime", "sglang", "--prompt-token-ids", "1,2", "--seed", "3")
    assert p.returncode == 2 and "no seed field" in p.stderr


def test_cli_a_vllm_client_against_the_sglang_mock_names_the_runtime() -> None:
    launch = f"{sys.executable} -m zmqdispatch mock-engine --runtime sglang --handshake-address {{handshake_address}}"
    p = run_cli("generate", "--prompt-token-ids", "1,2", "--max-tokens", "2", "--launch", launch)
    assert p.returncode == 3 and "SGLang scheduler" in p.stderr


def test_decoder_refuses_a_batch_of_another_tag() -> None:
    try:
        sg.decode_outputs([_pack(["BatchTokenIDOutSlim", [], [], [], [], [], [], [], [], [], []])])
    except RemoteProtocolError as exc:
        assert "wrong msgspec tag" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("decoded a TokenSpeed batch as SGLang's")


def test_cli_sglang_stop_strings_go_to_the_scheduler_and_a_tokenizer_is_refused(tmp_path: Path) -> None:
    from zmqdispatch import cli

    # the SGLang scheduler matches stop strings itself: sent as given, no tokenizer needed
    args = cli._build_parser().parse_args(["generate", "--runtime", "sglang", "--prompt-token-ids", "1,2",
                                           "--stop", "ab", "--stop", "c d"])
    args.tokenizer_obj = None
    (sample,) = cli._translate(args, cli._load_request(args), 4096, None)
    assert sample.request.sampling_params.stop == ("ab", "c d")
    p = run_cli("generate", "--runtime", "sglang", "--prompt-token-ids", "1,2", "--max-tokens", "3", "--stop", "ab")
    assert p.returncode == 0, p.stderr
    assert lines(p.stdout)[-1]["complete"]["finish_reason"] == "length"  # the mock has no tokenizer to match it
    help_text = " ".join(cli._build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "sglang: sent to the scheduler, which matches it itself" in help_text
    # a --tokenizer would be loaded and never used: refused by name, before an engine starts
    (tmp_path / "tokenizer.json").write_text("{}")
    p = run_cli("generate", "--runtime", "sglang", "--prompt-token-ids", "1,2", "--tokenizer",
                str(tmp_path / "tokenizer.json"))
    assert p.returncode == 2 and "--tokenizer: not used with --runtime sglang" in p.stderr, p.stderr
    assert p.stdout == ""
