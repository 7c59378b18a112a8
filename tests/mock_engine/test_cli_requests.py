"""``zmqdispatch generate --requests FILE``: many proto-JSON requests through one
client against the mock engine process (``docs/cli.md``, "Many requests"), and
the line checks without an engine (``zmqdispatch._cli_requests``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqdispatch._cli_requests import parse_requests, split_lines
from zmqdispatch.errors import RequestRejected
from zmqdispatch.translate.vllm import pb

from .test_cli_and_mock import ENV, run_cli


def req(rid: str, prompt: list[int] | None = None, **sp: object) -> dict:
    sp.setdefault("max_tokens", 4)
    return {"request_id": rid, "tokenized": {"input_ids": prompt or [1, 2, 3]}, "sampling_params": sp, "stream": True}


def jsonl(*reqs: dict | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in reqs)


def by_request(stdout: str) -> dict[str, list[dict]]:
    """Output lines grouped by request_id (each line one whole JSON object)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for line in stdout.splitlines():
        obj = json.loads(line)
        assert set(obj) == {"request_id", "response"}
        out[obj["request_id"]].append(obj["response"])
    return dict(out)


def check_streamed(responses: list[dict], n_tokens: int, index: int = 0) -> None:
    """Chunks of one sample, then its complete, whose ids are the chunks' tokens."""
    mine = [r for r in responses if (r.get("chunk") or r.get("complete"))["index"] == index]
    *chunks, last = mine
    assert chunks and all("chunk" in c for c in chunks)
    tokens = [t for c in chunks for t in c["chunk"]["token_ids"]]
    assert last["complete"]["output_ids"] == tokens and len(tokens) == n_tokens


def launch_marking(tmp_path) -> tuple[str, object]:
    """A --launch command that leaves a file when the engine starts."""
    mark = tmp_path / "engine-started"
    cmd = (f"sh -c 'touch {mark}; exec {sys.executable} -m zmqdispatch mock-engine "
           "--handshake-address {handshake_address}'")
    return cmd, mark


# ------------------------------------------------------------------ end to end


def test_every_request_completes_exit_0_one_line_per_response(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text(jsonl(req("a"), "", "   ", req("b", [4, 5], max_tokens=6),
                          req("c", [6], max_tokens=3, n=3, temperature=0.8, seed=5)))
    p = run_cli("generate", "--requests", str(path))
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    out = by_request(p.stdout)
    assert sorted(out) == ["a", "b", "c"]
    check_streamed(out["a"], 4)
    check_streamed(out["b"], 6)
    for i in range(3):  # n=3: every sample under the parent's id, told apart by index
        check_streamed(out["c"], 3, index=i)
    # the same request alone gives the same responses (the mock is deterministic)
    # (chunks may merge differently when the reader lags: compare the tokens and the complete)
    alone = [json.loads(x) for x in run_cli("generate", "--request", "-",
                                            stdin=json.dumps(req("b", [4, 5], max_tokens=6))).stdout.splitlines()]
    assert alone[-1] == out["b"][-1]
    assert [t for r in alone[:-1] for t in r["chunk"]["token_ids"]] == out["b"][-1]["complete"]["output_ids"]


def test_stdin_and_no_stream():
    p = run_cli("generate", "--requests", "-", "--no-stream", stdin=jsonl(req("x"), req("y", max_tokens=2)))
    assert p.returncode == 0, p.stderr
    out = by_request(p.stdout)
    assert [list(r) for r in out["x"]] == [["complete"]] and len(out["y"][0]["complete"]["output_ids"]) == 2


def test_a_prompt_past_max_model_len_is_rejected_alone_exit_2_naming_it():
    p = run_cli("generate", "--requests", "-", "--mock-max-model-len", "10",
                stdin=jsonl(req("ok-1"), req("too long", list(range(1, 11))), req("ok-2")))
    assert p.returncode == 2  # rejected before it was sent, as through --request
    out = by_request(p.stdout)
    assert sorted(out) == ["ok-1", "ok-2"]
    check_streamed(out["ok-1"], 4)
    failures = [line for line in p.stderr.splitlines() if "rejected:" in line]
    assert failures == ['zmqdispatch: error: request_id "too long" rejected: ContextLengthError: prompt_token_ids: '
                        'prompt of 10 tokens does not fit max_model_len=10 (at least one token must be generated)']
    assert p.stderr.splitlines()[-1] == ("zmqdispatch: error: 1 of 3 requests failed, 1 of them rejected before "
                                         "they were sent")
    assert "Traceback" not in p.stderr


def test_an_engine_death_fails_every_request_each_named():
    launch = f"{sys.executable} -m zmqdispatch mock-engine --handshake-address {{handshake_address}} --fault sentinel:2"
    p = run_cli("generate", "--requests", "-", "--launch", launch,
                stdin=jsonl(*(req(f"r{i}", max_tokens=100) for i in range(4))))
    assert p.returncode == 3, p.stderr
    named = sorted(line.split('"')[1] for line in p.stderr.splitlines() if "EngineDeadError" in line)
    assert named == ["r0", "r1", "r2", "r3"]
    assert all("chunk" in r for rs in by_request(p.stdout).values() for r in rs)  # tokens before the death


def test_a_bad_line_rejects_the_input_exit_2_before_any_engine_starts(tmp_path):
    launch, mark = launch_marking(tmp_path)
    lines = jsonl(req("a"), "{not json", "[1, 2]", {"tokenized": {"input_ids": [1]}}, req("a"),
                  req("t", temperature=-1), {"request_id": "u", "unknown_field": 1},
                  req("p", n=2, temperature=1.0), req("p-1"))
    p = run_cli("generate", "--requests", "-", "--launch", launch, stdin=lines)
    assert p.returncode == 2
    assert p.stdout == "" and not mark.exists()  # nothing sent: the engine was never started
    errors = p.stderr.splitlines()
    assert [e.split(": ")[3] for e in errors[:-1]] == [f"line {n}" for n in (2, 3, 4, 5, 6, 7, 9)]
    assert "not JSON" in errors[0] and "column 2" in errors[0]
    assert "expected a JSON object" in errors[1] and "an array" in errors[1]
    assert "request_id is required" in errors[2]
    assert 'duplicate request_id "a" (also on line 1)' in errors[3]
    assert "sampling_params.temperature" in errors[4]
    assert "unknown_field" in errors[5]
    assert '"p-1"' in errors[6] and "line 8" in errors[6]  # sample 1 of "p" is "p-1" on the engine
    assert errors[-1] == "zmqdispatch: error: request rejected: 7 bad line(s) in --requests '-'; nothing was sent"


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-tokens", "3"], "--max-tokens: set these in the --requests message instead"),
    (["--prompt-token-ids", "1,2"], "use either --requests or --prompt-token-ids"),
    (["--request", "-"], "use either --request or --requests"),
])
def test_request_flags_beside_requests_are_refused_by_name(argv, message):
    p = run_cli("generate", "--requests", "-", *argv, stdin=jsonl(req("a")))
    assert p.returncode == 2 and message in p.stderr and p.stderr.count("\n") == 1 and p.stdout == ""


def test_max_concurrency_needs_requests_and_an_unreadable_file_is_named(tmp_path):
    p = run_cli("generate", "--prompt-token-ids", "1", "--max-concurrency", "2")
    assert p.returncode == 2 and "--max-concurrency: only with --requests" in p.stderr
    p = run_cli("generate", "--requests", str(tmp_path / "missing.jsonl"))
    assert p.returncode == 2 and "cannot read it: No such file or directory" in p.stderr


def test_an_empty_input_runs_nothing(tmp_path):
    launch, mark = launch_marking(tmp_path)
    p = run_cli("generate", "--requests", "-", "--launch", launch, stdin="\n\n")
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "") and not mark.exists()


def test_500_requests_through_one_client_with_and_without_a_concurrency_cap(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text(jsonl(*(req(f"r{i}", [1 + i % 7, 2], max_tokens=1 + i % 5) for i in range(500))))
    for extra in ([], ["--max-concurrency", "16"]):
        p = run_cli("generate", "--requests", str(path), *extra, timeout=240)
        assert p.returncode == 0, p.stderr
        out = by_request(p.stdout)
        assert len(out) == 500
        for i in range(500):
            check_streamed(out[f"r{i}"], 1 + i % 5)


def test_tokenspeed_runtime_reads_its_own_proto():
    lines = jsonl(*({"request_id": f"t{i}", "tokenized": {"input_ids": [1, 2, 3]},
                     "sampling_params": {"max_new_tokens": 3}, "stream": True} for i in range(3)))
    p = run_cli("generate", "--runtime", "tokenspeed", "--requests", "-", stdin=lines)
    assert p.returncode == 0, p.stderr
    out = by_request(p.stdout)
    assert sorted(out) == ["t0", "t1", "t2"]
    assert all(len(rs[-1]["complete"]["output_ids"]) == 3 for rs in out.values())


def test_a_closed_stdout_aborts_the_rest_and_exits_141():
    proc = subprocess.Popen(
        [sys.executable, "-m", "zmqdispatch", "generate", "--requests", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        proc.stdin.write(jsonl(*(req(f"r{i}", max_tokens=4000) for i in range(3))))
        proc.stdin.close()
        assert json.loads(proc.stdout.readline())["request_id"].startswith("r")
        proc.stdout.close()
        assert proc.wait(timeout=60) == 141
        assert "stdout was closed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ the line checks


def _check(request: Any) -> list[str]:
    n = request.sampling_params.n
    if request.sampling_params.temperature < 0:
        raise RequestRejected("sampling_params.temperature: must be >= 0", field="sampling_params.temperature")
    rid = request.request_id
    return [rid] if n <= 1 else [f"{rid}-{i}" for i in range(n)]


def test_split_lines_cuts_at_newline_only():
    assert split_lines('{"a": "x\u2028y"}\r\n\n{}') == ['{"a": "x\u2028y"}', "", "{}"]


def test_a_rejected_field_is_named_once():
    _, rejected = parse_requests(['{"request_id": "a", "sampling_params": {"temperature": -1}}'],
                                 pb.GenerateRequest, _check)
    (bad,) = rejected
    assert (bad.line, bad.field) == (1, "sampling_params.temperature")
    assert str(bad) == 'line 1: request_id "a" rejected: sampling_params.temperature: must be >= 0'


@given(st.lists(st.tuples(st.sampled_from(["", " ", "\t"]), st.integers(1, 3)), min_size=1, max_size=20))
def test_blank_lines_are_skipped_and_line_numbers_count_them(layout):
    lines: list[str] = []
    expected: list[tuple[int, str]] = []
    for i, (blank, n) in enumerate(layout):
        lines.append(blank)
        rid = f"id{i}"
        lines.append(json.dumps({"request_id": rid, "sampling_params": {"n": n, "temperature": 1.0}}))
        expected.append((len(lines), rid))
    accepted, rejected = parse_requests(lines, pb.GenerateRequest, _check)
    assert rejected == []
    assert [(a.line, a.request_id) for a in accepted] == expected
    assert all(len(a.engine_ids) == max(1, a.request.sampling_params.n) for a in accepted)


def test_a_pin_to_a_rank_that_is_not_there_is_rejected_exit_2():
    pinned = {**req("pinned"), "data_parallel_rank": 5}
    p = run_cli("generate", "--requests", "-", "--data-parallel-size", "2", stdin=jsonl(req("ok"), pinned))
    assert p.returncode == 2, p.stderr
    assert sorted(by_request(p.stdout)) == ["ok"]
    assert [line for line in p.stderr.splitlines() if "rejected:" in line] == [
        'zmqdispatch: error: request_id "pinned" rejected: RequestRejected: data_parallel_rank: 5 is not an engine '
        'of this client; valid ranks: 0-1']
