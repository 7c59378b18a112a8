"""One request from asyncio: the same client and streams as the trio API, under
asyncio's default loop or uvloop (``zmqdispatch.aio``).

    python examples/asyncio_generate.py                          # launches the mock engine
    python examples/asyncio_generate.py tcp://127.0.0.1:29550    # an engine that dials that address
"""

import asyncio
import sys

from zmqdispatch import VllmTranslationConfig, aio, translate_vllm_request
from zmqdispatch import vllm_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with aio.connect(handshake_address, launch=launch) as client:  # trio runs as this loop's guest
        config = VllmTranslationConfig(max_model_len=client.max_model_len, eos_token_ids=(2,))
        req = pb.GenerateRequest(
            request_id="r1",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, 4, 5]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8),
            stream=True,
        )
        t = translate_vllm_request(req, config)
        builder = t.response_builder()
        async with client.generate(t.request) as stream:  # leaving early or a cancelled task aborts it
            async for delta in stream:  # the same OutputDelta and errors as in trio
                for response in builder.feed(delta):
                    ids = response.chunk.token_ids or response.complete.output_ids
                    print(response.WhichOneof("response"), list(ids))

        # four at once, each from its own asyncio task
        async def one(i: int) -> int:
            r = pb.GenerateRequest(request_id=f"t{i}", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                                   sampling_params=pb.SamplingParams(max_tokens=4), stream=True)
            async with client.generate(translate_vllm_request(r, config).request) as s:
                return sum([len(d.token_ids) async for d in s])

        print("tokens per task:", await asyncio.gather(*(one(i) for i in range(4))))


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:  # the `asyncio` extra installs it; asyncio's own loop works the same
        asyncio.run(main(*sys.argv[1:2]))
    else:
        uvloop.run(main(*sys.argv[1:2]))
