"""Hygiene of the ``ipc://`` endpoints we bind (the handshake ROUTER, the input
ROUTER, the output PULL).

Why this module exists: libzmq's ipc listener ``unlink()``\\ s whatever sits at
the path before it binds (``ipc_listener.cpp``, "Get rid of the file ... left
behind by the previous run"), whatever its type, and libzmq 4.3.5 does *not*
remove the socket file when the socket closes. So a plain ``bind`` would

- silently delete a regular file that a typo'd address points at,
- silently steal the address of another live front-end bound there (its
  engines would reconnect to us), and
- leave stale socket files behind after every close, which is harmless only
  because the next bind deletes them blindly.

:func:`prepare_bind` replaces the blind unlink with a checked one, for every
``ipc://`` address :func:`zmqdispatch.connect` binds:

1. the parent directory must be a real directory (``lstat``: not a symlink),
   owned by our effective uid and not writable by group or others. Only then
   is nobody else able to swap a file in between our check and libzmq's
   unlink / bind (``/tmp`` itself is refused: use a private directory);
2. nothing at the path: fine;
3. a socket (``lstat``) at the path: if something listens on it (read from
   ``/proc/net/unix``, without connecting to it), wait briefly (a socket we closed a moment ago is torn down
   asynchronously by libzmq's I/O thread, typically within 1 ms) and then refuse with
   ``EADDRINUSE``; otherwise it is stale and is unlinked;
4. anything else (regular file, directory, symlink, fifo): refused with an
   :class:`OSError` naming the path; nothing is removed.

Abstract-namespace (``ipc://@name``) and wildcard (``ipc://*``) addresses have
no file and are passed through, as are ``tcp://`` and other transports.

The default addresses live in :func:`private_ipc_dir`, a fresh ``mkdtemp``
directory (mode 0700, created atomically), removed when the connection ends.

**tcp**: a ``tcp://`` handshake (or input/output) address is bound exactly as
the caller gives it; nothing here rewrites it. Bind ``tcp://127.0.0.1:PORT``
(as every example and the CLI help do) unless the engine really is on another
host: the handshake tells whoever dials in where our data-plane sockets are.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile

import trio

__all__ = ["ipc_path", "prepare_bind", "private_ipc_dir"]

#: Seconds :func:`prepare_bind` waits for a live listener at the path to go
#: away before refusing with ``EADDRINUSE`` (covers a socket of ours that was
#: closed a moment ago; libzmq tears listeners down in its I/O thread).
LIVE_LISTENER_GRACE = 1.0

_POLL = 0.005


def private_ipc_dir(prefix: str = "zmqd-") -> str:
    """Create a private directory for default ipc endpoints and return its path.

    ``tempfile.mkdtemp`` creates it with mode 0700 in one ``mkdir`` call (the
    umask can only remove bits), so there is no window in which another user
    could plant a socket file; the result is checked anyway.

    Raises:
        PermissionError: the directory is not 0700 and ours (never expected).
    """
    d = tempfile.mkdtemp(prefix=prefix)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        os.rmdir(d)
        raise PermissionError(errno.EPERM, "private ipc directory is not a 0700 directory of ours", d)
    return d


def ipc_path(address: str) -> str | None:
    """The filesystem path of an ``ipc://`` address, or ``None`` when the
    address has no file (not ipc, abstract ``@name``, wildcard ``*``)."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):]
    if not path or path.startswith("@") or path == "*":
        return None
    return path


def _check_parent(path: str) -> None:
    parent = os.path.dirname(path) or "."
    try:
        st = os.lstat(parent)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "ipc socket directory does not exist", parent) from None
    if stat.S_ISLNK(st.st_mode):
        raise NotADirectoryError(
            errno.ENOTDIR, "ipc socket directory is a symlink; give the real directory", parent
        )
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "ipc socket parent is not a directory", parent)
    if st.st_uid != os.geteuid():
        raise PermissionError(
            errno.EPERM,
            f"ipc socket directory is owned by uid {st.st_uid}, not by us (uid {os.geteuid()}); "
            "use a private directory",
            parent,
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            errno.EPERM,
            f"ipc socket directory is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            "use a private directory (0700 or 0755)",
            parent,
        )


_SO_ACCEPTCON = 0x10000  # /proc/net/unix "Flags": the socket is listening


def _listening(path: str) -> bool:
    """True when a socket is listening on the unix socket file *path*.

    Read from ``/proc/net/unix`` (listening sockets and the path they were
    bound to), without connecting: a probe connection would reach the live
    socket's owner, and a zmq owner that watches ``EVENT_DISCONNECTED`` (our
    own ``death_on_disconnect``) takes any dropped connection for its engine
    leaving. Elsewhere (no procfs) fall back to a non-blocking connect.
    A listener bound through a *relative* path by a process in another
    directory is not recognised (it counts as stale, as libzmq would treat it).
    """
    wanted = {path, os.path.abspath(path)}
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="surrogateescape") as f:
            next(f, None)  # header
            for line in f:
                parts = line.rstrip("\n").split(None, 7)
                if len(parts) == 8 and parts[7] in wanted and int(parts[3], 16) & _SO_ACCEPTCON:
                    return True
        return False
    except (OSError, ValueError):
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.setblocking(False)
        rc = s.connect_ex(path)
    finally:
        s.close()
    # 0: accepted; EAGAIN: a live listener with a full backlog.
    return rc in (0, errno.EAGAIN, errno.EINPROGRESS)


def _inspect(path: str) -> str:
    """``"missing"``, ``"stale"`` or ``"live"`` for the socket at *path*.

    Raises:
        FileExistsError / IsADirectoryError: something that is not a socket.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "ipc address is a directory, refusing to bind there", path)
    if not stat.S_ISSOCK(st.st_mode):
        kind = "symlink" if stat.S_ISLNK(st.st_mode) else "regular file" if stat.S_ISREG(st.st_mode) else "file"
        raise FileExistsError(
            errno.EEXIST, f"ipc address is an existing {kind}, not a socket; refusing to replace it", path
        )
    return "live" if _listening(path) else "stale"


def prepare_bind_now(address: str) -> str:
    """Synchronous :func:`prepare_bind` without the grace period: a live
    listener is refused at once. Returns *address* unchanged."""
    path = ipc_path(address)
    if path is None:
        return address
    _check_parent(path)
    state = _inspect(path)
    if state == "live":
        raise OSError(errno.EADDRINUSE, "ipc address is in use by a live socket", path)
    if state == "stale":
        _unlink_socket(path)
    return address


async def prepare_bind(address: str, *, grace: float = LIVE_LISTENER_GRACE) -> str:
    """Check (and clean) an address before binding it; return it unchanged.

    See the module docstring for the rules. Non-ipc addresses are returned
    untouched.

    Raises:
        FileNotFoundError / NotADirectoryError / PermissionError: the parent
            directory is missing, not a real directory, not ours, or writable
            by others.
        FileExistsError / IsADirectoryError: a non-socket is at the path.
        OSError: ``EADDRINUSE``, a live listener is still there after *grace*
            seconds.
        (every one names the offending path in ``.filename``.)
    """
    path = ipc_path(address)
    if path is None:
        return address
    _check_parent(path)
    with trio.move_on_after(grace):
        while _inspect(path) == "live":
            await trio.sleep(_POLL)
    return prepare_bind_now(address)


def _unlink_socket(path: str) -> None:
    # Re-check the type right before unlinking: only a socket is ever removed.
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "ipc address is not a socket, refusing to replace it", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
