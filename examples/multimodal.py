"""One image request: the gateway's preprocessed pixel values and placeholder in,
tokens out; then the same image again, sent as a reference the engine's receiver
cache resolves (no pixel bytes on the wire the second time).

    python examples/multimodal.py                          # launches the mock engine
    python examples/multimodal.py tcp://127.0.0.1:29550    # an engine that dials that address
"""

import array
import sys

import trio

from zmqdispatch import VllmTranslationConfig, connect, translate_vllm_request
from zmqdispatch import vllm_pb as pb
from zmqdispatch.translate.multimodal import ReceiverCacheMirror

MOCK = [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", "{handshake_address}"]
IMAGE_TOKEN = 31_999  # the image placeholder id (inside the mock engine's 32,000-token vocabulary)


def image_request(rid: str) -> pb.GenerateRequest:
    pixels = array.array("f", (i % 255 / 255.0 for i in range(3 * 32 * 32)))  # [1, 3, 32, 32] float32
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[1, 4, *[IMAGE_TOKEN] * 16, 5, 6]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8),
    )
    mm = req.mm_inputs
    mm.pixel_values.CopyFrom(pb.TensorData(shape=[1, 3, 32, 32], dtype="float32", inline=pixels.tobytes()))
    mm.batched_keys.append("pixel_values")  # one row per image
    mm.mm_placeholders.add(offset=2, length=16)
    mm.mm_hashes.append("3f9a0c")  # the gateway's content hash: the engine's cache key
    mm.im_token_id = IMAGE_TOKEN
    return req


async def main(handshake_address: str | None = None) -> None:
    launch = None if handshake_address else MOCK
    async with connect(handshake_address, launch=launch) as client:
        # mm_dtype: float32 pixels are cast to the model's dtype (the engine casts nothing)
        config = VllmTranslationConfig(max_model_len=client.max_model_len, mm_dtype=client.ready.dtype or None)
        # what the engine's LRU receiver cache holds (vLLM's default capacity: 4 GiB)
        mirror = ReceiverCacheMirror(4 << 30)
        for rid in ("img-1", "img-2"):
            t = translate_vllm_request(image_request(rid), config)  # RequestRejected names a bad field
            request = mirror.apply_request(t.request)  # data nil for an item the engine holds
            tokens: list[int] = []
            async with client.generate(request) as stream:
                async for delta in stream:
                    tokens += delta.token_ids
            sent = "pixels" if request.mm_features[0]["data"] is not None else "a cache reference"
            print(f"{rid}: sent {sent}, tokens {tokens}")


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:2])
