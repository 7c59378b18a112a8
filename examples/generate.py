"""One request, streamed: a gateway's GenerateRequest in, GenerateResponse chunks out.

    python examples/generate.py                          # launches the mock engine
    python examples/generate.py tcp://127.0.0.1:29550    # an engine that dials that address
                                                         # (vllm serve --headless, zmqdispatch mock-engine)
"""

import sys

import trio

from zmqdispatch import VllmTranslationConfig, connect, translate_vllm_request
from zmqdispatch import vllm_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with connect(handshake_address, launch=launch) as client:  # binds, handshakes the engine
        config = VllmTranslationConfig(max_model_len=client.max_model_len, eos_token_ids=(2,))
        req = pb.GenerateRequest(
            request_id="r1",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, 4, 5]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8),
            stream=True,
        )
        t = translate_vllm_request(req, config)  # RequestRejected names a field the engine would refuse
        builder = t.response_builder()
        async with client.generate(t.request) as stream:  # leaving the block early aborts the request
            async for delta in stream:  # OutputDelta: the new tokens (merged if the reader lags)
                for response in builder.feed(delta):  # GenerateResponse: chunks, then one complete
                    ids = response.chunk.token_ids or response.complete.output_ids
                    print(response.WhichOneof("response"), list(ids))


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
