"""n > 1: one engine request per sample, merged by index, aborted together.

    python examples/parallel_samples.py [HANDSHAKE_ADDRESS]
"""

import sys

import trio

from zmqdispatch import VllmTranslationConfig, connect, translate_vllm_samples
from zmqdispatch import vllm_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


async def main(handshake_address: str | None = None) -> None:
    async with connect(handshake_address, launch=None if handshake_address else MOCK) as client:
        req = pb.GenerateRequest(
            request_id="r1",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=6),
        )
        samples = translate_vllm_samples(req, VllmTranslationConfig(max_model_len=client.max_model_len))
        builders = [s.response_builder() for s in samples]  # ids r1-0, r1-1, r1-2; seeds 7, 8, 9
        async with client.generate_samples([s.request for s in samples]) as merged:
            async for index, delta in merged:  # in order per sample; leaving early aborts every live one
                for response in builders[index].feed(delta):
                    if response.HasField("complete"):
                        print(index, list(response.complete.output_ids), response.complete.finish_reason)


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
