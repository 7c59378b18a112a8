"""``zmqdispatch generate --log-level``: a request's whole life on stderr, stdout
still proto-JSON only; the wait for an engine is said at the default level;
deadline flags; the library is silent unless configured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zmqdispatch", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_debug_shows_the_life_of_a_request_on_stderr_and_stdout_stays_proto_json():
    p = run_cli("generate", "--prompt-token-ids", "1,2,3,4,5", "--max-tokens", "6", "--request-id", "life-1",
                "--log-level", "debug")
    assert p.returncode == 0, p.stderr
    msgs = [json.loads(line) for line in p.stdout.splitlines()]  # every stdout line is proto-JSON
    complete = msgs[-1]["complete"]
    assert complete["finish_reason"] == "length" and len(complete["output_ids"]) == 6
    assert all("chunk" in m for m in msgs[:-1])  # (ticks merge when the printer lags: 1 to 6 chunks)
    err = p.stderr
    steps = [
        "INFO zmqdispatch.client: bound handshake ipc://",
        "INFO zmqdispatch.client: launched engine process",
        "INFO zmqdispatch.client: waiting for an engine at ipc://",
        "INFO zmqdispatch.client: handshake: HELLO from engine identity 0000",
        "INFO zmqdispatch.client: engine 0 ready (identity 0000): vllm, version 0.32.0+zmqdispatch.mock",
        "DEBUG zmqdispatch.protocol: request 'life-1': submitted to engine 0",
        "DEBUG zmqdispatch.protocol: request 'life-1': first token after",
        "DEBUG zmqdispatch.protocol: request 'life-1': finished, finish_reason=length",
        "INFO zmqdispatch.client: closing the client of engine 0",
        "INFO zmqdispatch.client: launched engine process",
    ]
    at = 0
    for step in steps:  # in this order
        found = err.find(step, at)
        assert found >= 0, f"{step!r} missing (after offset {at}) in:\n{err}"
        at = found + len(step)
    # the mock engine logs at the level it was given (its stderr is ours)
    assert "DEBUG zmqdispatch.mock: mock engine 0: ADD 'life-1'" in err


def test_default_level_says_only_what_it_waits_for(tmp_path):
    addr = f"ipc://{tmp_path}/hs.sock"
    engine = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", addr],
                              env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p = run_cli("generate", "--handshake-address", addr, "--prompt-token-ids", "1,2,3", "--max-tokens", "2",
                    "--handshake-timeout", "30")
    finally:
        engine.terminate()
        engine.wait(10)
    assert p.returncode == 0, p.stderr
    (line,) = p.stderr.splitlines()
    assert f"waiting for an engine at {addr}, timeout 30.0 s" in line
    # the embedded mock (ours, up within a second) is waited for silently at the default level
    p = run_cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "2")
    assert p.returncode == 0 and p.stderr == ""


def test_a_missed_deadline_exits_3_naming_the_limit():
    launch = (f"{sys.executable} -m zmqdispatch mock-engine --handshake-address {{handshake_address}} "
              "--fault silent:0")
    p = run_cli("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "5", "--launch", launch,
                "--first-token-timeout", "0.5")
    assert p.returncode == 3, p.stderr
    assert p.stdout == ""
    last = p.stderr.splitlines()[-1]
    assert last.startswith("zmqdispatch: error: DeadlineExceeded:") and "deadlines.first_token=0.5" in last
    assert "Traceback" not in p.stderr


def test_a_bad_deadline_is_rejected_before_any_engine_starts():
    p = run_cli("generate", "--prompt-token-ids", "1,2,3", "--stall-timeout", "-1")
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert "deadlines.stall must be > 0" in line


def test_the_library_is_silent_unless_logging_is_configured():
    # Without a handler Python prints WARNING records to stderr ("last resort");
    # the library's NullHandler keeps an unconfigured application quiet.
    code = (
        "import zmqdispatch\n"
        "from zmqdispatch.protocol.engine import EngineProtocol\n"
        "p = EngineProtocol()\n"
        "p.frames_received([b'\\xc1garbage'])\n"
        "assert p.decode_errors == 1\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
