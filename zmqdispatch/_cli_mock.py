"""``zmqdispatch mock-engine``: its options (:func:`add_arguments`) and its
runner (:func:`run`), which checks the flags and runs
:func:`zmqdispatch.mock.server.main_sync`, the mock engine of
:mod:`zmqdispatch.mock`."""

from __future__ import annotations

import argparse

from . import _cli_logging
from ._cli_common import DEBUG_ENV, EXIT_REJECTED, U32, bounded_int, fail, seconds, token_id_list
from .addresses import check_address
from .errors import InvalidAddressError
from .mock.server import MockEngineConfig, main_sync as run_mock_main, parse_fault
from .mock.server import MOCK_VOCAB_SIZE, RUNTIMES

__all__ = ["EPILOG", "add_arguments", "run"]

#: The ``mock-engine --help`` epilog.
EPILOG = (
    "exit status:\n"
    "  0    stopped by SIGINT or SIGTERM (running requests get a finish ABORT first, as vLLM's clean stop)\n"
    "  1    the engine died as the real one does (fatal request: ENGINE_CORE_DEAD sent; --fault sentinel/exit),\n"
    f"       or an internal error ({DEBUG_ENV}=1 prints its traceback)\n"
    "  2    a malformed flag value or --handshake-address\n"
    "the mock serves one client after another: when its client goes away it dials the handshake\n"
    "address again (and still accepts the old client's resumed data connections); with several DP\n"
    "ranks each rank does so on its own"
)

#: The longest mock step interval: an hour (anything longer never steps in practice).
_MAX_STEP_MS = 3_600_000.0


def _finite_ms(text: str) -> float:
    value = seconds(zero_ok=True)(text)
    if not value <= _MAX_STEP_MS:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {_MAX_STEP_MS:.0f} ms")
    return value


_finite_ms.__name__ = "float"


def _cache_gb(text: str) -> float:
    value = seconds(zero_ok=True)(text)  # a finite number >= 0
    if not value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {1 << 20} GB")
    return value


_cache_gb.__name__ = "float"


def _fault(text: str) -> str:
    try:
        parse_fault(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


def add_arguments(m: argparse.ArgumentParser) -> None:
    """The ``zmqdispatch mock-engine`` options."""
    m.add_argument("--handshake-address", required=True, metavar="ADDR",
                   help="the client's handshake address to dial (tcp://HOST:PORT or ipc://PATH)")
    m.add_argument("--log-level", choices=_cli_logging.LOG_LEVELS, default="warning",
                   help="log records of the zmqdispatch loggers on stderr")
    m.add_argument("--runtime", choices=RUNTIMES, default="vllm", help="which engine to imitate")
    m.add_argument("--engine-index", type=bounded_int(0, 2**16 - 1),
                   help="DP rank (its 2-byte identity) of a one-rank mock; default 0")
    dp = m.add_argument_group("data parallel (as vllm serve: one independent engine per rank, all dialing ADDR)")
    dp.add_argument("--data-parallel-size", type=bounded_int(1, 2**16), metavar="N",
                    help="ranks in the whole DP group; this process runs all of them unless told otherwise; "
                         "default 1")
    dp.add_argument("--data-parallel-size-local", type=bounded_int(1, 2**16), metavar="L",
                    help="ranks this process runs; default: every rank from the start rank on")
    dp.add_argument("--data-parallel-start-rank", type=bounded_int(0, 2**16 - 1), metavar="S",
                    help="the first rank this process runs (its ranks: S..S+L-1); default 0")
    m.add_argument("--max-model-len", type=bounded_int(1, 2**31 - 1), default=4096,
                   help="context length; a prompt this long or longer kills the vLLM mock, as vLLM 0.32")
    m.add_argument("--vocab-size", type=bounded_int(1, U32 + 1), default=MOCK_VOCAB_SIZE,
                   help="a token id at or past it kills the engine, as the real one")
    m.add_argument("--step-interval-ms", type=_finite_ms, default=1.0, help="0 = as fast as possible")
    m.add_argument("--tokens-per-step", type=bounded_int(1, 2**16), default=1, help="tokens per request per step")
    m.add_argument("--mm-processor-cache-gb", type=_cache_gb, default=4.0, metavar="GB",
                   help="vLLM: the multimodal receiver cache's capacity (vLLM's option; 0 = no cache)")
    m.add_argument("--headless", action="store_true", help="announce local=false, headless=true")
    m.add_argument("--eos-token-id", type=token_id_list, default=[], metavar="IDS",
                   help="tokenspeed, sglang: the model's EOS ids (the scheduler stops at EOS by itself)")
    m.add_argument("--stream-interval", type=bounded_int(1, 2**31 - 1), default=1,
                   help="tokenspeed, sglang: --stream-interval")
    m.add_argument("--no-output-logprobs", action="store_true",
                   help="tokenspeed: run without --enable-output-logprobs (logprob requests are aborted)")
    m.add_argument("--multimodal-encoder-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="tokenspeed: the encoder dtype the ready response announces (default: none, a text model)")
    m.add_argument(
        "--fault",
        type=_fault,
        action="append",
        default=[],
        metavar="KIND[:N]",
        help="sentinel:N, exit:N, garbage:N, silent:N, stop-reading:N, no-ready (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``zmqdispatch mock-engine``; returns its exit status (see ``--help``)."""
    try:
        check_address(args.handshake_address, role="--handshake-address", bind=False, any_port=False)
        faults = tuple(parse_fault(f) for f in args.fault)
    except ValueError as exc:  # InvalidAddressError is one
        return fail(EXIT_REJECTED, str(exc))
    try:
        start_rank, size_local, size = _mock_ranks(args)
    except ValueError as exc:
        return fail(EXIT_REJECTED, str(exc))
    cfg = MockEngineConfig(
        handshake_address=args.handshake_address,
        engine_index=start_rank,
        data_parallel_size_local=size_local,
        data_parallel_size=size,
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
        step_interval=args.step_interval_ms / 1000.0,
        tokens_per_step=args.tokens_per_step,
        mm_cache_gb=args.mm_processor_cache_gb,
        faults=faults,
        headless=args.headless,
        runtime=args.runtime,
        eos_token_ids=tuple(args.eos_token_id),
        stream_interval=args.stream_interval,
        enable_output_logprobs=not args.no_output_logprobs,
        multimodal_encoder_dtype=args.multimodal_encoder_dtype,
    )
    try:
        return run_mock_main(cfg)
    except InvalidAddressError as exc:  # an INIT naming an address we cannot dial
        return fail(EXIT_REJECTED, str(exc))


_DP_FLAGS = (("--data-parallel-size", "data_parallel_size"), ("--data-parallel-size-local", "data_parallel_size_local"),
             ("--data-parallel-start-rank", "data_parallel_start_rank"))


def _mock_ranks(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(start rank, ranks in this process, DP size)`` of ``mock-engine``.

    Raises:
        ValueError: ``--engine-index`` beside a ``--data-parallel-*`` flag, or
            ranks past the DP size.
    """
    given = [flag for flag, dest in _DP_FLAGS if getattr(args, dest) is not None]
    if args.engine_index is not None:
        if given:
            raise ValueError(f"--engine-index: not with {', '.join(given)} (the start rank is "
                             "--data-parallel-start-rank)")
        return args.engine_index, 1, 1  # what the ready response said before DP flags existed
    size = args.data_parallel_size
    if size is None:
        if given:  # vllm serve's default size is 1: a start rank or local size alone means little
            raise ValueError(f"{', '.join(given)}: give --data-parallel-size too")
        return 0, 1, 1
    start = args.data_parallel_start_rank or 0
    if start >= size:
        raise ValueError(f"--data-parallel-start-rank {start}: past --data-parallel-size {size} (ranks 0..{size - 1})")
    local = args.data_parallel_size_local if args.data_parallel_size_local is not None else size - start
    if start + local > size:
        raise ValueError(f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} runs ranks "
                         f"{start}..{start + local - 1}, past --data-parallel-size {size} (ranks 0..{size - 1})")
    return start, local, size
