"""Many engines behind one client: data-parallel ranks on one handshake, placed by load.

    python examples/many_engines.py                          # launches a mock with 2 ranks
    python examples/many_engines.py tcp://127.0.0.1:29550    # vllm serve --headless --data-parallel-size 2
                                                             # --data-parallel-address 127.0.0.1
                                                             # --data-parallel-rpc-port 29550

Eight requests are spread over the ranks (least loaded, ties broken at random); one is pinned to
rank 1 with `data_parallel_rank`; rank 0 is then drained. docs/many-engines.md has the rules.
"""

import sys
from collections import Counter

import trio

from zmqdispatch import VllmTranslationConfig, connect, translate_vllm_request
from zmqdispatch import vllm_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}",
        "--data-parallel-size", "2"]


def request(request_id: str, data_parallel_rank: int | None = None) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3, 4, 5]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8),
        data_parallel_rank=data_parallel_rank,
        stream=True,
    )


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with connect(handshake_address, launch=launch, data_parallel_size=2) as client:
        config = VllmTranslationConfig(max_model_len=client.max_model_len)
        placed: Counter[int] = Counter()

        async def run(req: pb.GenerateRequest) -> None:
            t = translate_vllm_request(req, config)
            async with client.generate(t.request) as stream:  # placed on an engine when entered
                engine = client.engine_of(req.request_id)
                tokens = [tok async for delta in stream for tok in delta.token_ids]
            placed[engine] += 1
            if req.HasField("data_parallel_rank"):
                print(f"request {req.request_id!r} pinned to rank {engine}: {len(tokens)} tokens")

        async with trio.open_nursery() as nursery:  # eight at once: spread over both ranks
            for i in range(8):
                nursery.start_soon(run, request(f"r{i}"))
        await run(request("pinned", data_parallel_rank=1))
        print("requests per engine:", dict(sorted(placed.items())))
        await client.drain(0)  # nothing new on rank 0; returns once its requests ended
        print("states:", [(s.engine_index, s.state.value) for s in client.states()])


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
