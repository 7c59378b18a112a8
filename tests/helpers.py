"""Small builders shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from zmqdispatch.testing import open_mock_engine_pair
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine


def make_request(rid: str = "r1", prompt: Sequence[int] = (1, 2, 3), **sp: object) -> wire.EngineCoreRequest:
    """A valid greedy EngineCoreRequest."""
    sp.setdefault("temperature", 0.0)
    sp.setdefault("max_tokens", 16)
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling_params=wire.SamplingParams(**sp),
        arrival_time=0.0,
    )


def out(
    rid: str, tokens: Sequence[int], finish: wire.FinishReason | None = None, **kw: object
) -> wire_engine.EngineCoreOutput:
    """One EngineCoreOutput."""
    return wire_engine.EngineCoreOutput(request_id=rid, new_token_ids=tuple(tokens), finish_reason=finish, **kw)


def outputs_frames(outputs: Sequence[wire_engine.EngineCoreOutput], **kw: object) -> list[bytes]:
    """Encode one EngineCoreOutputs message as the engine would."""
    kw.setdefault("timestamp", 1.0)
    return wire_engine.encode_outputs(0, list(outputs), **kw)


def make_ts_request(rid: str = "t1", prompt: Sequence[int] = (1, 2, 3), *, return_logprob: bool = False,
                    stream: bool = True, **sp: object) -> ts.TokenizedGenerateReqInput:
    """A valid TokenSpeed ADD (greedy unless told otherwise)."""
    sp.setdefault("temperature", 0.0)
    sp.setdefault("max_new_tokens", 16)
    return ts.TokenizedGenerateReqInput(
        rid=rid,
        input_ids=tuple(prompt),
        sampling_params=ts.TokenSpeedSamplingParams(**sp),
        return_logprob=return_logprob,
        stream=stream,
    )


def ts_batch_frames(rows: Sequence[tuple], *, engine_index: int = 0, load: tuple[int, int, int, int] = (0, 0, 0, 0)
                    ) -> list[bytes]:
    """One BatchTokenIDOutSlim as the engine sends it. ``rows``: ``(rid, tokens, reason,
    prompt_tokens, completion_tokens[, logprob_vals])``."""
    lp = [tuple(r[5]) if len(r) > 5 else () for r in rows]
    return ts_engine.encode_outputs(ts.TokenSpeedBatch(
        engine_index=engine_index,
        rids=tuple(r[0] for r in rows),
        output_ids=tuple(tuple(r[1]) for r in rows),
        finished_reasons=tuple(r[2] for r in rows),
        prompt_tokens=tuple(r[3] for r in rows),
        completion_tokens=tuple(r[4] for r in rows),
        cached_tokens=tuple(0 for _ in rows),
        logprob_vals=tuple(lp),
        logprob_ids=tuple(tuple(r[1]) if v else () for r, v in zip(rows, lp)),
        num_running=load[0],
        num_waiting=load[1],
        kv_active_pages=load[2],
        kv_total_pages=load[3],
    ))


#: trio.fail_after guard for whole tests (a hang must fail, not block the suite).
GUARD = 30


def tokenspeed_pair(**kw: Any) -> AbstractAsyncContextManager[tuple[Any, Any]]:
    """``open_mock_engine_pair`` with the TokenSpeed mock."""
    return open_mock_engine_pair(runtime="tokenspeed", **kw)


#: An engine command (``python -c ENGINE_WITH_STUBBORN_WORKER INFO ADDRESS
#: [MOCK-ENGINE ARGS...]``): starts a worker in its process group that ignores
#: SIGTERM (as a wedged vLLM worker would), writes "ENGINE_PID PGID WORKER_PID"
#: to INFO, then becomes a mock engine dialing ADDRESS with the extra arguments.
ENGINE_WITH_STUBBORN_WORKER = r"""
import os, subprocess, sys
info, address = sys.argv[1], sys.argv[2]
worker = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 600"])
with open(info + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.getpgrp()} {worker.pid}")
os.rename(info + ".tmp", info)
os.execv(sys.executable, [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", address,
                          *sys.argv[3:]])
"""
