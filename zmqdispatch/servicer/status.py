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
``EngineRequestError`` (the engine's error      ``INTERNAL``
finish), ``RemoteProtocolError``, any other
==============================================  ====================

A dead engine is ``UNAVAILABLE`` both for a new request and for one it failed
in flight (the reference gateway sends the second to ``INTERNAL``; a client
may retry either on another worker).
"""

from __future__ import annotations

from ..errors import (
    DeadlineExceeded,
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


def status_of(exc: BaseException) -> tuple[str, str]:
    """``(grpc.StatusCode member name, message)`` for *exc*.

    ``RequestRejected`` messages name the field (``"sampling_params.top_p:
    ..."``); the field is prepended when the message lacks it.
    """
    message = str(exc) or type(exc).__name__
    if isinstance(exc, DuplicateRequestIdError):
        return "ALREADY_EXISTS", message
    if isinstance(exc, RequestRejected):
        if exc.field and exc.field not in message:
            message = f"{exc.field}: {message}"
        return "INVALID_ARGUMENT", message
    if isinstance(exc, _UNAVAILABLE):
        return "UNAVAILABLE", f"{type(exc).__name__}: {message}"
    if isinstance(exc, (DeadlineExceeded, UtilityCallTimeout)):
        return "DEADLINE_EXCEEDED", message
    if isinstance(exc, SlowConsumerError):
        return "RESOURCE_EXHAUSTED", message
    if isinstance(exc, UnsupportedByRuntimeError):
        return "UNIMPLEMENTED", message
    if isinstance(exc, EngineRequestError):
        return "INTERNAL", f"the engine finished the request with an error: {message}"
    if isinstance(exc, RequestStreamClosed):
        return "UNAVAILABLE", f"{type(exc).__name__}: {message}"
    if isinstance(exc, RemoteProtocolError):
        return "INTERNAL", f"{type(exc).__name__}: {message}"
    return "INTERNAL", f"{type(exc).__name__}: {message}"
