"""Small builders shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence

from zmqdispatch.wire import vllm as wire


def make_request(rid: str = "r1", prompt: Sequence[int] = (1, 2, 3), **sp: object) -> wire.EngineCoreRequest:
    """A valid greedy EngineCoreRequest."""
    sp.setdefault("temperature", 0.0)
    sp.setdefault("max_tokens", 16)
    return wire.EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling_params=wire.SamplingParams(**sp),
        arrival_time=0.0,
    )


def out(rid: str, tokens: Sequence[int], finish: wire.FinishReason | None = None, **kw: object) -> wire.EngineCoreOutput:
    """One EngineCoreOutput."""
    return wire.EngineCoreOutput(request_id=rid, new_token_ids=tuple(tokens), finish_reason=finish, **kw)


def outputs_frames(outputs: Sequence[wire.EngineCoreOutput], **kw: object) -> list[bytes]:
    """Encode one EngineCoreOutputs message as the engine would."""
    kw.setdefault("timestamp", 1.0)
    return wire.encode_outputs(0, list(outputs), **kw)
