"""The reference router (``smg`` 1.13.0, installed by ``scripts/install_smg.sh``
into its own venv) in front of ``zmqdispatch serve-grpc`` and the embedded mock
engine: it loads its tokenizer through GetTokenizer, sends a real request
through the servicer, and a client that leaves its stream makes the router
drop the gRPC stream, which reaches the engine as an ABORT.

Without the router (no registry to install it from) the test skips, unless
``ZMQD_REQUIRE_SMG=1`` (CI: ``scripts/test --real-engine``), where that fails.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys

from .procs import serve_grpc
from .smg import post, router, smg_bin, tokenizer_dir  # noqa: F401  (fixtures)


def test_the_router_generates_through_the_servicer_and_a_leaving_client_aborts_on_the_engine(smg_bin, tokenizer_dir):
    # model_path is no local folder: the router must load the tokenizer through GetTokenizer
    with serve_grpc("--tokenizer-path", tokenizer_dir, "--served-model-name", "tiny", "--model-path", "tiny-remote",
                    "--log-level", "debug", "--mock-step-interval-ms", "5") as served, \
            router(smg_bin, served.address, "tiny") as port:
        status, text = post(port, {"model": "tiny", "input_ids": [1, 2, 3, 4, 5],
                                   "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert status == 200, text
        (out,) = json.loads(text) if text.startswith("[") else [json.loads(text)]
        assert len(out["output_ids"]) == 8 and out["meta_info"]["finish_reason"]["type"] == "length"
        assert all(0 <= t < 1024 for t in out["output_ids"])
        # the same request straight through zmqdispatch: the same tokens (the mock is deterministic)
        direct = subprocess.run([sys.executable, "-m", "zmqdispatch", "generate", "--prompt-token-ids", "1,2,3,4,5",
                                 "--max-tokens", "8", "--temperature", "0", "--no-stream", "--vocab-size", "1024",
                                 "--eos-token-id", "2"], capture_output=True,
                                text=True, timeout=60, check=True)
        assert json.loads(direct.stdout)["complete"]["output_ids"] == out["output_ids"]

        # streamed: leave after the first event; the router drops its gRPC stream -> ABORT on the engine
        assert not any("ABORT" in line for line in served.lines)  # what finished was not aborted
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/generate", json.dumps({"model": "tiny", "input_ids": [7, 8, 9], "stream": True,
                                                      "sampling_params": {"max_new_tokens": 3000}}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not resp.readline().startswith(b"data: {"):
            pass
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        line = served.wait_line("ABORT")
        assert "ABORT" in line and served.proc.poll() is None
