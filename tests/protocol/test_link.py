"""The engine link's liveness rules (zmqdispatch.protocol.link), with plain
numbers for time: no sockets, no trio."""

import math

import pytest

from zmqdispatch.protocol.link import EngineLink, LinkAction, PumpPhase

GRACE = 0.25
RECONNECT = 2.0


def serving(now: float = 0.0, *, links: int = 1, **kw) -> EngineLink:
    """A link serving since *now* with *links* output connections and one input connection (fd 7)."""
    kw.setdefault("silence_timeout", 30.0)
    link = EngineLink(engine_index=3, now=now, drop_grace=GRACE, reconnect_grace=RECONNECT, **kw)
    link.input_connected(7)
    for _ in range(links):
        link.output_connected()
    link.start(now)
    return link


def turn(link: EngineLink, now: float, busy: bool = True):
    """The pump's turn, as the shell takes it: only once its deadline is due."""
    assert link.pump_deadline <= now, (link.pump_deadline, now)
    return link.pump_turn(now, busy)


# ---------------------------------------------------------------- idle


def test_a_serving_link_reads_forever_and_decides_nothing():
    link = serving()
    assert link.pump_reads and link.pump_deadline == math.inf
    assert link.pump_turn(1.0, True) is None
    link.output_received(5.0)
    assert link.next_deadline() == 35.0


# ---------------------------------------------------------------- death signs


@pytest.mark.parametrize(
    ("sign", "reason"),
    [
        (lambda link, now: link.input_disconnected(7, "ipc://in", now), "disconnected"),
        (lambda link, now: link.process_exited(1234, -9, now), "process_exit"),
        (lambda link, now: link.unreachable(now), "unreachable"),
    ],
)
def test_a_death_sign_refuses_at_once_then_drains_while_an_output_link_is_up_then_dies(sign, reason):
    link = serving()
    gone = sign(link, 10.0)
    assert gone.action is LinkAction.GONE and gone.reason == reason and gone.until == 10.0 + GRACE
    assert link.pump_deadline == -math.inf  # the pump takes its turn at once
    assert turn(link, 10.0) is None  # outputs first: the pump drains
    assert link.phase is PumpPhase.DRAIN and link.pump_reads and link.pump_deadline == 10.0 + GRACE
    die = turn(link, 10.0 + GRACE)
    assert die.action is LinkAction.DIE and die.reason == reason and die.message == gone.message


def test_the_drain_ends_when_the_last_output_connection_closes():
    link = serving(links=1)
    link.process_exited(1, 0, 1.0)
    turn(link, 1.0)
    link.output_disconnected("ipc://out")  # the dead engine's PUSH closes too
    assert link.pump_deadline == -math.inf
    assert turn(link, 1.01).action is LinkAction.DIE


def test_a_death_sign_with_no_output_link_is_death_after_routing_what_is_queued():
    link = serving(links=0)
    link.input_disconnected(7, "ipc://in", 1.0)
    assert link.pump_reads  # the pump routes the queued outputs before its turn
    assert turn(link, 1.0).reason == "disconnected"


def test_the_first_sign_wins_and_later_signs_decide_nothing():
    link = serving()
    assert link.process_exited(1, 1, 1.0).reason == "process_exit"
    assert link.input_disconnected(7, "ipc://in", 1.1) is None
    assert link.unreachable(1.2) is None
    assert link.gone.reason == "process_exit"


def test_a_sentinel_among_the_drained_outputs_ends_the_drain_with_its_own_cause():
    # process exit first, then the ENGINE_CORE_DEAD sentinel routed while draining:
    # the protocol declared that death (first cause wins there); the link stops.
    link = serving()
    link.process_exited(1, 0, 1.0)
    turn(link, 1.0)
    link.died("sentinel")
    assert link.pump_deadline == -math.inf
    assert link.pump_turn(1.3, True) is None
    assert link.timer_fired(100.0, 5) is None and link.next_deadline() == math.inf


def test_a_sentinel_before_any_sign_makes_later_signs_decide_nothing():
    link = serving()
    link.died("sentinel")
    assert link.process_exited(1, 0, 1.0) is None
    assert link.input_disconnected(7, "ipc://in", 1.0) is None


def test_only_the_last_input_connection_closing_is_a_sign():
    link = serving()
    link.input_connected(9)  # a stray connection (a probe)
    assert link.input_disconnected(9, "ipc://in", 1.0) is None
    assert link.input_disconnected(7, "ipc://in", 2.0).reason == "disconnected"


def test_input_disconnects_are_no_sign_without_watch_input_before_serving_or_while_closing():
    assert serving(watch_input=False).input_disconnected(7, "x", 1.0) is None
    link = EngineLink(now=0.0)
    link.input_connected(7)
    assert link.input_disconnected(7, "x", 1.0) is None and link.gone is None  # the resume wait
    link = serving()
    link.close()
    assert link.input_disconnected(7, "x", 1.0) is None
    assert link.process_exited(1, 0, 1.0) is None


# ---------------------------------------------------------------- silence and send timeout


def test_silence_with_requests_in_flight_is_death_and_counts_from_the_last_output():
    link = serving(silence_timeout=10.0)
    link.output_received(4.0)
    assert link.next_deadline() == 14.0
    assert link.timer_fired(13.9, 2) is None
    die = link.timer_fired(14.0, 2)
    assert die.action is LinkAction.DIE and die.reason == "silence" and "2 requests in flight" in die.message


def test_silence_without_requests_restarts_the_count_and_the_first_request_starts_it():
    link = serving(silence_timeout=10.0)
    assert link.timer_fired(10.0, 0) is None and link.next_deadline() == 20.0
    link.submitted(15.0, 1)  # the first request in flight
    link.submitted(16.0, 2)  # not the first: no change
    assert link.next_deadline() == 25.0


def test_an_infinite_silence_timeout_never_fires():
    assert serving(silence_timeout=math.inf).next_deadline() == math.inf


def test_a_send_timeout_is_death_at_once():
    die = serving().send_timed_out(5.0)
    assert die.action is LinkAction.DIE and die.reason == "send_timeout" and "5.0 s" in die.message


# ---------------------------------------------------------------- output drops


def test_an_output_drop_with_work_open_holds_then_fails_what_was_sent_and_waits_for_a_reconnect():
    link = serving()
    assert link.output_disconnected("ipc://out") is None
    assert link.pump_deadline == -math.inf and link.pump_reads  # route what arrived before the drop
    assert turn(link, 1.0, busy=True) is None
    assert link.phase is PumpPhase.HOLD and not link.pump_reads and link.pump_deadline == 1.0 + GRACE
    lost = turn(link, 1.0 + GRACE)
    assert lost.action is LinkAction.FAIL_SENT and "ipc://out" in lost.message and "MAX_FRAME_BYTES" in lost.message
    assert link.phase is PumpPhase.RECONNECT and link.pump_deadline == 1.0 + GRACE + RECONNECT


def test_an_output_drop_with_nothing_open_fails_at_once():
    link = serving()
    link.output_disconnected("ipc://out")
    assert turn(link, 1.0, busy=False).action is LinkAction.FAIL_SENT


def test_a_death_sign_during_the_hold_makes_it_that_death_not_a_protocol_error():
    link = serving()
    link.output_disconnected("ipc://out")
    turn(link, 1.0)
    link.input_disconnected(7, "ipc://in", 1.1)
    assert link.pump_deadline == -math.inf
    assert turn(link, 1.1) is None and link.pump_reads  # read what is queued first
    die = turn(link, 1.1)
    assert die.action is LinkAction.DIE and die.reason == "disconnected"


def test_an_output_link_that_comes_back_ends_the_reconnect_wait():
    link = serving()
    link.output_disconnected("ipc://out")
    turn(link, 1.0, busy=False)
    assert link.phase is PumpPhase.RECONNECT
    link.output_connected()
    assert link.pump_deadline == -math.inf
    assert turn(link, 1.5) is None and link.phase is PumpPhase.READ and link.pump_deadline == math.inf


def test_no_output_link_back_within_the_grace_is_death():
    link = serving()
    link.output_disconnected("ipc://out")
    turn(link, 1.0, busy=False)
    assert link.pump_turn(1.0 + RECONNECT - 0.01, True) is None
    die = turn(link, 1.0 + RECONNECT)
    assert die.action is LinkAction.DIE and die.reason == "output_disconnected"


def test_without_await_output_reconnect_the_link_serves_on_after_a_drop():
    link = serving(await_output_reconnect=False)
    link.output_disconnected("ipc://out")
    turn(link, 1.0, busy=False)
    assert link.phase is PumpPhase.READ and link.pump_deadline == math.inf


def test_a_drop_while_an_other_output_link_is_up_needs_no_reconnect():
    link = serving(links=2)
    link.output_disconnected("ipc://out")
    assert turn(link, 1.0, busy=False).action is LinkAction.FAIL_SENT
    assert link.phase is PumpPhase.READ


def test_drops_in_a_row_each_fail_what_was_sent_and_never_kill_an_engine_that_reconnects():
    link = serving()
    link.output_disconnected("ipc://out")
    turn(link, 1.0, busy=False)
    link.output_connected()  # back
    link.output_disconnected("ipc://out")  # and dropped again before the pump ran
    # no output link: the reconnect wait goes on (a further drop does not end it)
    assert link.phase is PumpPhase.RECONNECT and link.pump_deadline == 1.0 + RECONNECT
    link.output_connected()  # back again
    assert turn(link, 1.1) is None and link.phase is PumpPhase.READ and link.dropped
    assert turn(link, 1.1, busy=False).action is LinkAction.FAIL_SENT  # the second drop
    assert link.phase is PumpPhase.READ and link.pump_deadline == math.inf  # a link is up: no wait


def test_a_stray_output_connection_is_counted_and_changes_nothing():
    link = serving()
    link.output_handshake_failed()
    stray = link.output_disconnected("ipc://out")
    assert stray.action is LinkAction.STRAY and link.stray_output_connections == 1
    assert link.output_links == 1 and not link.dropped and link.pump_deadline == math.inf


def test_output_disconnects_while_closing_are_no_drop():
    link = serving()
    link.close()
    assert link.output_disconnected("ipc://out") is None and not link.dropped
