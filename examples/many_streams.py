"""Many requests read by one task: a StreamGroup delivers every ready stream's
delta in one batch per wake-up (an HTTP/2 connection, a batching front end).

    python examples/many_streams.py [HANDSHAKE_ADDRESS]
"""

import sys

import trio

from zmqdispatch import connect
from zmqdispatch.multiplex import open_stream_group
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


async def main(handshake_address: str | None = None) -> None:
    async with connect(handshake_address, launch=None if handshake_address else MOCK) as client:
        config = TranslationConfig(max_model_len=client.max_model_len)
        tokens: dict[str, int] = {}
        async with open_stream_group(client) as group:  # leaving the block aborts what is still live
            for i in range(100):
                req = pb.GenerateRequest(request_id=f"r{i}", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3 + i]),
                                         sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=16))
                group.generate(translate_request(req, config).request)
            async for batch in group:  # [(request_id, OutputDelta or the error that ended it)]
                for request_id, item in batch:
                    if isinstance(item, Exception):
                        print(request_id, "failed:", item)
                    else:
                        tokens[request_id] = tokens.get(request_id, 0) + len(item.token_ids)
                if not len(group):  # every request delivered its end
                    break
        print(len(tokens), "requests,", sum(tokens.values()), "tokens")


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
