"""Admission under load: ADDs are encoded by the input pump in slices, so a
burst of requests entering at once does not hold the output routing; a request
the wire cannot carry fails alone with a typed error (client + FakeEngine over
real sockets)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from zmqdispatch import RequestRejected, limits
from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.protocol.engine import EngineProtocol
from zmqdispatch.testing import open_fake_engine_pair as fake_pair
from zmqdispatch.wire import vllm as wire

from ..helpers import make_request, out

GUARD = 10  # seconds: a hang guard only, never a timing assertion


class _Passes(trio.abc.Instrument):
    """Counts the event loop's passes (one I/O check, then the runnable tasks)."""

    def __init__(self) -> None:
        self.count = 0

    def after_io_wait(self, timeout: float) -> None:
        self.count += 1


async def test_the_input_pump_yields_between_slices_of_adds(monkeypatch):
    # SEND_SLICE_SECONDS bounds the input pump's work per scheduler pass; at 0
    # every message ends its slice, so each send is in a pass of its own and
    # other tasks (the output pump) run in between. Without slices, all of
    # them went out in one pass, after all of them were encoded.
    monkeypatch.setattr(limits, "SEND_SLICE_SECONDS", 0.0)
    monkeypatch.setattr(limits, "SEND_SLICE_SHARE", 0.0)
    passes = _Passes()
    sent_in_pass: list[int] = []
    real_send_done = EngineProtocol.send_done

    def send_done(self, out):
        sent_in_pass.append(passes.count)
        real_send_done(self, out)

    monkeypatch.setattr(EngineProtocol, "send_done", send_done)
    n = 6
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            entered = 0
            order: list[str] = []
            go = trio.Event()

            async def enter(i: int) -> None:
                nonlocal entered
                await go.wait()
                order.append(f"r{i}")  # trio runs a pass's tasks in any order
                async with client.generate(make_request(f"r{i}")):
                    entered += 1
                    await trio.sleep_forever()

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(enter, i)
                await trio.testing.wait_all_tasks_blocked()
                trio.lowlevel.add_instrument(passes)
                go.set()  # all of them enter in one scheduler pass
                # the ADDs still reach the engine in submission order
                assert [(await engine.receive_add()).request_id for _ in range(n)] == order
                while entered < n:
                    await trio.sleep(0.001)
                trio.lowlevel.remove_instrument(passes)
                adds_sent_in = sent_in_pass[:n]
                nursery.cancel_scope.cancel()
            assert len(set(adds_sent_in)) == n, adds_sent_in  # one send per pass
            # leaving the streams aborted all of them, in one frame
            assert sorted(await engine.receive_abort()) == sorted(order)


def _unencodable(monkeypatch, bad_id: str) -> None:
    """Requests with id *bad_id* pass validation but the wire encoder refuses
    them (as it does, e.g., a schema nested too deep for it)."""
    real = wire.encode_request  # the module protocol.runtime encodes with

    def encode(req):
        if req.request_id == bad_id:
            raise LocalProtocolError("structured_outputs: nested too deep to encode")
        return real(req)

    monkeypatch.setattr(wire, "encode_request", encode)


async def test_a_request_the_wire_cannot_carry_fails_on_entering_and_sends_nothing(monkeypatch):
    _unencodable(monkeypatch, "bad")
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            stream = client.generate(make_request("bad"))  # validation passes
            with pytest.raises(RequestRejected, match="nested too deep") as ei:
                async with stream:
                    pytest.fail("entered a stream whose ADD was never sent")
            assert ei.value.request_id == "bad" and stream.finished
            assert not client.protocol.is_live("bad")
            async with client.generate(make_request("ok", max_tokens=1)) as s:
                # the first thing the engine ever sees is the valid ADD
                assert (await engine.receive_add()).request_id == "ok"
                await engine.send_outputs([out("ok", [7], wire.FinishReason.LENGTH)])
                assert [d.token_ids async for d in s] == [[7]]


async def test_in_a_stream_group_it_ends_that_request_alone(monkeypatch):
    _unencodable(monkeypatch, "bad")
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            async with client.stream_group() as group:
                group.generate(make_request("a", max_tokens=1))
                group.generate(make_request("bad"))
                group.generate(make_request("b", max_tokens=1))
                assert [(await engine.receive_add()).request_id for _ in range(2)] == ["a", "b"]
                await engine.send_outputs([out("a", [1], wire.FinishReason.LENGTH),
                                           out("b", [2], wire.FinishReason.LENGTH)])
                items: dict[str, object] = {}
                while len(group):
                    for member, item in await group.receive():
                        items[member.request_id] = item
                assert isinstance(items["bad"], RequestRejected) and items["bad"].request_id == "bad"
                assert items["a"].token_ids == [1] and items["b"].token_ids == [2]


async def test_in_a_fan_out_it_fails_the_parent_and_aborts_the_siblings(monkeypatch):

    _unencodable(monkeypatch, "p-1")
    async with fake_pair() as (engine, client):
        with trio.fail_after(GUARD):
            with pytest.raises(RequestRejected) as ei:
                async with client.generate_samples([make_request(f"p-{i}") for i in range(3)]) as merged:
                    async for _ in merged:
                        pass  # pragma: no cover
            assert ei.value.request_id == "p-1"
            # The siblings' ADDs that went out are aborted; p-1 never reaches the wire.
            sent: list[str] = []
            while True:
                msg = await engine.receive()
                if msg.kind == wire.RequestType.ABORT:
                    break
                sent.append(msg.value.request_id)
            assert "p-0" in sent and "p-1" not in sent and sorted(msg.value) == sorted(sent)
            assert client.protocol.inflight == 0


def test_the_send_slice_follows_the_length_of_the_loops_passes(monkeypatch):
    from zmqdispatch.connection import send_slice

    monkeypatch.setattr(limits, "SEND_SLICE_SECONDS", 0.001)
    monkeypatch.setattr(limits, "SEND_SLICE_SHARE", 0.25)
    assert send_slice(0.0) == 0.001  # after a park, or when the others were quick
    assert send_slice(0.002) == 0.001
    # the others ran 100 ms (routing a saturated engine's batch): a quarter of it
    assert send_slice(0.1) == pytest.approx(0.025)
