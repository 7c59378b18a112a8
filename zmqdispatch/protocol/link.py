"""Sans-IO liveness of one engine's data-plane link: when is the engine gone,
dead, or only its output connection lost.

One :class:`EngineLink` per engine (vLLM data parallel: one per DP rank). The
trio shell (``client.py``) feeds it events as plain method calls with the
current time, and acts on what they return: a :class:`LinkDecision` (refuse
new requests and drain, declare the death, fail what an output drop may have
lost) or ``None``. Nothing here sleeps, reads a clock or touches a socket: the
shell sleeps until :meth:`EngineLink.next_deadline` (the silence watchdog) and
runs its output pump until :attr:`EngineLink.pump_deadline`.

The rules (``docs/failure-semantics.md``):

- **Death signs** (the input connection closed, the launched process exited,
  a send met ``EHOSTUNREACH``) may come before the engine's last outputs are
  read. The first sign is a ``GONE`` decision: new requests are refused at
  once; the pump keeps reading while an output connection is up, for at most
  ``drop_grace`` seconds, routes what is queued, then gets the ``DIE``
  decision (unless those outputs declared a death of their own: the
  ``ENGINE_CORE_DEAD`` sentinel, reported through :meth:`EngineLink.died`).
- **Output drop** (the output PULL's connection closed after its ZMTP
  handshake): the pump routes what arrived before, then, when requests or
  utility calls are open, stops reading for ``drop_grace`` seconds (a death
  sign in that window makes it a death as usual); else ``FAIL_SENT``: fail
  what may have been on the lost connection; the link lives on. With
  ``await_output_reconnect`` and no output connection left, the engine has
  ``reconnect_grace`` seconds to reconnect before ``DIE``
  (``output_disconnected``).
- **Silence**: ``silence_timeout`` seconds without output while requests are
  in flight is ``DIE`` (``silence``); counted from the last output or from the
  first request put in flight.
- **Send timeout**: ``DIE`` (``send_timeout``) at once.
- A connection that fails its ZMTP handshake before closing (a probe, a port
  scan) is counted in :attr:`EngineLink.stray_output_connections` and changes
  nothing; on the input socket only "no connection left" is a sign.

Cost on the hot path: the output pump calls :meth:`EngineLink.output_received`
once per received batch (one attribute store) and reads two attributes; nothing
per token or per request.
"""

from __future__ import annotations

import enum
import math

import attrs

from .. import limits

__all__ = ["EngineLink", "LinkAction", "LinkDecision", "PumpPhase"]


class LinkAction(enum.Enum):
    """What a :class:`LinkDecision` asks of the shell."""

    #: a death sign: refuse new requests now with ``reason`` / ``message``
    #: (``EngineProtocol.engine_gone``); the death follows once the outputs the
    #: engine sent before are routed (a later ``DIE`` from :meth:`EngineLink.pump_turn`)
    GONE = "gone"
    #: declare the engine dead (``EngineProtocol.engine_died``)
    DIE = "die"
    #: the output connection was lost: fail what may have been on it
    #: (``EngineProtocol.output_lost(message)``); the link lives on
    FAIL_SENT = "fail_sent"
    #: a stray connection to the output socket was ignored (log it; nothing else)
    STRAY = "stray"


@attrs.frozen(slots=True)
class LinkDecision:
    """One decision of the link. ``reason`` is the ``EngineDeadError.reason``
    for ``GONE`` / ``DIE``; ``message`` the error or log text; ``until`` the
    time the pump drains to (``GONE``), else ``inf``."""

    action: LinkAction
    reason: str
    message: str
    until: float = math.inf


class PumpPhase(enum.Enum):
    """What the output pump does until :attr:`EngineLink.pump_deadline`."""

    READ = "read"  # read and route outputs
    DRAIN = "drain"  # a death sign: read on while an output connection is up, then die
    HOLD = "hold"  # an output drop with work open: read nothing, wait for a death sign
    RECONNECT = "reconnect"  # no output connection left: read nothing, wait for one


class EngineLink:
    """The liveness state machine of one engine link (see the module doc).

    Args:
        engine_index: for messages.
        now: the current time (seconds, the shell's clock).
        silence_timeout: seconds of silence with requests in flight before
            ``DIE`` (``inf``: never).
        watch_input: an input disconnect (no input connection left) is a death
            sign (``ClientConfig.death_on_disconnect``).
        await_output_reconnect: without an output connection after a drop,
            ``DIE`` after ``reconnect_grace`` (``death_on_disconnect``).
        drop_grace: ``limits.OUTPUT_DROP_GRACE``.
        reconnect_grace: ``limits.OUTPUT_RECONNECT_GRACE``.

    Before :meth:`start` (the resume wait) input connection events only
    count connections. Every event after :meth:`died` or :meth:`close` decides
    nothing.

    Attributes read by the shell:
        pump_deadline: the output pump reads (:attr:`pump_reads`) or sleeps
            until then, then calls :meth:`pump_turn`; ``-inf`` = now. Changed
            by events: the shell moves its pump's wait to it after each one.
        pump_reads: whether the pump reads outputs in the current phase.
        gone: the ``GONE`` decision once a death sign came.
        output_links: output connections past their ZMTP handshake.
    """

    __slots__ = (
        "_stray",
        "await_output_reconnect",
        "closing",
        "dead",
        "drop_grace",
        "dropped",
        "engine_index",
        "gone",
        "input_peers",
        "last_activity",
        "output_links",
        "phase",
        "phase_until",
        "pump_deadline",
        "pump_reads",
        "reconnect_grace",
        "serving",
        "silence_timeout",
        "stray_output_connections",
        "watch_input",
    )

    def __init__(
        self,
        *,
        engine_index: int = 0,
        now: float = 0.0,
        silence_timeout: float = limits.DEFAULT_SILENCE_TIMEOUT,
        watch_input: bool = True,
        await_output_reconnect: bool = True,
        drop_grace: float = limits.OUTPUT_DROP_GRACE,
        reconnect_grace: float = limits.OUTPUT_RECONNECT_GRACE,
    ) -> None:
        self.engine_index = engine_index
        self.silence_timeout = silence_timeout
        self.watch_input = watch_input
        self.await_output_reconnect = await_output_reconnect
        self.drop_grace = drop_grace
        self.reconnect_grace = reconnect_grace
        self.last_activity = now
        self.serving = False
        self.closing = False
        self.dead: str | None = None  # the death's reason once declared
        self.gone: LinkDecision | None = None
        self.phase = PumpPhase.READ
        self.phase_until = math.inf
        self.pump_deadline = math.inf
        self.pump_reads = True
        self.output_links = 0
        self.dropped = ""  # endpoint of an output drop the pump has not handled yet
        self.stray_output_connections = 0
        self._stray = False
        self.input_peers: set[int] = set()

    def __repr__(self) -> str:
        return (f"<EngineLink engine={self.engine_index} phase={self.phase.value} dead={self.dead} "
                f"gone={self.gone is not None} output_links={self.output_links}>")

    @property
    def alive(self) -> bool:
        """Neither dead nor closing (events still decide)."""
        return self.dead is None and not self.closing

    def _refresh(self) -> None:
        """Recompute what the pump does and until when."""
        phase = self.phase
        self.pump_reads = phase is PumpPhase.READ or phase is PumpPhase.DRAIN
        if self.dead is not None:
            self.pump_deadline = -math.inf
        elif phase is PumpPhase.READ:
            self.pump_deadline = -math.inf if (self.gone is not None or self.dropped) else math.inf
        elif phase is PumpPhase.DRAIN:
            self.pump_deadline = -math.inf if self.output_links == 0 else self.phase_until
        elif phase is PumpPhase.HOLD:
            self.pump_deadline = -math.inf if self.gone is not None else self.phase_until
        else:  # RECONNECT
            self.pump_deadline = -math.inf if (self.gone is not None or self.output_links) else self.phase_until

    # ------------------------------------------------------------------ lifecycle

    def start(self, now: float) -> None:
        """The link serves from *now* (after the handshake or the resume wait)."""
        self.serving = True
        self.last_activity = now

    def died(self, reason: str) -> None:
        """The engine was declared dead (the ``ENGINE_CORE_DEAD`` sentinel,
        undecodable outputs, a ``DIE`` decision acted on, the client closing).
        The pump stops; nothing decides anymore."""
        if self.dead is None:
            self.dead = reason
            self._refresh()

    def close(self) -> None:
        """The client is closing: connection and process events are expected
        and decide nothing."""
        self.closing = True

    # ------------------------------------------------------------------ activity (per request / per batch)

    def submitted(self, now: float, inflight: int) -> None:
        """A request was put in flight; *inflight* counts it. The silence
        timer counts from the first request in flight."""
        if inflight == 1:
            self.last_activity = now

    def output_received(self, now: float) -> None:
        """A batch of outputs was received at *now* (the hot path: one store)."""
        self.last_activity = now

    def next_deadline(self) -> float:
        """When the shell calls :meth:`timer_fired` next (``inf``: never)."""
        if self.dead is not None or not self.serving:
            return math.inf
        return self.last_activity + self.silence_timeout

    def timer_fired(self, now: float, inflight: int) -> LinkDecision | None:
        """The silence watchdog: ``DIE`` (``silence``) when nothing came for
        ``silence_timeout`` seconds with *inflight* requests open; when none
        are, the silence restarts now."""
        if self.dead is not None or not self.serving or now < self.last_activity + self.silence_timeout:
            return None
        if inflight > 0:
            return LinkDecision(
                LinkAction.DIE, "silence",
                f"engine {self.engine_index} sent nothing for {self.silence_timeout} s "
                f"with {inflight} requests in flight",
            )
        self.last_activity = now
        return None

    # ------------------------------------------------------------------ death signs

    def _sign(self, reason: str, message: str, now: float) -> LinkDecision | None:
        if self.dead is not None or self.gone is not None or not self.serving:
            return None
        self.gone = LinkDecision(LinkAction.GONE, reason, message, now + self.drop_grace)
        self.phase_until = self.gone.until  # the drain's end, whatever phase the pump is in
        self._refresh()
        return self.gone

    def input_connected(self, fd: int) -> None:
        """The input ROUTER accepted a connection (monitor ``ACCEPTED``, *fd* its value)."""
        self.input_peers.add(fd)

    def input_disconnected(self, fd: int, endpoint: str, now: float) -> LinkDecision | None:
        """An input connection closed (monitor ``DISCONNECTED``). ``GONE``
        (``disconnected``) when it was the last one, with ``watch_input``,
        while serving and not closing: a stray connection closing leaves the
        engine's own in place."""
        self.input_peers.discard(fd)
        if self.input_peers or not self.watch_input or self.closing:
            return None
        return self._sign("disconnected", f"engine {self.engine_index} closed its input connection ({endpoint})", now)

    def process_exited(self, pid: int, code: int | None, now: float) -> LinkDecision | None:
        """The launched engine process exited: ``GONE`` (``process_exit``) unless closing."""
        if self.closing:
            return None
        return self._sign("process_exit", f"engine process {pid} exited with code {code}", now)

    def unreachable(self, now: float) -> LinkDecision | None:
        """A send met ``EHOSTUNREACH`` (no engine connected to the input ROUTER): ``GONE``."""
        return self._sign(
            "unreachable", f"engine {self.engine_index} is not connected to the input socket (EHOSTUNREACH)", now
        )

    def send_timed_out(self, timeout: float) -> LinkDecision | None:
        """A send waited *timeout* seconds for room: ``DIE`` (``send_timeout``)."""
        if self.dead is not None:
            return None
        return LinkDecision(
            LinkAction.DIE, "send_timeout",
            f"engine {self.engine_index} stopped reading its input: a send waited {timeout} s",
        )

    # ------------------------------------------------------------------ output connections

    def output_connected(self) -> None:
        """An output connection finished its ZMTP handshake (monitor ``HANDSHAKE_SUCCEEDED``)."""
        self.output_links += 1
        self._refresh()

    def output_handshake_failed(self) -> None:
        """A connection to the output socket failed its ZMTP handshake
        (libzmq reports it right before that connection's ``DISCONNECTED``)."""
        self._stray = True

    def output_disconnected(self, endpoint: str) -> LinkDecision | None:
        """An output connection closed (monitor ``DISCONNECTED``). A stray one
        is counted (``STRAY``, to log); an engine's (past its handshake) is a
        drop the pump handles (:attr:`pump_deadline` becomes now), unless
        closing."""
        if self._stray:
            self._stray = False
            self.stray_output_connections += 1
            return LinkDecision(LinkAction.STRAY, "", f"a connection to the output socket ({endpoint}) failed its "
                                "ZMTP handshake and was ignored")
        if self.closing:
            return None
        self.output_links = max(0, self.output_links - 1)
        self.dropped = endpoint or "?"
        self._refresh()
        return None

    # ------------------------------------------------------------------ the pump's turn

    def pump_turn(self, now: float, busy: bool) -> LinkDecision | None:
        """The pump reached :attr:`pump_deadline`. When :attr:`pump_reads`,
        it first routed every output already queued on its socket. *busy*:
        requests or utility calls are open (their outputs may be on a dropped
        connection). Returns what to act on; afterwards the pump goes on with
        the new :attr:`pump_deadline` / :attr:`pump_reads`."""
        if self.dead is not None:
            return None
        decision = self._turn(now, busy)
        self._refresh()
        return decision

    def _turn(self, now: float, busy: bool) -> LinkDecision | None:
        phase = self.phase
        gone = self.gone
        if phase is PumpPhase.READ:
            if gone is not None:
                if self.output_links > 0 and now < gone.until:
                    self.phase = PumpPhase.DRAIN  # phase_until is the drain's end (set by the sign)
                    return None
                return self._die_of(gone)
            if self.dropped:
                if busy:
                    self.phase, self.phase_until = PumpPhase.HOLD, now + self.drop_grace
                    return None
                return self._output_lost(now)
            return None
        if phase is PumpPhase.DRAIN:
            assert gone is not None
            if self.output_links > 0 and now < gone.until:
                return None
            return self._die_of(gone)
        if phase is PumpPhase.HOLD:
            if gone is not None:  # a death after all: read what is queued, drain, die
                self.phase = PumpPhase.READ
                return None
            if now < self.phase_until:
                return None
            return self._output_lost(now)
        # RECONNECT
        if gone is not None or self.output_links > 0:
            self.phase = PumpPhase.READ  # a further drop (self.dropped) is handled on the next turn
            return None
        if now < self.phase_until:
            return None
        self.phase = PumpPhase.READ
        return LinkDecision(
            LinkAction.DIE, "output_disconnected",
            f"engine {self.engine_index}'s output connection closed and did not come back within "
            f"{self.reconnect_grace} s (limits.OUTPUT_RECONNECT_GRACE)",
        )

    def _die_of(self, gone: LinkDecision) -> LinkDecision:
        self.phase = PumpPhase.READ
        return LinkDecision(LinkAction.DIE, gone.reason, gone.message)

    def _output_lost(self, now: float) -> LinkDecision:
        endpoint, self.dropped = self.dropped, ""
        if self.await_output_reconnect and self.output_links == 0:
            self.phase, self.phase_until = PumpPhase.RECONNECT, now + self.reconnect_grace
        else:
            self.phase = PumpPhase.READ
        return LinkDecision(
            LinkAction.FAIL_SENT, "output_lost",
            f"engine {self.engine_index}'s output connection ({endpoint}) was dropped, by libzmq for a frame above "
            f"MAX_FRAME_BYTES ({limits.MAX_FRAME_BYTES} bytes, ZMQ_MAXMSGSIZE) or by a broken link: outputs on it "
            "may be lost",
        )
