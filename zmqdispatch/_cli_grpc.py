"""``zmqdispatch serve-grpc``: its options (:func:`add_arguments`) and its
runner (:func:`run`), which checks the flags, builds the model facts and the
tokenizer bundle, and runs :func:`zmqdispatch.servicer.server.serve` under
asyncio (``docs/grpc.md``)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Any

from . import __version__, _cli_logging
from ._cli_common import (
    DEBUG_ENV,
    EXIT_ENGINE,
    EXIT_ENGINE_LOST,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TERMINATED,
    INTERNAL_EPILOG,
    U32,
    bounded_int,
    fail,
    launch_command,
    seconds,
    token_id_list,
)
from .addresses import check_address
from .config import ClientConfig
from .errors import AddressBindError, EngineError, InvalidAddressError, ZmqDispatchError
from .limits import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_SILENCE_TIMEOUT
from .mock.server import MOCK_VOCAB_SIZE, RUNTIMES

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = (
    "exit status:\n"
    "  0    stopped by SIGTERM or SIGINT after the drain (in-flight streams got --drain-grace to finish;\n"
    "       the rest were aborted on the engine; a launched engine was stopped)\n"
    + INTERNAL_EPILOG +
    "  2    a malformed flag value, address or --model-path / --tokenizer-path; the grpc extra missing\n"
    "  3    the engine failed to come up (handshake, launch), or an address cannot be bound\n"
    "  4    the engines were lost while serving: every engine dead (a launched one exited, one gone past\n"
    "       --silence-timeout, ...) and none up again within --engine-lost-grace; meanwhile health was\n"
    "       NOT_SERVING and Generate failed UNAVAILABLE naming the engine and why; then drained, a launched\n"
    "       engine stopped, one line on stderr. Nothing restarts an engine here: let a supervisor restart\n"
    "       serve-grpc (with --launch, or the embedded mock, that restarts the engine too)\n"
    "  130  interrupted (SIGINT) before serving; 143 terminated (SIGTERM) before serving\n"
    "when serving, one line goes to stdout: grpc://HOST:PORT (the bound address; nothing else is\n"
    "written there)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``zmqdispatch serve-grpc`` options."""
    p.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the engines' runtime: vllm serves vllm.grpc.engine.VllmEngine, tokenspeed "
                        "tokenspeed.grpc.scheduler.TokenSpeedScheduler, sglang sglang.grpc.scheduler.SglangScheduler")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=bounded_int(0, 65535), default=50051, help="port to listen on (0: a free one)")
    p.add_argument("--drain-grace", type=seconds(zero_ok=True), default=30.0, metavar="S",
                   help="on SIGTERM: seconds in-flight streams get to finish before they are aborted")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the event loop (default uvloop, in the grpc extra; asyncio's own without it installed)")
    p.add_argument("--log-level", choices=_cli_logging.LOG_LEVELS, default="warning",
                   help="log records of the zmqdispatch loggers on stderr")
    model = p.add_argument_group("model (the engines do not report it)")
    model.add_argument("--served-model-name", metavar="NAME",
                       help="the model name clients send; default: --model-path, else 'default'")
    model.add_argument("--model-path", metavar="PATH",
                       help="reported as model_path; a local folder's config.json / generation_config.json give "
                            "vocab_size, EOS, BOS and pad ids, architectures, model_type (flags win)")
    model.add_argument("--tokenizer-path", metavar="PATH",
                       help="a Hugging Face tokenizer folder (or tokenizer.json) that GetTokenizer serves as a ZIP; "
                            "its tokenizer.json also enables stop strings ('tokenizers' package). Unset: "
                            "GetTokenizer answers FAILED_PRECONDITION")
    model.add_argument("--vocab-size", type=bounded_int(1, U32 + 1),
                       help="refuse token ids >= this; default: config.json's")
    model.add_argument("--eos-token-id", type=token_id_list, metavar="IDS",
                       help="the model's EOS id(s), primary first; default: the model folder's")
    model.add_argument("--max-logprobs", type=bounded_int(0, U32), default=20, help="the engine's max_logprobs")
    eng = p.add_argument_group("engine (neither address nor --launch: the embedded mock engine)")
    how = eng.add_mutually_exclusive_group()
    how.add_argument("--handshake-address", metavar="ADDR", action="append",
                     help="bind here and wait for engines to dial in (repeat it for independent engines)")
    how.add_argument("--launch", type=launch_command, metavar="CMD",
                     help="engine command; it must contain {handshake_address}, replaced by the address the "
                          "engine dials; stopped on exit")
    eng.add_argument("--data-parallel-size", type=bounded_int(1, 65536), metavar="N", default=1,
                     help="engines to wait for (the embedded mock runs N ranks)")
    eng.add_argument("--handshake-timeout", type=seconds(zero_ok=False), default=DEFAULT_HANDSHAKE_TIMEOUT,
                     metavar="S", help="seconds for the engines' startup handshake")
    eng.add_argument("--silence-timeout", type=seconds(zero_ok=False), default=DEFAULT_SILENCE_TIMEOUT,
                     metavar="S", help="seconds without output while requests run before an engine is dead")
    eng.add_argument("--engine-lost-grace", type=seconds(zero_ok=True), default=5.0, metavar="S",
                     help="once every engine is dead: seconds to wait for one to be up again (an engine started "
                          "elsewhere that dials --handshake-address again; a launched one is not restarted) "
                          "before draining and exiting 4; inf: wait for ever")
    eng.add_argument("--allow-unknown-engine-version", action="store_true",
                     help="connect to an engine version the wire codec was not checked against")
    eng.add_argument("--mock-max-model-len", type=bounded_int(1, 2**31 - 1), default=4096,
                     help="embedded mock only: its max_model_len")
    eng.add_argument("--mock-step-interval-ms", type=seconds(zero_ok=True), default=1.0, metavar="MS",
                     help="embedded mock only: milliseconds per engine step")


def _mock_argv(args: argparse.Namespace, eos: tuple[int, ...], vocab_size: int | None) -> list[str]:
    argv = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
            "--runtime", args.runtime, "--max-model-len", str(args.mock_max_model_len),
            "--step-interval-ms", repr(args.mock_step_interval_ms)]
    if args.runtime != "vllm" and eos:
        argv += ["--eos-token-id", ",".join(map(str, eos))]
    if vocab_size is not None:
        argv += ["--vocab-size", str(vocab_size)]
    if args.log_level != "warning":
        argv += ["--log-level", args.log_level]
    if args.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(args.data_parallel_size)]
    return argv


def _load_tokenizer(path: str | None) -> Any:
    """A ``tokenizers.Tokenizer`` for stop strings from *path*'s tokenizer.json, or None."""
    if path is None:
        return None
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None  # stop strings are then refused per request, by name
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # the library raises its own Exception type for a bad file
        raise ValueError(f"--tokenizer-path {file!r}: cannot load: {exc}") from None


def _options(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``(ServeOptions, aio.connect keywords)`` from the flags.

    Raises:
        ValueError: a malformed address, model folder or tokenizer (named).
    """
    from .servicer.facts import ModelFacts, read_model_dir
    from .servicer.generate import TranslateOptions
    from .servicer.server import ServeOptions
    from .servicer.tokenizer_zip import build_bundle

    for addr in args.handshake_address or ():
        check_address(addr, role="--handshake-address", any_port=False)
        if addr.startswith("inproc://"):
            raise InvalidAddressError(f"--handshake-address {addr!r}: an engine in another process cannot dial "
                                      "inproc://; use tcp:// or ipc://", address=addr, role="--handshake-address")
    found: dict[str, Any] = {}
    if args.model_path is not None and os.path.isdir(args.model_path):
        found = read_model_dir(args.model_path)
    if not found and args.tokenizer_path is not None and os.path.isdir(args.tokenizer_path):
        found = read_model_dir(args.tokenizer_path)
    if args.vocab_size is not None:
        found["vocab_size"] = args.vocab_size
    elif "vocab_size" not in found and not args.handshake_address and args.launch is None:
        found["vocab_size"] = MOCK_VOCAB_SIZE  # the embedded mock's, which an out-of-range id kills
    if args.eos_token_id is not None:
        found["eos_token_ids"] = tuple(args.eos_token_id)
    bundle = build_bundle(args.tokenizer_path) if args.tokenizer_path is not None else None
    facts = ModelFacts(served_model_name=args.served_model_name or args.model_path or "default",
                       model_path=args.model_path or "", tokenizer_path=args.tokenizer_path, **found)
    translate = TranslateOptions(runtime=args.runtime, eos_token_ids=facts.eos_token_ids, vocab_size=facts.vocab_size,
                                 max_logprobs=args.max_logprobs, tokenizer=_load_tokenizer(args.tokenizer_path))
    options = ServeOptions(host=args.host, port=args.port, facts=facts, translate=translate, bundle=bundle,
                           drain_grace=args.drain_grace, version=f"zmqdispatch {__version__}",
                           engine_lost_grace=None if math.isinf(args.engine_lost_grace) else args.engine_lost_grace)
    config = ClientConfig(handshake_timeout=args.handshake_timeout, silence_timeout=args.silence_timeout,
                          vocab_size=facts.vocab_size, max_logprobs=args.max_logprobs,
                          allow_unknown_engine_version=args.allow_unknown_engine_version)
    addresses = args.handshake_address
    handshake: str | list[str] | None = None
    if addresses:
        handshake = addresses[0] if len(addresses) == 1 else list(addresses)
    launch: str | list[str] | None = None
    if handshake is None:
        launch = args.launch if args.launch is not None else _mock_argv(args, facts.eos_token_ids, facts.vocab_size)
    connect = {"handshake_address": handshake, "launch": launch, "config": config, "runtime": args.runtime,
               "data_parallel_size": args.data_parallel_size}
    return options, connect


def _ready(address: str) -> None:
    sys.stdout.write(f"grpc://{address}\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Run ``zmqdispatch serve-grpc``; returns its exit status (see ``--help``)."""
    # grpc's C core logs its own copy of a failure (a port in use) on stderr; the
    # command reports it in its one line. GRPC_VERBOSITY set by the caller wins.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        import grpc  # noqa: F401
        import grpc_health  # noqa: F401
        import grpc_reflection  # noqa: F401
    except ImportError as exc:
        return fail(EXIT_REJECTED, f"serve-grpc needs the grpc extra ({exc.name} is missing): "
                                   "pip install 'zmqdispatch[grpc]'")
    _cli_logging.configure(args.log_level, announce_waits=bool(args.handshake_address or args.launch))
    try:
        options, connect = _options(args)
    except ValueError as exc:  # InvalidAddressError is one
        return fail(EXIT_REJECTED, str(exc))
    from .servicer.server import EnginesLost, serve

    run_loop: Any = asyncio.run
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass  # asyncio's own loop
        else:
            run_loop = uvloop.run
    try:
        how = run_loop(serve(options, connect, ready=_ready))
    except KeyboardInterrupt:
        return fail(EXIT_INTERRUPTED, "interrupted")
    except EnginesLost as exc:
        return fail(EXIT_ENGINE_LOST, f"the engines are lost: {exc}")
    except AddressBindError as exc:
        return fail(EXIT_ENGINE, f"cannot bind: {exc}")
    except (EngineError, ZmqDispatchError) as exc:
        return fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    except OSError as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        return fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    if how == "SIGTERM-early":
        return fail(EXIT_TERMINATED, "terminated (SIGTERM) before serving")
    if how == "SIGINT-early":
        return fail(EXIT_INTERRUPTED, "interrupted (SIGINT) before serving")
    return EXIT_OK
