"""The msgspec typed decode of vLLM output messages against the msgpack reference.

``wire.vllm.decode_outputs`` decodes with msgspec into ``EngineCoreOutputRow`` structs
and falls back to ``_decode_outputs_msgpack`` (the reference) for what it refuses. On
any message both accept the same, refuse with the same error, and build the same
rows (bad rows set aside alike). The one documented difference: elements after a
row's 19th and a ``utility_output``'s 3rd are skipped unread by msgspec, so junk the
reference refuses there (a pickle ext type) is accepted.
"""

from __future__ import annotations

import datetime
from typing import Any

import attrs
import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zmqdispatch import limits
from zmqdispatch.errors import RemoteProtocolError
from zmqdispatch.wire import vllm as w

from .test_vllm_roundtrip import _mutated, encode_message, msgpack_values, output_like, output_messages

PROPERTY = settings(deadline=None, max_examples=400, database=None, suppress_health_check=[HealthCheck.too_slow])


def view(m: w.EngineCoreOutputs) -> tuple[str, list[tuple[str | None, str]]]:
    """Everything a decoded message holds, comparable (repr: NaN-safe, tuple != list)."""
    return repr(attrs.evolve(m, bad_rows=())), [(rid, str(exc)) for rid, exc in m.bad_rows]


def typed_only(frames: list[bytes]) -> Any:
    """The bare typed decode (no fallback), for asserting that it took a message."""
    _row, dec = w._typed(limits.MAX_OUTPUTS_PER_MESSAGE, limits.MAX_TOKENS_PER_TICK, limits.MAX_TOKEN_ID)
    return dec.decode(frames[0])


def _skipped_tails_trimmed(value: object) -> object:
    """*value* without what the typed decode skips unread (row elements after the 19th,
    utility_output elements after the 3rd)."""
    if type(value) is not list or len(value) < 2:
        return value
    value = list(value)
    if type(value[1]) is list:
        value[1] = [r[: len(w.ROW_FIELDS)] if type(r) is list else r for r in value[1]]
    if len(value) > 4 and type(value[4]) is list:
        value[4] = value[4][:3]
    return value


@st.composite
def mutated_valid(draw: st.DrawFn) -> object:
    """A valid 0.32/0.33 message (logprobs, tensors, prefill stats, errors) with a few
    envelope or row positions replaced by junk."""
    version = draw(st.sampled_from(["0.32.0", "0.33.0"]))
    env, outs = draw(output_messages(with_error=version == "0.33.0"))
    frames = encode_message(env, outs, version)
    value = msgpack.unpackb(frames[0], strict_map_key=False, ext_hook=msgpack.ExtType)
    if value[1] and draw(st.booleans()):
        i = draw(st.integers(0, len(value[1]) - 1))
        value[1][i] = draw(_mutated(value[1][i]))
    return draw(_mutated(value)) if draw(st.booleans()) else value


@PROPERTY
@given(msgpack_values | output_like() | mutated_valid())
def test_typed_decode_agrees_with_the_msgpack_reference(value: object) -> None:
    frames = [msgpack.packb(value, use_bin_type=True), b"\x00" * 8, b"\x01" * 256]
    try:
        ref = w._decode_outputs_msgpack(frames)
    except RemoteProtocolError as exc:
        try:
            got = w.decode_outputs(frames)
        except RemoteProtocolError as typed_exc:
            assert str(typed_exc) == str(exc)
            event("both refuse")
            return
        event("only the reference refuses: a skipped tail")
        # Accepted only because the refused part is in a tail msgspec skips unread.
        trimmed = [msgpack.packb(_skipped_tails_trimmed(value), use_bin_type=True), *frames[1:]]
        assert view(attrs.evolve(got, frames=trimmed)) == view(w._decode_outputs_msgpack(trimmed))
        return
    try:
        typed_only(frames)
        event("both accept, the typed decode itself")
    except (msgspec.DecodeError, msgspec.ValidationError, RemoteProtocolError, RecursionError):
        event(f"both accept, through the fallback ({len(ref.bad_rows)} bad rows)" if ref.bad_rows
              else "both accept, through the fallback")
    assert view(w.decode_outputs(frames)) == view(ref)


@settings(deadline=None, max_examples=100, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(output_messages(), output_messages(with_error=True))
def test_valid_messages_take_the_typed_decode(message_032: tuple, message_033: tuple) -> None:
    for version, (env, outs) in (("0.32.0", message_032), ("0.33.0", message_033)):
        _check_typed(encode_message(env, outs, version))


def _check_typed(frames: list[bytes]) -> None:
    typed = typed_only(frames)  # raises if msgspec refused: the hot path would fall back
    got = w.decode_outputs(frames)
    assert got.outputs == typed.outputs and not got.bad_rows
    assert view(got) == view(w._decode_outputs_msgpack(frames))


def _row(rid: str = "r", **fields: object) -> list:
    row: list = [rid, [1]] + [None] * 11 + [0] + [None] * 4
    for k, v in fields.items():
        row[w.ROW_FIELDS.index(k)] = v
    return row


def test_one_bad_row_falls_back_and_fails_only_that_row() -> None:
    frames = [msgpack.packb([0, [_row("a"), _row("b", finish_reason=7), _row("c")], None, 1.0])]
    with pytest.raises(msgspec.ValidationError, match=r"<= 4 - at `\$\[1\]\[1\]\[5\]`"):
        typed_only(frames)
    msg = w.decode_outputs(frames)
    assert [r.request_id for r in msg.outputs] == ["a", "c"]
    assert all(isinstance(r, w.EngineCoreOutputRow) for r in msg.outputs)
    ((rid, err),) = msg.bad_rows
    assert rid == "b" and "outputs[1].finish_reason" in str(err)


def test_bad_prefill_stats_fall_back_to_the_reference() -> None:
    # The prefill counts are checked after the typed decode; a bad one fails its row.
    frames = [msgpack.packb([0, [_row("a", prefill_stats={"num_prompt_tokens": 5}),
                                 _row("b", prefill_stats={"num_cached_tokens": -1})], None, 1.0])]
    typed_only(frames)  # msgspec itself takes it
    for payload in (frames[0], bytearray(frames[0]), memoryview(frames[0])):
        msg = w.decode_outputs([payload])
        assert [r.request_id for r in msg.outputs] == ["a"]
        assert msg.outputs[0].prefill_stats == {"num_prompt_tokens": 5}
        assert [(rid, "prefill_stats" in str(e)) for rid, e in msg.bad_rows] == [("b", True)]


def test_opaque_fields_hold_lists_on_both_paths() -> None:
    kv = {"remote_block_ids": [[1, 2], [3]], (1, 2): "tuple key"}
    good = [0, [_row("a", kv_transfer_params=kv)], {"running": [1, 2]}, 1.0, [3, None, [None, [4, [5]]]]]
    bad = [0, [_row("a", kv_transfer_params=kv), _row("b", stop_reason=1.5)], {"running": [1, 2]}, 1.0,
           [3, None, [None, [4, [5]]]]]
    for value in (good, bad):
        msg = w.decode_outputs([msgpack.packb(value)])
        assert msg.outputs[0].kv_transfer_params == kv and type(msg.outputs[0].kv_transfer_params[(1, 2)]) is str
        assert type(msg.outputs[0].kv_transfer_params["remote_block_ids"][0]) is list
        assert msg.scheduler_stats == {"running": [1, 2]}
        assert msg.utility_output is not None and msg.utility_output.result == w.UtilityResult([4, [5]], None)


def test_deep_nesting_msgspec_refuses_is_decoded_by_the_reference() -> None:
    deep: object = 1
    for _ in range(990):
        deep = [deep]
    frames = [msgpack.packb([0, [_row("a", events=deep)], None, 1.0])]
    with pytest.raises(RecursionError):
        typed_only(frames)
    (row,) = w.decode_outputs(frames).outputs
    v = row.events
    for _ in range(990):
        assert type(v) is list
        (v,) = v
    assert v == 1


def test_msgpack_timestamps_are_datetimes_on_both_paths() -> None:
    ts = msgpack.Timestamp(1, 0)
    when = datetime.datetime(1970, 1, 1, 0, 0, 1, tzinfo=datetime.UTC)
    for rows in ([_row("a", trace_headers={"t": ts})], [_row("a", trace_headers={"t": ts}), ["b"]]):
        msg = w.decode_outputs([msgpack.packb([0, rows, None, 1.0])])
        assert msg.outputs[0].trace_headers == {"t": when}


def test_row_tail_after_the_19th_element_is_skipped() -> None:
    # A newer vLLM's fields: ignored, as msgspec ignores fields it does not know.
    row = _row("a") + [None, {"new": [1]}, "x"]
    msg = w.decode_outputs([msgpack.packb([0, [row], None, 1.0])])
    assert msg.outputs[0] == w._decode_outputs_msgpack([msgpack.packb([0, [row[:19]], None, 1.0])]).outputs[0]


def test_changed_limits_take_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = [msgpack.packb([0, [_row("a", new_token_ids=[1, 2, 3])], None, 1.0])]
    assert w.decode_outputs(frames).outputs[0].new_token_ids == (1, 2, 3)
    monkeypatch.setattr(limits, "MAX_TOKENS_PER_TICK", 2)
    msg = w.decode_outputs(frames)
    assert not msg.outputs and "new_token_ids" in str(msg.bad_rows[0][1])


def test_junk_in_a_skipped_tail_is_the_one_difference() -> None:
    # The reference reads the whole payload (a pickle ext type anywhere refuses the
    # message); msgspec skips a row's elements after the 19th unread, so it never
    # builds that value, and the message decodes as if the tail were absent.
    row = _row("a") + [None, msgpack.ExtType(1, b"\x80\x04N.")]
    frames = [msgpack.packb([0, [row], None, 1.0])]
    with pytest.raises(RemoteProtocolError, match="ext type 1"):
        w._decode_outputs_msgpack(frames)
    assert [r.request_id for r in w.decode_outputs(frames).outputs] == ["a"]
    # Anywhere msgspec does read, it is refused as the reference refuses it.
    frames = [msgpack.packb([0, [_row("a", events=msgpack.ExtType(1, b"\x80\x04N."))], None, 1.0])]
    with pytest.raises(RemoteProtocolError, match="ext type 1"):
        w.decode_outputs(frames)
