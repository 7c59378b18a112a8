"""Hygiene (issue 7): the ipc socket directory is 0700, stale socket files are
unlinked safely (and nothing else is), the handshake address default is a
private ipc path and a tcp address is bound as given (examples use loopback),
no pickle anywhere, and the frame-size / tokens-per-tick limits live in
``zmqdispatch/limits.py`` only."""

from __future__ import annotations

import ast
import builtins
import errno
import os
import re
import socket
import stat
import sys
from pathlib import Path

import msgpack
import pytest
import trio
import zmq

import zmqdispatch
from zmqdispatch import AddressBindError, ClientConfig, RemoteProtocolError, connect, limits
from zmqdispatch._ipc import ipc_path, prepare_bind, prepare_bind_now, private_ipc_dir
from zmqdispatch.testing import FakeEngine
from zmqdispatch.wire import tokenspeed
from zmqdispatch.wire import tokenspeed_engine
from zmqdispatch.wire import vllm as wire
from zmqdispatch.wire import vllm_engine as wire_engine
from zmqdispatch.wire import vllm_handshake as handshake

from ..helpers import make_request
from ..helpers import GUARD

PACKAGE = Path(zmqdispatch.__file__).parent
REPO = PACKAGE.parent


def stale_socket(path: Path) -> None:
    """Leave a unix socket file nobody listens on (a crashed front-end's)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def private_dir(tmp_path: Path, name: str = "d") -> Path:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return d


# ------------------------------------------------------------------ the private directory


def test_private_ipc_dir_is_0700_and_ours_even_with_a_permissive_umask():
    old = os.umask(0)
    try:
        d = private_ipc_dir()
    finally:
        os.umask(old)
    try:
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    finally:
        os.rmdir(d)


# Records the address it was given and the state of its directory, then
# becomes a mock engine.
RECORDER = r"""
import json, os, stat, sys
info, address = sys.argv[1], sys.argv[2]
rec = {"address": address}
if address.startswith("ipc://"):
    st = os.lstat(os.path.dirname(address[len("ipc://"):]))
    rec.update(mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, isdir=stat.S_ISDIR(st.st_mode))
open(info, "w").write(json.dumps(rec))
os.execv(sys.executable, [sys.executable, "-m", "zmqdispatch", "mock-engine", "--handshake-address", address])
"""


async def test_default_addresses_are_in_one_private_0700_directory_removed_at_close(tmp_path):
    import json

    info = tmp_path / "rec.json"
    with trio.fail_after(GUARD):
        async with connect(launch=[sys.executable, "-c", RECORDER, str(info), "{handshake_address}"],
                           config=ClientConfig(handshake_timeout=20)) as client:
            rec = json.loads(info.read_text())
            hs = rec["address"]
            assert hs.startswith("ipc://")
            d = os.path.dirname(hs[len("ipc://"):])
            assert rec["isdir"] and rec["mode"] == 0o700 and rec["uid"] == os.geteuid()
            for bound in (client.engine()._bound_input, client.engine()._bound_output):
                assert bound.startswith("ipc://") and os.path.dirname(bound[len("ipc://"):]) == d
            assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
            async with client.generate(make_request("r", max_tokens=2)) as s:
                async for _ in s:
                    pass
    assert not os.path.exists(d)


async def test_a_tcp_handshake_address_is_bound_exactly_as_given(tmp_path):
    import json

    info = tmp_path / "rec.json"
    with trio.fail_after(GUARD):
        launch = [sys.executable, "-c", RECORDER, str(info), "{handshake_address}"]
        async with connect("tcp://127.0.0.1:0", launch=launch, config=ClientConfig(handshake_timeout=20)) as client:
            assert await client.get_supported_tasks() == ("generate",)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", json.loads(info.read_text())["address"])


def test_examples_and_help_bind_tcp_on_loopback_only():
    """Every concrete tcp host in the README, the package (docstrings, CLI help)
    and the scripts is loopback; placeholders (HOST, ...) are fine."""
    allowed = {"127.0.0.1", "localhost", "[::1]", "HOST", "..."}
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*.py"),
             *PACKAGE.rglob("*.py"), *(REPO / "scripts").rglob("*.py"),
             *(REPO / "scripts").rglob("*.sh"), *(REPO / "benchmarks").rglob("*.py")]
    hosts = {}
    for f in files:
        if f.exists():
            for host in re.findall(r"tcp://([^:/\s`'\")]+):", f.read_text(errors="replace")):
                hosts.setdefault(host, []).append(str(f.relative_to(REPO)))
    assert "127.0.0.1" in hosts  # the scan sees the examples
    assert {h: fs for h, fs in hosts.items() if h not in allowed} == {}


# ------------------------------------------------------------------ stale sockets, checked unlink


def test_ipc_path_of_addresses_without_a_file():
    assert ipc_path("ipc:///run/x/a.sock") == "/run/x/a.sock"
    assert ipc_path("ipc://rel.sock") == "rel.sock"
    for address in ("ipc://@abstract", "ipc://*", "tcp://127.0.0.1:5555", "inproc://x"):
        assert ipc_path(address) is None
        assert prepare_bind_now(address) == address  # passed through untouched


def test_missing_path_is_fine_and_a_stale_socket_is_unlinked(tmp_path):
    d = private_dir(tmp_path)
    assert prepare_bind_now(f"ipc://{d}/none.sock") == f"ipc://{d}/none.sock"
    stale_socket(d / "stale.sock")
    prepare_bind_now(f"ipc://{d}/stale.sock")
    assert not os.path.lexists(d / "stale.sock")


@pytest.mark.parametrize("kind", ["regular", "directory", "symlink", "fifo"])
def test_anything_but_a_socket_at_the_path_is_refused_by_name_and_left_alone(tmp_path, kind):
    d = private_dir(tmp_path)
    path = d / "x.sock"
    target = d / "target.sock"
    if kind == "regular":
        path.write_text("precious")
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        stale_socket(target)  # even a link to a stale socket is not followed
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    before = os.lstat(path)
    with pytest.raises(OSError) as ei:
        prepare_bind_now(f"ipc://{path}")
    assert ei.value.filename == str(path) and str(path) in str(ei.value)
    assert isinstance(ei.value, (FileExistsError, IsADirectoryError))
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    if kind == "regular":
        assert path.read_text() == "precious"
    if kind == "symlink":
        assert stat.S_ISSOCK(os.lstat(target).st_mode)


async def test_a_live_listener_is_refused_after_the_grace_period_and_kept(tmp_path):
    d = private_dir(tmp_path)
    path = d / "live.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    try:
        with pytest.raises(OSError) as ei:
            prepare_bind_now(f"ipc://{path}")
        assert ei.value.errno == errno.EADDRINUSE and ei.value.filename == str(path)
        t0 = trio.current_time()
        with pytest.raises(OSError) as ei:
            await prepare_bind(f"ipc://{path}", grace=0.1)
        assert ei.value.errno == errno.EADDRINUSE and trio.current_time() - t0 >= 0.1
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # not unlinked
    finally:
        listener.close()


async def test_a_live_clients_address_is_refused_without_disturbing_it():
    # Liveness is read from /proc/net/unix, not probed by connecting: a
    # connection dropped on the live client's input ROUTER would be taken for
    # its engine leaving (death_on_disconnect).
    from zmqdispatch.testing import open_fake_engine_pair as fake_pair

    async with fake_pair() as (engine, client):
        for address in (client.engine()._bound_input, client.engine()._bound_output):
            with pytest.raises(OSError) as ei:
                await prepare_bind(address, grace=0.05)
            assert ei.value.errno == errno.EADDRINUSE
        await trio.sleep(0.2)
        assert client.is_alive
        async with client.generate(make_request("r1")) as s:
            await engine.receive_add()
            await engine.send_tokens("r1", [9], finish=wire.FinishReason.STOP)
            assert (await s.receive()).token_ids == [9]


async def test_a_zmq_socket_closed_a_moment_ago_is_waited_for_not_refused(tmp_path):
    # libzmq tears a closed socket's listener down in its I/O thread; a client
    # re-binding its fixed addresses at once (resume=) must not fail on it.
    d = private_dir(tmp_path)
    address = f"ipc://{d}/again.sock"
    ctx = zmq.Context.instance()
    for _ in range(20):
        s = ctx.socket(zmq.PULL)
        s.bind(await prepare_bind(address))
        s.close(linger=0)
    s = ctx.socket(zmq.PULL)
    s.bind(await prepare_bind(address))
    s.close(linger=0)


def test_the_parent_directory_must_be_a_real_private_directory_of_ours(tmp_path):
    d = private_dir(tmp_path)
    with pytest.raises(FileNotFoundError) as ei:
        prepare_bind_now(f"ipc://{d}/missing/x.sock")
    assert ei.value.filename == f"{d}/missing"
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(NotADirectoryError) as ei:
        prepare_bind_now(f"ipc://{link}/x.sock")
    assert ei.value.filename == str(link)
    (d / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        prepare_bind_now(f"ipc://{d}/file/x.sock")
    for mode in (0o770, 0o707, 0o1777):
        shared = tmp_path / f"shared{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        stale_socket(shared / "x.sock")
        with pytest.raises(PermissionError) as ei:
            prepare_bind_now(f"ipc://{shared}/x.sock")
        assert ei.value.filename == str(shared)
        assert os.path.lexists(shared / "x.sock")  # nothing unlinked
    d.chmod(0o755)  # not writable by others: fine
    prepare_bind_now(f"ipc://{d}/x.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_parent_directory_owned_by_another_user_is_refused(tmp_path):
    other = private_dir(tmp_path, "other")
    stale_socket(other / "x.sock")
    os.chown(other, 65534, 65534)
    with pytest.raises(PermissionError) as ei:
        prepare_bind_now(f"ipc://{other}/x.sock")
    assert ei.value.filename == str(other) and "owned by uid 65534" in str(ei.value)
    assert os.path.lexists(other / "x.sock")


async def test_connect_refuses_a_regular_file_at_a_configured_address_and_keeps_it(tmp_path):
    d = private_dir(tmp_path)
    (d / "out.sock").write_text("precious")
    cfg = ClientConfig(input_address=f"ipc://{d}/in.sock", output_address=f"ipc://{d}/out.sock",
                       handshake_timeout=5)
    with trio.fail_after(GUARD):
        with pytest.raises(AddressBindError) as ei:
            async with connect(f"ipc://{d}/hs.sock", config=cfg):
                pass  # pragma: no cover
    assert ei.value.errno == errno.EEXIST and ei.value.role == "output_address"
    assert ei.value.filename == f"{d}/out.sock" and ei.value.address == f"ipc://{d}/out.sock"
    assert (d / "out.sock").read_text() == "precious"
    assert not os.path.lexists(d / "hs.sock")  # it stopped before binding more


async def test_connect_unlinks_stale_sockets_left_by_a_crashed_front_end_and_serves(tmp_path):
    from zmqdispatch.testing import ready_response

    d = private_dir(tmp_path)
    for name in ("hs.sock", "in.sock", "out.sock"):
        stale_socket(d / name)
    cfg = ClientConfig(input_address=f"ipc://{d}/in.sock", output_address=f"ipc://{d}/out.sock")
    engine = FakeEngine(f"ipc://{d}/hs.sock", ready=ready_response())
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run_handshake)
            async with connect(f"ipc://{d}/hs.sock", config=cfg) as client:
                await engine.handshake_done.wait()
                async with client.generate(make_request("r1")) as s:
                    assert (await engine.receive_add()).request_id == "r1"
                    await engine.send_tokens("r1", [5], finish=wire.FinishReason.STOP)
                    assert (await s.receive()).token_ids == [5]
            engine.close()


# ------------------------------------------------------------------ no pickle


PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "copyreg"}


def test_no_pickle_module_is_imported_or_used_anywhere_in_the_package():
    offenders = []
    for f in PACKAGE.rglob("*.py"):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            elif isinstance(node, ast.Name) and node.id in PICKLE_MODULES:
                names = [node.id]
            offenders += [f"{f.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in PICKLE_MODULES]
    assert offenders == []


class _Marker:
    """Unpickling this sets a flag (what an attacker's payload would run)."""

    def __reduce__(self):
        return (exec, ("import builtins; builtins._zmqd_unpickled = True",))


def _pickled_payloads() -> list[tuple[int, bytes]]:
    import pickle  # the test builds the hostile bytes; the package never imports it

    data = pickle.dumps(_Marker())
    return [(1, data), (2, data)]  # vLLM CUSTOM_TYPE_PICKLE / CUSTOM_TYPE_CLOUDPICKLE


def _decoders():
    ok = wire_engine.encode_outputs(0, [wire_engine.EngineCoreOutput(request_id="r", new_token_ids=(1,))],
                                    timestamp=1.0)
    template = msgpack.unpackb(ok[0], raw=False, strict_map_key=False)

    def nested_in_outputs(ext: msgpack.ExtType) -> None:
        msg = list(template)
        msg[1] = [[*msg[1][0]]]
        msg[1][0][1] = ext  # where new_token_ids would be
        wire.decode_outputs([msgpack.packb(msg)])

    return {
        "vllm.decode_outputs": lambda ext: wire.decode_outputs([msgpack.packb(ext)]),
        "vllm.decode_outputs(nested)": nested_in_outputs,
        "vllm.decode_ready_response":
            lambda ext: handshake.decode_ready_response(msgpack.packb({"max_model_len": ext})),
        "vllm.decode_handshake_status": lambda ext: handshake.decode_handshake_status(msgpack.packb({"status": ext})),
        "vllm.decode_init": lambda ext: handshake.decode_init(msgpack.packb(ext)),
        "vllm.decode_request": lambda ext: wire_engine.decode_request([msgpack.packb(ext)]),
        "vllm.decode_utility_call": lambda ext: wire_engine.decode_utility_call(msgpack.packb([0, 1, "m", [ext]])),
        "tokenspeed.decode_outputs": lambda ext: tokenspeed.decode_outputs([msgpack.packb(ext)]),
        "tokenspeed_engine.decode_input": lambda ext: tokenspeed_engine.decode_input([msgpack.packb(ext)]),
        "tokenspeed.decode_ready_response": lambda ext: tokenspeed.decode_ready_response(msgpack.packb(ext)),
    }


@pytest.mark.parametrize("code,data", _pickled_payloads(), ids=["ext1-pickle", "ext2-cloudpickle"])
@pytest.mark.parametrize("decoder", sorted(_decoders()))
def test_pickle_ext_types_are_refused_by_every_decoder_and_never_unpickled(decoder, code, data):
    with pytest.raises(RemoteProtocolError):
        _decoders()[decoder](msgpack.ExtType(code, data))
    assert not hasattr(builtins, "_zmqd_unpickled")


# ------------------------------------------------------------------ limits in one place


def test_frame_and_tick_limits_are_defined_once_in_limits_py_and_used_from_there():
    doc = (PACKAGE / "limits.py").read_text()
    for name in ("MAX_FRAME_BYTES", "MAX_TOKENS_PER_TICK"):
        assert re.search(rf"^#: .*\n(#: .*\n)*{name} = ", doc, re.M), f"{name} has no documented definition"
        users = []
        for f in PACKAGE.rglob("*.py"):
            if f.name == "limits.py":
                continue
            text = f.read_text()
            assert not re.search(rf"^\s*{name}\s*[:=]", text, re.M), f"{f} redefines {name}"
            if name in text:
                users.append(f.name)
        assert users, f"{name} is documented but unused"
    assert "limits." in (REPO / "docs" / "failure-semantics.md").read_text()


async def test_the_output_socket_is_capped_at_max_frame_bytes():
    from zmqdispatch.testing import open_fake_engine_pair as fake_pair

    async with fake_pair() as (engine, client):
        assert client.engine()._conn._output._sock.getsockopt(zmq.MAXMSGSIZE) == limits.MAX_FRAME_BYTES
