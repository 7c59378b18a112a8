"""Checks of the ZMQ addresses we bind and dial, before libzmq sees them (sans-IO).

libzmq accepts, or fails obscurely on, addresses a user mistypes: a port past
65535 is wrapped to another port (``tcp://127.0.0.1:99999`` binds 34463, ``:-1``
binds 65535), a missing scheme is a bare ``EINVAL``, ``foo://`` is
``EPROTONOSUPPORT``. :func:`check_address` refuses all of these with an
:class:`~zmqdispatch.errors.InvalidAddressError` naming the address and its
role. Whether a well-formed address can be bound (in use, not an address of
this host, permission) is only known by binding it: that failure is an
:class:`~zmqdispatch.errors.AddressBindError`, raised by the socket layer.

Accepted forms:

- ``tcp://HOST:PORT``: HOST an IPv4 address, a bracketed IPv6 address
  (``[::1]``), a host or interface name (letters, digits, ``-``, ``_``, ``.``;
  at most 253 characters), or ``*`` (bind only: every interface). PORT decimal,
  1..65535; ``0`` or ``*`` (the OS picks one) only where ``any_port`` is allowed.
- ``ipc://PATH``: a filesystem path, or ``@name`` (Linux abstract namespace),
  at most :data:`IPC_PATH_MAX` bytes (``sockaddr_un.sun_path``); ``ipc://*``
  (bind only: libzmq picks a path).
- ``inproc://NAME``: same-process endpoints (tests).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

from .errors import InvalidAddressError

__all__ = ["IPC_PATH_MAX", "SCHEMES", "check_address"]

#: Transports an engine can be reached by (``inproc`` only inside one process).
SCHEMES = ("tcp", "ipc", "inproc")

#: Longest ipc path in bytes: ``sizeof(sockaddr_un.sun_path)`` (108) minus the NUL.
IPC_PATH_MAX = 107

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")

_FORMS = "expected tcp://HOST:PORT or ipc://PATH"


def check_address(address: object, *, role: str = "address", bind: bool = True, any_port: bool = True) -> str:
    """Return *address* unchanged when it is well formed, else raise.

    Args:
        address: the endpoint string.
        role: its name in the message (``"handshake_address"``, a CLI flag, ...).
        bind: True for an address we bind (``*`` hosts and ``ipc://*`` allowed),
            False for one we dial.
        any_port: whether port ``0`` / ``*`` (the OS picks a port) is allowed.
            Never for a dialed address.

    Raises:
        InvalidAddressError: the address is malformed (the message names it,
            the role and the rule it breaks).
    """
    if not isinstance(address, str):
        raise InvalidAddressError(f"{role}: expected a string, got {type(address).__name__}",
                                  address=repr(address), role=role)

    def bad(why: str) -> InvalidAddressError:
        return InvalidAddressError(f"{role} {address!r}: {why}", address=address, role=role)

    if address != address.strip() or any(c.isspace() or c == "\0" for c in address):
        raise bad("contains whitespace or NUL")
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise bad(f"no scheme ({_FORMS})")
    if scheme not in SCHEMES:
        raise bad(f"unknown scheme {scheme + '://'!r} ({_FORMS})")
    if scheme == "tcp":
        _check_tcp(rest, bad, bind=bind, any_port=any_port and bind)
    elif scheme == "ipc":
        if not rest:
            raise bad("empty ipc path")
        if rest == "*":
            if not bind:
                raise bad("ipc://* (a path libzmq picks) can only be bound, not dialed")
        elif len(rest.encode("utf-8")) > IPC_PATH_MAX:
            raise bad(f"ipc path is {len(rest.encode('utf-8'))} bytes, more than the limit of {IPC_PATH_MAX}")
    elif not rest:
        raise bad("empty inproc name")
    return address


def _check_tcp(rest: str, bad: Callable[[str], InvalidAddressError], *, bind: bool, any_port: bool) -> None:
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise bad("expected tcp://HOST:PORT (host and port both required)")
    if port == "*" or port == "0":
        if not any_port:
            raise bad("port 0 / * (the OS picks a port) is not allowed here: give a port in 1..65535")
    elif not port.isascii() or not port.isdigit():
        raise bad(f"port {port!r} is not a decimal number in 1..65535")
    elif not 1 <= int(port) <= 65535:
        raise bad(f"port {int(port)} is outside 1..65535")
    if host.startswith("["):
        if not host.endswith("]"):
            raise bad("unterminated '[' in an IPv6 host")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise bad(f"{host[1:-1]!r} is not an IPv6 address") from None
        return
    if host == "*":
        if not bind:
            raise bad("host * (every interface) can only be bound, not dialed")
        return
    if ":" in host:
        raise bad("an IPv6 host must be in brackets, as in [::1]")
    if _DOTTED_NUMBERS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise bad(f"{host!r} is not an IPv4 address") from None
        return
    if len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise bad(f"{host!r} is not a host name, an IP address or an interface name")
