"""Where the daemon lives on this node.

A node daemon (``krex serve --node``) serves every user from
``$KREX_NODE_DIR`` (default ``/run/krex``); a per-user daemon from
``$KREX_RUNTIME_DIR`` when set (tests, several isolated daemons), else
``$XDG_RUNTIME_DIR/krex``, else ``/tmp/krex-<uid>``.  Clients take
``$KREX_SOCKET`` when set (it is what managed jobs get), else the per-user
directory named by ``$KREX_RUNTIME_DIR``, else the node daemon's socket when
one is there and this user may use it, else the per-user one.  A node socket
left behind by a dead node daemon (connection refused) is remembered by its
identity (device, inode) and passed over until a new node daemon binds a new
one, so clients fall back to their own daemon once, at no cost afterwards.
"""

from __future__ import annotations

import grp
import os
import stat

from krex.errors import AccessDenied, BadRequest

SOCKET_NAME = "krexd.sock"
NODE_DIR = "/run/krex"


def node_dir() -> str:
    return os.environ.get("KREX_NODE_DIR") or NODE_DIR


_stale: set[tuple[str, int, int]] = set()  # node sockets that refused us: (path, dev, ino)


def node_socket() -> str | None:
    """The node daemon's socket when one is there, this user may connect to it, and it
    is not one a dead daemon left (:func:`forget_node_socket`)."""
    path = os.path.join(node_dir(), SOCKET_NAME)
    try:
        st = os.stat(path)
    except OSError:
        return None
    if (path, st.st_dev, st.st_ino) in _stale:
        return None
    if stat.S_ISSOCK(st.st_mode) and os.access(path, os.R_OK | os.W_OK):
        return path
    return None


def is_node_choice(path: str) -> bool:
    """True when ``path`` is the node socket chosen by :func:`socket_path` (not named by
    ``$KREX_SOCKET``): a refused connection there may fall back to the per-user daemon."""
    return (not os.environ.get("KREX_SOCKET") and not os.environ.get("KREX_RUNTIME_DIR")
            and path == os.path.join(node_dir(), SOCKET_NAME))


def forget_node_socket(path: str) -> None:
    """The node socket ``path`` refused a connection: pass it over from now on (until a
    node daemon binds a new socket there)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    _stale.add((path, st.st_dev, st.st_ino))


def runtime_dir() -> str:
    explicit = os.environ.get("KREX_RUNTIME_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "krex")
    return f"/tmp/krex-{os.getuid()}"


def socket_path() -> str:
    explicit = os.environ.get("KREX_SOCKET")
    if explicit:
        return explicit
    if not os.environ.get("KREX_RUNTIME_DIR"):
        node = node_socket()
        if node is not None:
            return node
    return os.path.join(runtime_dir(), SOCKET_NAME)


def ensure_private_dir(path: str) -> str:
    """Create ``path`` owner-only (0700) or check an existing one is ours and private."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise AccessDenied(
            f"runtime directory {path} is not a directory owned by uid {os.getuid()}",
            hint="remove it or set KREX_RUNTIME_DIR to a private directory",
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def group_id(name: str) -> int:
    """The gid of the group ``name`` (a number is taken as it is)."""
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise BadRequest(f"group {name!r} does not exist",
                         hint=f"create it (groupadd {name}) and add the users who may use "
                              "the daemon, or pass --group GROUP") from None


def ensure_shared_dir(path: str, gid: int, mode: int = 0o750) -> str:
    """Create ``path`` for a daemon shared with a group: ours, group ``gid``, ``mode``
    (0750; 0710 where the group may open what it knows the name of, not list it)."""
    os.makedirs(path, mode=mode, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise AccessDenied(
            f"runtime directory {path} is not a directory owned by uid {os.getuid()}",
            hint="remove it or pass --runtime-dir")
    if st.st_gid != gid:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    return path
