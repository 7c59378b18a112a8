"""zmqdispatch errors -> gRPC status, sans-IO.

:func:`status_of` names the status (a ``grpc.StatusCode`` member name, so
this module needs no grpcio) and the message for an exception raised by a
stream or a call of the client:

==============================================  ====================
error                                           status
==============================================  ====================
``RequestRejected`` (a field refused: named)    ``INVALID_ARGUMENT``
``DuplicateRequestIdError``                     ``ALREADY_EXISTS``
``EngineDeadError``, ``NoEngineAvailableError``,
``EngineDrainingError``                         ``UNAVAILABLE``
``DeadlineExceeded`` (a zmqdispatch deadline)   ``DEADLINE_EXCEEDED``
``SlowConsumerError``                           ``RESOURCE_EXHAUSTED``
``UnsupportedByRuntimeError``                   ``UNIMPLEMENTED``
``UtilityCallTimeout``                          ``DEADLINE_EXCEEDED``
``EngineAbortedRequest`` with status 400 / 503   ``INVALID_ARGUMENT`` / ``UNAVAILABLE``
(an SGLang scheduler's refusal / overload)
``EngineRequestError`` (the engine's error      ``INTERNAL``
finish), ``RemoteProtocolError``, any other
==============================================  ====================

A dead engine is ``UNAVAILABLE`` both for a new request and for one it failed
in flight, the message naming the engine and its death's reason
(``engine 0 is dead (process_exit): ...``) (the reference gateway sends the second to ``INTERNAL``; a client
may retry either on another worker).
"""

from __future__ import annotations

from ..errors import (
    DeadlineExceeded,
    EngineAbortedRequest,
    DuplicateRequestIdError,
    EngineDeadError,
    EngineDrainingError,
    EngineRequestError,
    NoEngineAvailableError,
    RemoteProtocolError,
    RequestRejected,
    RequestStreamClosed,
    SlowConsumerError,
    UnsupportedByRuntimeError,
    UtilityCallTimeout,
)

__all__ = ["status_of"]

_UNAVAILABLE = (EngineDeadError, NoEngineAvailableError, EngineDrainingError)

#: the engine requests' prompt fields (vLLM ``prompt_token_ids``, TokenSpeed and
#: SGLang ``input_ids``; checked when the client sends), as the gateway's
#: ``GenerateRequest`` names them
_PROTO_FIELDS = {"prompt_token_ids": "tokenized.input_ids", "input_ids": "tokenized.input_ids"}


def status_of(exc: BaseException) -> tuple[str, str]:
    """``(grpc.StatusCode member name, message)`` for *exc*.

    ``RequestRejected`` messages start with the ``GenerateRequest`` field
    (``"sampling_params.top_p: ..."``): an engine request's prompt field is
    renamed to ``tokenized.input_ids``, and the field is prepended when the
    message does not start with it.
    """
    message = str(exc) or type(exc).__name__
    if isinstance(exc, DuplicateRequestIdError):
        return "ALREADY_EXISTS", message
    if isinstance(exc, RequestRejected):
        field = exc.field
        if field and message.startswith(f"{field}:"):
            message = message[len(field) + 1:].lstrip()
        proto = _PROTO_FIELDS.get(field, field)
        if proto and not message.startswith(f"{proto}:"):
            message = f"{proto}: {message}"
        return "INVALID_ARGUMENT", message
    if isinstance(exc, EngineDeadError) and exc.engine_index is not None:
        # the engine and why, whatever the cause's own words (``engine process 7 exited with code 1``)
        dead = f"engine {exc.engine_index} is dead ({exc.reason})"
        return "UNAVAILABLE", f"{type(exc).__name__}: " + (message if dead in message else f"{dead}: {message}")
    if isinstance(exc, _UNAVAILABLE):
        return "UNAVAILABLE", f"{type(exc).__name__}: {message}"
    if isinstance(exc, (DeadlineExceeded, UtilityCallTimeout)):
        return "DEADLINE_EXCEEDED", message
    if isinstance(exc, SlowConsumerError):
        return "RESOURCE_EXHAUSTED", message
    if isinstance(exc, UnsupportedByRuntimeError):
        return "UNIMPLEMENTED", message
    if isinstance(exc, EngineAbortedRequest) and exc.status in (400, 503):
        return ("INVALID_ARGUMENT" if exc.status == 400 else "UNAVAILABLE"), message
    if isinstance(exc, EngineRequestError):
        return "INTERNAL", f"the engine finished the request with an error: {message}"
    if isinstance(exc, RequestStreamClosed):
        return "UNAVAILABLE", f"{type(exc).__name__}: {message}"
    if isinstance(exc, RemoteProtocolError):
        return "INTERNAL", f"{type(exc).__name__}: {message}"
    return "INTERNAL", f"{type(exc).__name__}: {message}"
