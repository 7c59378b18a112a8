#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of every decoder of vLLM engine bytes.

The engine's bytes are untrusted: each decoder may raise only
``zmqdispatch.errors.RemoteProtocolError``; anything else (or a hang, or an
allocation beyond :mod:`zmqdispatch.limits`) is a finding. The input's first
byte picks the decoder; the rest is split into frames at ``b"|FRAME|"`` so
aux-frame indexes get exercised too. Routing through
:class:`~zmqdispatch.protocol.engine.EngineProtocol` checks that the router
never raises either.

    pip install atheris
    python fuzz/vllm_outputs.py -atheris_runs=1000000          # a fixed number of runs
    python fuzz/vllm_outputs.py fuzz/corpus/vllm_outputs        # grow a corpus

Seeds: ``fuzz/seed_corpus.py`` writes the golden vectors as a starting corpus.
"""

from __future__ import annotations

import sys

import atheris
import msgpack

with atheris.instrument_imports():
    from zmqdispatch.errors import RemoteProtocolError
    from zmqdispatch.protocol.engine import EngineProtocol
    from zmqdispatch.wire import tensors
    from zmqdispatch.wire import vllm as wire

SEP = b"|FRAME|"


def _route(frames: list[bytes]) -> None:
    p = EngineProtocol(max_decode_errors=10**9)
    # Register a few ids a fuzzer can hit, so mailboxes (logprob decoding,
    # merging, finish handling) run on hostile rows too.
    for rid in ("r", "req-1", "a"):
        p.submit(wire.EngineCoreRequest(request_id=rid, prompt_token_ids=(1,),
                                        sampling_params=wire.SamplingParams(temperature=0.0, max_tokens=4),
                                        arrival_time=0.0))
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    p.frames_received(frames)  # must never raise


def test_one_input(data: bytes) -> None:
    if not data:
        return
    which, body = data[0] % 8, data[1:]
    frames = body.split(SEP)
    try:
        if which == 0:
            wire.decode_outputs(frames)
        elif which == 1:
            _route(frames)
        elif which == 2:
            wire.decode_request(frames)
        elif which == 3:
            wire.decode_handshake_status(body)
        elif which == 4:
            wire.decode_ready_response(body)
        elif which == 5:
            wire.decode_init(body)
        elif which == 6:
            msg = wire.decode_outputs(frames)
            for row in msg.outputs:
                if row[wire.O_NEW_LOGPROBS] is not None:
                    wire.decode_logprobs_lists(row[wire.O_NEW_LOGPROBS], frames)
                if row[wire.O_NEW_PROMPT_LOGPROBS] is not None:
                    wire.decode_logprobs_tensors(row[wire.O_NEW_PROMPT_LOGPROBS], frames)
        else:
            try:
                raw = msgpack.unpackb(body, ext_hook=tensors.ext_hook, strict_map_key=False)
            except Exception:  # the harness's own parse of its input, not code under test
                return  # not a msgpack value: nothing for the tensor decoder to see
            tensors.decode_tensor(raw, frames).tolist()
    except RemoteProtocolError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
