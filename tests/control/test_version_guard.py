"""The handshake's engine-version guard (zmqdispatch.protocol.versions)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from zmqdispatch import ClientConfig, EngineHandshakeError, connect
from zmqdispatch.protocol.versions import EngineVersion, check_engine_version
from zmqdispatch.testing import FakeEngine, ready_response

GUARD = 30


@pytest.mark.parametrize(
    "raw, runtime, release, known",
    [
        ("0.32.0", "vllm", (0, 32, 0), True),
        ("0.32.7", "vllm", (0, 32, 7), True),
        ("0.32.0+cpu", "vllm", (0, 32, 0), True),
        ("0.32.0+zmqdispatch.mock", "vllm", (0, 32, 0), True),
        ("0.33.0", "vllm", (0, 33, 0), True),
        ("0.33.1.post1", "vllm", (0, 33, 1), True),
        ("0.31.2", "vllm", (0, 31, 2), False),
        ("0.34.0", "vllm", (0, 34, 0), False),
        ("1.0.0", "vllm", (1, 0, 0), False),
        ("0.33.0rc1", "vllm", (0, 33, 0), False),
        ("0.32.1.dev12+g0abc", "vllm", (0, 32, 1), False),
        ("", "vllm", None, False),
        ("dev", "vllm", None, False),
        ("tokenspeed-0.1.1", "tokenspeed", (0, 1, 1), True),
        ("tokenspeed-0.1.1+zmqdispatch.mock", "tokenspeed", (0, 1, 1), True),
        ("tokenspeed-0.1.2", "tokenspeed", (0, 1, 2), False),
        ("tokenspeed-", "tokenspeed", None, False),
        ("sglang-0.5.21", "sglang", (0, 5, 21), True),
        ("sglang-0.5.21+zmqdispatch.mock", "sglang", (0, 5, 21), True),
        ("sglang-0.5.22", "sglang", (0, 5, 22), False),
        ("sglang-0.0.0.dev0", "sglang", (0, 0, 0), False),
    ],
)
def test_parse(raw, runtime, release, known):
    v = EngineVersion.parse(raw)
    assert (v.raw, v.runtime, v.release, v.known) == (raw, runtime, release, known)


def test_check_refuses_unknown_naming_it_and_the_known_ones():
    with pytest.raises(ValueError) as ei:
        check_engine_version("0.34.0", allow_unknown=False)
    msg = str(ei.value)
    assert "'0.34.0'" in msg and "0.32.x" in msg and "0.33.x" in msg and "TokenSpeed 0.1.1" in msg
    assert "allow_unknown_engine_version" in msg and "--allow-unknown-engine-version" in msg
    assert check_engine_version("0.34.0", allow_unknown=True).known is False
    assert check_engine_version("0.32.0", allow_unknown=False).known is True


def test_in_repo_engines_report_a_known_version():
    # the one ready-response factory, as the mock (both runtimes), the scripted
    # fake engine and the bench engine call it
    versions = [
        ready_response(runtime="vllm", build="zmqdispatch.mock").vllm_version,
        ready_response(runtime="tokenspeed", build="zmqdispatch.mock").vllm_version,
        ready_response().vllm_version,
        ready_response(4096, max_num_seqs=65536, build="zmqdispatch.bench").vllm_version,
    ]
    for v in versions:
        assert EngineVersion.parse(v).known, v


@asynccontextmanager
async def _engine_reporting(version: str, **config: object):
    d = tempfile.mkdtemp(prefix="zqv-")
    addr = f"ipc://{d}/hs.sock"
    engine = FakeEngine(addr, ready=attrs.evolve(ready_response(), vllm_version=version))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            try:
                async with connect(addr, config=ClientConfig(handshake_timeout=GUARD, **config)) as client:
                    yield client
            finally:
                engine.close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:  # the nursery's: the one error inside
        assert len(eg.exceptions) == 1, eg
        raise eg.exceptions[0] from None
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_unknown_vllm_version_fails_the_handshake(caplog):
    with trio.fail_after(GUARD):
        with pytest.raises(EngineHandshakeError) as ei:
            async with _engine_reporting("0.34.0"):
                pytest.fail("connected to an unknown engine version")
    assert "'0.34.0'" in str(ei.value) and "0.32.x" in str(ei.value)


async def test_unknown_tokenspeed_version_fails_the_handshake():
    with trio.fail_after(GUARD):
        with pytest.raises(EngineHandshakeError, match=r"tokenspeed-0\.2\.0"):
            async with _engine_reporting("tokenspeed-0.2.0"):
                pytest.fail("connected to an unknown engine version")


async def test_opt_in_connects_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="zmqdispatch.client")
    with trio.fail_after(GUARD):
        async with _engine_reporting("0.34.0", allow_unknown_engine_version=True) as client:
            assert client.engine_version.release == (0, 34, 0)
            assert client.engine_version.known is False
    records = [r for r in caplog.records if r.name == "zmqdispatch.client"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "'0.34.0'" in records[0].getMessage()


async def test_known_version_connects_without_a_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="zmqdispatch")
    with trio.fail_after(GUARD):
        async with _engine_reporting("0.33.0") as client:
            assert client.engine_version.known and client.engine_version.release == (0, 33, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


_FAKE_ENGINE = """
import sys, trio, attrs
from zmqdispatch.testing import FakeEngine, ready_response
from zmqdispatch.wire import vllm as wire

async def main():
    engine = FakeEngine(sys.argv[1], ready=attrs.evolve(ready_response(), vllm_version=sys.argv[2]))
    await engine.run_handshake()
    req = await engine.receive_add()
    await engine.send_tokens(req.request_id, [5, 6], finish=wire.FinishReason.LENGTH)
    await trio.sleep(60)  # the client stops us (SIGTERM) when it is done

trio.run(main)
"""


@pytest.mark.parametrize("allow", [False, True])
def test_cli_flag(tmp_path, allow):
    script = tmp_path / "engine.py"
    script.write_text(_FAKE_ENGINE)
    argv = [sys.executable, "-m", "zmqdispatch", "generate", "--launch",
            f"{sys.executable} {script} {{handshake_address}} 9.9.9", "--handshake-timeout", "30",
            "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]
    if allow:
        argv.append("--allow-unknown-engine-version")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert "'9.9.9'" in p.stderr
    if allow:
        assert p.returncode == 0, p.stderr
        assert "connecting anyway" in p.stderr
        complete = json.loads(p.stdout.splitlines()[-1])["complete"]
        assert [int(t) for t in complete["output_ids"]] == [5, 6], complete
    else:
        assert p.returncode == 3, p.stderr
        assert "--allow-unknown-engine-version" in p.stderr and not p.stdout
