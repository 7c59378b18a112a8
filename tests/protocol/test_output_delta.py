"""OutputDelta is a plain class with class-level defaults (the mailbox's hot
path stores three attributes): whatever way a delta is made, it reads the same."""

from __future__ import annotations

import pytest

from zmqdispatch.protocol.mailbox import Mailbox, OutputDelta
from zmqdispatch.wire import vllm as wire

FIELDS = ("request_id", "token_ids", "finish_reason", "stop_reason", "logprobs", "prompt_logprobs",
          "num_prompt_tokens", "num_cached_tokens", "ticks", "engine_timestamp")


def _row(rid: str, tokens: tuple[int, ...]) -> wire.EngineCoreOutputRow:
    return wire.EngineCoreOutputRow(rid, tokens)


def _values(d: OutputDelta) -> dict:
    return {name: getattr(d, name) for name in FIELDS}


def test_hot_path_delta_reads_like_a_constructed_one() -> None:
    mb = Mailbox("r1", max_pending_tokens=100)
    mb.put(_row("r1", (5, 6)), [], 12.5)
    d = mb.take()
    assert type(d) is OutputDelta
    assert _values(d) == _values(OutputDelta("r1", [5, 6], engine_timestamp=12.5))
    assert type(d.token_ids) is list  # the consumer may keep or extend it


def test_merged_delta_counts_ticks_and_keeps_the_newest_timestamp() -> None:
    mb = Mailbox("r1", max_pending_tokens=100)
    mb.put(_row("r1", (5,)), [], 1.0)
    mb.put(_row("r1", (6, 7)), [], 2.0)
    d = mb.take()
    assert (d.token_ids, d.ticks, d.engine_timestamp) == ([5, 6, 7], 2, 2.0)
    mb.put(_row("r1", (8,)), [], 3.0)  # a fresh delta after take: the defaults again
    d = mb.take()
    assert (d.token_ids, d.ticks, d.engine_timestamp, d.finish_reason) == ([8], 1, 3.0, None)


def test_overflow_on_the_first_tick_of_an_empty_mailbox() -> None:
    mb = Mailbox("r1", max_pending_tokens=2)
    row = _row("r1", (1, 2, 3))
    assert mb.put(row, [], 0.0) != 0  # PUT_OVERFLOW: three tokens over a bound of two
    with pytest.raises(Exception, match="max_pending_tokens=2"):
        mb.take()


def test_replace_copies_and_refuses_unknown_fields() -> None:
    d = OutputDelta("r1", [1], finish_reason=wire.FinishReason.STOP, stop_reason=7, ticks=3)
    e = d.replace(token_ids=[2], stop_reason=None)
    assert _values(e) == {**_values(d), "token_ids": [2], "stop_reason": None}
    assert _values(d)["token_ids"] == [1] and e is not d
    with pytest.raises(TypeError, match="tokens"):
        d.replace(tokens=[3])
    assert "finish_reason=<FinishReason.STOP" in repr(d)
