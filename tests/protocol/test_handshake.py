"""The startup handshake (zmqdispatch.protocol.handshake), per engine
identity, with plain numbers for time: no sockets, no trio."""

import math

import msgpack
import pytest

from zmqdispatch.errors import EngineHandshakeError, EngineHandshakeTimeout
from zmqdispatch.protocol.handshake import Handshake

E0, E1 = (0).to_bytes(2, "little"), (1).to_bytes(2, "little")
HELLO = msgpack.packb({"status": "HELLO", "local": True, "headless": False})
READY = msgpack.packb({"status": "READY", "local": True, "headless": False})
READY_RESPONSE = msgpack.packb({"max_model_len": 2048})


def machine(now: float = 0.0, **kw) -> Handshake:
    kw.setdefault("timeout", 30.0)
    return Handshake(now=now, input_address="ipc://in", output_address="ipc://out", **kw)


def test_hello_init_ready_and_ready_response_complete_it_with_the_stages_named():
    h = machine()
    assert h.stage() == "HELLO"
    step = h.handshake_received([E0, HELLO], 1.0)
    assert step.event == "HELLO" and step.identity == E0 and step.local
    identity, init = step.reply
    assert identity == E0
    addresses = msgpack.unpackb(init)["addresses"]
    assert addresses["inputs"] == ["ipc://in"] and addresses["outputs"] == ["ipc://out"]
    assert h.stage() == "READY"
    assert h.handshake_received([E0, READY], 2.0).event == "READY"
    assert h.stage() == "input_registration" and not h.complete
    assert h.input_received([E0, READY_RESPONSE], 3.0).event == "ready_response"
    assert h.complete and h.stage() == "done"
    ((identity, ready),) = h.results()
    assert identity == E0 and ready.max_model_len == 2048


def test_the_ready_response_may_come_before_ready():
    h = machine()
    h.handshake_received([E0, HELLO], 1.0)
    h.input_received([E0, READY_RESPONSE], 2.0)
    assert h.stage() == "READY" and not h.complete
    h.handshake_received([E0, READY], 3.0)
    assert h.complete


@pytest.mark.parametrize(
    ("feed", "stage"),
    [([], "HELLO"), ([[E0, HELLO]], "READY"), ([[E0, HELLO], [E0, READY]], "input_registration")],
)
def test_the_timeout_names_the_stage_it_waited_for(feed, stage):
    h = machine(timeout=5.0)
    for frames in feed:
        h.handshake_received(frames, 1.0)
    assert h.next_deadline() == 5.0
    h.timer_fired(4.99)
    with pytest.raises(EngineHandshakeTimeout) as ei:
        h.timer_fired(5.0)
    assert ei.value.stage == stage and "after 5.0 s waiting for " + stage in str(ei.value)


def test_a_second_hello_from_the_same_engine_during_its_handshake_is_an_error():
    h = machine()
    h.handshake_received([E0, HELLO], 1.0)
    with pytest.raises(EngineHandshakeError, match="second HELLO"):
        h.handshake_received([E0, HELLO], 2.0)


def test_a_hello_from_more_engines_than_expected_is_an_error():
    h = machine()
    h.handshake_received([E0, HELLO], 1.0)
    with pytest.raises(EngineHandshakeError, match=r"second HELLO.*expected 1 engine"):
        h.handshake_received([E1, HELLO], 2.0)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([E0, READY], "READY from identity 0000 before its HELLO"),
        ([E0], "1 frames, expected 2"),
        ([E0, b"\xc1"], "undecodable handshake message"),
        ([E0, msgpack.packb({"status": "BYE"})], "unexpected handshake status 'BYE'"),
    ],
)
def test_unexpected_handshake_messages_are_errors(frames, match):
    with pytest.raises(EngineHandshakeError, match=match):
        machine().handshake_received(frames, 1.0)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([E1, READY_RESPONSE], "ready response from unknown identity 0100"),
        ([E0, READY_RESPONSE, b""], "3 frames, expected 2"),
        ([E0, msgpack.packb({"max_model_len": 0})], "bad EngineCoreReadyResponse"),
    ],
)
def test_bad_input_registrations_are_errors(frames, match):
    h = machine()
    h.handshake_received([E0, HELLO], 1.0)
    with pytest.raises(EngineHandshakeError, match=match):
        h.input_received(frames, 2.0)


def test_the_handshake_connection_closing_mid_handshake_fails_it_after_the_grace():
    h = machine(drop_grace=0.25)
    h.peer_connected(5)
    h.handshake_received([E0, HELLO], 1.0)
    h.peer_disconnected(5, 2.0)
    assert h.next_deadline() == 2.25
    h.timer_fired(2.2)
    with pytest.raises(EngineHandshakeError,
                       match="closed its handshake connection while the handshake waited for READY"):
        h.timer_fired(2.25)


def test_what_was_sent_before_the_close_still_completes_the_handshake():
    h = machine(drop_grace=0.25)
    h.peer_connected(5)
    h.handshake_received([E0, HELLO], 1.0)
    h.peer_disconnected(5, 2.0)
    h.handshake_received([E0, READY], 2.1)
    h.input_received([E0, READY_RESPONSE], 2.1)
    h.timer_fired(2.25)  # complete: nothing raised
    assert h.complete


def test_a_probe_closing_before_any_hello_is_ignored():
    h = machine(drop_grace=0.25)
    h.peer_connected(5)
    h.peer_disconnected(5, 1.0)
    h.timer_fired(1.25)
    assert h.next_deadline() == 30.0  # back to the timeout
    h.peer_connected(6)
    h.peer_connected(7)
    h.peer_disconnected(6, 2.0)  # another connection is still open
    assert h.next_deadline() == 30.0


def test_process_exit_and_an_unreachable_engine_are_errors_naming_them():
    h = machine()
    assert "engine process 42 exited with code 1 during the handshake" in str(h.process_exited(42, 1))
    assert "right after HELLO" in str(h.init_unreachable(E0))


def test_several_engines_behind_one_handshake_each_get_their_own_init_and_complete_together():
    h = machine(engines=2)
    assert h.handshake_received([E0, HELLO], 1.0).reply[0] == E0
    assert h.stage() == "HELLO"  # rank 1 has not said HELLO yet
    assert h.handshake_received([E1, HELLO], 1.1).reply[0] == E1
    for e in (E0, E1):
        h.handshake_received([e, READY], 2.0)
    h.input_received([E1, READY_RESPONSE], 2.0)
    assert not h.complete and h.stage() == "input_registration"
    h.input_received([E0, READY_RESPONSE], 2.0)
    assert h.complete and [i for i, _ in h.results()] == [E0, E1]
    assert not h.wants_handshake_messages and not h.wants_ready_responses


def test_an_engine_restarted_after_its_handshake_starts_over_with_a_fresh_hello():
    h = machine()
    for frames in ([E0, HELLO], [E0, READY]):
        h.handshake_received(frames, 1.0)
    h.input_received([E0, READY_RESPONSE], 1.0)
    assert h.complete
    step = h.handshake_received([E0, HELLO], 50.0)  # restarted on the same address
    assert step.reply is not None and h.stage() == "READY" and not h.complete


def test_no_timeout_means_no_deadline():
    assert machine(timeout=math.inf).next_deadline() == math.inf


def test_a_lock_step_vllm_rank_is_refused_and_says_why():
    from zmqdispatch.protocol.handshake import check_not_lockstep
    from zmqdispatch.wire import vllm_handshake as wire

    lockstep = wire.EngineCoreReadyResponse(max_model_len=64, data_parallel_size=4, data_parallel_rank=2)
    with pytest.raises(EngineHandshakeError, match=r"data_parallel_rank 2.*data_parallel_size 4.*wave protocol"):
        check_not_lockstep(lockstep, b"\x02\x00", vllm=True)
    check_not_lockstep(lockstep, b"\x02\x00", vllm=False)  # TokenSpeed ranks report the group size: independent
    check_not_lockstep(wire.EngineCoreReadyResponse(max_model_len=64), b"\x00\x00", vllm=True)
