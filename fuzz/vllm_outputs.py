#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of vLLM output messages, engine -> client.

Target: ``zmqdispatch.wire.vllm.decode_outputs`` and everything resolved lazily
from its rows (``decode_logprobs_lists``, ``decode_logprobs_tensors``,
``EngineCoreOutput.from_row``: logprob tensors inline or in aux frames, pooling /
routed-experts tensors, prefill stats, events, 0.33 ``error``), and the routing of
a message through :class:`zmqdispatch.protocol.engine.EngineProtocol`.

Contract checked on every input:

- the decoders raise only ``RemoteProtocolError``;
- the msgspec typed decode (``decode_outputs``) and the msgpack reference decoder
  (``_decode_outputs_msgpack``) agree: the same rows, bad rows and envelope, or the
  same error; the one difference allowed is junk in a tail msgspec skips unread (row
  elements after the 19th, ``utility_output`` elements after the 3rd);
- ``EngineProtocol.frames_received`` never raises, whatever the frames; a stream
  ends only with a ``ZmqDispatchError``;
- memory stays bounded by the input: a decoded message holds at most one value
  per input byte (plus the defaults of the fields a short row omits), decoded logprobs at most
  4 values per input byte, and after routing the mailboxes of all requests hold
  at most 4 values (tokens, logprob ids/values/ranks and rows) per input byte.

Input: byte 0 picks the mode (0: decode and resolve every lazy part; 1: route
through ``EngineProtocol``; 2: route with a tiny ``max_pending_tokens`` and a
decode-error streak of 2, twice, to reach slow-consumer and death paths); the
rest is one multipart message, frames separated by ``b"|FRAME|"``. Modes 3-5
do the same on a golden output message mutated structurally
(``_common.mutate_message``, the rest of the input drives the mutations).
Modes 6-8 do the same on a message generated field by field
(:func:`generated`): rows for a few ids with tokens, finish reasons, prefill
stats and sample / prompt logprobs whose tensors agree with their bytes (or
not), inline or in aux frames, new or shared with earlier rows.

    python fuzz/seed_corpus.py vllm_outputs fuzz/corpus/vllm_outputs
    python fuzz/vllm_outputs.py fuzz/corpus/vllm_outputs -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import atheris
import attrs
import msgpack
import msgspec

with atheris.instrument_imports():
    from zmqdispatch.errors import RemoteProtocolError, ZmqDispatchError
    from zmqdispatch.protocol.engine import EngineProtocol, LinkState
    from zmqdispatch.wire import tensors
    from zmqdispatch.wire import vllm as wire
    from zmqdispatch.wire import vllm_engine as wire_engine

import _common as C

MODES = 9
SEEDS = C.load_vectors("vllm_0.32.0.json", keep=lambda c: c["direction"] == "from_engine"
                         and c["kind"] in ("outputs", "utility"))
_SP = wire.SamplingParams(temperature=0.0, max_tokens=4)
_ALWAYS = ("r",)  # one id every message can name with two bytes
MAX_REGISTERED = 8


_RIDS = ["r", "req-1", "a", ""]
_IDS_DT = ["|i1", "|u1", "<i4", "<i8", "int32", "int64", "<f4", "|b1"]
_LPS_DT = ["<f4", "<f2", "float32", "bfloat16", "<f8", "<i4"]
_RANKS_DT = ["<i8", "|i1", "int32", "<i4", "<f4"]


def _tensor(fdp: atheris.FuzzedDataProvider, dtypes: list[str], shape: list[int], frames: list[bytes]) -> list:
    dtype = fdp.PickValueInList(dtypes)
    info = tensors.dtype_info(dtype)
    n = 1
    for d in shape:
        n *= d
    nbytes = max(0, n * info.itemsize + fdp.PickValueInList([0, 0, 0, 0, 0, 0, 1, -1]))
    where = fdp.ConsumeIntInRange(0, 3)
    if where == 0 or (where == 1 and nbytes < 256):
        return [dtype, shape, msgpack.ExtType(3, fdp.ConsumeBytes(nbytes).ljust(nbytes, b"\0"))]
    same = [i for i in range(1, len(frames)) if len(frames[i]) == nbytes]
    if where == 2 and same:
        return [dtype, shape, fdp.PickValueInList(same)]  # an aux frame another tensor uses too
    frames.append(fdp.ConsumeBytes(nbytes).ljust(nbytes, b"\0"))
    return [dtype, shape, len(frames) - 1 + fdp.PickValueInList([0, 0, 0, 0, 1, -len(frames)])]


def _logprobs(fdp: atheris.FuzzedDataProvider, frames: list[bytes], prompt: bool) -> list:
    n = fdp.ConsumeIntInRange(0, 8) if fdp.ConsumeBool() else fdp.PickValueInList([0, 1, 63, 64, 255, 1024])
    k1 = fdp.ConsumeIntInRange(0, 4) if fdp.ConsumeBool() else fdp.PickValueInList([1, 21, 64])
    ids = _tensor(fdp, _IDS_DT, [n, k1], frames)
    lps = _tensor(fdp, _LPS_DT, [n, k1] if fdp.ConsumeProbability() < 0.95 else [n, k1 + 1], frames)
    ranks = _tensor(fdp, _RANKS_DT, [n] if fdp.ConsumeProbability() < 0.95 else [n, 1], frames)
    cu = None if fdp.ConsumeBool() else [fdp.ConsumeIntInRange(-1, 8) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    return [ids, lps, ranks, cu] + ([None] if prompt else [])


def generated(fdp: atheris.FuzzedDataProvider) -> list[bytes] | None:
    """An ``EngineCoreOutputs`` message built field by field from the input."""
    frames: list[bytes] = [b""]
    rows: list = []
    lp = plp = None
    for _ in range(fdp.ConsumeIntInRange(0, 6) if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeIntInRange(0, 300)):
        rid = fdp.PickValueInList(_RIDS) if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeUnicodeNoSurrogates(4)
        toks = [fdp.ConsumeIntInRange(0, 2**32 + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        choice = fdp.ConsumeIntInRange(0, 3)
        if choice == 1:
            lp = _logprobs(fdp, frames, False)
        elif choice == 0:
            lp = None
        # choice 2/3: the previous row's logprobs again (same tensors, same aux frames)
        if fdp.ConsumeProbability() < 0.2:
            plp = _logprobs(fdp, frames, True)
        fr = fdp.PickValueInList([None, None, None, 0, 1, 2, 3, 4, 5, -1])
        sr = fdp.PickValueInList([None, 7, "stop", -1, 2**32])
        ps = fdp.PickValueInList([None, {"num_prompt_tokens": 3, "num_cached_tokens": 1}, {"num_prompt_tokens": -1},
                                  {"num_cached_tokens": "x"}, []])
        err = fdp.PickValueInList([None, {"code": "validation_error", "message": "m", "retryable": False}, 5])
        row = [rid, toks, lp, plp if fdp.ConsumeBool() else None, None, fr, sr, None, None, None, None, ps, None, 0,
               None, None, None, None, err]
        rows.append(row[: fdp.ConsumeIntInRange(2, 19)] if fdp.ConsumeProbability() < 0.2 else row)
    utility = None
    if fdp.ConsumeProbability() < 0.2:
        utility = [fdp.PickValueInList([1, 2, 3, 2**64 - 1]), fdp.PickValueInList([None, "failed", 5]),
                   fdp.PickValueInList([None, [None, 1], [None], [None, [1, 2]]])]
    finished = None if fdp.ConsumeBool() else [fdp.PickValueInList(_RIDS) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    env = [fdp.PickValueInList([0, 1, -1]), rows, None, fdp.PickValueInList([1.0, 0, -1.5, 2**64 - 1]), utility,
           finished, None, None, fdp.PickValueInList(["default", None])]
    try:
        frames[0] = msgpack.packb(env[: fdp.ConsumeIntInRange(2, 9)] if fdp.ConsumeProbability() < 0.1 else env,
                                  use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None
    return frames


def _request(rid: str) -> wire.EngineCoreRequest:
    return wire.EngineCoreRequest(request_id=rid, prompt_token_ids=(1,), sampling_params=_SP, arrival_time=0.0)


def _named_ids(frames: list[bytes]) -> list[str]:
    """Request ids the message names (rows and finished_requests), so the
    routed rows reach real mailboxes instead of the unknown-id counter."""
    ids = dict.fromkeys(_ALWAYS)
    try:
        msg = wire.decode_outputs(frames)
    except RemoteProtocolError:
        return list(ids)
    for row in msg.outputs:
        ids[row.request_id] = None
    for rid, _exc in msg.bad_rows:
        if rid is not None:
            ids[rid] = None
    for rid in msg.finished_requests or ():
        ids[rid] = None
    return [r for r in ids if r][:MAX_REGISTERED]


def _view(m: wire.EngineCoreOutputs) -> tuple[str, list[tuple[str | None, str]]]:
    return repr(attrs.evolve(m, bad_rows=(), frames=())), [(rid, str(exc)) for rid, exc in m.bad_rows]


def _skipped_tails_trimmed(frames: list[bytes]) -> list[bytes] | None:
    """The message without what msgspec skips unread, or None if it is no envelope."""
    try:
        value = msgpack.unpackb(frames[0], strict_map_key=False, ext_hook=msgpack.ExtType, timestamp=3)
    except Exception:
        return None
    if type(value) is not list or len(value) < 2:
        return None
    if type(value[1]) is list:
        value[1] = [r[: len(wire.ROW_FIELDS)] if type(r) is list else r for r in value[1]]
    if len(value) > 4 and type(value[4]) is list:
        value[4] = value[4][:3]
    try:
        return [msgpack.packb(value, use_bin_type=True, datetime=True), *frames[1:]]
    except (TypeError, ValueError, OverflowError):
        return None


def _agree(frames: list[bytes], ok: bool, msg: wire.EngineCoreOutputs | None) -> None:
    """The typed decode and the msgpack reference decode *frames* alike."""
    ref_ok, ref = C.only_typed(RemoteProtocolError, wire._decode_outputs_msgpack, frames)  # noqa: SLF001
    if ok and ref_ok:
        assert _view(msg) == _view(ref), "msgspec and the msgpack reference decode differently"
    elif ok:
        trimmed = _skipped_tails_trimmed(frames)
        assert trimmed is not None, "msgspec accepts what the msgpack reference refuses"
        ref_ok, ref = C.only_typed(RemoteProtocolError, wire._decode_outputs_msgpack, trimmed)  # noqa: SLF001
        assert ref_ok and _view(msg) == _view(ref), "msgspec accepts what the msgpack reference refuses"
    else:
        assert not ref_ok, "msgspec (with its fallback) refuses what the msgpack reference accepts"


def _decode(frames: list[bytes], budget: int) -> None:
    ok, msg = C.only_typed(RemoteProtocolError, wire.decode_outputs, frames)
    _agree(frames, ok, msg)
    if not ok:
        return
    # One value per input byte, plus the defaults of the fields a short row omits.
    C.assert_bounded("EngineCoreOutputs.outputs", [msgspec.structs.astuple(r) for r in msg.outputs],
                     budget + len(wire.ROW_FIELDS) * len(msg.outputs) + 2)
    assert all(isinstance(r, wire.EngineCoreOutputRow) for r in msg.outputs)
    for row in msg.outputs:
        assert type(row.request_id) is str
        assert all(type(t) is int and 0 <= t <= 2**32 - 1 for t in row.new_token_ids)
        for raw, fn in ((row.new_logprobs, wire.decode_logprobs_lists),
                        (row.new_prompt_logprobs_tensors, wire.decode_logprobs_tensors)):
            if raw is None:
                continue
            ok, lp = C.only_typed(RemoteProtocolError, fn, raw, frames)
            if ok:
                n = len(lp.ranks)
                assert len(lp.token_ids) == len(lp.logprobs) == n
                C.assert_bounded(fn.__name__, (lp.token_ids, lp.logprobs, lp.ranks), 4 * budget + 64)
        C.only_typed(RemoteProtocolError, wire_engine.EngineCoreOutput.from_row, row, frames)
    if msg.utility_output is not None:
        assert type(msg.utility_output.call_id) is int


def _mailbox_values(p: EngineProtocol, mailboxes: list) -> int:
    n = 0
    for mb in mailboxes:
        d = mb.pending
        if d is None:
            continue
        n += len(d.token_ids)
        for lp in (d.logprobs, d.prompt_logprobs):
            if lp is not None:
                n += len(lp.ranks) + sum(len(r) + 1 for r in lp.token_ids) + sum(len(r) + 1 for r in lp.logprobs)
    return n


def _route(frames: list[bytes], budget: int, *, tight: bool) -> None:
    p = EngineProtocol(max_decode_errors=2 if tight else 10**9, max_pending_tokens=2 if tight else 1 << 16)
    mailboxes = [p.submit(_request(rid))[0] for rid in _named_ids(frames)]
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    calls = [p.start_utility("m") for _ in range(2)]  # call ids 1 and 2
    while (o := p.pop_send()) is not None:
        p.send_done(o)
    rounds = 2 if tight else 1
    for _ in range(rounds):
        p.frames_received(frames)  # must never raise
    values = _mailbox_values(p, mailboxes)
    if values > rounds * 4 * budget + 64 and not C.known("aux-reuse"):
        raise C.BoundExceeded(
            f"routing {budget} input bytes left {values} values in the mailboxes "
            f"(bound {rounds} x 4 per input byte)"
        )
    # Consumers see deltas, then at most one typed error.
    for mb in mailboxes:
        while True:
            try:
                d = mb.take()
            except ZmqDispatchError:
                break
            if d is None:
                break
            assert type(d.token_ids) is list
    for call in calls:
        if call.done:
            assert call.error is None or isinstance(call.error, ZmqDispatchError)
    if p.state is LinkState.DEAD:
        assert p.inflight == 0 and p.pending_utility_calls == 0
    assert p.inflight <= len(mailboxes)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % MODES, data[1:]
    if mode >= 6:
        mode -= 6
        frames = generated(atheris.FuzzedDataProvider(body))
        if frames is None:
            return
    elif mode >= 3:
        mode -= 3
        frames = C.mutate_message(atheris.FuzzedDataProvider(body), SEEDS)
        if frames is None:
            return
    else:
        frames = C.split_frames(body)
    budget = C.total_bytes(frames)
    if mode == 0:
        _decode(frames, budget)
    else:
        _route(frames, budget, tight=mode == 2)


if __name__ == "__main__":
    C.setup_and_fuzz(test_one_input)
