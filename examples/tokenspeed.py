"""The same transport to a TokenSpeed scheduler (`ts serve --headless`): its own
proto package, its own request and response builder, the same fan-out.

    python examples/tokenspeed.py [HANDSHAKE_ADDRESS]
"""

import sys

import trio

from zmqdispatch import (
    TokenSpeedTranslationConfig,
    connect,
    translate_tokenspeed_samples,
)
from zmqdispatch import tokenspeed_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--runtime", "tokenspeed",
        "--handshake-address", "{handshake_address}"]


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with connect(handshake_address, launch=launch, runtime="tokenspeed") as client:
        req = pb.GenerateRequest(
            request_id="r1",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(max_new_tokens=8, n=2, temperature=0.7),
        )
        samples = translate_tokenspeed_samples(req, TokenSpeedTranslationConfig(max_model_len=client.max_model_len))
        builders = [s.response_builder() for s in samples]
        async with client.generate_samples([s.request for s in samples]) as merged:
            async for index, delta in merged:
                for response in builders[index].feed(delta):
                    if response.HasField("complete"):
                        print(index, list(response.complete.output_ids), response.complete.finish_reason)


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
