"""Addresses: malformed ones refused before libzmq sees them (InvalidAddressError),
well-formed ones that cannot be bound reported typed (AddressBindError); both name
the address and its role."""

from __future__ import annotations

import errno
import socket

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from zmqdispatch import AddressBindError, ClientConfig, InvalidAddressError, connect
from zmqdispatch.addresses import IPC_PATH_MAX, check_address
from zmqdispatch.mock.server import MockEngineConfig, start_mock_engine

GOOD = [
    "tcp://127.0.0.1:5555",
    "tcp://localhost:1",
    "tcp://eth0:65535",
    "tcp://[::1]:5555",
    "tcp://*:5555",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:*",
    "ipc:///tmp/x/hs.sock",
    "ipc://@abstract",
    "ipc://*",
    "inproc://x",
]

BAD = {
    "foo://bar": "unknown scheme",
    "127.0.0.1:5555": "no scheme",
    "tcp://127.0.0.1": "host and port",
    "tcp://:5555": "host and port",
    "tcp://127.0.0.1:99999": "outside 1..65535",
    "tcp://127.0.0.1:65536": "outside 1..65535",
    "tcp://127.0.0.1:-1": "not a decimal",
    "tcp://127.0.0.1:abc": "not a decimal",
    "tcp://127.0.0.1:5e3": "not a decimal",
    "tcp://300.1.1.1:5555": "not an IPv4",
    "tcp://::1:5555": "brackets",
    "tcp://[::g]:5555": "not an IPv6",
    "tcp://[::1:5555": "unterminated",
    "tcp://a b:5555": "whitespace",
    " tcp://127.0.0.1:5555": "whitespace",
    "tcp://bad/host:5555": "not a host name",
    "ipc://": "empty ipc path",
    "ipc:///" + "x" * IPC_PATH_MAX: "more than the limit",
    "inproc://": "empty inproc",
}


@pytest.mark.parametrize("address", GOOD)
def test_well_formed_bind_addresses_pass_unchanged(address):
    assert check_address(address, role="r") == address


@pytest.mark.parametrize("address,why", BAD.items())
def test_malformed_addresses_are_refused_naming_the_address_the_role_and_the_rule(address, why):
    with pytest.raises(InvalidAddressError) as ei:
        check_address(address, role="handshake_address")
    assert why in str(ei.value) and repr(address) in str(ei.value) and "handshake_address" in str(ei.value)
    assert ei.value.address == address and ei.value.role == "handshake_address"
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*", "tcp://*:5555", "ipc://*"])
def test_a_dialed_address_needs_a_real_host_port_and_path(address):
    with pytest.raises(InvalidAddressError):
        check_address(address, role="r", bind=False)


def test_port_zero_only_where_allowed():
    with pytest.raises(InvalidAddressError, match="port 0"):
        check_address("tcp://127.0.0.1:0", role="r", any_port=False)


@given(st.integers())
def test_a_tcp_port_is_accepted_exactly_in_1_to_65535(port):
    address = f"tcp://127.0.0.1:{port}"
    if 1 <= port <= 65535:
        assert check_address(address, any_port=False) == address
    else:
        with pytest.raises(InvalidAddressError):
            check_address(address, any_port=False)


@given(st.text(max_size=40))
def test_any_text_either_passes_or_raises_invalid_address(text):
    try:
        check_address(text)
    except InvalidAddressError:
        pass


def test_client_config_checks_its_addresses_at_construction():
    with pytest.raises(InvalidAddressError, match="input_address"):
        ClientConfig(input_address="tcp://127.0.0.1:70000")
    with pytest.raises(InvalidAddressError, match="output_address"):
        ClientConfig(output_address="127.0.0.1:5555")


async def enter(address: str, **kw) -> None:
    async with connect(address, config=ClientConfig(handshake_timeout=0.01), **kw):
        pass  # pragma: no cover - never reached


@pytest.mark.parametrize("address", ["foo://bar", "127.0.0.1:5555", "tcp://127.0.0.1:99999"])
async def test_connect_refuses_a_malformed_handshake_address(address):
    with pytest.raises(InvalidAddressError) as ei:
        await enter(address)
    assert ei.value.role == "handshake_address"


async def test_connect_refuses_handshake_port_zero_without_launch():
    # nothing could know which port the OS picked
    with pytest.raises(InvalidAddressError, match="port 0"):
        await enter("tcp://127.0.0.1:0")


def _listening_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


async def test_an_address_in_use_is_a_typed_bind_error_naming_it():
    s, port = _listening_port()
    with s:
        address = f"tcp://127.0.0.1:{port}"
        with pytest.raises(AddressBindError) as ei:
            await enter(address)
    assert ei.value.errno == errno.EADDRINUSE and ei.value.address == address
    assert address in str(ei.value) and "handshake_address" in str(ei.value)


async def test_an_unassignable_ip_is_a_typed_bind_error():
    address = "tcp://192.0.2.1:5555"  # TEST-NET-1: never an address of this host
    with pytest.raises(AddressBindError) as ei:
        await enter(address)
    assert ei.value.errno == errno.EADDRNOTAVAIL and ei.value.address == address


async def test_an_input_address_in_use_is_a_typed_bind_error_naming_its_role():
    s, port = _listening_port()
    with s:
        with pytest.raises(AddressBindError) as ei:
            async with connect(config=ClientConfig(input_address=f"tcp://127.0.0.1:{port}", handshake_timeout=0.01)):
                pass  # pragma: no cover
    assert ei.value.role == "input_address"


async def test_a_missing_ipc_directory_is_a_typed_bind_error(tmp_path):
    with pytest.raises(AddressBindError) as ei:
        await enter(f"ipc://{tmp_path}/missing/hs.sock")
    assert ei.value.errno == errno.ENOENT


async def test_the_mock_engine_refuses_a_malformed_or_wildcard_handshake_address():
    for address in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://*:5555", "foo://x"):
        with pytest.raises(InvalidAddressError):
            with trio.fail_after(5):
                await start_mock_engine(MockEngineConfig(handshake_address=address), in_process=True)
