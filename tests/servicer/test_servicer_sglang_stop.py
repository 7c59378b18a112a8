"""A stop string through ``serve-grpc``'s SglangScheduler service and the SGLang mock: the
scheduler matches it (the servicer runs no matcher), the complete names it in
``matched_stop_str`` and keeps the token that completed it."""

from __future__ import annotations

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgrpc

from zmqdispatch.mock.core import mock_text, mock_token

from .procs import serve_grpc
from .test_cli_serve import MOCK


def test_a_stop_string_ends_the_stream_with_stop_and_matched_stop_str():
    h = (((1 * 31) + 2) * 31 + 3) & 0xFFFFFFFF
    tokens = [mock_token(h, k, 0, 32_000) for k in range(12)]
    text = mock_text(tokens)
    stop = text[3:6]
    kept = text.find(stop) + len(stop)  # a match is seen as soon as its last token arrives
    with serve_grpc(*MOCK, "--runtime", "sglang") as served, grpc.insecure_channel(served.address) as ch:
        stub = sgrpc.SglangSchedulerStub(ch)
        req = spb.GenerateRequest(request_id="st", tokenized=spb.TokenizedInput(input_ids=[1, 2, 3]),
                                  sampling_params=spb.SamplingParams(max_new_tokens=12, stop=["zzzzzzzzzzzzz", stop]),
                                  stream=True)
        out = list(stub.Generate(req))
        complete = out[-1].complete
        assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
        assert complete.WhichOneof("matched_stop") == "matched_stop_str"
        assert list(complete.output_ids) == tokens[:kept] and complete.completion_tokens == kept
        assert [t for r in out[:-1] for t in r.chunk.token_ids] == tokens[:kept]
