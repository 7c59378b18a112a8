"""TrioSocket.recv_batch: one scheduler pass per received batch, cancellation atomic."""

from __future__ import annotations

import uuid

import pytest
import trio
import trio.testing
import zmq

from zmqdispatch._zmq_trio import ZmqContext

GUARD = 10  # seconds: a hang guard only, never a timing assertion


class _Steps(trio.abc.Instrument):
    """Counts the steps of one task (each resumption after a yield is a step)."""

    def __init__(self, task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task) -> None:
        if task is self.task:
            self.steps += 1


def _pair():
    ctx = ZmqContext()
    addr = f"inproc://zmqd-test-{uuid.uuid4().hex}"
    a = ctx.socket(zmq.PAIR, name="a")
    b = ctx.socket(zmq.PAIR, name="b")
    a.bind(addr)
    b.connect(addr)
    return a, b


async def _recv_counting_resumptions(sock) -> tuple[list[list[bytes]], int]:
    steps = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        batch = await sock.recv_batch()
    finally:
        trio.lowlevel.remove_instrument(steps)
    return batch, steps.steps


async def test_a_receive_that_waited_returns_in_the_pass_that_woke_it():
    # The wait was the checkpoint: routing starts in the pass the data woke the
    # pump, not one scheduler pass (an epoll round) later.
    a, b = _pair()
    try:
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                result: dict[str, object] = {}

                async def receiver() -> None:
                    result["batch"], result["resumed"] = await _recv_counting_resumptions(b)

                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                await a.send([b"x"])
                await a.send([b"y"])
            assert result["batch"] in ([[b"x"]], [[b"x"], [b"y"]])
            assert result["resumed"] == 1  # woken once, then returned without another yield
    finally:
        a.close()
        b.close()


async def test_a_receive_with_data_queued_still_yields_once():
    a, b = _pair()
    try:
        with trio.fail_after(GUARD):
            await a.send([b"x"])
            await a.send([b"y"])
            batch: list[list[bytes]] = []
            while len(batch) < 2:
                got, resumed = await _recv_counting_resumptions(b)
                batch += got
                assert resumed == 1  # a checkpoint even though nothing had to be waited for
            assert batch == [[b"x"], [b"y"]]
    finally:
        a.close()
        b.close()


async def test_a_cancelled_receive_takes_nothing():
    a, b = _pair()
    try:
        with trio.fail_after(GUARD):
            await a.send([b"x"])
            with trio.CancelScope() as scope:
                scope.cancel()
                with pytest.raises(trio.Cancelled):
                    await b.recv_batch()
            assert await b.recv_batch() == [[b"x"]]
    finally:
        a.close()
        b.close()
