#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of TokenSpeed output batches, engine -> client.

Target: ``zmqdispatch.wire.tokenspeed.decode_outputs`` on ``BatchTokenIDOutSlim``
messages of any length (the 9- and 10-element legacy prefixes, the 14-element
0.1.1 form, longer ones from newer engines), plus the batch's views
(``outputs()``, ``finished_rids()``, ``load``).

Input: byte 0 picks the mode. Even: the rest is one multipart message, frames
separated by ``b"|FRAME|"`` (aux frames are ignored by the decoder, which is
checked too). Odd: a golden batch (14, 10 and 9 elements) mutated structurally
(``_common.mutate_message``; the rest of the input drives it).

Contract: only ``RemoteProtocolError``; the msgspec typed decode and the msgpack
reference decoder (``_decode_outputs_msgpack``) accept the same messages and agree on
them; an accepted batch has parallel columns of
``len(rids)`` entries, str rids and reasons, ints in ``0..2**32-1`` for counts
and token ids, numbers for logprob values with one id each, non-negative
scalars, at most ``MAX_TOKENS_PER_TICK`` tokens per rid and
``MAX_OUTPUTS_PER_MESSAGE`` rids; it holds at most one value per input byte; it
re-encodes (``encode_outputs`` with as many elements as it had, up to 14) to a
message that decodes to the same batch.

    python fuzz/seed_corpus.py tokenspeed_outputs fuzz/corpus/tokenspeed_outputs
    python fuzz/tokenspeed_outputs.py fuzz/corpus/tokenspeed_outputs \
        -atheris_runs=1000000 -rss_limit_mb=1024 -timeout=10
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports():
    from zmqdispatch import limits
    from zmqdispatch.errors import RemoteProtocolError
    from zmqdispatch.wire import tokenspeed as ts
    from zmqdispatch.wire import tokenspeed_engine as ts_engine

import _common as C

U32 = 2**32 - 1
SEEDS = C.load_vectors("tokenspeed_0.1.1.json", keep=lambda c: c["kind"] == "outputs")


def check_batch(b: ts.TokenSpeedBatch, budget: int) -> None:
    m = len(b.rids)
    assert m <= limits.MAX_OUTPUTS_PER_MESSAGE
    cols = (b.output_ids, b.finished_reasons, b.prompt_tokens, b.completion_tokens, b.cached_tokens,
            b.logprob_vals, b.logprob_ids)
    assert all(type(c) is tuple and len(c) == m for c in cols)
    C.assert_bounded("BatchTokenIDOutSlim", (b.rids, *cols), budget + 8)
    assert all(type(r) is str for r in b.rids + b.finished_reasons)
    assert all(type(x) is int and 0 <= x <= U32 for x in b.prompt_tokens + b.completion_tokens + b.cached_tokens)
    for toks, vals, lids in zip(b.output_ids, b.logprob_vals, b.logprob_ids):
        assert type(toks) is tuple and len(toks) <= limits.MAX_TOKENS_PER_TICK
        assert all(type(t) is int and 0 <= t <= U32 for t in toks + lids)
        assert all(type(v) in (int, float) for v in vals) and len(vals) == len(lids)
    scalars = (b.engine_index, b.num_running, b.num_waiting, b.kv_active_pages, b.kv_total_pages)
    assert all(type(x) is int and x >= 0 for x in scalars)
    assert b.wire_elements >= ts.BATCH_MIN_ELEMENTS
    views = list(b.outputs())
    assert len(views) == m
    assert set(b.finished_rids()) <= set(b.rids)
    load = b.load
    if load is not None:
        _ = load.kv_usage  # kv_total_pages > 0: no ZeroDivisionError
    # What decodes re-encodes to a fixed point: encode(decode(encode(b))) ==
    # encode(b) (bytes, so NaN logprob values compare equal).
    canon = _canon(b)
    assert _canon(ts.decode_outputs(canon)) == canon, "encode(decode(x)) is not a fixed point"


def _canon(b: ts.TokenSpeedBatch) -> list[bytes]:
    return ts_engine.encode_outputs(b, elements=min(b.wire_elements, ts.BATCH_ELEMENTS))


def test_one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] & 1:
        frames = C.mutate_message(atheris.FuzzedDataProvider(data[1:]), SEEDS)
        if frames is None:
            return
    else:
        frames = C.split_frames(data[1:])
    ok, batch = C.only_typed(RemoteProtocolError, ts.decode_outputs, frames)
    # The msgspec typed decode accepts exactly what the msgpack reference decoder
    # accepts, and decodes it to the same batch (it falls back to the reference for
    # everything it refuses, so a refusal it should not make goes unseen but costs time).
    ref_ok, ref = C.only_typed(RemoteProtocolError, ts._decode_outputs_msgpack, frames)  # noqa: SLF001
    assert ok == ref_ok, f"msgspec {'accepts' if ok else 'refuses'} what the msgpack reference does not"
    if ok:
        assert _canon(batch) == _canon(ref) and batch.wire_elements == ref.wire_elements
        check_batch(batch, len(frames[0]))
        # Aux frames after the payload are ignored.
        assert _canon(ts.decode_outputs(frames[:1])) == _canon(batch)


if __name__ == "__main__":
    C.setup_and_fuzz(test_one_input)
