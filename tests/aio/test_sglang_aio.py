"""The asyncio API against the SGLang mock scheduler program: a request streams,
and the SGLang control calls answer (under both loops)."""

from __future__ import annotations

import sys

from zmqdispatch import UtilityCallError, aio
from zmqdispatch.wire import sglang as sg
from zmqdispatch.wire.vllm import FinishReason

from .conftest import Runner

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--runtime", "sglang",
        "--handshake-address", "{handshake_address}"]


def test_generate_and_control_calls(run: Runner) -> None:
    async def main() -> None:
        async with aio.connect(launch=MOCK, runtime="sglang") as client:
            req = sg.TokenizedGenerateReqInput(rid="a1", input_ids=(1, 2, 3), stream=True,
                                               sampling_params=sg.SGLangSamplingParams(max_new_tokens=5))
            async with client.generate(req) as stream:
                deltas = [d async for d in stream]
            assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finish_reason is FinishReason.LENGTH
            assert await client.flush_cache() == ""
            assert await client.start_profile(num_steps=2) == ""
            assert await client.stop_profile() == ""
            try:
                await client.stop_profile()
            except UtilityCallError as exc:
                assert "not in progress" in str(exc)
            else:  # pragma: no cover
                raise AssertionError("a second stop_profile succeeded")

    run(main)
