"""The main job end to end: ``zmqdispatch generate`` against the mock engine
process, and the mock engine's real-engine behaviours through the client."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zmqdispatch import ClientConfig, EngineDeadError, connect
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zmqdispatch", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_generate_against_embedded_mock_prints_chunks_then_complete():
    p = run_cli("generate", "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    msgs = lines(p.stdout)
    chunks = [m["chunk"] for m in msgs[:-1]]
    complete = msgs[-1]["complete"]
    assert chunks and all("chunk" in m for m in msgs[:-1])
    ids = [t for c in chunks for t in c["token_ids"]]
    assert len(complete["output_ids"]) == 8 and complete["output_ids"] == ids
    assert complete["finish_reason"] == "length"
    assert complete["prompt_tokens"] == 5 and complete["completion_tokens"] == 8


def test_generate_reads_proto_json_from_stdin_and_is_deterministic():
    req = {"request_id": "cli-1", "tokenized": {"input_ids": [7, 8, 9]},
           "sampling_params": {"max_tokens": 4, "temperature": 0}, "stream": False}
    p1 = run_cli("generate", "--request", "-", stdin=json.dumps(req))
    p2 = run_cli("generate", "--request", "-", stdin=json.dumps(req))
    assert p1.returncode == 0, p1.stderr
    (only,) = lines(p1.stdout)
    assert len(only["complete"]["output_ids"]) == 4
    assert p1.stdout == p2.stdout


def test_rejected_request_exits_2_with_one_line_and_no_output():
    p = run_cli("generate", "--prompt-token-ids", "1,2", "--max-tokens", "4", "--request-id", "x",
                "--temperature", "-1")
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and "temperature" in p.stderr and "Traceback" not in p.stderr
    req = {"request_id": "r", "text": "hello"}
    p = run_cli("generate", "--request", "-", stdin=json.dumps(req))
    assert p.returncode == 2 and "token ids" in p.stderr and p.stdout == ""
    p = run_cli("generate", "--request", "-", stdin="{not json")
    assert p.returncode == 2 and p.stdout == ""


def test_context_overflow_is_rejected_after_handshake_with_exit_2():
    p = run_cli("generate", "--prompt-token-ids", ",".join(["1"] * 10), "--mock-max-model-len", "10")
    assert p.returncode == 2 and "max_model_len=10" in p.stderr and p.stdout == ""


def test_engine_failure_exits_3():
    launch = f"{sys.executable} -m zmqdispatch mock-engine --handshake-address {{handshake_address}} --fault sentinel:2"
    p = run_cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "50", "--launch", launch)
    assert p.returncode == 3, p.stderr
    assert "EngineDeadError" in p.stderr and "Traceback" not in p.stderr
    assert all("chunk" in m for m in lines(p.stdout))  # tokens before the death were printed


def test_a_launch_command_that_cannot_run_exits_3_with_one_line():
    p = run_cli("generate", "--prompt-token-ids", "1,2,3", "--launch", "zmqd-no-such-engine {handshake_address}")
    assert p.returncode == 3 and p.stdout == ""
    assert p.stderr.strip().splitlines()[-1] == (
        "zmqdispatch: error: EngineHandshakeError: cannot start engine command "
        "'zmqd-no-such-engine': [Errno 2] No such file or directory: 'zmqd-no-such-engine'")


@pytest.mark.parametrize("command", ["generate", "mock-engine"])
def test_a_hard_open_files_limit_too_low_exits_1_with_one_line_that_names_it(command):
    def low_limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (20, 20))

    p = subprocess.run([sys.executable, "-m", "zmqdispatch", command, "--handshake-address", "ipc:///nowhere"],
                       capture_output=True, text=True, timeout=60, env=ENV, preexec_fn=low_limit)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.splitlines() == ["zmqdispatch: error: out of file descriptors: this process may open only 20 "
                                     "files (ulimit -n; hard limit 20); zmqdispatch needs at least 64"]


def test_out_of_files_is_found_inside_groups_and_chains():
    import errno

    import zmq

    from zmqdispatch import cli

    def raised_during(inner: BaseException, outer: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException:
                raise outer  # noqa: B904 - the implicit context is what is tested
        except BaseException as exc:
            return exc

    emfile = zmq.ZMQError(errno.EMFILE)
    assert cli._out_of_files(emfile) and cli._out_of_files(OSError(errno.ENFILE, "x"))
    assert cli._out_of_files(ExceptionGroup("g", [ValueError(), ExceptionGroup("h", [emfile])]))
    assert cli._out_of_files(raised_during(emfile, RuntimeError("while handling it")))
    assert not cli._out_of_files(ExceptionGroup("g", [OSError(errno.ENOENT, "x"), ValueError()]))


def test_a_low_soft_open_files_limit_is_raised_to_the_hard_one():
    def low_soft_limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    p = subprocess.run([sys.executable, "-m", "zmqdispatch", "generate", "--prompt-token-ids", "1,2,3",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=60, env=ENV,
                       preexec_fn=low_soft_limit)
    assert p.returncode == 0, p.stderr
    assert "complete" in lines(p.stdout)[-1]


def test_generate_waits_for_an_engine_started_elsewhere(tmp_path):
    addr = f"ipc://{tmp_path}/hs.sock"
    engine = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", addr],
                              env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        p = run_cli("generate", "--handshake-address", addr, "--prompt-token-ids", "1,2,3", "--max-tokens", "3")
        assert p.returncode == 0, p.stderr
        assert len(lines(p.stdout)[-1]["complete"]["output_ids"]) == 3
    finally:
        engine.terminate()
        engine.wait(10)


def mock(*extra: str) -> list[str]:
    return [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}", *extra]


async def collect(stream):
    toks, last = [], None
    async for delta in stream:
        toks += delta.token_ids
        last = delta
    return toks, last


async def test_mock_honours_stop_tokens_eos_lengths_and_aborts():
    async with connect(launch=mock("--max-model-len", "64"), config=ClientConfig(handshake_timeout=60)) as client:
        assert client.max_model_len == 64
        async with client.generate(make_request("a", prompt=[1, 2, 3], max_tokens=6)) as s:
            free, last = await collect(s)
        assert len(free) == 6 and last.finish_reason is wire.FinishReason.LENGTH
        assert last.num_prompt_tokens is None or last.num_prompt_tokens == 3
        # the 3rd token as a stop token: STOP with stop_reason, stop token included
        async with client.generate(make_request("b", prompt=[1, 2, 3], max_tokens=6, stop_token_ids=(free[2],))) as s:
            toks, last = await collect(s)
        assert toks == free[:3] and last.finish_reason is wire.FinishReason.STOP and last.stop_reason == free[2]
        # the same token as EOS: STOP without stop_reason
        async with client.generate(make_request("c", prompt=[1, 2, 3], max_tokens=6, eos_token_id=free[1],
                                                all_stop_token_ids=(free[1],))) as s:
            toks, last = await collect(s)
        assert toks == free[:2] and last.finish_reason is wire.FinishReason.STOP and last.stop_reason is None
        # max_model_len caps generation: LENGTH at 64 tokens total
        async with client.generate(make_request("d", prompt=range(60), max_tokens=4)) as s:
            toks, last = await collect(s)
        assert len(toks) == 4
        assert await client.get_supported_tasks() == ("generate",)
        assert await client.is_sleeping() is False


async def test_mock_engine_sentinel_fault_reaches_every_stream():
    async with connect(launch=mock("--fault", "sentinel:3"), config=ClientConfig(handshake_timeout=60)) as client:
        streams = [client.generate(make_request(f"r{i}", max_tokens=1000)) for i in range(3)]
        for s in streams:
            await s.__aenter__()
        for s in streams:
            with pytest.raises(EngineDeadError) as ei:
                await collect(s)
            assert ei.value.reason == "sentinel"


def test_generate_with_n3_prints_chunks_tagged_0_to_2_and_three_completes():
    p = run_cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "4", "--n", "3", "--seed", "11",
                "--temperature", "0.9")
    assert p.returncode == 0, p.stderr
    msgs = lines(p.stdout)
    chunks = [m["chunk"] for m in msgs if "chunk" in m]
    completes = [m["complete"] for m in msgs if "complete" in m]
    assert sorted(c["index"] for c in completes) == [0, 1, 2]
    assert {c["index"] for c in chunks} == {0, 1, 2}
    for c in completes:
        per_index = [t for ch in chunks if ch["index"] == c["index"] for t in ch["token_ids"]]
        assert per_index == c["output_ids"] and len(per_index) == 4
    # seeds differ per child (seed + index), so the samples differ
    assert len({tuple(c["output_ids"]) for c in completes}) == 3


def test_stop_strings_with_a_tokenizer_file(tmp_path):
    pytest.importorskip("tokenizers", reason="the 'tokenizers' package (test extra) is not installed")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(1000)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    base = ["generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "12", "--vocab-size", "1000",
            "--mock-max-model-len", "64", "--tokenizer", str(path)]
    free = lines(run_cli(*base).stdout)[-1]["complete"]["output_ids"]
    assert len(free) == 12
    # a stop spanning tokens 3 and 4 is matched on the client; the output ends at token 4
    stop = f"w{free[2]} w{free[3]}"
    p = run_cli(*base, "--stop", stop)
    assert p.returncode == 0, p.stderr
    complete = lines(p.stdout)[-1]["complete"]
    assert complete["output_ids"] == free[:4]
    assert complete["finish_reason"] == "stop" and complete["matched_stop_str"] == stop


def test_sigterm_stops_the_generate_and_its_launched_engine(tmp_path):
    import signal
    import time

    pidfile = tmp_path / "engine.pid"
    launch = (f"sh -c 'echo $$ > {pidfile}; exec {sys.executable} -m zmqdispatch mock-engine "
              "--handshake-address {handshake_address}'")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zmqdispatch", "generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "4000",
         "--launch", launch],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        assert proc.stdout.readline()  # streaming: the engine is up
        engine_pid = int(pidfile.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert "terminated" in proc.stderr.read()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the launched engine {engine_pid} outlived its client")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_stream_applies_to_a_request_read_from_stdin():
    req = {"request_id": "r1", "tokenized": {"input_ids": [1, 2, 3]}, "sampling_params": {"max_tokens": 3},
           "stream": True}
    p = run_cli("generate", "--request", "-", "--no-stream", stdin=json.dumps(req))
    assert p.returncode == 0, p.stderr
    (only,) = lines(p.stdout)
    assert len(only["complete"]["output_ids"]) == 3
