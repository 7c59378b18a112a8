"""The public exception hierarchy of zmqdispatch.

Errors are split by blame, the way h11 and httpcore split them:

- :class:`RequestError` -- one request failed; the engine link is fine.
  :class:`RequestRejected` (also a :class:`ValueError`) is raised *before*
  anything is sent: a field the wire cannot carry, a value the engine would
  die on, a context-length overflow, a duplicate live ``request_id``.
- :class:`EngineError` -- the engine side failed. :class:`EngineDeadError`
  fails every open stream of one engine connection at once; new requests on
  that connection are refused with the same type.
- :class:`AddressError` -- a ZMQ address (handshake, input, output) is
  malformed (:class:`InvalidAddressError`, refused before libzmq sees it) or
  cannot be bound (:class:`AddressBindError`: in use, not a local address,
  permission).
- :class:`RemoteProtocolError` -- the engine sent bytes that do not decode as
  its wire (vLLM ``EngineCoreOutputs``). Raised by the sans-IO decoders; the
  connection counts them and declares the engine dead after a streak. Streams
  and utility calls also get it when the engine's output connection dropped
  (libzmq closes it for a frame above ``limits.MAX_FRAME_BYTES``): their
  outputs may be lost.

Raw ``zmq.ZMQError``, ``trio`` resource errors and ``msgpack`` exceptions never
escape the public API: they are translated at one boundary.
"""

from __future__ import annotations

__all__ = [
    "ZmqDispatchError",
    "RequestError",
    "RequestRejected",
    "ContextLengthError",
    "MultiModalCacheMissError",
    "DuplicateRequestIdError",
    "RuntimeMismatchError",
    "EngineRequestError",
    "EngineAbortedRequest",
    "SlowConsumerError",
    "RequestStreamClosed",
    "DeadlineExceeded",
    "EngineError",
    "EngineDeadError",
    "EngineDrainingError",
    "NoEngineAvailableError",
    "EngineHandshakeError",
    "EngineHandshakeTimeout",
    "UtilityCallError",
    "UtilityCallTimeout",
    "AddressError",
    "InvalidAddressError",
    "AddressBindError",
    "RemoteProtocolError",
    "LocalProtocolError",
    "UnsupportedByRuntimeError",
]


class ZmqDispatchError(Exception):
    """Base class of every error zmqdispatch raises on purpose."""


# --------------------------------------------------------------------------- request


class RequestError(ZmqDispatchError):
    """One request failed; the engine connection itself is still usable.

    Attributes:
        request_id: the id the request was submitted with ("" when unknown).
    """

    def __init__(self, message: str, *, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class RequestRejected(RequestError, ValueError):
    """The request was refused locally; nothing was sent to the engine.

    Attributes:
        field: dotted name of the offending field (``"sampling_params.top_p"``),
            or ``""`` when the request as a whole is at fault.
    """

    def __init__(self, message: str, *, request_id: str = "", field: str = "") -> None:
        super().__init__(message, request_id=request_id)
        self.field = field


class ContextLengthError(RequestRejected):
    """The prompt (plus ``max_tokens``) does not fit ``max_model_len``.

    Attributes:
        prompt_len: number of prompt tokens.
        max_tokens: requested (or defaulted) completion tokens, ``None`` when the
            prompt alone is too long.
        max_model_len: the engine's context length from its ready response.
        field: what the message names first: ``prompt_token_ids`` (the wire's
            ``input_ids`` on TokenSpeed / SGLang) or the max-tokens field.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str = "",
        prompt_len: int,
        max_tokens: int | None,
        max_model_len: int,
        field: str = "prompt_token_ids",
    ) -> None:
        super().__init__(message, request_id=request_id, field=field)
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class DuplicateRequestIdError(RequestRejected):
    """A request with this id is still live on the connection.

    vLLM's scheduler asserts on a duplicate live id and the whole engine dies
    (``docs/vllm-wire.md`` §5.8), so the client refuses it first.
    """


class RuntimeMismatchError(RequestRejected):
    """A request built for one engine runtime was handed to a connection of the other.

    A vLLM ``EngineCoreRequest`` cannot travel to a TokenSpeed scheduler, nor a
    TokenSpeed ``TokenizedGenerateReqInput`` to a vLLM EngineCore: the payloads
    differ and either engine drops (TokenSpeed) or dies on (vLLM) the other's bytes.

    Attributes:
        runtime: the connection's runtime (``"vllm"`` / ``"tokenspeed"`` / ``"sglang"``).
    """

    def __init__(self, message: str, *, request_id: str = "", runtime: str) -> None:
        super().__init__(message, request_id=request_id, field="request")
        self.runtime = runtime


class EngineRequestError(RequestError):
    """The engine finished this request with an error (vLLM ``FinishReason.ERROR`` (3)).

    The engine keeps serving other requests. ``code`` / ``retryable`` come from
    vLLM 0.33's ``RequestError`` output field when present.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str = "",
        code: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.code = code
        self.retryable = retryable


class MultiModalCacheMissError(EngineRequestError):
    """The engine's receiver cache no longer holds items this request sent with
    data nil (vLLM ``FinishReason.ERROR`` with ``mm_cache_miss_hashes``); retryable.

    Drop ``mm_hashes`` from the client's mirror
    (``zmqdispatch.translate.multimodal.ReceiverCacheMirror.invalidate``) and send the
    request again: the items then go with their data. ``code`` is ``"mm_cache_miss"``.
    """

    def __init__(self, message: str, *, request_id: str = "", mm_hashes: tuple[str, ...]) -> None:
        super().__init__(message, request_id=request_id, code="mm_cache_miss", retryable=True)
        self.mm_hashes = mm_hashes


class EngineAbortedRequest(EngineRequestError):
    """The engine ended the request with a terminal ``"abort"`` it was not asked for.

    TokenSpeed answers an ADD it refuses at admission (a sampling value out of
    range, logprobs on an engine started without ``--enable-output-logprobs``,
    a grammar that does not compile, ...) with one terminal ``"abort"`` frame
    carrying no tokens and no reason text; a client ABORT never produces a frame.
    So an unrequested abort is an error of this request, never a normal
    completion. ``code`` is ``"abort"``.

    Attributes:
        tokens_before_abort: tokens the engine generated before the abort
            (0 for an admission refusal).
        status: the HTTP status the engine gave the abort (SGLang: 400 for a
            request it refused, 503 for one it could not serve now), or None.
    """

    def __init__(self, message: str, *, request_id: str = "", tokens_before_abort: int,
                 status: int | None = None) -> None:
        super().__init__(message, request_id=request_id, code="abort", retryable=False)
        self.tokens_before_abort = tokens_before_abort
        self.status = status


class SlowConsumerError(RequestError):
    """The stream's consumer fell too far behind; the request was aborted.

    Attributes:
        pending_tokens: tokens buffered for the stream when it was failed.
        limit: the configured bound (``ClientConfig.max_pending_tokens``).
    """

    def __init__(self, message: str, *, request_id: str = "", pending_tokens: int, limit: int) -> None:
        super().__init__(message, request_id=request_id)
        self.pending_tokens = pending_tokens
        self.limit = limit


class RequestStreamClosed(RequestError):
    """The stream was used after it was closed, or the connection closed under it.

    A stream never ends "cleanly" without a terminal output: truncation is
    always this error (``docs/reference-gateway-lessons.md`` lesson 11a).
    """


class DeadlineExceeded(RequestError, TimeoutError):
    """The request went past one of its :class:`~zmqdispatch.protocol.deadlines.Deadlines`;
    it was aborted on the engine (its stream raises this after the tokens it
    had received).

    Attributes:
        limit: ``"first_token"``, ``"total"`` or ``"stall"``.
        seconds: the limit's value.
        elapsed: seconds since the request was submitted.
    """

    def __init__(self, message: str, *, request_id: str = "", limit: str, seconds: float, elapsed: float) -> None:
        super().__init__(message, request_id=request_id)
        self.limit = limit
        self.seconds = seconds
        self.elapsed = elapsed


# --------------------------------------------------------------------------- engine


class EngineError(ZmqDispatchError):
    """The engine side failed.

    Attributes:
        engine_index: the engine's DP rank / identity index, ``None`` if unknown.
    """

    def __init__(self, message: str, *, engine_index: int | None = None) -> None:
        super().__init__(message)
        self.engine_index = engine_index


class EngineDeadError(EngineError):
    """The engine is gone: every open stream fails with this, new requests too.

    Attributes:
        reason: a short machine-readable cause: ``"sentinel"`` (``ENGINE_CORE_DEAD``),
            ``"process_exit"``, ``"unreachable"`` (EHOSTUNREACH on send),
            ``"send_timeout"`` (the engine stopped reading its input),
            ``"decode_errors"``, ``"silence"``, ``"disconnected"`` (its input
            connection closed), ``"output_disconnected"`` (its output
            connection closed and did not come back) or ``"closed"`` (the
            client shut down).
    """

    def __init__(self, message: str, *, engine_index: int | None = None, reason: str) -> None:
        super().__init__(message, engine_index=engine_index)
        self.reason = reason


class EngineDrainingError(EngineError):
    """The engine a request was pinned to (``data_parallel_rank``) is draining:
    it finishes what it holds and takes nothing new. Nothing was sent."""


class NoEngineAvailableError(EngineError):
    """No engine is up to take an unpinned request (all draining or dead). Nothing was sent.

    Attributes:
        states: ``{engine_index: "draining" | "dead: <reason>"}`` for every known engine.
    """

    def __init__(self, message: str, *, states: dict[int, str]) -> None:
        super().__init__(message)
        self.states = states


class EngineHandshakeError(EngineError):
    """The startup handshake failed (an unexpected message, a spawned engine exited)."""


class EngineHandshakeTimeout(EngineHandshakeError, TimeoutError):
    """The handshake did not complete within ``ClientConfig.handshake_timeout``.

    Attributes:
        stage: ``"HELLO"``, ``"READY"``, ``"input_registration"`` or
            ``"reconnect"`` (a resumed session whose engine did not come back).
    """

    def __init__(self, message: str, *, engine_index: int | None = None, stage: str) -> None:
        super().__init__(message, engine_index=engine_index)
        self.stage = stage


class UtilityCallError(EngineError):
    """The engine answered a utility call with a ``failure_message``."""


class UtilityCallTimeout(UtilityCallError, TimeoutError):
    """No utility reply arrived within the call's timeout."""


# --------------------------------------------------------------------------- addresses


class AddressError(ZmqDispatchError):
    """A ZMQ endpoint we were given cannot be used.

    Attributes:
        address: the address as given.
        role: which address it is (``"handshake_address"``, ``"input_address"``,
            ``"output_address"``, or ``""``).
    """

    def __init__(self, message: str, *, address: str, role: str = "") -> None:
        super().__init__(message)
        self.address = address
        self.role = role


class InvalidAddressError(AddressError, ValueError):
    """The address is malformed: no or unknown scheme, a port outside
    1..65535 (or 0 where no port can be picked), a malformed host or ipc path.

    Raised before any socket sees the address (libzmq would otherwise wrap an
    out-of-range port to another port, or fail with a bare errno). Rules:
    :func:`zmqdispatch.addresses.check_address`.
    """


class AddressBindError(AddressError, OSError):
    """A well-formed address could not be bound: in use, not an address of this
    host, no permission, or an ipc path refused by :mod:`zmqdispatch._ipc`.

    Attributes:
        errno: the OS error number when there is one (``errno.EADDRINUSE``, ...).
    """

    def __init__(self, message: str, *, address: str, role: str = "", errno: int | None = None) -> None:
        super().__init__(message, address=address, role=role)
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0])


# --------------------------------------------------------------------------- protocol


class RemoteProtocolError(ZmqDispatchError):
    """The engine sent bytes that are not valid on its wire.

    The only exception the sans-IO decoders raise for hostile input.
    """


class LocalProtocolError(ZmqDispatchError):
    """We (the caller of a sans-IO API) tried something the wire cannot express."""


class UnsupportedByRuntimeError(ZmqDispatchError):
    """The operation does not exist on this engine runtime's wire.

    E.g. utility calls on a TokenSpeed scheduler, whose direct wire has only
    ADD and ABORT.

    Attributes:
        runtime: the connection's runtime (``"vllm"`` / ``"tokenspeed"`` / ``"sglang"``).
    """

    def __init__(self, message: str, *, runtime: str) -> None:
        super().__init__(message)
        self.runtime = runtime
