"""Command line: ``zmqdispatch generate``, ``mock-engine``, ``serve-grpc`` and ``bench``.

``generate`` reads a proto-JSON ``vllm.grpc.engine.GenerateRequest`` (with
``--runtime tokenspeed``: a ``tokenspeed.grpc.scheduler.GenerateRequest``; with
``--runtime sglang``: a ``sglang.grpc.scheduler.GenerateRequest``), or
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

``--requests FILE`` runs many requests (one proto-JSON ``GenerateRequest`` per
line) concurrently through one client and prints ``{"request_id": ID,
"response": GenerateResponse}`` lines (:mod:`zmqdispatch._cli_requests`,
``docs/cli.md``).

Exit status: 0 the generate completed; 2 the client rejected the request
(nothing was sent), a flag value or an address is malformed; 3 the engine failed
(dead, handshake, engine error) or an address cannot be bound; 130 interrupted
(SIGINT), 143 terminated (SIGTERM): both stop a launched engine first; 141
stdout closed or unwritable (the request is aborted); 1 an
internal error (a bug: ``ZMQDISPATCH_DEBUG=1`` shows its traceback) or out of
file descriptors. Failures print one line on stderr, no traceback.

``mock-engine``'s options and runner are in :mod:`zmqdispatch._cli_mock`,
``serve-grpc``'s in :mod:`zmqdispatch._cli_grpc`; what
the subcommands share (exit statuses, the failure line, argument types) in
:mod:`zmqdispatch._cli_common`.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from types import ModuleType
from typing import Any, NoReturn, cast

try:
    import resource  # POSIX only: the open-files limit
except ImportError:  # pragma: no cover
    resource = None  # type: ignore[assignment]

import trio
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from . import __version__
from .addresses import check_address
from . import _cli_logging
from . import _cli_grpc
from . import _cli_mock
from . import _cli_requests
from ._cli_common import DEBUG_ENV as DEBUG_ENV  # the traceback switch, read as cli.DEBUG_ENV too
from ._cli_common import (
    EXIT_ENGINE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_STDOUT_CLOSED,
    EXIT_TERMINATED,
    INTERNAL_EPILOG,
    U32,
    Formatter,
    bounded_int,
    fail,
    int_list,
    launch_command,
    seconds,
    token_id_list,
)
from ._engine_lifecycle import leaves, unwrap
from .client import EngineClient
from .config import ClientConfig
from .shell import connect
from .errors import (
    AddressBindError,
    EngineError,
    InvalidAddressError,
    RequestError,
    RequestRejected,
    ZmqDispatchError,
)
from .limits import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_SILENCE_TIMEOUT
from .mock.server import MOCK_VOCAB_SIZE, RUNTIMES
from .protocol.deadlines import Deadlines
from .protocol.runtime import Runtime
from .translate import sglang as sg_translate
from .translate import tokenspeed as ts_translate
from .translate import vllm as vllm_translate
from .bench import harness as bench_harness

__all__ = ["main"]

_GENERATE_EPILOG = (
    "exit status:\n"
    "  0    the generate completed (--requests: every request completed)\n"
    + INTERNAL_EPILOG +
    "  2    rejected before anything was sent: a request field or flag value out of range,\n"
    "       a malformed address, an unreadable --request file (--requests: any bad line, each named)\n"
    "  3    the engine failed (dead, handshake, engine-side error), or an address cannot be bound\n"
    "       (--requests: any request failed, each named by its request_id; the others ran)\n"
    "  130  interrupted (SIGINT); 143 terminated (SIGTERM): a launched engine is stopped first\n"
    "  141  stdout was closed (the reader went away, e.g. `| head -1`) or cannot be written (a full disk):\n"
    "       the request was aborted\n"
    "every failure prints one line on stderr"
)

_BENCH_EPILOG = (
    "exit status:\n"
    "  0    the benchmark ran\n"
    + INTERNAL_EPILOG +
    "  2    a malformed flag value"
)

#: proto3 integer field types and their ranges
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: ("uint32", 0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: ("int64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: ("int64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: ("uint64", 0, 2**64 - 1),
}
_FLOAT32_MAX = 3.4028234663852886e38


class _Terminated(Exception):
    """SIGTERM arrived: the generate was cancelled and its engine stopped."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one stderr line (the usage is in ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zmqdispatch", description=__doc__.split("\n\n")[0],
                                     formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="dispatch one GenerateRequest and print GenerateResponse proto-JSON lines",
        description="Dispatch one GenerateRequest (vllm.grpc.engine, or tokenspeed.grpc.scheduler with "
                    "--runtime tokenspeed, or sglang.grpc.scheduler with --runtime sglang) to an engine over ZMQ. "
                    "Engine: --handshake-address (started "
                    "elsewhere), --launch CMD, or neither: the embedded mock engine.",
        formatter_class=Formatter,
        epilog=_GENERATE_EPILOG,
    )
    src = g.add_argument_group("request")
    g.add_argument("--runtime", choices=RUNTIMES, default="vllm",
                   help="the engine's runtime; selects the request/response proto package")
    src.add_argument("--request", metavar="FILE", help="proto-JSON GenerateRequest file, or - for stdin")
    src.add_argument("--requests", metavar="FILE",
                     help="many requests: one proto-JSON GenerateRequest per line (- for stdin), run concurrently; "
                          'prints {"request_id": ID, "response": GenerateResponse} lines (docs/cli.md)')
    src.add_argument("--max-concurrency", type=bounded_int(1), metavar="N",
                     help="with --requests: at most N requests in flight (the others wait, deadlines not started); "
                          "unset: all at once")
    src.add_argument("--prompt-token-ids", type=int_list, metavar="IDS", help="e.g. 1,2,3 (builds a request)")
    src.add_argument("--request-id", help="default: a random zmqd-<hex> id")
    src.add_argument("--max-tokens", type=int, help="max_tokens (TokenSpeed: max_new_tokens); unset: the engine's rule")
    src.add_argument("--temperature", type=float, help="unset: the proto default")
    src.add_argument("--top-p", type=float, help="unset: the proto default")
    src.add_argument("--top-k", type=int, help="unset: the proto default (disabled)")
    src.add_argument("--seed", type=int, help="seed (TokenSpeed: sampling_seed); unset: random")
    src.add_argument("--stop-token-ids", type=int_list, metavar="IDS", help="e.g. 7,9")
    src.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable). vllm, tokenspeed: needs --tokenizer (matched on the client, "
                          "the engine then aborted); sglang: sent to the scheduler, which matches it itself")
    src.add_argument("-n", "--n", type=int, dest="n", help="samples per request (fan-out); unset: 1")
    src.add_argument("--no-stream", action="store_true", help="print only the complete")
    eng = g.add_argument_group("engine")
    how = eng.add_mutually_exclusive_group()
    how.add_argument("--handshake-address", metavar="ADDR",
                     help="bind here (tcp://HOST:PORT or ipc://PATH) and wait for an engine to dial in")
    how.add_argument("--launch", type=launch_command, metavar="CMD",
                     help="engine command; it must contain {handshake_address}, replaced by the address the "
                          "engine dials")
    eng.add_argument("--data-parallel-size", type=bounded_int(1, 65536), metavar="N",
                     help="serve N engines (the ranks of one `vllm serve --data-parallel-size N`, or N that "
                          "dial in): wait for N on the handshake, place each request on one; the embedded "
                          "mock runs N ranks. Unset: one engine")
    eng.add_argument("--handshake-timeout", type=seconds(zero_ok=False), default=DEFAULT_HANDSHAKE_TIMEOUT,
                     metavar="S", help="seconds for the engine's startup handshake")
    eng.add_argument("--silence-timeout", type=seconds(zero_ok=False), default=DEFAULT_SILENCE_TIMEOUT,
                     metavar="S", help="seconds without output while requests run before the engine is dead")
    eng.add_argument("--vocab-size", type=bounded_int(1, U32 + 1),
                     help="reject token ids >= this (protects the engine); unset: not checked, except "
                          f"against the embedded mock's {MOCK_VOCAB_SIZE}")
    eng.add_argument("--eos-token-id", type=token_id_list, default=[], metavar="IDS",
                     help="the model's EOS id(s), primary first (vLLM: the engine has no tokenizer; "
                          "tokenspeed, sglang: given to the embedded mock, which stops on them)")
    eng.add_argument("--max-logprobs", type=bounded_int(0, U32), default=20, help="the engine's max_logprobs")
    eng.add_argument("--tokenizer", metavar="FILE",
                     help="tokenizer.json of the model (needs the 'tokenizers' extra); enables stop strings "
                          "(vllm, tokenspeed; refused with sglang, whose scheduler has its own)")
    eng.add_argument("--mock-max-model-len", type=bounded_int(1, 2**31 - 1), default=4096,
                     help="embedded mock only: its max_model_len")
    eng.add_argument("--allow-unknown-engine-version", action="store_true",
                     help="connect to an engine version the wire codec was not checked against "
                          "(logs a warning; default: refuse it)")
    lim = g.add_argument_group("deadlines (per sample; past one the request is aborted, exit 3)")
    lim.add_argument("--first-token-timeout", type=float, metavar="S", help="seconds to the first token")
    lim.add_argument("--total-timeout", type=float, metavar="S", help="seconds to the final output")
    lim.add_argument("--stall-timeout", type=float, metavar="S", help="seconds without a new token")
    g.add_argument("--log-level", choices=_cli_logging.LOG_LEVELS, default="warning",
                   help="log records of the zmqdispatch loggers on stderr ("
                        "debug shows every request's life)")

    m = sub.add_parser(
        "mock-engine",
        help="run the wire-faithful mock engine (vLLM EngineCore, TokenSpeed or SGLang scheduler)",
        description="A mock vLLM EngineCore (or, with --runtime tokenspeed / sglang, a TokenSpeed scheduler or an "
                    "SGLang scheduler behind the SGLang plugin) that dials "
                    "ADDR like the real one (see zmqdispatch.mock.server), and serves one client after another.",
        formatter_class=Formatter,
        epilog=_cli_mock.EPILOG,
    )
    _cli_mock.add_arguments(m)
    sg = sub.add_parser("serve-grpc",
                        help="serve the engines as a gRPC VllmEngine / TokenSpeedScheduler / SglangScheduler worker",
                        description="A gRPC servicer (vllm.grpc.engine.VllmEngine; with --runtime tokenspeed "
                                    "tokenspeed.grpc.scheduler.TokenSpeedScheduler; with --runtime sglang "
                                    "sglang.grpc.scheduler.SglangScheduler) backed by zmqdispatch over ZMQ, "
                                    "for gateways such as smg (docs/grpc.md; needs the 'grpc' extra).",
                        formatter_class=Formatter, epilog=_cli_grpc.EPILOG)
    _cli_grpc.add_arguments(sg)
    b = sub.add_parser("bench", help="transport benchmark: zmqdispatch vs the raw limit vs vLLM's client",
                       description="See zmqdispatch.bench.harness (progress bar and PNG: the 'bench' extra).",
                       formatter_class=Formatter, epilog=_BENCH_EPILOG)
    bench_harness.add_arguments(b)
    return parser


#: Flags that build a request from flags (``--prompt-token-ids``): refused beside
#: ``--request``, which carries the whole message.
_REQUEST_FLAGS = (
    ("--request-id", "request_id"), ("--max-tokens", "max_tokens"), ("--temperature", "temperature"),
    ("--top-p", "top_p"), ("--top-k", "top_k"), ("--seed", "seed"), ("--stop-token-ids", "stop_token_ids"),
    ("--stop", "stop"), ("--n", "n"),
)


def _refuse_request_flags(args: argparse.Namespace, option: str) -> None:
    """*option* (``--request`` / ``--requests``) carries whole messages: the
    flags that build one are refused beside it, by name."""
    if args.prompt_token_ids is not None:
        raise RequestRejected(f"use either {option} or --prompt-token-ids, not both")
    given = [flag for flag, dest in _REQUEST_FLAGS if getattr(args, dest) not in (None, [])]
    if given:
        raise RequestRejected(f"{', '.join(given)}: set these in the {option} message instead "
                              f"(with {option}, request flags are not applied)", field=option.lstrip("-"))


def _read_input(option: str, path: str) -> str:
    """The text of *path* (``-``: stdin), or ``RequestRejected`` naming *option*."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RequestRejected(f"{option} {path!r}: cannot read it: {reason}", field=option.lstrip("-")) from None


def _load_request(args: argparse.Namespace) -> object:
    pb = _pb(args)
    if args.request is not None:
        _refuse_request_flags(args, "--request")
        text = _read_input("--request", args.request)
        req = pb.GenerateRequest()
        try:
            json_format.Parse(text, req)
        except json_format.ParseError as exc:
            raise RequestRejected(
                f"--request: not a proto-JSON {pb.GenerateRequest.DESCRIPTOR.full_name}: {exc}"
            ) from None
        if args.no_stream:
            req.stream = False
        return req
    if args.prompt_token_ids is None:
        raise RequestRejected("give --request FILE or --prompt-token-ids IDS")
    return _request_from_flags(args, pb)


def _in_range(
    message: type[Message], field: str, value: float | list[int] | list[float], flag: str, path: str
) -> float | list[int] | list[float]:
    """*value* (or each item of a list) when it fits proto field *field* of *message*.

    Raises:
        RequestRejected: out of the field's range (named *path*) or, for a
            float field, not finite.
    """
    fd = message.DESCRIPTOR.fields_by_name[field]
    items: list[int] | list[float] = value if isinstance(value, list) else [value]
    if fd.type in _INT_RANGES:
        kind, lo, hi = _INT_RANGES[fd.type]
        for v in items:
            if not lo <= v <= hi:
                raise RequestRejected(f"{flag}: {v} is outside the range of {path} ({kind}: {lo}..{hi})", field=path)
    elif fd.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        limit = _FLOAT32_MAX if fd.type == FieldDescriptor.TYPE_FLOAT else sys.float_info.max
        for v in items:
            if not math.isfinite(v) or abs(v) > limit:
                kind = "float" if fd.type == FieldDescriptor.TYPE_FLOAT else "double"
                raise RequestRejected(f"{flag}: {v!r} is not a finite {kind} (|x| <= {limit:.7g}) for {path}",
                                      field=path)
    return value


#: flag -> (vLLM SamplingParams field, TokenSpeed SamplingParams field)
_SAMPLING_FLAGS = (
    ("max_tokens", "--max-tokens", "max_tokens", "max_new_tokens"),
    ("temperature", "--temperature", "temperature", "temperature"),
    ("top_p", "--top-p", "top_p", "top_p"),
    ("top_k", "--top-k", "top_k", "top_k"),
    ("seed", "--seed", "seed", "sampling_seed"),
    ("n", "--n", "n", "n"),
)


def _request_from_flags(args: argparse.Namespace, pb: ModuleType) -> Message:
    """A ``GenerateRequest`` of the runtime's proto package from the flags.

    Raises:
        RequestRejected: a value outside its proto field's range (naming the
            field and the range), or ``--n`` < 1.
    """
    tokenspeed = args.runtime != "vllm"
    sp = pb.SamplingParams()
    for attr, flag, vllm_field, ts_field in _SAMPLING_FLAGS:
        value = getattr(args, attr)
        if value is None:
            continue
        field = ts_field if tokenspeed else vllm_field
        if args.runtime == "sglang" and attr == "seed":
            raise RequestRejected("--seed: sglang.grpc.scheduler.SamplingParams has no seed field",
                                  field="sampling_params.sampling_seed")
        if attr == "n" and value < 1:
            raise RequestRejected(f"--n must be >= 1, got {value}", field="sampling_params.n")
        setattr(sp, field, _in_range(pb.SamplingParams, field, value, flag, f"sampling_params.{field}"))
    if args.stop_token_ids:
        sp.stop_token_ids.extend(_in_range(pb.SamplingParams, "stop_token_ids", args.stop_token_ids,
                                           "--stop-token-ids", "sampling_params.stop_token_ids"))
    if args.stop:
        sp.stop.extend(args.stop)
    ids = _in_range(pb.TokenizedInput, "input_ids", args.prompt_token_ids, "--prompt-token-ids",
                    "tokenized.input_ids")
    request: Message = pb.GenerateRequest(
        request_id=args.request_id or f"zmqd-{uuid.uuid4().hex[:12]}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=sp,
        stream=not args.no_stream,
    )
    return request


def _pb(args: argparse.Namespace) -> ModuleType:
    """The generated proto module of the runtime (``vllm_engine_pb2``, TokenSpeed's or SGLang's)."""
    # smg_grpc_proto ships no annotations (no py.typed, no stubs): its modules are Any to mypy.
    pb = {"tokenspeed": ts_translate.pb, "sglang": sg_translate.pb}.get(args.runtime, vllm_translate.pb)
    return cast(ModuleType, pb)


def _mock_launch_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
            "--runtime", args.runtime, "--max-model-len", str(args.mock_max_model_len)]
    if args.runtime != "vllm" and args.eos_token_id:
        argv += ["--eos-token-id", ",".join(map(str, args.eos_token_id))]
    if args.vocab_size is not None:
        argv += ["--vocab-size", str(args.vocab_size)]
    if args.log_level != "warning":
        argv += ["--log-level", args.log_level]
    if args.data_parallel_size is not None and args.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(args.data_parallel_size)]
    return argv


def _print(resp: Message) -> None:
    line = json_format.MessageToJson(
        resp, indent=None, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _cli_requests.write_out(sys.stdout, line + "\n")


def _load_requests(args: argparse.Namespace) -> list[_cli_requests.RequestLine]:
    """Every request of ``--requests``, each checked as far as it can be without
    an engine.

    Raises:
        RequestRejected: beside request flags or ``--request``; an unreadable
            input; any bad line (each is reported on stderr first).
    """
    if args.request is not None:
        raise RequestRejected("use either --request or --requests, not both")
    _refuse_request_flags(args, "--requests")
    text = _read_input("--requests", args.requests)
    runtime = Runtime(args.runtime)

    def check(req: object) -> list[str]:
        ids = []
        for sample in _translate(args, req, 2**31 - 1, None):
            runtime.check_request(sample.request, max_model_len=None, vocab_size=args.vocab_size,
                                  max_logprobs=args.max_logprobs)
            ids.append(runtime.request_id(sample.request))
        return ids

    accepted, rejected = _cli_requests.parse_requests(_cli_requests.split_lines(text), _pb(args).GenerateRequest,
                                                      check)
    for bad in rejected:
        fail(EXIT_REJECTED, f"--requests: {bad}")
    if rejected:
        raise RequestRejected(f"{len(rejected)} bad line(s) in --requests {args.requests!r}; nothing was sent",
                              field="requests")
    if args.no_stream:
        for item in accepted:
            cast(Any, item.request).stream = False  # a generated field: not in Message's stubs
    return accepted


async def _generate(args: argparse.Namespace, req: object,
                    dispatch: Callable[[argparse.Namespace, object], Awaitable[int]] | None = None) -> int:
    """Run :func:`_dispatch` (or *dispatch*); SIGTERM cancels it (so a launched
    engine is stopped, as on SIGINT) and raises :class:`_Terminated`."""
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
                code = await (dispatch or _dispatch)(args, req)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None  # the typed error main() reports, not a group
    if terminated:
        raise _Terminated
    return code


def _connect(args: argparse.Namespace) -> AbstractAsyncContextManager[EngineClient]:
    """The client of ``generate``: the engine its flags name."""
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
    return connect(args.handshake_address, launch=launch, config=config, runtime=args.runtime,
                   data_parallel_size=args.data_parallel_size or 1)


def _deadlines(args: argparse.Namespace) -> Deadlines:
    return Deadlines(first_token=args.first_token_timeout, total=args.total_timeout, stall=args.stall_timeout)


async def _dispatch(args: argparse.Namespace, req: object) -> int:
    async with _connect(args) as client:
        samples = _translate(args, req, client.max_model_len, client.engine_index)
        builders = [t.response_builder() for t in samples]
        async with client.generate_samples([t.request for t in samples], deadlines=_deadlines(args)) as stream:
            async for index, delta in stream:
                builder = builders[index]
                for resp in builder.feed(delta):
                    _print(resp)
                if builder.stopped_early:  # a stop string matched: stop that sample on the engine
                    stream.abort_sample(index)
    return EXIT_OK


async def _dispatch_requests(args: argparse.Namespace, requests: object) -> int:
    """``--requests``: every request through one client; exit 3 when any failed."""
    assert isinstance(requests, list)
    if not requests:
        return EXIT_OK  # nothing to run: no engine is started or waited for
    async with _connect(args) as client:
        failed, rejected = await _cli_requests.run_requests(
            client, requests, lambda req, max_model_len, engine_index: _translate(args, req, max_model_len,
                                                                                  engine_index),
            deadlines=_deadlines(args), max_concurrency=args.max_concurrency)
    if rejected:
        return fail(EXIT_REJECTED, f"{failed} of {len(requests)} requests failed, {rejected} of them "
                                    "rejected before they were sent")
    if failed:
        return fail(EXIT_ENGINE, f"{failed} of {len(requests)} requests failed")
    return EXIT_OK


def _load_tokenizer(path: str | None) -> object | None:
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RequestRejected(
            "--tokenizer needs the 'tokenizers' package: pip install 'zmqdispatch[tokenizers]'"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises its own Exception type for a bad file
        raise RequestRejected(f"--tokenizer {path!r}: cannot load: {exc}") from None


def _translate(
    args: argparse.Namespace, req: object, max_model_len: int, engine_index: int | None
) -> (list[vllm_translate.Translation] | list[ts_translate.Translation]
      | list[sg_translate.Translation]):
    """``translate_parallel`` of the runtime's translation module."""
    if args.runtime == "sglang":
        return sg_translate.translate_parallel(req, sg_translate.TranslationConfig(
            max_model_len=max_model_len, vocab_size=args.vocab_size, engine_index=engine_index))
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


#: File descriptors the command line wants at least: a client and an engine
#: process take about 10 each (sockets, their monitors, libzmq's own).
MIN_OPEN_FILES = 64
#: What the command line raises its soft ``RLIMIT_NOFILE`` to, at most (the hard limit caps it).
WANTED_OPEN_FILES = 65536


def _open_files_limit() -> str | None:
    """Raise the soft open-files limit toward the hard one (as vLLM's server
    does; a launched engine inherits it); a one-line complaint if what is left
    is below :data:`MIN_OPEN_FILES`, else ``None``."""
    if resource is None:  # pragma: no cover - not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (OSError, ValueError):
            pass
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        return (f"this process may open only {soft} files (ulimit -n; hard limit {hard}); "
                f"zmqdispatch needs at least {MIN_OPEN_FILES}")
    return None


def _out_of_files(exc: BaseException) -> bool:
    """A leaf of *exc* (:func:`._engine_lifecycle.leaves`), or what a leaf was
    raised from or during, is EMFILE / ENFILE (OSError or zmq.ZMQError)."""
    for leaf in leaves(exc):
        e: BaseException | None = leaf
        while e is not None:
            if getattr(e, "errno", None) in (errno.EMFILE, errno.ENFILE):
                return True
            e = e.__cause__ or e.__context__
    return False


def _open_files_now() -> str:
    if resource is None:  # pragma: no cover - not POSIX
        return "a limited number of"
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (see ``--help``).

    Every failure prints one line on stderr. An exception nothing here expects
    (a bug) is reported as an internal error (exit 1), with its traceback only
    when ``ZMQDISPATCH_DEBUG`` is set. ``generate`` and ``mock-engine`` raise the
    soft open-files limit to the hard one first; running out of file
    descriptors (a hard limit below :data:`MIN_OPEN_FILES`, or later) exits 1
    too, with a line that says so.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)  # argparse: exit 2 on a bad flag
    if args.command == "bench" and (conflict := bench_harness.flag_conflict(args)):
        parser.error(f"bench: {conflict}")  # flags that cannot go together: exit 2 as well
    try:
        return _run(args)
    except KeyboardInterrupt:
        return fail(EXIT_INTERRUPTED, "interrupted")
    except Exception as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        if _out_of_files(exc):
            return fail(EXIT_INTERNAL, f"out of file descriptors: this process may open {_open_files_now()} "
                                        "files (ulimit -n) and needs more; raise the limit")
        return fail(EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {exc} "
                                    f"(a bug; re-run with {DEBUG_ENV}=1 for the traceback)")


def _run(args: argparse.Namespace) -> int:
    if args.command in ("generate", "mock-engine", "serve-grpc") and (complaint := _open_files_limit()):
        return fail(EXIT_INTERNAL, f"out of file descriptors: {complaint}")
    if args.command in ("generate", "mock-engine"):
        # The wait for an engine started elsewhere (or by --launch) is said at
        # any level; the embedded mock answers within a second or fails.
        _cli_logging.configure(args.log_level, announce_waits=args.command == "generate" and (
            args.handshake_address is not None or args.launch is not None))
    if args.command == "bench":
        return bench_harness.main(args)
    if args.command == "mock-engine":
        return _cli_mock.run(args)
    if args.command == "serve-grpc":
        return _cli_grpc.run(args)
    if sys.stdout is None:  # started with stdout closed (`>&-`): nowhere to write the responses
        return fail(EXIT_STDOUT_CLOSED, "stdout is closed: nowhere to write the responses; nothing was sent")
    try:
        if args.handshake_address is not None:
            check_address(args.handshake_address, role="--handshake-address", any_port=False)
            if args.handshake_address.startswith("inproc://"):
                # an engine started elsewhere is another process: inproc cannot reach it
                raise InvalidAddressError(
                    f"--handshake-address {args.handshake_address!r}: an engine in another process cannot dial "
                    "inproc://; use tcp:// or ipc://", address=args.handshake_address, role="--handshake-address")
        _deadlines(args)
        if args.max_concurrency is not None and args.requests is None:
            raise RequestRejected("--max-concurrency: only with --requests", field="max_concurrency")
        if args.tokenizer is not None and args.runtime == "sglang":
            raise RequestRejected("--tokenizer: not used with --runtime sglang (the SGLang scheduler matches stop "
                                  "strings with its own tokenizer; --stop is sent to it as is)", field="tokenizer")
        if args.vocab_size is None and args.handshake_address is None and args.launch is None:
            args.vocab_size = MOCK_VOCAB_SIZE  # the embedded mock's, which an out-of-range id kills
        if args.requests is not None:
            args.tokenizer_obj = _load_tokenizer(args.tokenizer)
            return trio.run(_generate, args, _load_requests(args), _dispatch_requests)
        req = _load_request(args)
        args.tokenizer_obj = _load_tokenizer(args.tokenizer)
        # Checks that need no engine first, so a bad request fails before one starts.
        runtime = Runtime(args.runtime)
        for sample in _translate(args, req, 2**31 - 1, None):
            runtime.check_request(sample.request, max_model_len=None, vocab_size=args.vocab_size,
                                  max_logprobs=args.max_logprobs)
        return trio.run(_generate, args, req)
    except RequestRejected as exc:
        return fail(EXIT_REJECTED, f"request rejected: {exc}")
    except InvalidAddressError as exc:
        return fail(EXIT_REJECTED, f"bad address: {exc}")
    except AddressBindError as exc:
        return fail(EXIT_ENGINE, f"cannot bind: {exc}")
    except (EngineError, RequestError) as exc:
        return fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    except ZmqDispatchError as exc:
        return fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    except BrokenPipeError:
        # Leaving the stream aborted the request; later writes to stdout go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return fail(EXIT_STDOUT_CLOSED, "stdout was closed (the reader went away); the request was aborted")
    except _cli_requests.StdoutUnwritable as exc:
        return fail(EXIT_STDOUT_CLOSED, f"{exc}; the request was aborted")
    except OSError as exc:  # the system refused something (fds, processes) while serving
        return fail(EXIT_ENGINE, f"{type(exc).__name__}: {exc}")
    except _Terminated:
        return fail(EXIT_TERMINATED, "terminated (SIGTERM)")


def main_entry() -> None:
    """Console-script entry point (``zmqdispatch``)."""
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    main_entry()
