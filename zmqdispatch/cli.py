"""Command line: ``zmqdispatch generate``, ``zmqdispatch mock-engine`` and ``zmqdispatch bench``.

``generate`` reads a proto-JSON ``vllm.grpc.engine.GenerateRequest`` (with
``--runtime tokenspeed``: a ``tokenspeed.grpc.scheduler.GenerateRequest``), or
builds one from flags, dispatches it to one engine and prints every
``GenerateResponse`` of that proto package as one proto-JSON line on stdout
(nothing else goes to stdout, so it pipes into ``jq``). The engine must be of
the named runtime (default ``vllm``). Engine choice:

- ``--handshake-address ADDR``: bind and wait for an engine started elsewhere
  (e.g. ``vllm serve DIR --headless --data-parallel-address 127.0.0.1
  --data-parallel-rpc-port P`` with ``ADDR = tcp://127.0.0.1:P``);
- ``--launch "CMD"``: start CMD with ``{handshake_address}`` substituted, stop
  it on exit (its stdout goes to our stderr);
- neither: start the embedded mock engine.

Exit status: 0 the generate completed; 2 the client rejected the request
(nothing was sent); 3 the engine failed (dead, handshake, engine error); 130
interrupted (SIGINT), 143 terminated (SIGTERM): both stop a launched engine
first. Failures print one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import uuid
from collections.abc import Sequence

import trio
from google.protobuf import json_format

from .client import ClientConfig, _unwrap, connect
from .errors import EngineError, RequestError, RequestRejected, ZmqDispatchError
from .limits import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_SILENCE_TIMEOUT
from .mock.server import MockEngineConfig, main_sync as run_mock_main, parse_fault
from .fanout import generate_parallel
from .mock.server import RUNTIMES
from .protocol.runtime import Runtime
from .translate import tokenspeed as ts_translate
from .translate import vllm as vllm_translate
from .bench import harness as bench_harness

__all__ = ["main"]

EXIT_OK = 0
EXIT_REJECTED = 2
EXIT_ENGINE = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class _Terminated(Exception):
    """SIGTERM arrived: the generate was cancelled and its engine stopped."""


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zmqdispatch", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="dispatch one GenerateRequest and print GenerateResponse proto-JSON lines",
        description="Dispatch one GenerateRequest (vllm.grpc.engine, or tokenspeed.grpc.scheduler with "
                    "--runtime tokenspeed) to an engine over ZMQ.",
    )
    src = g.add_argument_group("request")
    g.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the engine's runtime; selects the request/response proto package (default vllm)")
    src.add_argument("--request", metavar="FILE", help="proto-JSON GenerateRequest file, or - for stdin")
    src.add_argument("--prompt-token-ids", type=_int_list, metavar="IDS", help="e.g. 1,2,3 (builds a request)")
    src.add_argument("--request-id", help="default: a random zmqd-<hex> id")
    src.add_argument("--max-tokens", type=int, help="max_tokens (TokenSpeed: max_new_tokens)")
    src.add_argument("--temperature", type=float)
    src.add_argument("--top-p", type=float)
    src.add_argument("--top-k", type=int)
    src.add_argument("--seed", type=int, help="seed (TokenSpeed: sampling_seed)")
    src.add_argument("--stop-token-ids", type=_int_list, metavar="IDS")
    src.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable; needs --tokenizer)")
    src.add_argument("-n", "--n", type=int, dest="n", help="samples per request (fan-out)")
    src.add_argument("--no-stream", action="store_true", help="print only the complete")
    eng = g.add_argument_group("engine")
    how = eng.add_mutually_exclusive_group()
    how.add_argument("--handshake-address", metavar="ADDR", help="bind here and wait for an engine to dial in")
    how.add_argument("--launch", metavar="CMD", help="engine command; {handshake_address} is substituted")
    eng.add_argument("--handshake-timeout", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT, metavar="S")
    eng.add_argument("--silence-timeout", type=float, default=DEFAULT_SILENCE_TIMEOUT, metavar="S")
    eng.add_argument("--vocab-size", type=int, help="reject token ids >= this (protects the engine)")
    eng.add_argument("--eos-token-id", type=_int_list, default=[], metavar="IDS",
                     help="the model's EOS id(s), primary first (vLLM: the engine has no tokenizer; "
                          "tokenspeed: given to the embedded mock, which stops on them)")
    eng.add_argument("--max-logprobs", type=int, default=20, help="the engine's max_logprobs")
    eng.add_argument("--tokenizer", metavar="FILE",
                     help="tokenizer.json of the model (needs the 'tokenizers' extra); enables stop strings")
    eng.add_argument("--mock-max-model-len", type=int, default=4096, help="embedded mock only")
    eng.add_argument("--allow-unknown-engine-version", action="store_true",
                     help="connect to an engine version the wire codec was not checked against "
                          "(logs a warning; default: refuse it)")

    m = sub.add_parser(
        "mock-engine",
        help="run the wire-faithful mock engine (vLLM EngineCore or TokenSpeed scheduler)",
        description="A mock vLLM EngineCore (or, with --runtime tokenspeed, TokenSpeed scheduler) that dials "
                    "ADDR like the real one (see zmqdispatch.mock.server).",
    )
    m.add_argument("--handshake-address", required=True, metavar="ADDR")
    m.add_argument("--runtime", choices=RUNTIMES, default="vllm", help="which engine to imitate (default vllm)")
    m.add_argument("--engine-index", type=int, default=0)
    m.add_argument("--max-model-len", type=int, default=4096)
    m.add_argument("--vocab-size", type=int, default=32_000)
    m.add_argument("--step-interval-ms", type=float, default=1.0, help="0 = as fast as possible")
    m.add_argument("--tokens-per-step", type=int, default=1)
    m.add_argument("--headless", action="store_true", help="announce local=false, headless=true")
    m.add_argument("--eos-token-id", type=_int_list, default=[], metavar="IDS",
                   help="tokenspeed: the model's EOS ids (TokenSpeed stops at EOS by itself)")
    m.add_argument("--stream-interval", type=int, default=1, help="tokenspeed: --stream-interval")
    m.add_argument("--no-output-logprobs", action="store_true",
                   help="tokenspeed: run without --enable-output-logprobs (logprob requests are aborted)")
    m.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND[:N]",
        help="sentinel:N, exit:N, garbage:N, silent:N, stop-reading:N, no-ready (repeatable)",
    )
    b = sub.add_parser("bench", help="transport benchmark: zmqdispatch vs the raw limit vs vLLM's client",
                       description="See zmqdispatch.bench.harness (progress bar and PNG: the 'bench' extra).")
    bench_harness.add_arguments(b)
    return parser


def _load_request(args: argparse.Namespace) -> object:
    pb = _pb(args)
    if args.request is not None:
        if args.prompt_token_ids is not None:
            raise RequestRejected("use either --request or --prompt-token-ids, not both")
        text = sys.stdin.read() if args.request == "-" else open(args.request, encoding="utf-8").read()
        req = pb.GenerateRequest()
        try:
            json_format.Parse(text, req)
        except json_format.ParseError as exc:
            raise RequestRejected(
                f"--request: not a proto-JSON {pb.GenerateRequest.DESCRIPTOR.full_name}: {exc}"
            ) from None
        return req
    if args.prompt_token_ids is None:
        raise RequestRejected("give --request FILE or --prompt-token-ids IDS")
    if args.runtime == "tokenspeed":
        return _tokenspeed_request_from_flags(args)
    sp = pb.SamplingParams()
    if args.max_tokens is not None:
        if args.max_tokens < 0:
            raise RequestRejected("--max-tokens must be >= 1", field="sampling_params.max_tokens")
        sp.max_tokens = args.max_tokens
    if args.temperature is not None:
        sp.temperature = args.temperature
    if args.top_p is not None:
        sp.top_p = args.top_p
    if args.top_k is not None:
        if args.top_k < 0:
            raise RequestRejected("--top-k must be >= 0 (0 = disabled)", field="sampling_params.top_k")
        sp.top_k = args.top_k
    if args.seed is not None:
        sp.seed = args.seed
    if args.stop_token_ids:
        sp.stop_token_ids.extend(args.stop_token_ids)
    if args.stop:
        sp.stop.extend(args.stop)
    if args.n is not None:
        if args.n < 1:
            raise RequestRejected(f"--n must be >= 1, got {args.n}", field="sampling_params.n")
        sp.n = args.n
    return pb.GenerateRequest(
        request_id=args.request_id or f"zmqd-{uuid.uuid4().hex[:12]}",
        tokenized=pb.TokenizedInput(input_ids=args.prompt_token_ids),
        sampling_params=sp,
        stream=not args.no_stream,
    )


def _pb(args: argparse.Namespace):  # the proto module of the runtime
    return ts_translate.pb if args.runtime == "tokenspeed" else vllm_translate.pb


def _tokenspeed_request_from_flags(args: argparse.Namespace) -> object:
    pb = ts_translate.pb
    sp = pb.SamplingParams()
    if args.max_tokens is not None:
        if args.max_tokens < 0:
            raise RequestRejected("--max-tokens must be >= 0", field="sampling_params.max_new_tokens")
        sp.max_new_tokens = args.max_tokens
    if args.temperature is not None:
        sp.temperature = args.temperature
    if args.top_p is not None:
        sp.top_p = args.top_p
    if args.top_k is not None:
        sp.top_k = args.top_k
    if args.seed is not None:
        if args.seed < 0:
            raise RequestRejected("--seed must be >= 0 (sampling_seed is a uint64)", field="sampling_params.sampling_seed")
        sp.sampling_seed = args.seed
    if args.stop_token_ids:
        sp.stop_token_ids.extend(args.stop_token_ids)
    if args.stop:
        sp.stop.extend(args.stop)
    if args.n is not None:
        if args.n < 1:
            raise RequestRejected(f"--n must be >= 1, got {args.n}", field="sampling_params.n")
        sp.n = args.n
    return pb.GenerateRequest(
        request_id=args.request_id or f"zmqd-{uuid.uuid4().hex[:12]}",
        tokenized=pb.TokenizedInput(input_ids=args.prompt_token_ids),
        sampling_params=sp,
        stream=not args.no_stream,
    )


def _mock_launch_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
            "--runtime", args.runtime, "--max-model-len", str(args.mock_max_model_len)]
    if args.runtime == "tokenspeed" and args.eos_token_id:
        argv += ["--eos-token-id", ",".join(map(str, args.eos_token_id))]
    if args.vocab_size is not None:
        argv += ["--vocab-size", str(args.vocab_size)]
    return argv


def _print(resp: object) -> None:
    line = json_format.MessageToJson(
        resp, indent=None, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _generate(args: argparse.Namespace, req: object) -> int:
    """Run :func:`_dispatch`; SIGTERM cancels it (so a launched engine is stopped,
    as on SIGINT) and raises :class:`_Terminated`."""
    terminated = False
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    nonlocal terminated
                    async for _ in signals:
                        terminated = True
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(watch)
                code = await _dispatch(args, req)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise _unwrap(eg) from None  # the typed error main() reports, not a group
    if terminated:
        raise _Terminated
    return code


async def _dispatch(args: argparse.Namespace, req: object) -> int:
    config = ClientConfig(
        handshake_timeout=args.handshake_timeout,
        silence_timeout=args.silence_timeout,
        vocab_size=args.vocab_size,
        max_logprobs=args.max_logprobs,
        allow_unknown_engine_version=args.allow_unknown_engine_version,
    )
    launch: str | list[str] | None
    if args.handshake_address is not None:
        launch = None
    elif args.launch is not None:
        launch = args.launch
    else:
        launch = _mock_launch_argv(args)
    async with connect(args.handshake_address, launch=launch, config=config, runtime=args.runtime) as client:
        samples = _translate(args, req, client.max_model_len, client.engine_index)
        builders = [t.response_builder() for t in samples]
        async with generate_parallel(client, [t.request for t in samples]) as stream:
            async for index, delta in stream:
                builder = builders[index]
                for resp in builder.feed(delta):
                    _print(resp)
                if builder.stopped_early:  # a stop string matched: stop that sample on the engine
                    stream.close_child(index)
    return EXIT_OK


def _load_tokenizer(path: str | None) -> object | None:
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RequestRejected("--tokenizer needs the 'tokenizers' package: pip install 'zmqdispatch[tokenizers]'") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises its own Exception type for a bad file
        raise RequestRejected(f"--tokenizer {path!r}: cannot load: {exc}") from None


def _translate(args: argparse.Namespace, req: object, max_model_len: int, engine_index: int | None) -> list:
    """``translate_parallel`` of the runtime's translation module."""
    if args.runtime == "tokenspeed":
        config = ts_translate.TranslationConfig(
            tokenizer=args.tokenizer_obj,
            max_model_len=max_model_len,
            vocab_size=args.vocab_size,
            engine_index=engine_index,
        )
        return ts_translate.translate_parallel(req, config)
    return vllm_translate.translate_parallel(req, vllm_translate.TranslationConfig(
        tokenizer=args.tokenizer_obj,
        max_model_len=max_model_len,
        eos_token_ids=tuple(args.eos_token_id),
        vocab_size=args.vocab_size,
        max_logprobs=args.max_logprobs,
        engine_index=engine_index,
    ))


def _fail(code: int, message: str) -> int:
    one_line = " ".join(message.split())  # library messages may span lines
    sys.stderr.write(f"zmqdispatch: error: {one_line}\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    if args.command == "bench":
        return bench_harness.main(args)
    if args.command == "mock-engine":
        try:
            faults = tuple(parse_fault(f) for f in args.fault)
        except ValueError as exc:
            return _fail(EXIT_REJECTED, str(exc))
        cfg = MockEngineConfig(
            handshake_address=args.handshake_address,
            engine_index=args.engine_index,
            max_model_len=args.max_model_len,
            vocab_size=args.vocab_size,
            step_interval=args.step_interval_ms / 1000.0,
            tokens_per_step=args.tokens_per_step,
            faults=faults,
            headless=args.headless,
            runtime=args.runtime,
            eos_token_ids=tuple(args.eos_token_id),
            stream_interval=args.stream_interval,
            enable_output_logprobs=not args.no_output_logprobs,
        )
        try:
            return run_mock_main(cfg)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED

    try:
        req = _load_request(args)
        args.tokenizer_obj = _load_tokenizer(args.tokenizer)
        # Checks that need no engine first, so a bad request fails before one starts.
        runtime = Runtime(args.runtime)
        for sample in _translate(args, req, 2**31 - 1, None):
            runtime.check_request(sample.request, max_model_len=None, vocab_size=args.vocab_size,
                                  max_logprobs=args.max_logprobs)
        return trio.run(_generate, args, req)
    except RequestRejected as exc:
        return _fail(EXIT_REJECTED, f"request rejected: {exc}")
    except (EngineError, RequestError) as exc:
        return _fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    except ZmqDispatchError as exc:
        return _fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    except OSError as exc:
        return _fail(EXIT_REJECTED if isinstance(exc, FileNotFoundError) else EXIT_ENGINE, str(exc))
    except KeyboardInterrupt:
        return _fail(EXIT_INTERRUPTED, "interrupted")
    except _Terminated:
        return _fail(EXIT_TERMINATED, "terminated (SIGTERM)")


def main_entry() -> None:
    """Console-script entry point (``zmqdispatch``)."""
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    main_entry()
