"""An image request through ``serve-grpc``'s servicer: a gateway's ``mm_inputs`` reach
the engine as ``mm_features`` and stream back; a bad placeholder is
``INVALID_ARGUMENT`` naming the field, and nothing reaches the engine."""

from __future__ import annotations

import queue
import struct

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from .test_servicer import _get, _serve


def image_request(rid: str, offset: int) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 9, 9, 9, 9, 2]),
                           sampling_params=pb.SamplingParams(max_tokens=3), stream=True)
    m = r.mm_inputs
    m.pixel_values.CopyFrom(pb.TensorData(shape=[1, 3, 8, 8], dtype="float32",
                                          inline=struct.pack("<192f", *range(192))))
    m.batched_keys.append("pixel_values")
    m.mm_placeholders.add(offset=offset, length=4)
    m.mm_hashes.append("h")
    return r


def test_an_image_request_streams_and_a_bad_placeholder_is_invalid_argument():
    async def body(stub, engine, srv, client):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(image_request("bad", 4)):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mm_inputs.mm_placeholders[0]" in info.value.details()
        assert "outside the prompt of 6 tokens" in info.value.details()
        tokens = [t async for r in stub.Generate(image_request("ok", 1)) for t in r.chunk.token_ids]
        assert tokens == [7, 7, 7]
        assert await _get(engine.adds) == "ok"  # the first ADD the engine saw
        with pytest.raises(queue.Empty):
            engine.adds.get_nowait()

    _serve(body)


def test_float32_pixels_are_cast_to_the_engines_model_dtype():
    async def body(stub, engine, srv, client):
        tokens = [t async for r in stub.Generate(image_request("cast", 1)) for t in r.chunk.token_ids]
        assert tokens == [7, 7, 7]
        (feature,), frames = await _get(engine.mm_features)
        dtype, shape, aux = feature["data"]["pixel_values"]["data"]  # [dtype, shape, aux frame index]
        assert (dtype, shape) == ("bfloat16", [3, 8, 8])
        # frames: [type, payload, *aux]; bfloat16 is float32's upper half: 0..191 are exact
        halves = struct.unpack("<192H", frames[1 + aux])
        assert [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves] == list(range(192))

    _serve(body, dtype="bfloat16")
