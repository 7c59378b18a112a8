"""Many requests read by one task: a StreamGroup delivers every ready stream's
delta in one batch per wake-up (an HTTP/2 connection, a batching front end).

    python examples/many_streams.py [HANDSHAKE_ADDRESS]
"""

import sys

import trio

from zmqdispatch import (
    OutputDelta,
    VllmTranslationConfig,
    connect,
    translate_vllm_request,
)
from zmqdispatch import vllm_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


async def main(handshake_address: str | None = None) -> None:
    async with connect(handshake_address, launch=None if handshake_address else MOCK) as client:
        config = VllmTranslationConfig(max_model_len=client.max_model_len)
        tokens: dict[str, int] = {}
        async with client.stream_group() as group:  # leaving the block aborts what is still live
            for i in range(100):
                req = pb.GenerateRequest(request_id=f"r{i}", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3 + i]),
                                         sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=16))
                group.generate(translate_vllm_request(req, config).request)  # returns the member's handle
            async for batch in group:  # [(member, OutputDelta or the typed error that ended it)]
                for member, item in batch:
                    if isinstance(item, OutputDelta):
                        tokens[member.request_id] = tokens.get(member.request_id, 0) + len(item.token_ids)
                    else:  # this request is done; the others go on
                        print(member.request_id, "failed:", item)
                if not len(group):  # every request delivered its end
                    break
        print(len(tokens), "requests,", sum(tokens.values()), "tokens")


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
