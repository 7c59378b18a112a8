"""An image request to a TokenSpeed scheduler: the gateway's preprocessed pixel values and
placeholders become `multimodal_inputs` (the tensor as an aux frame) and the prompt is sent
with each placeholder run set to the image's pad value, as TokenSpeed's msgpack ingest
expects; then a video request, refused by name before anything is sent.

    python examples/tokenspeed_multimodal.py                 # launches the TokenSpeed mock engine
    python examples/tokenspeed_multimodal.py HANDSHAKE_ADDR  # a scheduler that dials that address
"""

import array
import sys

import trio
from smg_grpc_proto.generated import common_pb2

from zmqdispatch import RequestRejected, TokenSpeedTranslationConfig, connect, translate_tokenspeed_request
from zmqdispatch import tokenspeed_pb as pb

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--runtime", "tokenspeed",
        "--handshake-address", "{handshake_address}"]
IMAGE_TOKEN = 31_999  # the image placeholder id the gateway expanded in the prompt


def image_request(rid: str, modality: int = common_pb2.IMAGE) -> pb.GenerateRequest:
    pixels = array.array("f", (i % 255 / 255.0 for i in range(4 * 588)))  # [4, 588] float32 patches
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[1, 4, *[IMAGE_TOKEN] * 4, 5, 6]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=8),
    )
    req.mm_inputs.items.add(
        modality=modality,
        content_hash=bytes.fromhex("3f9a0c11d2e45b67"),  # the gateway's content hash
        encoder_input=pb.TensorData(shape=[4, 588], dtype="float32", inline=pixels.tobytes()),
        placeholders=[pb.PlaceholderRange(offset=2, length=4)],  # one embedding per patch
        placeholder_token_id=IMAGE_TOKEN,
    )
    return req


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with connect(handshake_address, launch=launch, runtime="tokenspeed") as client:
        config = TokenSpeedTranslationConfig(max_model_len=client.max_model_len)
        t = translate_tokenspeed_request(image_request("img-1"), config)
        print(f"img-1: input_ids {list(t.request.input_ids)}")  # the pad value over the placeholders
        tokens: list[int] = []
        async with client.generate(t.request) as stream:
            async for delta in stream:
                tokens += delta.token_ids
        print(f"img-1: tokens {tokens}")
        try:
            translate_tokenspeed_request(image_request("vid-1", common_pb2.VIDEO), config)
        except RequestRejected as exc:
            print(f"vid-1: refused, field {exc.field}")


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
