"""The command line never ends in a traceback: every bad input maps to exit 2
(malformed) or 3 (cannot bind) with one line on stderr; anything unexpected is
exit 1 with one line; ``--version`` and ``--help`` say what they should."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import zmqdispatch
from zmqdispatch import _cli_mock, cli

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop(cli.DEBUG_ENV, None)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zmqdispatch", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def assert_one_line(p: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    for needle in needles:
        assert needle in p.stderr, (needle, p.stderr)
    assert p.stdout == ""


PROMPT = ("--prompt-token-ids", "1,2,3")

# (argv, fragments the one stderr line must contain)
REJECTED = [
    (("--handshake-address", "foo://bar", *PROMPT), ("foo://bar", "unknown scheme")),
    (("--handshake-address", "127.0.0.1:5555", *PROMPT), ("127.0.0.1:5555", "no scheme")),
    (("--handshake-address", "tcp://127.0.0.1:99999", *PROMPT), ("99999", "1..65535")),
    (("--handshake-address", "tcp://127.0.0.1:0", *PROMPT), ("port 0",)),
    (("--handshake-address", "tcp://300.0.0.1:5555", *PROMPT), ("not an IPv4",)),
    (("--handshake-address", "inproc://x", *PROMPT), ("inproc://x", "another process")),
    (("--prompt-token-ids", "1,-2,3"), ("tokenized.input_ids", "-2", "uint32")),
    (("--prompt-token-ids", "1,4294967296"), ("tokenized.input_ids", "4294967295")),
    ((*PROMPT, "--stop-token-ids=-1"), ("sampling_params.stop_token_ids", "uint32")),
    ((*PROMPT, "--max-tokens", "99999999999"), ("sampling_params.max_tokens", "4294967295")),
    ((*PROMPT, "--max-tokens", "-1"), ("sampling_params.max_tokens", "uint32")),
    ((*PROMPT, "--seed", "99999999999"), ("sampling_params.seed", "int32")),
    ((*PROMPT, "--top-k", "-1"), ("sampling_params.top_k", "uint32")),
    ((*PROMPT, "--n", "5000000000"), ("sampling_params.n", "uint32")),
    ((*PROMPT, "--n", "0"), ("--n", ">= 1")),
    ((*PROMPT, "--temperature", "1e39"), ("sampling_params.temperature", "finite float")),
    ((*PROMPT, "--temperature", "nan"), ("sampling_params.temperature",)),
    ((*PROMPT, "--top-p", "inf"), ("sampling_params.top_p",)),
    (("--runtime", "tokenspeed", *PROMPT, "--seed", "-1"), ("sampling_params.sampling_seed", "uint64")),
    (("--runtime", "tokenspeed", *PROMPT, "--top-k", "3000000000"), ("sampling_params.top_k", "int32")),
    (("--runtime", "tokenspeed", *PROMPT, "--max-tokens", "99999999999"), ("sampling_params.max_new_tokens",)),
    (("--request", "/nonexistent/req.json"), ("--request", "cannot read")),
    (("--request", "/"), ("--request", "cannot read")),
    (("--request", sys.executable), ("--request", "cannot read")),
    (("--request", "/dev/null", *PROMPT), ("either --request or --prompt-token-ids",)),
    ((), ("--prompt-token-ids",)),
    (("--prompt-token-ids", "1,,3"), ("--prompt-token-ids", "item ''")),
    (("--prompt-token-ids", "\uff11,\uff12"), ("--prompt-token-ids", "integers")),
    (("--prompt-token-ids", "1_000"), ("--prompt-token-ids", "integers")),
    ((*PROMPT, "--launch", ""), ("--launch", "empty")),
    ((*PROMPT, "--launch", "   "), ("--launch", "empty")),
    ((*PROMPT, "--launch", "echo 'unterminated"), ("--launch", "No closing quotation")),
    ((*PROMPT, "--launch", "zmqdispatch mock-engine"), ("argument --launch", "lacks the {handshake_address}")),
    ((*PROMPT, "--max-tokens", "abc"), ("--max-tokens", "invalid int value")),
    (("--request", "/dev/null", "--max-tokens", "5", "--n", "2"), ("--max-tokens, --n", "--request message")),
    (("--request", "/dev/null", "--request-id", "abc"), ("--request-id", "--request message")),
]


@pytest.mark.parametrize("argv,needles", REJECTED, ids=[" ".join(a) for a, _ in REJECTED])
def test_bad_generate_input_is_exit_2_with_one_line(argv, needles):
    assert_one_line(run_cli("generate", *argv), 2, *needles)


def test_an_address_in_use_is_exit_3_with_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        p = run_cli("generate", "--handshake-address", address, *PROMPT)
    assert_one_line(p, 3, address, "Address already in use")


def test_an_unassignable_ip_is_exit_3_with_one_line():
    p = run_cli("generate", "--handshake-address", "tcp://192.0.2.1:5555", *PROMPT)
    assert_one_line(p, 3, "tcp://192.0.2.1:5555", "Cannot assign requested address")


# argparse-level refusals: exit 2, the flag named, no traceback
FLAG_ERRORS = [
    ("generate", *PROMPT, "--handshake-timeout", "-1"),
    ("generate", *PROMPT, "--handshake-timeout", "nan"),
    ("generate", *PROMPT, "--silence-timeout", "0"),
    ("generate", *PROMPT, "--vocab-size", "0"),
    ("generate", *PROMPT, "--max-logprobs", "-1"),
    ("generate", *PROMPT, "--eos-token-id", "-3"),
    ("generate", *PROMPT, "--mock-max-model-len", "0"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--step-interval-ms", "-1"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--step-interval-ms", "inf"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--engine-index", "65536"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--max-model-len", "0"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--vocab-size", "-5"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--tokens-per-step", "0"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--mm-processor-cache-gb", "-1"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--mm-processor-cache-gb", "nan"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--stream-interval", "0"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--eos-token-id", "1,-1"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--step-interval-ms", "1e308"),
    ("mock-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--fault", "sentinel:x"),
]


@pytest.mark.parametrize("argv", FLAG_ERRORS, ids=[" ".join(a[-2:]) for a in FLAG_ERRORS])
def test_a_flag_value_out_of_range_is_an_argparse_error_naming_the_flag(argv):
    assert_one_line(run_cli(*argv), 2, f"argument {argv[-2]}")


def test_a_launch_command_without_the_placeholder_is_refused_up_front_by_every_subcommand_that_launches():
    # without {handshake_address} the engine cannot know where to dial: refused before anything starts
    launch = f"{sys.executable} -m zmqdispatch mock-engine --handshake-address tcp://127.0.0.1:5555"
    for argv in (("generate", *PROMPT, "--launch", launch), ("serve-grpc", "--port", "0", "--launch", launch)):
        assert_one_line(run_cli(*argv, timeout=30), 2, "argument --launch", "lacks the {handshake_address} placeholder")
    launching = [a.option_strings for p in _subparsers(cli._build_parser()).values() for a in p._actions
                 if "--launch" in a.option_strings]
    assert len(launching) == 2  # generate and serve-grpc: both checked above


def _subparsers(parser):
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("argv", [
    ("--handshake-address", "tcp://127.0.0.1:99999"),
    ("--handshake-address", "tcp://127.0.0.1:0"),
    ("--handshake-address", "tcp://*:5555"),
    ("--handshake-address", "foo://bar"),
    ("--handshake-address", "tcp://127.0.0.1:5555", "--fault", "nope"),
    ("--handshake-address", "tcp://127.0.0.1:5555", "--fault", "exit:-1"),
])
def test_bad_mock_engine_input_is_exit_2_with_one_line(argv):
    assert_one_line(run_cli("mock-engine", *argv), 2)


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert zmqdispatch.__version__ == version("zmqdispatch")
    p = run_cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"zmqdispatch {zmqdispatch.__version__}"


@pytest.mark.parametrize("command,default", [
    ("generate", "(default: 600.0)"),
    ("mock-engine", "(default: 4096)"),
    ("bench", "(default: 3)"),
])
def test_every_subcommand_help_shows_defaults_and_exit_codes(command, default, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # no line breaks inside "(default: X)"
    with pytest.raises(SystemExit) as ei:
        cli.main([command, "--help"])
    assert ei.value.code == 0
    text = capsys.readouterr().out
    assert default in text and "exit status:" in text and "  2 " in text
    assert "(default: None)" not in text


def test_an_unexpected_exception_is_exit_1_with_one_line_and_a_hint(monkeypatch, capsys):
    def boom(*_: object) -> None:
        raise RuntimeError("something nobody expected\nacross lines")

    monkeypatch.setattr(cli, "_load_request", boom)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["generate", *PROMPT]) == cli.EXIT_INTERNAL == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: RuntimeError: something nobody expected" in err
    assert cli.DEBUG_ENV in err
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError):
        cli.main(["generate", *PROMPT])


def test_the_mock_engine_command_also_has_the_last_resort(monkeypatch, capsys):
    def boom(_: object) -> int:
        raise KeyError("x")

    monkeypatch.setattr(_cli_mock, "run_mock_main", boom)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["mock-engine", "--handshake-address", "tcp://127.0.0.1:5555"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_a_reader_that_goes_away_is_exit_141_with_one_line():
    p = subprocess.Popen([sys.executable, "-m", "zmqdispatch", "generate", *PROMPT, "--max-tokens", "4000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().startswith('{"chunk"')
    p.stdout.close()  # as `| head -1` does
    assert p.wait(timeout=60) == 141
    err = p.stderr.read()
    assert "Traceback" not in err and err.count("\n") == 1 and "stdout was closed" in err


def test_stdout_closed_at_start_is_exit_141_before_anything_starts():
    p = subprocess.run([sys.executable, "-m", "zmqdispatch", "generate", *PROMPT], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env=ENV, timeout=60,
                       preexec_fn=lambda: os.close(1))  # `>&-`
    assert p.returncode == 141
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1 and "stdout is closed" in p.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("many", [False, True])
def test_a_stdout_that_refuses_writes_is_exit_141_naming_the_cause(many, tmp_path):
    args = ["generate", *PROMPT]
    stdin = None
    if many:
        args = ["generate", "--requests", "-"]
        stdin = "\n".join(json.dumps({"request_id": f"r{i}", "tokenized": {"input_ids": [1, 2, 3]},
                                      "sampling_params": {"max_tokens": 4}}) for i in range(3)) + "\n"
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "zmqdispatch", *args], stdout=full, stderr=subprocess.PIPE,
                           input=stdin, text=True, env=ENV, timeout=60)
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr
    assert "cannot write to stdout" in p.stderr and "No space left" in p.stderr


@pytest.mark.parametrize("runtime", ["vllm", "tokenspeed", "sglang"])
def test_a_token_id_past_the_embedded_mocks_vocabulary_is_refused_before_any_engine_starts(runtime):
    p = run_cli("generate", "--runtime", runtime, "--prompt-token-ids", "1,40000", "--max-tokens", "3")
    assert_one_line(p, 2, "request rejected", "40000")
    assert "32000" in p.stderr or "31999" in p.stderr, p.stderr  # the limit is named
