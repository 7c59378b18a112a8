"""The client's settings (:class:`ClientConfig`) and what re-attaching to an
engine needs (:class:`EngineSession`). Sans-IO: plain attrs values, checked at
construction.
"""

from __future__ import annotations

import attrs

from . import limits
from .addresses import check_address
from .wire import vllm_handshake as wire

__all__ = ["ClientConfig", "EngineSession"]


def _check_bind_address(_: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        check_address(value, role=attribute.name)


@attrs.frozen(kw_only=True)
class ClientConfig:
    """Per-connection settings. Defaults and their reasons: :mod:`zmqdispatch.limits`.

    Attributes:
        handshake_timeout: seconds for the whole startup handshake.
        send_timeout: seconds one input send may wait for room before the
            engine is declared dead (``reason="send_timeout"``).
        send_hwm: messages queued towards the engine before sends wait.
        silence_timeout: seconds without output while requests are in flight
            before the engine is declared dead (``reason="silence"``).
        max_decode_errors: consecutive undecodable messages that mean death.
        max_pending_tokens: per-stream backlog before ``SlowConsumerError``.
        utility_timeout: default seconds a utility call waits.
        vocab_size: when set, prompt, stop, logit-bias and allowed token ids
            are checked against it (an out-of-range id crashes a vLLM engine;
            the engine does not report its vocabulary size).
        max_logprobs: the engine's ``max_logprobs`` (vLLM's default 20); larger
            logprob requests crash the engine, so they are refused.
        input_address / output_address: data-plane endpoints to bind (default:
            ``ipc://`` in a private 0700 temporary directory). Fixed addresses
            let headless engines reconnect to a restarted client. Checked at
            construction (``InvalidAddressError``, see
            :func:`zmqdispatch.addresses.check_address`).
        terminate_grace: seconds a spawned engine gets after SIGTERM.
        death_on_disconnect: treat the engine's input connection closing (a
            zmq monitor ``EVENT_DISCONNECTED`` on the input ROUTER) as death
            (``reason="disconnected"``), and its handshake connection closing
            before READY as a failed handshake (``EngineHandshakeError`` at
            once, not after ``handshake_timeout``). Right for same-host engines, where it
            catches a SIGKILLed engine we did not spawn at once; turn it off
            for tcp links that may drop and reconnect.
        pause_gc_while_routing: hold off Python's cyclic garbage collector
            while one received batch is decoded and routed (synchronous: no
            other task runs meanwhile, and no user code), then restore it. A
            step of C requests allocates about 2 x C tuples that die right after
            routing; collections in the middle of it promote them to the older
            generations, and those then cost full collections of tens of
            milliseconds (``benchmarks/README.md``). It is msgpack's own advice
            for large messages. Nothing happens when the collector is already
            disabled. Process-wide, like every ``gc`` switch: another thread
            allocating in that window (at most one batch's routing) is not
            collected until it ends.
        allow_unknown_engine_version: connect to an engine whose reported
            version the wire codec was not checked against (known: vLLM 0.32.x
            and 0.33.x, TokenSpeed 0.1.1; :mod:`zmqdispatch.protocol.versions`),
            logging a WARNING on the ``zmqdispatch.client`` logger. Off by
            default: such an engine fails the handshake with
            ``EngineHandshakeError``, since a changed positional layout would
            be misread without any decode error.
    """

    handshake_timeout: float = limits.DEFAULT_HANDSHAKE_TIMEOUT
    send_timeout: float = limits.DEFAULT_SEND_TIMEOUT
    send_hwm: int = limits.DEFAULT_SEND_HWM
    silence_timeout: float = limits.DEFAULT_SILENCE_TIMEOUT
    max_decode_errors: int = limits.DEFAULT_MAX_DECODE_ERRORS
    max_pending_tokens: int = limits.DEFAULT_MAX_PENDING_TOKENS
    utility_timeout: float = limits.DEFAULT_UTILITY_TIMEOUT
    vocab_size: int | None = None
    max_logprobs: int = limits.DEFAULT_MAX_LOGPROBS
    input_address: str | None = attrs.field(default=None, validator=_check_bind_address)
    output_address: str | None = attrs.field(default=None, validator=_check_bind_address)
    terminate_grace: float = limits.DEFAULT_TERMINATE_GRACE
    death_on_disconnect: bool = True
    pause_gc_while_routing: bool = True
    allow_unknown_engine_version: bool = False


@attrs.frozen(kw_only=True)
class EngineSession:
    """What a client needs to re-attach to an engine without a new handshake.

    vLLM's engine handshakes once, then keeps dialing the input/output
    addresses it was given: a client that re-binds the same addresses gets the
    engine back (its DEALER and PUSH reconnect on their own; outputs queued
    meanwhile are delivered and dropped as unknown ids). ``docs/vllm-wire.md``
    §6. Only sessions with explicitly configured
    ``input_address`` / ``output_address`` can be resumed.

    ``orphan_ids`` are requests the engine may still be running for nobody
    (their ADD reached it, their ABORT did not: e.g. a ``send_timeout`` death
    of a frozen engine); a resumed client ABORTs them before sending anything
    else. Take the session after the client died or closed; at most
    ``limits.MAX_ORPHAN_IDS``.
    """

    identity: bytes
    ready: wire.EngineCoreReadyResponse
    input_address: str
    output_address: str
    orphan_ids: tuple[str, ...] = ()
