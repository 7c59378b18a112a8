"""A scripted fake vLLM engine for tests, in the same trio run as the client.

The test drives it step by step: receive what the client sent
(:meth:`FakeEngine.receive` -> :class:`Received`), push hand-built outputs,
the ``ENGINE_CORE_DEAD`` sentinel or garbage, stop reading, disconnect. It
speaks the real wire (vLLM 0.32 ``EngineCoreRequest`` in, ``EngineCoreOutputs``
out) over real ``ipc://`` sockets (:mod:`zmqdispatch.testing.dial`).

Usage (or :func:`zmqdispatch.testing.open_fake_engine_pair`, which does this)::

    async with trio.open_nursery() as nursery:
        engine = FakeEngine(addr)
        nursery.start_soon(engine.run_handshake)
        async with connect(addr) as client:
            await engine.handshake_done.wait()
            ...
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ..wire import vllm as wire
from ..wire import vllm_engine as wire_engine
from ..wire import vllm_handshake as handshake
from .dial import EngineSockets, dial, ready_response

__all__ = ["FakeEngine", "Received"]


@attrs.define
class Received:
    """One message the client sent: ``kind`` is a ``RequestType``; ``value`` is
    the decoded ``EngineCoreRequest``, the ABORT id tuple, or the
    ``wire_engine.UtilityCall`` (``client_index``, ``call_id``, ``method``, ``args``)."""

    kind: wire.RequestType
    value: object
    frames: list[bytes]


class FakeEngine:
    """The engine end of one connection, scripted by a test.

    Args:
        handshake_address: the client's handshake address.
        ready: the ready response to register with (default:
            :func:`~zmqdispatch.testing.dial.ready_response`).
        engine_index: DP rank / identity.
        input_rcvhwm: receive HWM of the input DEALER (0 = unbounded as vLLM).
        send_ready: False = never send READY (handshake timeout tests).
    """

    def __init__(
        self,
        handshake_address: str,
        *,
        ready: handshake.EngineCoreReadyResponse | None = None,
        engine_index: int = 0,
        input_rcvhwm: int = 0,
        send_ready: bool = True,
    ) -> None:
        self.handshake_address = handshake_address
        self.ready = ready or ready_response()
        self.engine_index = engine_index
        self.input_rcvhwm = input_rcvhwm
        self.send_ready = send_ready
        self.handshake_done = trio.Event()
        self.socks: EngineSockets | None = None
        self.aborted: list[str] = []

    async def run_handshake(self) -> None:
        """Dial the client and complete (or, scripted, stall) the handshake."""
        self.socks = await dial(
            self.handshake_address,
            self.ready,
            engine_index=self.engine_index,
            send_ready=self.send_ready,
            input_rcvhwm=self.input_rcvhwm,
        )
        self.handshake_done.set()

    # ---------------------------------------------------------------- input side

    async def receive(self) -> Received:
        """The next message from the client, decoded."""
        assert self.socks is not None
        frames = await self.socks.input.recv_multipart()
        kind = wire.RequestType(frames[0][0])
        if kind == wire.RequestType.ADD:
            value: object = wire_engine.decode_request(frames[1:])
        elif kind == wire.RequestType.ABORT:
            aborted = wire_engine.decode_abort(frames[1])
            self.aborted.extend(aborted)
            value = aborted
        elif kind == wire.RequestType.UTILITY:
            value = wire_engine.decode_utility_call(frames[1])
        else:
            value = frames[1:]
        return Received(kind, value, frames)

    async def receive_add(self) -> wire.EngineCoreRequest:
        """Receive the next message and check that it is an ADD."""
        msg = await self.receive()
        assert msg.kind == wire.RequestType.ADD, f"expected ADD, got {msg.kind!r}"
        return msg.value  # type: ignore[return-value]

    async def receive_abort(self) -> tuple[str, ...]:
        """Receive the next message and check that it is an ABORT."""
        msg = await self.receive()
        assert msg.kind == wire.RequestType.ABORT, f"expected ABORT, got {msg.kind!r}"
        return msg.value  # type: ignore[return-value]

    # ---------------------------------------------------------------- output side

    async def send_outputs(self, outputs: Sequence[wire_engine.EngineCoreOutput], **kw: Any) -> None:
        """Push one ``EngineCoreOutputs`` with *outputs*; *kw* are its other fields
        (``wire.vllm_engine.encode_outputs``: ``timestamp``, default now; ``utility_output``,
        ``finished_requests``, ...)."""
        assert self.socks is not None
        kw.setdefault("timestamp", time.monotonic())
        kw.setdefault("weight_version", "default")
        await self.socks.output.send(wire_engine.encode_outputs(self.engine_index, list(outputs), **kw))

    async def send_tokens(self, request_id: str, token_ids: Sequence[int], finish: wire.FinishReason | None = None,
                          stop_reason: int | str | None = None) -> None:
        """Shorthand: one output for one request."""
        await self.send_outputs([
            wire_engine.EngineCoreOutput(request_id=request_id, new_token_ids=tuple(token_ids), finish_reason=finish,
                                  stop_reason=stop_reason)
        ])

    async def send_raw(self, frames: Sequence[bytes]) -> None:
        """Push arbitrary frames (garbage, truncated messages, ...)."""
        assert self.socks is not None
        await self.socks.output.send(list(frames))

    async def send_sentinel(self) -> None:
        """Push the single-frame ``ENGINE_CORE_DEAD`` sentinel."""
        await self.send_raw([wire.ENGINE_CORE_DEAD])

    async def reply_utility(self, call_id: int, result: object = None, failure: str | None = None) -> None:
        """Answer a utility call."""
        await self.send_outputs(
            [], utility_output=wire.UtilityOutput(
                call_id=call_id, failure_message=failure, result=None if failure else wire.UtilityResult(result)
            ),
            weight_version=None,
        )

    def close(self) -> None:
        """Disconnect both data-plane sockets (the client's ROUTER then gets EHOSTUNREACH)."""
        if self.socks is not None:
            self.socks.close()
