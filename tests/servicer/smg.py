"""The reference router ``smg`` (1.13.0, ``scripts/install_smg.sh``) for tests:
the ``smg_bin`` fixture (installed once; skipped without a registry unless
``ZMQD_REQUIRE_SMG=1``), ``router()`` in front of a gRPC worker, ``post()``."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def smg_bin() -> str:
    p = subprocess.run([str(REPO / "scripts" / "install_smg.sh")], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        msg = f"smg not installable: {p.stderr.strip()[-500:]}"
        if os.environ.get("ZMQD_REQUIRE_SMG") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return p.stdout.strip()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """The tiny model's byte-level BPE tokenizer (1024 ids; ``scripts/real_vllm/tiny_tokenizer.py``)."""
    d = tmp_path_factory.mktemp("tiny_tok")
    subprocess.run([sys.executable, str(REPO / "scripts" / "real_vllm" / "tiny_tokenizer.py"), str(d)], check=True,
                   stdout=subprocess.DEVNULL)
    return str(d)


def post(port: int, body: dict, timeout: float = 30) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


@contextmanager
def router(smg: str, worker: str, model: str, *, backend: str = "vllm", timeout: float = 120) -> Iterator[int]:
    """``smg launch`` in front of *worker* (``host:port``); yields its HTTP port once
    a generation of *model* goes through (the router answers 503 until its worker is healthy)."""
    port = _free_port()
    log = open(os.devnull, "wb")
    proc = subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-port", str(_free_port()), "--worker-urls", f"grpc://{worker}",
                             "--backend", backend, "--policy", "round_robin", "--health-check-interval-secs", "1",
                             "--log-level", "warn"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        last = (0, "")
        while True:
            assert proc.poll() is None, f"smg exited with {proc.returncode}"
            try:
                last = post(port, {"model": model, "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
                if last[0] == 200:
                    break
            except OSError as exc:
                last = (0, repr(exc))
            if time.monotonic() > deadline:
                raise AssertionError(f"smg did not serve a generation within {timeout} s: {last}")
            time.sleep(0.25)  # polling the router until its worker is registered and healthy
        yield port
    finally:
        proc.kill()  # its own graceful stop keeps the listener 5 s: nothing of the test is left in it
        proc.wait()
        log.close()


