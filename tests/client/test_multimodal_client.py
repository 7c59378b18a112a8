"""Multimodal requests through the client against the scripted engine.

The ADD carries ``mm_features`` with the pixel tensor as an aux frame; a request the
engine could not take is refused by field and nothing is sent; the engine's receiver
cache missing an item sent with data nil (``FinishReason.ERROR`` +
``mm_cache_miss_hashes``) is :class:`MultiModalCacheMissError`, the client and other
requests unaffected, and a resend after ``ReceiverCacheMirror.invalidate`` carries the
data again."""

from __future__ import annotations

import struct

import attrs
import pytest
import trio

from zmqdispatch import RequestRejected
from zmqdispatch.errors import EngineRequestError, MultiModalCacheMissError
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.translate.multimodal import ReceiverCacheMirror
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine
from zmqdispatch.wire.tensors import Tensor
from zmqdispatch.wire.vllm_multimodal import (
    BatchedField,
    FieldElem,
    MultiModalFeatureSpec,
    PlaceholderRange,
    decode_mm_features,
    features_to_wire,
)

from ..helpers import GUARD, make_request

ERROR = wire.FinishReason.ERROR
PIXELS = struct.pack("<192f", *range(192))  # [3, 8, 8] float32: 768 B, an aux frame


def image(h: str, offset: int = 1) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec({"pixel_values": FieldElem(Tensor("float32", (3, 8, 8), PIXELS), BatchedField())},
                                 "image", h, PlaceholderRange(offset, 4), h)


def mm_request(rid: str, features) -> wire.EngineCoreRequest:
    return attrs.evolve(make_request(rid, prompt=(1, 9, 9, 9, 9, 2, 9, 9, 9, 9, 3), max_tokens=4),
                        mm_features=features_to_wire(features))


async def next_add(engine):
    msg = await engine.receive()
    assert msg.kind == wire.RequestType.ADD
    frames = msg.frames[1:]
    return msg.value, decode_mm_features(msg.value.mm_features, frames), frames


async def test_an_image_request_goes_with_its_tensor_as_an_aux_frame_and_streams():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(mm_request("m1", [image("h0")])) as s:
                req, feats, frames = await next_add(engine)
                assert len(frames) == 2 and bytes(frames[1]) == PIXELS
                assert feats[0].data["pixel_values"].data.tolist()[0][0][:3] == [0.0, 1.0, 2.0]
                assert (feats[0].mm_position.offset, feats[0].mm_hash) == (1, "h0")
                await engine.send_tokens("m1", [5, 6], finish=wire.FinishReason.LENGTH)
                assert [list(d.token_ids) async for d in s] == [[5, 6]]


@pytest.mark.parametrize("features, words", [
    ([{"data": None, "modality": "image", "identifier": "h", "mm_position": {"offset": 9, "length": 4,
                                                                            "is_embed": None}, "mm_hash": "h"}],
     "[9, 13) must be a non-empty range inside the prompt of 11 tokens"),
    ([{"data": {"pixel_values": {"data": Tensor("<f4", (2,), bytes(8)), "field": ["batched", {}]}},
       "modality": "image", "identifier": "h", "mm_position": {"offset": 1, "length": 4, "is_embed": None},
       "mm_hash": "h"}], "numpy's spelling"),
    ([{"data": {"pixel_values": {"data": Tensor("float32", (3,), bytes(8)), "field": ["batched", {}]}},
       "modality": "image", "identifier": "h", "mm_position": {"offset": 1, "length": 4, "is_embed": None},
       "mm_hash": "h"}], "data holds 8 bytes; shape [3] of float32 needs 12"),
    ([{"data": {"pixel_values": {"data": 1.0, "field": ["ragged", {}]}}, "modality": "image", "identifier": "h",
       "mm_position": {"offset": 1, "length": 4, "is_embed": None}, "mm_hash": "h"}], "unknown field factory"),
    (None, "overlaps a placeholder ending at 5"),
])
async def test_what_the_engine_cannot_take_is_refused_and_nothing_is_sent(features, words):
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            if features is None:
                bad = mm_request("bad", [image("a", 1), image("b", 3)])
            else:
                bad = attrs.evolve(mm_request("bad", []), mm_features=features)
            with pytest.raises(RequestRejected) as ei:
                async with client.generate(bad) as s:
                    async for _ in s:
                        pass
            assert ei.value.field == "mm_features" and words in str(ei.value)
            # the next message the engine sees is the next request: nothing of "bad" went out
            async with client.generate(make_request("ok", max_tokens=1)) as s:
                assert (await engine.receive_add()).request_id == "ok"
                await engine.send_tokens("ok", [1], finish=wire.FinishReason.LENGTH)
                assert [list(d.token_ids) async for d in s] == [[1]]


async def test_a_receiver_cache_miss_is_a_retryable_error_and_a_resend_carries_the_data():
    mirror = ReceiverCacheMirror(1 << 20)
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            # the first request stores h0 (the engine holds it from now on, as far as we know)
            assert [f.data is not None for f in mirror.apply([image("h0")])] == [True]
            # the engine restarted its cache behind our back: h0 goes nil and misses
            feats = mirror.apply([image("h0"), image("h1", 6)])
            assert [f.data is None for f in feats] == [True, False]
            async with client.generate(make_request("bystander", max_tokens=8)) as other, \
                    client.generate(mm_request("m2", feats)) as s:
                adds = {}
                for _ in range(2):
                    req, got, frames = await next_add(engine)
                    adds[req.request_id] = (got, frames)
                got, frames = adds["m2"]
                assert got[0].data is None and got[1].data is not None and len(frames) == 2
                await engine.send_outputs(
                    [wire_engine.EngineCoreOutput(request_id="m2", new_token_ids=(), finish_reason=ERROR,
                                                  mm_cache_miss_hashes=("h0",))],
                    finished_requests=["m2"])
                with pytest.raises(MultiModalCacheMissError) as ei:
                    async for _ in s:
                        pass
                err = ei.value
                assert isinstance(err, EngineRequestError) and err.retryable is True and err.code == "mm_cache_miss"
                assert err.mm_hashes == ("h0",) and err.request_id == "m2" and "'h0'" in str(err)
                # the other request and the client are unaffected
                await engine.send_tokens("bystander", [7], finish=wire.FinishReason.LENGTH)
                assert [list(d.token_ids) async for d in other] == [[7]]
            assert client.is_alive and client.protocol.inflight == 0
            mirror.invalidate(err.mm_hashes)
            assert "h0" not in mirror and "h1" in mirror
            again = mirror.apply([image("h0"), image("h1", 6)])
            assert [f.data is None for f in again] == [False, True]
            async with client.generate(mm_request("m2", again)) as s:
                _, got, frames = await next_add(engine)
                assert got[0].data is not None and got[1].data is None and len(frames) == 2
                await engine.send_tokens("m2", [4], finish=wire.FinishReason.LENGTH)
                assert [list(d.token_ids) async for d in s] == [[4]]


async def test_an_error_row_without_miss_hashes_stays_a_plain_engine_error():
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.generate(mm_request("m3", [image("h0")])) as s:
                await engine.receive_add()
                await engine.send_outputs(
                    [wire_engine.EngineCoreOutput(request_id="m3", new_token_ids=(), finish_reason=ERROR,
                                                  mm_cache_miss_hashes=())], finished_requests=["m3"])
                with pytest.raises(EngineRequestError) as ei:
                    async for _ in s:
                        pass
                assert type(ei.value) is EngineRequestError
