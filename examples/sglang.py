"""The same transport to an SGLang scheduler (SGLang behind the SGLang plugin of
smg-grpc-servicer): its own proto package (`sglang.grpc.scheduler`), logprobs
with ranked candidates, the same fan-out, a named stop (a stop token id the
complete names in `matched_token_id`), and the control calls SGLang answers.

    python examples/sglang.py [HANDSHAKE_ADDRESS]
"""

import sys
from typing import Any

import trio

from zmqdispatch import (
    EngineClient,
    SGLangTranslationConfig,
    connect,
    translate_sglang_samples,
)
from zmqdispatch import sglang_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--runtime", "sglang",
        "--handshake-address", "{handshake_address}"]


async def run(client: EngineClient, req: Any, config: SGLangTranslationConfig) -> list[tuple[int, Any]]:
    """Every sample of *req*: ``[(index, complete)]``, by index."""
    samples = translate_sglang_samples(req, config)
    builders = [s.response_builder() for s in samples]
    completes: list[tuple[int, Any]] = []
    async with client.generate_samples([s.request for s in samples]) as merged:
        async for index, delta in merged:
            for response in builders[index].feed(delta):
                if response.HasField("complete"):
                    completes.append((index, response.complete))
    return sorted(completes, key=lambda item: item[0])


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with connect(handshake_address, launch=launch, runtime="sglang") as client:
        print("engine:", client.engine().engine_version.engine_name)
        req = pb.GenerateRequest(
            request_id="r1",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(max_new_tokens=8, n=2, temperature=0.7),
            return_logprob=True,
            logprob_start_len=-1,  # no prompt logprobs (proto3's 0 would ask for them)
            top_logprobs_num=2,
        )
        config = SGLangTranslationConfig(max_model_len=client.max_model_len)
        completes = await run(client, req, config)
        for index, c in completes:
            tops = len(c.output_logprobs.top_logprobs[0].token_ids)
            print(index, list(c.output_ids), c.finish_reason, f"{tops} candidates per token")
        # A named stop: the scheduler ends the sample at a stop token id (here the
        # fourth token of the run above) and the complete names it.
        stop_at = list(completes[0][1].output_ids)[3]
        stopped = pb.GenerateRequest(
            request_id="r2",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(max_new_tokens=8, temperature=0.7, stop_token_ids=[stop_at]),
        )
        for _, c in await run(client, stopped, config):
            print("named stop:", list(c.output_ids), c.finish_reason, "matched_token_id", c.matched_token_id)
        print("flush_cache:", repr(await client.flush_cache()))
        print("start_profile:", repr(await client.start_profile(output_dir="/tmp/sglang-profile", num_steps=3)))
        print("stop_profile:", repr(await client.stop_profile()))


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
