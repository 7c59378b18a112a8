"""The mock engine takes multimodal ADDs: decodes ``mm_features`` and their aux frames,
keeps vLLM 0.32's LRU receiver cache, answers a miss with ``mm_cache_miss_hashes``,
refuses bad placeholders with an ERROR output, and streams tokens that depend on the
image."""

from __future__ import annotations

import struct

import attrs
import pytest
import trio

from zmqdispatch.errors import EngineRequestError, MultiModalCacheMissError
from zmqdispatch.mock.core import MockEngineCore
from zmqdispatch.testing import open_mock_engine_pair
from zmqdispatch.translate.multimodal import ReceiverCacheMirror
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire.tensors import Tensor
from zmqdispatch.wire.vllm_multimodal import (
    BatchedField,
    FieldElem,
    MultiModalFeatureSpec,
    PlaceholderRange,
    cache_item_size,
)

from ..helpers import GUARD, make_request

IM = 77


def feature(h: str, offset: int = 1, length: int = 4, *, data: bool = True, nbytes: int = 768,
            is_embed: Tensor | None = None) -> MultiModalFeatureSpec:
    d = {"pixel_values": FieldElem(Tensor("uint8", (nbytes,), bytes(nbytes)), BatchedField())} if data else None
    return MultiModalFeatureSpec(d, "image", h, PlaceholderRange(offset, length, is_embed), h)


PROMPT = (1, IM, IM, IM, IM, 2, IM, IM, IM, IM, 3)


def add(core: MockEngineCore, rid: str, feats) -> wire.FinishReason | tuple[str, ...] | None:
    out = core.add(make_request(rid, prompt=PROMPT, max_tokens=2), feats)
    if out is None:
        return None
    assert out.finish_reason == wire.FinishReason.ERROR and out.new_token_ids == ()
    return tuple(out.mm_cache_miss_hashes) if out.mm_cache_miss_hashes else out.finish_reason


def test_the_receiver_cache_stores_touches_evicts_and_reports_misses():
    size = cache_item_size(feature("x"))
    core = MockEngineCore(mm_cache_bytes=2 * size)
    assert add(core, "a", [feature("h0")]) is None
    assert add(core, "b", [feature("h0", data=False)]) is None  # held: a hit
    assert add(core, "c", [feature("h1", data=False), feature("h2", 6, data=False)]) == ("h1", "h2")
    assert add(core, "d", [feature("h1")]) is None
    assert list(core.mm_cache) == ["h0", "h1"]
    assert add(core, "e", [feature("h0", data=False), feature("h2", 6)]) is None  # h0 touched first: h1 goes
    assert list(core.mm_cache) == ["h0", "h2"] and core.mm_cache_used == 2 * size
    assert add(core, "f", [feature("h1", data=False)]) == ("h1",)
    # too big for the cache: served, not stored (and what it replaced is gone)
    assert add(core, "g", [feature("h0", nbytes=4 * size)]) is None
    assert list(core.mm_cache) == ["h2"]
    assert MockEngineCore(mm_cache_bytes=0).add(make_request("z", prompt=PROMPT), [feature("h0", data=False)]) \
        .mm_cache_miss_hashes == ("h0",)


@pytest.mark.parametrize("feats", [
    [feature("h0", 8, 4)],  # past the prompt of 11
    [feature("h0", 1, 0)],
    [feature("h0", 1, 4), feature("h1", 3, 4)],
    [feature("h0", is_embed=Tensor("bool", (3,), bytes(3)))],
])
def test_bad_placeholders_are_an_error_output_and_the_engine_serves_on(feats):
    core = MockEngineCore()
    assert add(core, "bad", feats) == wire.FinishReason.ERROR
    assert "bad" not in core.running
    assert add(core, "ok", [feature("h9")]) is None and "ok" in core.running


def test_tokens_depend_on_the_items_key():
    def first_tokens(h: str) -> tuple[int, ...]:
        core = MockEngineCore()
        core.add(make_request("r", prompt=PROMPT, max_tokens=3), [feature(h)])
        toks: list[int] = []
        while core.running:
            toks += [t for o in core.step() for t in o.new_token_ids]
        return tuple(toks)

    assert first_tokens("a") == first_tokens("a") != first_tokens("b")


def gateway_image(rid: str, h: str) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=list(PROMPT)),
                           sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=4))
    m = r.mm_inputs
    m.pixel_values.CopyFrom(pb.TensorData(shape=[2, 3, 8, 8], dtype="float32",
                                          inline=struct.pack("<384f", *range(384))))
    m.batched_keys.append("pixel_values")
    m.mm_placeholders.add(offset=1, length=4)
    m.mm_placeholders.add(offset=6, length=4)
    m.mm_hashes.extend([h, h + "-2"])
    return r


async def test_an_image_request_end_to_end_through_the_mock():
    async with open_mock_engine_pair() as (engine, client):
        with trio.fail_after(GUARD):
            config = TranslationConfig(max_model_len=client.max_model_len)
            mirror = ReceiverCacheMirror(4 << 30)
            outs = []
            for rid in ("i1", "i2"):
                req = mirror.apply_request(translate_request(gateway_image(rid, "img"), config).request)
                assert [m["data"] is None for m in req.mm_features] == [rid == "i2"] * 2
                async with client.generate(req) as s:
                    outs.append([t async for d in s for t in d.token_ids])
            assert len(outs[0]) == 4 and outs[0] == outs[1]
            assert engine.core.mm_items_received == 2 and list(engine.core.mm_cache) == ["img", "img-2"]
            # an item the engine never got, sent as a reference: a retryable miss, the engine serves on
            stale = mirror.apply_request(translate_request(gateway_image("i3", "img"), config).request)
            stale = attrs.evolve(stale, mm_features=[{**m, "identifier": "other", "mm_hash": "other"}
                                                     for m in stale.mm_features[:1]])
            with pytest.raises(MultiModalCacheMissError) as ei:
                async with client.generate(stale) as s:
                    async for _ in s:
                        pass
            assert ei.value.mm_hashes == ("other",) and isinstance(ei.value, EngineRequestError)
            async with client.generate(make_request("after", max_tokens=2)) as s:
                assert len([t async for d in s for t in d.token_ids]) == 2
