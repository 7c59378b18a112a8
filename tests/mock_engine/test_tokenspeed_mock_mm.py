"""The TokenSpeed mock engine takes multimodal ADDs: decoded as TokenSpeed decodes them,
pad ids exempt from the embedding-table check, the image's hash in the tokens; a bad
multimodal request is refused on the client and never reaches the engine."""

from __future__ import annotations

import struct

import attrs
import pytest
import trio
from smg_grpc_proto.generated import common_pb2

from zmqdispatch.errors import RemoteProtocolError, RequestRejected
from zmqdispatch.mock.tokenspeed_core import MockTokenSpeedScheduler, embedding_fault, typed_multimodal
from zmqdispatch.translate.tokenspeed import TranslationConfig, pb, translate_request
from zmqdispatch.wire import tokenspeed as ts
from zmqdispatch.wire import tokenspeed_engine as ts_engine

from ..helpers import GUARD, make_ts_request, tokenspeed_pair

VOCAB = 32_000
PIXELS = struct.pack("<128f", *range(128))  # 512 bytes: an aux frame


def gateway_request(rid: str = "mm1", content_hash: bytes = b"\x07" * 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[1, 5, 5, 5, 5, 2]),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=4),
        mm_inputs=pb.MultimodalInputs(items=[pb.MultimodalItem(
            modality=common_pb2.IMAGE, content_hash=content_hash,
            encoder_input=pb.TensorData(shape=[4, 32], dtype="float32", inline=PIXELS),
            placeholders=[pb.PlaceholderRange(offset=1, length=4)], placeholder_token_id=5)]),
    )


def translated(**kw) -> ts.TokenizedGenerateReqInput:
    return translate_request(gateway_request(**kw), TranslationConfig(max_model_len=1024, vocab_size=VOCAB)).request


async def tokens_of(client, req) -> list[int]:
    out = []
    async with client.generate(req) as stream:
        async for delta in stream:
            out += delta.token_ids
    return out


async def test_a_multimodal_request_runs_on_the_mock_engine():
    with trio.fail_after(GUARD):
        async with tokenspeed_pair(vocab_size=VOCAB) as (engine, client):
            a = await tokens_of(client, translated(rid="a"))
            same = await tokens_of(client, translated(rid="b"))
            other = await tokens_of(client, translated(rid="c", content_hash=b"\x08" * 8))
            assert len(a) == 4 and a == same  # greedy, same image: same tokens
            assert other != a  # another image's pad ids: other tokens, as on the real engine
            stats = engine.core.stats()
            assert stats["mm_items_received"] == 3 and stats["mm_feature_bytes_received"] == 3 * len(PIXELS)
            assert engine.dropped == 0 and engine.fatal is None
            assert await tokens_of(client, make_ts_request("text")) != []  # and text requests still run


async def test_a_bad_multimodal_request_is_refused_before_sending_and_the_connection_lives_on():
    good = translated()
    unpadded = attrs.evolve(good, rid="bad", input_ids=good.input_ids_unpadded)
    with trio.fail_after(GUARD):
        async with tokenspeed_pair(vocab_size=VOCAB) as (engine, client):
            with pytest.raises(RequestRejected, match="input_ids") as ei:
                client.generate(unpadded)
            assert ei.value.field == "input_ids"
            assert engine.core.requests_received == 0
            assert len(await tokens_of(client, good)) == 4
            assert engine.core.requests_received == 1


def test_the_mock_reads_the_items_as_tokenspeed_does_and_drops_a_truncated_frame():
    frames = ts.encode_add(translated())
    req = typed_multimodal(ts_engine.decode_input([b"\x00", *frames])[1], frames)
    assert isinstance(req.multimodal_inputs, ts.MultimodalInputs)
    assert bytes(req.multimodal_inputs.mm_items[0].feature.data) == PIXELS
    core = MockTokenSpeedScheduler(vocab_size=VOCAB)
    assert core.add(req) is None and core.mm_items_received == 1
    short = [frames[0], bytes(frames[1])[:-4]]
    with pytest.raises(RemoteProtocolError, match="508 bytes"):
        typed_multimodal(ts_engine.decode_input([b"\x00", *short])[1], short)


def test_pad_ids_are_exempt_from_the_embedding_check_only_inside_the_ranges():
    req = typed_multimodal(ts_engine.decode_add(frames := ts.encode_add(translated())), frames)
    assert embedding_fault(req, VOCAB) is None
    pad = req.input_ids[1]
    outside = attrs.evolve(req, input_ids=(pad, *req.input_ids[1:]))
    assert embedding_fault(outside, VOCAB) == 0
    text = make_ts_request(prompt=(1, VOCAB))
    assert embedding_fault(text, VOCAB) == 1


def test_cli_runs_a_multimodal_request_file_and_refuses_a_bad_one(tmp_path):
    """The gateway's JSON (bytes base64, as protobuf's JSON mapping has them) through
    ``zmqdispatch generate --runtime tokenspeed`` and the mock engine process."""
    import base64
    import json

    from .test_cli_and_mock import lines, run_cli

    req = {
        "request_id": "cli-mm",
        "tokenized": {"input_ids": [1, 5, 5, 5, 5, 2]},
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
        "mm_inputs": {"items": [{
            "modality": "IMAGE", "content_hash": base64.b64encode(b"\x07" * 8).decode(),
            "encoder_input": {"shape": [4, 32], "dtype": "float32", "inline": base64.b64encode(PIXELS).decode()},
            "placeholders": [{"offset": 1, "length": 4}], "placeholder_token_id": 5,
        }]},
    }
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    p = run_cli("generate", "--runtime", "tokenspeed", "--request", str(path))
    assert p.returncode == 0, p.stderr
    (complete,) = [m["complete"] for m in lines(p.stdout) if "complete" in m]
    assert len(complete["output_ids"]) == 3 and complete["prompt_tokens"] == 6
    req["mm_inputs"]["items"][0]["placeholders"] = [{"offset": 4, "length": 4}]
    path.write_text(json.dumps(req))
    p = run_cli("generate", "--runtime", "tokenspeed", "--request", str(path))
    assert p.returncode == 2 and "mm_inputs.items[0].placeholders[0]" in p.stderr
    assert "outside the prompt of 6 tokens" in p.stderr
