"""Sans-IO startup handshake, keyed by engine identity.

The engine dials the client's handshake ROUTER (``docs/vllm-wire.md`` §5.1)::

    engine -> HELLO   (handshake ROUTER, frames [identity, status map])
    client -> INIT    (the input and output addresses to dial)
    engine -> READY                  (handshake ROUTER)
    engine -> EngineCoreReadyResponse (input ROUTER, same identity)

READY and the ready response come in either order (vLLM sends the ready
response first, TokenSpeed READY first). One :class:`Handshake` serves every
engine behind one handshake address: its state is one :class:`EngineHandshake`
per identity (vLLM data parallel: the DP rank, 2 bytes little-endian), and it
is complete once ``engines`` identities have finished. An identity that
finished and says HELLO again starts over (an engine restarted on the same
address); HELLO twice during one handshake is an error.

The shell (``client.py``) feeds the received frames, the handshake socket's
connection events and the launched process's exit with the current time,
sends the INIT frames it is handed, and sleeps until :meth:`Handshake.next_deadline`,
then calls :meth:`Handshake.timer_fired`. Failures raise
:class:`~zmqdispatch.errors.EngineHandshakeError` /
:class:`~zmqdispatch.errors.EngineHandshakeTimeout`, which name the stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from .. import limits
from ..errors import EngineHandshakeError, EngineHandshakeTimeout, RemoteProtocolError
from ..wire import vllm_handshake as wire  # only the handshake messages are used here

__all__ = [
    "ADDRESS_INDEX_STRIDE", "EngineHandshake", "Handshake", "HandshakeStep", "HandshakeTable", "HelloVerdict",
    "check_not_lockstep", "is_hello",
]


@attrs.define(slots=True)
class EngineHandshake:
    """One engine's handshake: HELLO received at ``hello_at``, then its READY
    status and its ready response (either order)."""

    identity: bytes
    hello_at: float
    local: bool = False
    ready_status: wire.HandshakeStatus | None = None
    ready: wire.EngineCoreReadyResponse | None = None

    @property
    def done(self) -> bool:
        return self.ready_status is not None and self.ready is not None

    @property
    def stage(self) -> str:
        """What this engine's handshake waits for: ``"READY"``,
        ``"input_registration"`` (its ready response), or ``"done"``."""
        if self.ready_status is None:
            return "READY"
        if self.ready is None:
            return "input_registration"
        return "done"


@attrs.frozen(slots=True)
class HandshakeStep:
    """What a received message did, for the shell to act on and log.

    ``event``: ``"HELLO"`` (send ``reply`` back on the handshake socket:
    ``[identity, INIT]``), ``"READY"``, or ``"ready_response"``."""

    event: str
    identity: bytes
    reply: list[bytes] | None = None
    local: bool = False


class Handshake:
    """The handshake of up to ``engines`` engines behind one handshake address.

    Args:
        now: the start (seconds, the shell's clock).
        timeout: seconds for the whole handshake (``ClientConfig.handshake_timeout``).
        input_address / output_address: what INIT tells each engine to dial.
        engines: how many distinct identities complete the handshake (1 today).
        drop_grace: after the handshake connection closed with a handshake
            begun and not done, seconds to read what was sent before the
            close (``limits.OUTPUT_DROP_GRACE``), then ``EngineHandshakeError``.
    """

    def __init__(
        self,
        *,
        now: float,
        timeout: float,
        input_address: str,
        output_address: str,
        engines: int = 1,
        drop_grace: float = limits.OUTPUT_DROP_GRACE,
    ) -> None:
        self.deadline = now + timeout
        self.timeout = timeout
        self.input_address = input_address
        self.output_address = output_address
        self.engines = engines
        self.drop_grace = drop_grace
        self.by_identity: dict[bytes, EngineHandshake] = {}
        self.peers: set[int] = set()
        self.closed_until = math.inf  # the grace after the handshake connection closed

    # ------------------------------------------------------------------ state

    @property
    def complete(self) -> bool:
        done = [e for e in self.by_identity.values() if e.done]
        return len(done) >= self.engines

    def stage(self) -> str:
        """What the handshake waits for: ``"HELLO"`` until every expected
        engine said HELLO, then the earliest stage among them (``"READY"``,
        ``"input_registration"``)."""
        if self.complete:
            return "done"
        if len(self.by_identity) < self.engines:
            return "HELLO"
        pending = [e.stage for e in self.by_identity.values() if not e.done]
        return "READY" if "READY" in pending else "input_registration"

    @property
    def wants_handshake_messages(self) -> bool:
        """Some expected engine has not sent HELLO or READY yet."""
        return len(self.by_identity) < self.engines or any(e.ready_status is None for e in self.by_identity.values())

    @property
    def wants_ready_responses(self) -> bool:
        """Some expected engine has not sent its ready response yet."""
        return len(self.by_identity) < self.engines or any(e.ready is None for e in self.by_identity.values())

    def results(self) -> list[tuple[bytes, wire.EngineCoreReadyResponse]]:
        """``(identity, ready response)`` of each finished engine, in HELLO order."""
        return [(e.identity, e.ready) for e in self.by_identity.values() if e.ready is not None and e.done]

    def next_deadline(self) -> float:
        """When the shell calls :meth:`timer_fired`."""
        return min(self.deadline, self.closed_until)

    # ------------------------------------------------------------------ events

    def handshake_received(self, frames: list[bytes], now: float) -> HandshakeStep:
        """A message on the handshake ROUTER: ``[identity, status map]``.

        Raises:
            EngineHandshakeError: not 2 frames, undecodable, HELLO twice from
                one identity during its handshake, HELLO from more engines than
                expected, READY before HELLO, or another status.
        """
        if len(frames) != 2:
            raise EngineHandshakeError(f"handshake message has {len(frames)} frames, expected 2")
        identity, payload = frames
        try:
            status = wire.decode_handshake_status(payload)
        except RemoteProtocolError as exc:
            raise EngineHandshakeError(f"undecodable handshake message: {exc}") from exc
        known = self.by_identity.get(identity)
        if status.status == "HELLO":
            if known is not None and not known.done:
                raise EngineHandshakeError(f"second HELLO (identity {identity.hex()}) during the handshake")
            if known is None and len(self.by_identity) >= self.engines:
                raise EngineHandshakeError(
                    f"second HELLO (identity {identity.hex()}) during the handshake: expected {self.engines} "
                    f"engine{'s' if self.engines != 1 else ''}"
                )
            self.by_identity[identity] = EngineHandshake(identity, now, local=status.local)
            init = wire.encode_init(inputs=[self.input_address], outputs=[self.output_address])
            return HandshakeStep("HELLO", identity, [identity, init], status.local)
        if status.status == "READY":
            if known is None or known.done:
                raise EngineHandshakeError(f"READY from identity {identity.hex()} before its HELLO")
            known.ready_status = status
            return HandshakeStep("READY", identity)
        raise EngineHandshakeError(f"unexpected handshake status {status.status!r}")

    def input_received(self, frames: list[bytes], now: float) -> HandshakeStep:
        """A message on the input ROUTER during the handshake: an engine's
        ``EngineCoreReadyResponse`` ``[identity, map]``.

        Raises:
            EngineHandshakeError: not 2 frames, an identity without a HELLO, a
                second ready response, or an undecodable ready response.
        """
        if len(frames) != 2:
            raise EngineHandshakeError(f"input registration has {len(frames)} frames, expected 2")
        identity, payload = frames
        known = self.by_identity.get(identity)
        if known is None or known.ready is not None:
            raise EngineHandshakeError(f"ready response from unknown identity {identity.hex()}")
        try:
            known.ready = wire.decode_ready_response(payload)
        except RemoteProtocolError as exc:
            raise EngineHandshakeError(f"bad EngineCoreReadyResponse: {exc}") from exc
        return HandshakeStep("ready_response", identity)

    def init_unreachable(self, identity: bytes) -> EngineHandshakeError:
        """INIT could not be sent (``EHOSTUNREACH``): the error to raise."""
        return EngineHandshakeError(
            "the engine closed its handshake connection right after HELLO (it exited or crashed)"
        )

    def process_exited(self, pid: int, code: int | None) -> EngineHandshakeError:
        """The launched engine exited during the handshake: the error to raise."""
        return EngineHandshakeError(f"engine process {pid} exited with code {code} during the handshake")

    def peer_connected(self, fd: int) -> None:
        """The handshake ROUTER accepted a connection (monitor ``ACCEPTED``)."""
        self.peers.add(fd)

    def peer_disconnected(self, fd: int, now: float) -> None:
        """A handshake connection closed (monitor ``DISCONNECTED``). When none
        is left, what was sent before the close gets ``drop_grace`` seconds;
        :meth:`timer_fired` then fails a begun handshake."""
        self.peers.discard(fd)
        if not self.peers and self.closed_until == math.inf:
            self.closed_until = now + self.drop_grace

    def timer_fired(self, now: float) -> None:
        """Check the deadlines at *now*.

        Raises:
            EngineHandshakeError: the handshake connection closed ``drop_grace``
                ago with a handshake begun and not complete (a close before
                any HELLO is a probe, or an engine not started yet: ignored).
            EngineHandshakeTimeout: ``timeout`` passed (``.stage`` says what
                was awaited).
        """
        if self.complete:
            return
        if now >= self.closed_until:
            self.closed_until = math.inf
            if self.by_identity:
                raise EngineHandshakeError(
                    f"the engine closed its handshake connection while the handshake waited for {self.stage()}"
                    " (it exited or crashed)"
                )
        if now >= self.deadline:
            stage = self.stage()
            raise EngineHandshakeTimeout(
                f"engine handshake timed out after {self.timeout} s waiting for {stage}", stage=stage
            )


def is_hello(frames: list[bytes]) -> bool:
    """Whether a message of the handshake ROUTER, ``[identity, status map]``,
    is a well-formed HELLO (vLLM's or TokenSpeed's). Never raises."""
    if len(frames) != 2:
        return False
    try:
        return wire.decode_handshake_status(frames[1]).status == "HELLO"
    except RemoteProtocolError:
        return False


def check_not_lockstep(ready: wire.EngineCoreReadyResponse, identity: bytes, *, vllm: bool) -> None:
    """Refuse a vLLM engine that runs MoE lock-step waves.

    A vLLM ``DPEngineCoreProc`` reports ``data_parallel_size > 1`` in its ready
    response: its ranks step together in waves, and a front end must run the
    wave protocol (start-wave messages, wave-complete notices, dummy batches
    on idle ranks). This client does not, so such a rank is refused rather
    than left to stall (``docs/many-engines.md`` §5). Independent DP ranks
    (non-MoE models) report 1. TokenSpeed ranks report the group size and are
    independent: not refused (*vllm* False).

    Raises:
        EngineHandshakeError: naming the rank and the reported size.
    """
    if vllm and ready.data_parallel_size > 1:
        raise EngineHandshakeError(
            f"engine identity {identity.hex()} (data_parallel_rank {ready.data_parallel_rank}) reports "
            f"data_parallel_size {ready.data_parallel_size}: a lock-step (MoE wave) data-parallel rank; "
            "zmqdispatch does not implement the wave protocol, so it serves only independent ranks "
            "(data_parallel_size 1 in each engine's ready response)"
        )


#: The ``engine_index`` step between handshake addresses: an engine that dialed
#: the k-th address (0-based, in the order given) has ``engine_index`` ``k *
#: ADDRESS_INDEX_STRIDE + identity``. The identity is 2 bytes (vLLM: the DP rank;
#: TokenSpeed: ``zmq_engine_index + dp_rank``), so no two addresses can collide,
#: and the engines of the first (or only) address keep their identity as index.
ADDRESS_INDEX_STRIDE = 1 << 16


@attrs.frozen
class HelloVerdict:
    """What to do with one message on a handshake ROUTER (:meth:`HandshakeTable.classify`).

    Attributes:
        engine_index: the engine it belongs to.
        refusal: why it is dropped (log it; the engine may dial again), or None.
        restarted_mid_handshake: a HELLO from an engine whose handshake is under
            way: it restarted; drop that attempt and start over.
    """

    engine_index: int
    refusal: str | None = None
    restarted_mid_handshake: bool = False


@attrs.define
class HandshakeTable:
    """Which engine a handshake message belongs to, and whether it may start
    a handshake: the shell's rules for every engine that dials, sans-IO.

    Args:
        max_pending: handshakes under way at once (``limits.MAX_PENDING_HANDSHAKES``,
            or the engines waited for when more).
        one_engine_only: the client's data-plane pair is fixed (one engine):
            a HELLO from any engine but the first one seen is refused.
    """

    max_pending: int
    one_engine_only: bool = False
    _only_index: int | None = None

    def classify(self, frames: list[bytes], base: int, pending: Mapping[int, object],
                 members: Mapping[int, object]) -> HelloVerdict:
        """Classify *frames* received on the handshake ROUTER of the address
        whose index base is *base*, given the handshakes under way (*pending*)
        and the engines served (*members*), both by ``engine_index``."""
        identity = frames[0] if frames else b""
        rank = int.from_bytes(identity, "little")
        if rank >= ADDRESS_INDEX_STRIDE:
            return HelloVerdict(-1, f"identity {identity.hex()} refused: an engine identity is 2 bytes (its rank)")
        index = base + rank
        under_way = index in pending
        restarted = under_way and is_hello(frames)
        if self.one_engine_only:
            if self._only_index is None:
                self._only_index = index
            elif index != self._only_index:
                return HelloVerdict(index, f"HELLO from identity {identity.hex()} refused: this client's fixed "
                                           f"input/output addresses serve engine {self._only_index} only")
        if (not under_way or restarted) and len(pending) - restarted >= self.max_pending:
            return HelloVerdict(index, f"HELLO from identity {identity.hex()} refused: {len(pending)} handshakes "
                                       "are under way, the most at once (limits.MAX_PENDING_HANDSHAKES); it may "
                                       "dial again")
        return HelloVerdict(index, restarted_mid_handshake=restarted)
