"""An image request through ``serve-grpc``'s TokenSpeedScheduler service and the TokenSpeed
mock engine: it streams; a bad placeholder is ``INVALID_ARGUMENT`` naming the field; float32
pixels reach the engine in the dtype its ready response gives as ``multimodal_encoder_dtype``."""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
import threading
from typing import Any

import grpc
import pytest
import trio
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as tpb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as tgrpc

from zmqdispatch import aio
from zmqdispatch.mock.server import MockEngineConfig, start_mock_engine
from zmqdispatch.servicer.facts import ModelFacts
from zmqdispatch.servicer.generate import TranslateOptions
from zmqdispatch.servicer.server import ServeOptions, open_server

from .procs import serve_grpc
from .test_cli_serve import MOCK


def image_request(rid: str, offset: int) -> tpb.GenerateRequest:
    return tpb.GenerateRequest(
        request_id=rid, tokenized=tpb.TokenizedInput(input_ids=[1, 9, 9, 9, 9, 2]),
        sampling_params=tpb.SamplingParams(max_new_tokens=3, ignore_eos=True), stream=True,
        mm_inputs=tpb.MultimodalInputs(items=[tpb.MultimodalItem(
            modality=common_pb2.IMAGE, content_hash=b"\x2a" * 8,
            encoder_input=tpb.TensorData(shape=[1, 3, 8, 8], dtype="float32",
                                         inline=struct.pack("<192f", *range(192))),
            placeholders=[tpb.PlaceholderRange(offset=offset, length=4)], placeholder_token_id=9)]),
    )


def test_an_image_request_streams_and_a_bad_placeholder_is_invalid_argument():
    with serve_grpc(*MOCK, "--runtime", "tokenspeed") as served, grpc.insecure_channel(served.address) as ch:
        stub = tgrpc.TokenSpeedSchedulerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(image_request("bad", 4)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mm_inputs.items[0].placeholders[0]" in info.value.details()
        assert "outside the prompt of 6 tokens" in info.value.details()
        out = list(stub.Generate(image_request("ok", 1)))
        complete = out[-1].complete
        assert complete.finish_reason == "length" and len(complete.output_ids) == 3
        assert complete.prompt_tokens == 6


class _ThreadedTokenSpeedMock:
    """The TokenSpeed mock engine in a trio run of its own thread (its state readable)."""

    def __init__(self, cfg: MockEngineConfig) -> None:
        self.cfg = cfg
        self.engine: Any = None
        self._token: Any = None
        self._cancel: trio.CancelScope | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._cancel:
            self._started.set()
            self.engine = await start_mock_engine(self.cfg, in_process=True)
            try:
                await self.engine.run()
            finally:
                self.engine.socks.close()

    def __enter__(self) -> _ThreadedTokenSpeedMock:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._cancel is not None
        trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
        self._thread.join(10)


def _serve_tokenspeed(encoder_dtype: str | None, body: Any) -> None:
    d = tempfile.mkdtemp(prefix="zqg-")
    addr = f"ipc://{d}/hs.sock"
    cfg = MockEngineConfig(handshake_address=addr, runtime="tokenspeed", step_interval=0.001,
                           multimodal_encoder_dtype=encoder_dtype)
    options = ServeOptions(facts=ModelFacts(served_model_name="m"), drain_grace=1,
                           translate=TranslateOptions(runtime="tokenspeed"))

    async def main() -> None:
        with _ThreadedTokenSpeedMock(cfg) as mock:
            async with aio.connect(addr) as client, open_server(client, options) as srv, \
                    grpc.aio.insecure_channel(srv.address) as ch:
                await body(tgrpc.TokenSpeedSchedulerStub(ch), mock.engine.core, client)

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


@pytest.mark.parametrize(("encoder_dtype", "model_dtype_sent"), [("bfloat16", "bfloat16"), ("float16", "float16"),
                                                                 (None, "float32")])
def test_float32_pixels_reach_the_engine_in_the_dtype_its_encoder_announced(encoder_dtype, model_dtype_sent):
    async def body(stub: Any, core: Any, client: Any) -> None:
        assert client.ready.multimodal_encoder_dtype == encoder_dtype  # read at the handshake
        assert client.ready.dtype == "float32"  # the mock's model dtype
        out = [r async for r in stub.Generate(image_request("cast", 1))]
        assert out[-1].complete.finish_reason == "length" and len(out[-1].complete.output_ids) == 3
        assert list(core.mm_features_received) == [("cast", model_dtype_sent, (1, 3, 8, 8))]
        assert core.mm_feature_bytes_received == 192 * (4 if model_dtype_sent == "float32" else 2)

    _serve_tokenspeed(encoder_dtype, body)


def test_another_float_dtype_than_the_encoders_is_invalid_argument_and_nothing_is_sent():
    async def body(stub: Any, core: Any, client: Any) -> None:
        req = image_request("f16", 1)
        req.mm_inputs.items[0].encoder_input.CopyFrom(tpb.TensorData(shape=[1, 3, 8, 8], dtype="float16",
                                                                     inline=bytes(384)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(req):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mm_inputs.items[0].encoder_input" in info.value.details() and "bfloat16" in info.value.details()
        assert core.requests_received == 0

    _serve_tokenspeed("bfloat16", body)


@pytest.mark.parametrize(("runtime", "dtype", "encoder", "expected"), [
    ("tokenspeed", "bfloat16", None, "bfloat16"),  # no encoder reported: the model dtype
    ("tokenspeed", "bfloat16", "float32", "float32"),  # the encoder's dtype wins
    ("tokenspeed", "float32", "", "float32"),
    ("vllm", "bfloat16", "float32", "bfloat16"),  # vLLM: the model dtype (it sends no encoder dtype)
    ("sglang", "bfloat16", "bfloat16", None),  # SGLang carries no multimodal input
])
def test_the_cast_dtype_per_runtime(runtime, dtype, encoder, expected):
    from types import SimpleNamespace

    from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    from zmqdispatch.servicer.server import ServicerCore

    client = SimpleNamespace(ready=SimpleNamespace(dtype=dtype, multimodal_encoder_dtype=encoder))
    core = ServicerCore(client, ServeOptions(facts=ModelFacts(served_model_name="m"),
                                             translate=TranslateOptions(runtime=runtime)))
    if runtime == "tokenspeed":
        mm, text = image_request("x", 1), tpb.GenerateRequest(request_id="t")
    elif runtime == "vllm":
        mm = vpb.GenerateRequest(request_id="x")
        mm.mm_inputs.pixel_values.dtype = "float32"
        text = vpb.GenerateRequest(request_id="t")
    else:
        mm = spb.GenerateRequest(request_id="x", mm_inputs=spb.MultimodalInputs(im_token_id=1))
        text = spb.GenerateRequest(request_id="t")
    assert core.mm_dtype(mm) == expected
    assert core.mm_dtype(text) is None  # a text request casts nothing
